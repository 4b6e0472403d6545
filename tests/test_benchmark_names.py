"""The benchmark scripts run with ``benchmarks/`` first on ``sys.path``, so a script named like an installed or
standard-library top-level module shadows it for every library that imports it (transformers 5.25 imports the
``kernels`` distribution, which ``benchmarks/kernels.py`` once shadowed)."""
import importlib.machinery
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_script_shadows_an_installed_module():
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != BENCHMARKS]
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert len(scripts) > 10, f"expected the benchmark scripts under {BENCHMARKS}, found {scripts}"
    clashes = [s for s in scripts
               if s in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(s, elsewhere) is not None]
    assert not clashes, f"benchmarks/{clashes}.py shadow installed modules of the same name; rename the scripts"
