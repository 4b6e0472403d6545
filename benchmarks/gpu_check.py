"""Every registered op against its torch reference, timed, plus the end-to-end GPU checks, in one table.

    python benchmarks/gpu_check.py                  # CUDA rows when a GPU is present, else skipped with the reason
    python benchmarks/gpu_check.py --ops sparse_mla --dtypes bfloat16

Op rows: each op's registry example (``Op.example``: the shapes ``doctor`` reports on; sparse MLA also as a
one-token decode) on this machine's CPU and, with CUDA, on the GPU; every implementation that applies there runs on
its own copy of the inputs and is compared with the reference (float outputs: max abs error relative to the
reference's largest value, within :data:`REL_TOL` of the output dtype; index outputs: top-k overlap >= 0.99) and
timed (median ms of :data:`REPEATS` calls after a warm-up). The Triton rows run only on CUDA (on the CPU they
would be the interpreter). End-to-end rows: the engine's greedy tokens on CUDA equal the CPU's for a tiny random
DeepSeek-V3; the video pipeline with the step cache on CUDA (``benchmarks/step_cache.py --quick``); the all-reduce
under ``torchrun`` when there are 2 GPUs. Exit status 1 when any row fails (a skipped row is not a failure).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Every registered op, by name: tests/kernels/test_triton_aot.py checks this equals the registry, so a new op
# cannot be left out of the device check.
OPS = ("rms_norm", "fused_add_rms_norm", "rope", "adaln_modulate", "gated_residual", "store_kv_cache",
       "fp8_act_quant", "fp8_weight_dequant", "fp8_block_gemm", "indexer_topk", "sparse_mla", "moe_experts",
       "conv3d", "channel_rms_norm", "upsample_nearest", "timestep_embedding", "paged_mla_decode", "linear",
       "block_attention")
IN_PLACE = {"store_kv_cache": (2, 4)}  # op -> the argument slice it writes (compared instead of the return value)
INDEX_OUTPUT = {"indexer_topk"}  # returns key indices: compared by top-k overlap
VARIANTS = {"sparse_mla": {"prefill": lambda a: a,
                           "decode": lambda a: (a[0][:1].contiguous(), a[1], a[2][:1].contiguous(), *a[3:])}}
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float8_e4m3fn: 0.07}
REPEATS = 5


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _outputs(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    return []


def _compare(op: str, got, want, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """(within tolerance, what was measured); float32 side outputs of a ``dtype`` run (a log-sum-exp) get the run
    dtype's tolerance: they carry its rounding."""
    if op in INDEX_OUTPUT:
        from metainfer_gen.kernels.indexer import topk_overlap

        overlap = topk_overlap(got.cpu(), want.cpu())
        return overlap >= 0.99, f"overlap {overlap:.4f}"
    worst, ok = 0.0, True
    for g, w in zip(_outputs(got), _outputs(want), strict=True):
        tol = max(REL_TOL.get(w.dtype, 1e-4), REL_TOL.get(dtype, 0.0))
        g, w = g.float().cpu(), w.float().cpu()
        rel = float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)) if w.numel() else 0.0
        ok, worst = ok and rel <= tol, max(worst, rel)
    return ok, f"rel err {worst:.1e}"


def _time(fn, device: str) -> float:
    fn()
    _sync(device)
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def op_rows(names: list[str], device: str, dtypes: list[torch.dtype]) -> list[list[str]]:
    from metainfer_gen.kernels.catalog import get_op

    rows = []
    for name in names:
        op = get_op(name)
        for dtype in dtypes:
            torch.manual_seed(0)
            args, kwargs = op.example(device, dtype)
            for variant, shape in VARIANTS.get(name, {"": lambda a: a}).items():
                a = shape(args)
                label = f"{name} {variant}".strip()
                dt = str(dtype).removeprefix("torch.")
                with torch.inference_mode():
                    ref_args = copy.deepcopy(a) if name in IN_PLACE else a
                    ref_out = op.reference(*ref_args, **kwargs)
                    want = ref_args[slice(*IN_PLACE[name])] if name in IN_PLACE else ref_out
                    ref_ms = _time(lambda: op.reference(*ref_args, **kwargs), device)
                    for impl in op.implementations[:-1]:
                        if not impl.built_for(torch.device(device).type):
                            continue  # a kernel for another device (the audit passes over it too)
                        reason = impl.supports(*a, **kwargs)
                        if impl.name == "triton" and not device.startswith("cuda"):
                            reason = reason or "the CPU runs Triton only in the interpreter (tests/kernels)"
                        if reason:
                            rows.append([label, device, dt, impl.name, "skipped", reason[:70], "", f"{ref_ms:.3f}"])
                            continue
                        own = copy.deepcopy(a) if name in IN_PLACE else a
                        try:
                            out = impl(*own, **kwargs)
                            got = own[slice(*IN_PLACE[name])] if name in IN_PLACE else out
                            ok, measured = _compare(name, got, want, dtype)
                            ms = _time(lambda: impl(*own, **kwargs), device)
                        except Exception as exc:  # a kernel that fails to build or run is a FAIL row
                            rows.append([label, device, dt, impl.name, "FAIL", f"{type(exc).__name__}: {exc}"[:70],
                                         "", f"{ref_ms:.3f}"])
                            continue
                        rows.append([label, device, dt, impl.name, "ok" if ok else "FAIL", measured, f"{ms:.3f}",
                                     f"{ref_ms:.3f}"])
    return rows


def engine_row(num_tokens: int = 8) -> list[str]:
    """Greedy tokens of a tiny random DeepSeek-V3 on CUDA against the same checkpoint on the CPU."""
    label = ["engine greedy tokens", "cuda vs cpu", "float32", "LLMEngine"]
    if not torch.cuda.is_available():
        return label + ["skipped", "no CUDA device", "", ""]
    from transformers import AutoConfig, AutoModelForCausalLM

    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams

    config = AutoConfig.for_model("deepseek_v3", bos_token_id=None, eos_token_id=None, vocab_size=512,
                                  hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
                                  qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                  max_position_embeddings=512, num_mtp_layers=0)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 17, 33)]
    params = SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        tokens, seconds = {}, {}
        for device in ("cpu", "cuda"):
            engine = LLMEngine.from_pretrained(tmp, EngineConfig(device=device, block_size=16, max_num_seqs=8))
            start = time.perf_counter()
            tokens[device] = [o.token_ids for o in engine.generate(prompts, params)]
            seconds[device] = time.perf_counter() - start
    same = sum(a == b for a, b in zip(tokens["cpu"], tokens["cuda"]))
    return label + ["ok" if same == len(prompts) else "FAIL", f"{same}/{len(prompts)} prompts identical",
                    f"{seconds['cuda'] * 1e3:.0f}", f"{seconds['cpu'] * 1e3:.0f}"]


def _subprocess_row(label: list[str], command: list[str], limit_s: int) -> list[str]:
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return label + ["FAIL", f"over {limit_s} s", "", ""]
    ms = (time.perf_counter() - start) * 1e3
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return label + ["ok" if proc.returncode == 0 else "FAIL", f"exit {proc.returncode}: {tail[0]}"[:70], f"{ms:.0f}",
                    ""]


def video_row() -> list[str]:
    label = ["video pipeline + step cache", "cuda", "default", "step_cache.py --quick"]
    if not torch.cuda.is_available():
        return label + ["skipped", "no CUDA device", "", ""]
    return _subprocess_row(label, [sys.executable, "benchmarks/step_cache.py", "--quick", "--device", "cuda",
                                   "--setups", "embedded", "--num-prompts", "1", "--steps", "8"], 240)


def allreduce_row() -> list[str]:
    label = ["all_reduce (torchrun, 2 ranks)", "cuda", "float32", "collectives.all_reduce"]
    if torch.cuda.device_count() < 2:
        return label + ["skipped", f"{torch.cuda.device_count()} CUDA device(s); needs 2", "", ""]
    return _subprocess_row(label, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "benchmarks/gpu_check.py", "--allreduce-rank"], 120)


def allreduce_rank() -> int:
    """One torchrun rank: our all_reduce on this rank's GPU equals the exact sum (nccl group)."""
    import torch.distributed as dist

    from metainfer_gen.collectives import all_reduce

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * (rank + 1)
    expected = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 3
    all_reduce(x)
    ok = torch.equal(x, expected)
    dist.destroy_process_group()
    return 0 if ok else 1


HEADER = ["op / check", "device", "dtype", "path", "status", "measured", "ms", "reference ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated op names (default every registered op)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (default both)")
    parser.add_argument("--devices", default="cpu,cuda",
                        help="where the op rows run (default both; a lent GPU's check passes cuda: CI covers the CPU)")
    parser.add_argument("--no-e2e", action="store_true", help="skip the engine, video and all-reduce rows")
    parser.add_argument("--allreduce-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.allreduce_rank:
        return allreduce_rank()
    from table import print_table  # benchmarks/ is on the path when a script here runs

    names = args.ops.split(",")
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    devices = args.devices.split(",")
    rows = op_rows(names, "cpu", dtypes) if "cpu" in devices else []
    if "cuda" in devices and torch.cuda.is_available():
        rows += op_rows(names, "cuda", dtypes)
    elif "cuda" in devices:
        rows += [[n, "cuda", "", "all", "skipped", "no CUDA device", "", ""] for n in names]
    if not args.no_e2e:
        rows += [engine_row(), video_row(), allreduce_row()]
    print_table(HEADER, rows)
    failed = [r for r in rows if r[4] == "FAIL"]
    print(f"gpu_check.py: {len(rows)} rows, {len(failed)} failed, {sum(r[4] == 'skipped' for r in rows)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
