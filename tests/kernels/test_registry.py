"""The registry's refusals, strict mode, and the audit; platform probing and import hygiene."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metainfer_gen import platform
from metainfer_gen.kernels import FastPathRefused, audit, get_op, global_audit, kv_cache, norm, registered_ops
from metainfer_gen.kernels.common import CompiledPath
from metainfer_gen.kernels.registry import Op


def _reasons(op_name, *args):
    return {r.implementation: r.reason for r in get_op(op_name).select(*args)[1]}


def test_builtin_ops_are_registered_fastest_first():
    names = {op.name: op.names for op in registered_ops()}
    for op in ("rms_norm", "fused_add_rms_norm"):  # the C++ rows below the compiled path's size
        assert names[op] == ["triton", "compiled", "cpp", "torch"]
    assert names["rope"] == ["triton", "cpp", "compiled", "torch"]  # the C++ rope beat the compiled graph at every size
    for op in ("adaln_modulate", "gated_residual"):
        assert names[op] == ["triton", "compiled", "torch"]
    assert names["store_kv_cache"] == ["triton", "torch"]


def test_cpu_only_machine_refuses_triton_with_its_reason(no_interpret):
    if torch.cuda.is_available():
        pytest.skip("CPU-only row")
    x = torch.randn(4, 64)
    reasons = _reasons("rms_norm", x, None, 1e-6)
    assert reasons["triton"].startswith("CPU-only machine")
    assert reasons["compiled"] == "256 elements, below 1048576 where compiled beats eager"


def test_missing_triton_is_the_refusal_reason(monkeypatch):
    monkeypatch.setattr(platform, "triton_installed", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even when interpretation is asked for
    reasons = _reasons("rms_norm", torch.randn(4, 64), None, 1e-6)
    assert reasons["triton"].startswith("triton not installed")


def test_wrong_dtype_is_refused_and_the_reference_still_runs(interpret):
    x = torch.randn(4, 64, dtype=torch.float64)
    assert _reasons("rms_norm", x, None, 1e-6)["triton"] == ("x dtype float64 not in (float32, bfloat16, "
                                                              "float16)")
    with audit() as report:
        out = norm.rms_norm(x, None, 1e-6)
    assert report.paths() == {"rms_norm": {"torch": 1}}
    torch.testing.assert_close(out, norm.rms_norm_reference(x, None, 1e-6))


def test_non_contiguous_input_is_refused(interpret):
    x = torch.randn(64, 4).t()
    assert _reasons("rms_norm", x, None, 1e-6)["triton"] == "x is not contiguous (shape (4, 64), stride (1, 4))"


def test_misaligned_rows_are_refused_by_the_word_copy_store(interpret):
    key = torch.randn(5, 1, 3, dtype=torch.float16)  # 6-byte rows
    cache = torch.zeros(4, 2, 1, 3, dtype=torch.float16)
    slots = torch.arange(5)
    reason = _reasons("store_kv_cache", key, None, cache, None, slots)["triton"]
    assert reason.startswith("misaligned: a key row of 1x3 float16 is 6 bytes, not a multiple of 4")
    kv_cache.store_kv_cache(key, None, cache, None, slots)  # falls back and still stores
    assert torch.equal(cache.view(-1, 1, 3)[:5], key)


def test_dtype_mismatch_and_oversized_rows_are_refused(interpret):
    key = torch.randn(2, 1, 8)
    cache = torch.zeros(2, 2, 1, 8, dtype=torch.bfloat16)
    assert "differs from the cache's bfloat16" in _reasons("store_kv_cache", key, None, cache, None,
                                                           torch.arange(2))["triton"]
    wide = torch.randn(2, 20000)
    assert "over the 65536-byte" in _reasons("rms_norm", wide, None, 1e-6)["triton"]


def test_inputs_that_need_grad_are_refused_by_triton(interpret):
    x = torch.randn(3, 16, requires_grad=True)
    assert "requires grad" in _reasons("rms_norm", x, None, 1e-6)["triton"]
    with torch.no_grad():
        assert get_op("rms_norm").select(x, None, 1e-6)[0].name == "triton"


def test_strict_mode_raises_by_argument_and_by_environment(no_interpret, monkeypatch):
    monkeypatch.setenv("METAINFER_CPU_KERNELS", "0")  # the C++ row kernel off too: the reference is all that is left
    x = torch.randn(2, 8)
    with pytest.raises(FastPathRefused, match="rms_norm at here would fall back to 'torch'") as info:
        norm.rms_norm(x, site="here", strict=True)
    assert [r.implementation for r in info.value.refusals] == ["triton", "compiled", "cpp"]
    assert "METAINFER_CPU_KERNELS=0" in info.value.refusals[2].reason
    monkeypatch.setenv("METAINFER_STRICT_FAST_PATH", "1")
    with pytest.raises(FastPathRefused):
        norm.rms_norm(x)
    assert norm.rms_norm(x, strict=False).shape == x.shape  # the argument overrides the environment


def test_strict_mode_passes_when_the_fastest_path_applies(interpret):
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm.rms_norm(x, strict=True), norm.rms_norm_reference(x, None, 1.2e-7),
                               atol=1e-5, rtol=1e-5)


def test_audit_counts_per_call_site_not_per_call(no_interpret, monkeypatch):
    monkeypatch.setenv("METAINFER_CPU_KERNELS", "0")  # a path that is not the fastest, on any machine
    x = torch.randn(2, 8)
    before = sum(e.num_calls for e in global_audit().entries if e.site == "loop-site")
    with audit() as outer:
        for _ in range(5):
            norm.rms_norm(x, site="loop-site")
        with audit() as inner:
            norm.rms_norm(x)  # default site: this file and line
    assert len(outer.entries) == 2 and len(inner.entries) == 1
    loop = next(e for e in outer.entries if e.site == "loop-site")
    assert loop.num_calls == 5 and loop.path == "torch" and not loop.fast_path
    assert inner.entries[0].site.startswith("test_registry.py:")
    assert "test_audit_counts_per_call_site_not_per_call" in inner.entries[0].site
    assert sum(e.num_calls for e in global_audit().entries if e.site == "loop-site") == before + 5
    summary = outer.summary()
    assert "rms_norm" in summary and "x5" in summary and "refused triton" in summary
    assert outer.to_dict()[0]["refusals"]


def test_op_registration_rules():
    op = Op("toy", "a test op")
    op.register("slow", lambda x: x + 1)
    op.register("fast", lambda x: x + 1, lambda x: None if x > 0 else f"x={x} is not positive", before="slow")
    assert op.names == ["fast", "slow"]
    assert op.select(1)[0].name == "fast"
    impl, refusals = op.select(-1)
    assert impl.name == "slow" and refusals[0].reason == "x=-1 is not positive"
    with pytest.raises(ValueError, match="already registered"):
        op.register("fast", lambda x: x)
    with pytest.raises(ValueError, match="no implementation 'nope'"):
        op.implementation("nope")
    with pytest.raises(KeyError, match="no op 'nope'"):
        get_op("nope")


def test_compiled_path_refuses_past_dynamos_recompile_limit():
    import torch._dynamo.config as dynamo_config

    path = CompiledPath(norm.rms_norm_reference, min_numel=1)
    path._signatures.update(range(dynamo_config.recompile_limit))
    reason = path.refusal(torch.randn(3, 4), None, 1e-6)
    assert reason.startswith(f"already compiled for {dynamo_config.recompile_limit} input signatures")


def test_dispatch_inside_torch_compile_traces_the_reference_without_graph_breaks(no_interpret):
    def f(x):
        return norm.rms_norm(x, None, 1e-6) * 2

    x = torch.randn(3, 16)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), norm.rms_norm_reference(x, None, 1e-6) * 2)


def test_capabilities_of_this_machine_and_overrides(monkeypatch):
    caps = platform.capabilities()
    assert caps.has_gpu == torch.cuda.is_available()
    if not caps.has_gpu:
        assert caps.device_kind is platform.DeviceKind.CPU and caps.compute_capability is None
    assert caps.num_devices == torch.cuda.device_count()
    fake = platform.Capabilities(device_kind=platform.DeviceKind.CUDA, device_names=("A", "B", "C"),
                                 compute_capabilities=((8, 9),) * 3, bf16=True, fp8_e4m3=True,
                                 peer_access=frozenset({(0, 1), (1, 0)}))
    with platform.override_capabilities(fake):
        assert platform.capabilities() is fake
        assert not fake.all_peer_access and fake.missing_peer_pairs() == [(0, 2), (1, 2), (2, 0), (2, 1)]
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert platform.triton_status().mode is platform.TritonMode.COMPILE
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert platform.triton_status().mode is platform.TritonMode.INTERPRET
    assert platform.capabilities() is caps


def test_importing_the_package_probes_nothing_and_works_without_triton():
    code = (
        "import sys\n"
        "import metainfer_gen, metainfer_gen.platform, metainfer_gen.kernels\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'heavy import at import time'\n"
        "sys.modules['triton'] = None  # as if triton were not installed\n"
        "import torch\n"
        "from metainfer_gen import kernels\n"
        "x = torch.randn(4, 8)\n"
        "with kernels.audit() as report:\n"
        "    kernels.rms_norm(x, None, 1e-6)\n"
        "print(report.summary())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": ".", "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                            cwd=root)
    assert result.returncode == 0, result.stderr
    assert "refused triton: triton not installed" in result.stdout


def test_an_implementation_built_for_another_device_is_passed_over_without_a_refusal():
    op = Op("device_probe_op")
    op.register("cpu-kernel", lambda x: x + 1, devices=("cpu",))
    op.register("picky", lambda x: x + 2, lambda x: "never applies")
    op.register("torch", lambda x: x + 3)
    impl, refusals = op.select(torch.zeros(2))
    assert impl.name == "cpu-kernel" and refusals == ()
    impl, refusals = op.select(torch.zeros(2, device="meta"))  # a device the CPU kernel is not built for
    assert impl.name == "torch" and [r.implementation for r in refusals] == ["picky"]
    assert op.fastest_for("cpu") == "cpu-kernel" and op.fastest_for("cuda") == "picky"


def test_cpu_kernels_are_not_fast_paths_on_a_gpu():
    """On CUDA, cuBLAS / cuDNN / the torch reference are the fast paths for these ops, not fallbacks (the H200 check
    saw doctor --strict fail on them)."""
    for name, impl in (("linear", "bucketed"), ("conv3d", "onednn"), ("block_attention", "flash-cpu"),
                       ("paged_mla_decode", "cpp")):
        op = get_op(name)
        assert op.implementation(impl).devices == ("cpu",)
        assert op.fastest_for("cpu") != op.reference.name
    assert get_op("linear").fastest_for("cuda") == "torch" and get_op("conv3d").fastest_for("cuda") == "torch"
    assert get_op("block_attention").fastest_for("cuda") == "torch"
