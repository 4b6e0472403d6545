"""The audit's call site of a collective names the user's line, at a script's top level and inside a function.

The script runs as ``python script.py`` on 2 ranks (gloo), the way the package docstring shows it used under
torchrun, so ``<module>`` is the outermost frame of the stack (no runpy or pytest frames above it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""\
    import json, sys
    import torch
    from metainfer_gen import collectives, kernels

    collectives.init_distributed()
    x = torch.ones(8)
    out = torch.empty(16)
    collectives.all_reduce(x)  # MARK top_reduce
    collectives.all_gather(out, x)  # MARK top_gather


    def step():
        collectives.all_reduce(x)  # MARK fn_reduce
        collectives.reduce_scatter(x[:4].clone(), out[:8].clone())  # MARK fn_scatter


    step()
    sites = {e.op + ":" + e.site: e.num_calls for e in kernels.global_audit().entries}
    collectives.shutdown_distributed()
    with open(sys.argv[1], "w") as f:
        json.dump(sites, f)
    """)


def _marks(text: str, name: str) -> dict[str, str]:
    """``{mark: "name:line (function)"}`` for every ``# MARK`` comment of the script."""
    out = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if "# MARK " in line:
            mark = line.split("# MARK ")[1].strip()
            out[mark] = f"{name}:{lineno} ({'<module>' if mark.startswith('top') else 'step'})"
    return out


def test_collective_site_is_the_callers_line_at_top_level_and_in_a_function(tmp_path):
    from metainfer_gen.collectives.distributed import free_port

    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", METAINFER_COLLECTIVES_TUNE="0",
               METAINFER_COLLECTIVES_CACHE=str(tmp_path / "collectives.json"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"sites{r}.json")],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log}"
    want = _marks(_SCRIPT, script.name)
    for r in range(2):
        sites = json.loads((tmp_path / f"sites{r}.json").read_text())
        assert sites.get(f"all_reduce:{want['top_reduce']}") == 1, sites
        assert sites.get(f"all_gather:{want['top_gather']}") == 1, sites
        assert sites.get(f"all_reduce:{want['fn_reduce']}") == 1, sites
        assert sites.get(f"reduce_scatter:{want['fn_scatter']}") == 1, sites


def test_caller_site_names_the_frame_that_called_the_public_function():
    from metainfer_gen.collectives.dispatch import caller_site

    def public_collective():  # stands in for all_reduce: caller_site() called directly in its body
        return caller_site()

    line = sys._getframe().f_lineno + 1
    site = public_collective()
    assert site == f"{Path(__file__).name}:{line} (test_caller_site_names_the_frame_that_called_the_public_function)"
