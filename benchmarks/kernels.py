"""Kernel benchmark: eager torch reference vs the fused paths (torch.compile on CPU, Triton on CUDA), one table.

    python benchmarks/kernels.py                       # this machine's device, float32 and bfloat16
    python benchmarks/kernels.py --quick               # smaller shapes, fewer repeats (CI smoke run)
    python benchmarks/kernels.py --model PATH          # plus the end-to-end row (seconds per denoising step)

Each row times one op at a realistic shape: the eager reference (what the model's own code costs, one torch op per
line), then every faster registered implementation that runs on this device, called directly (the registry's
size threshold is bypassed so the compiled path is measured even where dispatch would not pick it). Ratios are
eager time / fused time; GB/s counts the bytes the op must read and write once. Every fused output is checked
against the reference and the max abs error is printed. Compile time is excluded from timings (warm-up) but
reported. Run it with one intra-op thread on a shared machine: ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.kernels import adaln, channel_norm, conv, kv_cache, norm, rotary, timestep_embed  # noqa: E402
from metainfer_gen.kernels.registry import Op  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    op: Op
    make: Callable[[str, torch.dtype, bool], tuple]  # (device, dtype, quick) -> args
    num_bytes: Callable[[tuple], int]  # bytes read + written once
    in_place: bool = False


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _rms(device, dtype, quick):
    rows, width = (512, 2048) if quick else (2048, 4096)  # an LLM prefill chunk
    return torch.randn(rows, width, device=device, dtype=dtype), torch.randn(width, device=device, dtype=dtype), 1e-6


def _fused_rms(device, dtype, quick):
    x, w, eps = _rms(device, dtype, quick)
    return x, torch.randn_like(x), w, eps


def _rope(device, dtype, quick, interleaved):
    seq = 1024 if quick else 4096  # Wan 1.3B: 12 heads of 128
    angles = torch.rand(seq, 64, device=device) * 6.28
    return torch.randn(1, seq, 12, 128, device=device, dtype=dtype), angles.cos(), angles.sin(), interleaved


def _modulate(device, dtype, quick):
    seq = 1024 if quick else 4096  # Wan 1.3B width 1536
    table = torch.randn(1, 6, 1536, device=device)
    return torch.randn(1, seq, 1536, device=device, dtype=dtype), table[:, 1:2], table[:, 0:1], 1e-6


def _gated(device, dtype, quick):
    x, scale, _, _ = _modulate(device, dtype, quick)
    return x, torch.randn_like(x), scale


def _store(device, dtype, quick):
    tokens, heads, dim, block = (1024 if quick else 8192), 8, 128, 16
    num_blocks = tokens // block * 2
    caches = [torch.zeros(num_blocks, block, heads, dim, device=device, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block, device=device)[:tokens]
    return (torch.randn(tokens, heads, dim, device=device, dtype=dtype),
            torch.randn(tokens, heads, dim, device=device, dtype=dtype), caches[0], caches[1], slots)


CASES = [
    Case("rms_norm", norm.RMS_NORM, _rms, lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1])),
    Case("fused_add_rms_norm", norm.FUSED_ADD_RMS_NORM, _fused_rms, lambda a: 4 * _nbytes(a[0]) + _nbytes(a[2])),
    Case("rope interleaved", rotary.ROPE, lambda d, t, q: _rope(d, t, q, True),
         lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1], a[2])),
    Case("rope half-split", rotary.ROPE, lambda d, t, q: _rope(d, t, q, False),
         lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1], a[2])),
    Case("adaln_modulate", adaln.ADALN_MODULATE, _modulate, lambda a: 2 * _nbytes(a[0])),
    Case("gated_residual", adaln.GATED_RESIDUAL, _gated, lambda a: 3 * _nbytes(a[0])),
    Case("store_kv_cache", kv_cache.STORE_KV_CACHE, _store, lambda a: 2 * _nbytes(a[0], a[1]), in_place=True),
    # One latent frame of the embedded Wan VAE decoder (the same shape at --quick: it is small already).
    Case("conv3d (Wan VAE)", conv.CONV3D, lambda d, t, q: conv.CONV3D.example(d, t)[0],
         lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1])),
    # A decoder feature map of the embedded Wan VAE (its WanRMS_norm), also at --quick.
    Case("channel_rms_norm", channel_norm.CHANNEL_RMS_NORM,
         lambda d, t, q: channel_norm.CHANNEL_RMS_NORM.example(d, t)[0], lambda a: 2 * _nbytes(a[0])),
    # The embedded model's condition embedder on 2 x 320 per-token timesteps (TI2V), also at --quick.
    Case("timestep_embedding", timestep_embed.TIMESTEP_EMBEDDING,
         lambda d, t, q: timestep_embed.TIMESTEP_EMBEDDING.example(d, t)[0], lambda a: _nbytes(a[0])),
]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _max_err(got, want) -> float:
    if isinstance(got, tuple):
        return max(_max_err(g, w) for g, w in zip(got, want))
    return float((got.float() - want.float()).abs().max())


def _fast_impls(case: Case, device: str) -> list[str]:
    names = []
    for impl in case.op.implementations[:-1]:
        if impl.name == "triton" and not device.startswith("cuda"):
            continue  # the interpreter is for correctness, not speed
        names.append(impl.name)
    return names


def run_case(case: Case, device: str, dtype: torch.dtype, quick: bool, repeats: int) -> list[dict]:
    """Time one op: the eager reference and each faster implementation available on ``device``."""
    args = case.make(device, dtype, quick)
    reference = case.op.reference
    rows = []
    if case.in_place:
        want = [t.clone() for t in args[2:4]]
        reference(*args[:2], *want, args[4])
        eager_ms = time_ms(lambda: reference(*args), device, repeats)
    else:
        want = reference(*args)
        eager_ms = time_ms(lambda: reference(*args), device, repeats)
    for name in _fast_impls(case, device):
        impl = case.op.implementation(name)
        refusal = impl.supports(*args)
        if refusal:  # e.g. oneDNN's bfloat16 convolution needs AVX-512 or AVX-NE-CONVERT
            print(f"  skipped {case.name} {name}: {refusal}", file=sys.stderr, flush=True)
            continue
        with torch.no_grad():
            start = time.perf_counter()
            if case.in_place:
                got = [torch.zeros_like(t) for t in args[2:4]]
                impl(*args[:2], *got, args[4])
                err = max(_max_err(g, w) for g, w in zip(got, want))
            else:
                err = _max_err(impl(*args), want)
            _sync(device)
            first_s = time.perf_counter() - start
            fast_ms = time_ms(lambda: impl(*args), device, repeats)
        rows.append(dict(op=case.name, dtype=str(dtype).removeprefix("torch."), path=name, eager_ms=eager_ms,
                         fast_ms=fast_ms, ratio=eager_ms / fast_ms, gbps=case.num_bytes(args) / fast_ms / 1e6,
                         max_err=err, first_call_s=first_s))
    return rows


def end_to_end_row(model_path: str | None, device: str = "cpu", dtype: torch.dtype | None = None,
                   num_inference_steps: int = 4, repeats: int = 2, **call) -> dict:
    """Seconds per denoising step of a video pipeline with and without :func:`fuse_kernels`.

    Args:
        model_path: a diffusers pipeline folder or hub id; None = the embedded default model.
        device, dtype: where and in what precision to run (dtype None = the pipeline's default).
        num_inference_steps, repeats: steps per call and timed calls per variant (after one warm-up call each).
        call: extra pipeline call arguments (num_frames, height, width ...).
    Returns:
        dict with ``unfused_s_per_step``, ``fused_s_per_step``, ``ratio`` and the fused call's audit summary.
    """
    from metainfer_gen.kernels import audit
    from metainfer_gen.video.fuse import fuse_kernels, unfuse_kernels
    from metainfer_gen.pipelines import TextToVideoPipeline

    pipe = TextToVideoPipeline.from_pretrained(model_path, torch_dtype=dtype, device=device)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(num_inference_steps=num_inference_steps, seed=0, **call)

    def seconds_per_step() -> float:
        pipe("a red circle moving right", **kwargs)  # warm-up (and compiles, when fused)
        _sync(device)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            pipe("a red circle moving right", **kwargs)
            _sync(device)
            samples.append((time.perf_counter() - start) / num_inference_steps)
        return min(samples)

    unfused = seconds_per_step()
    for transformer in pipe.transformers:
        fuse_kernels(transformer)
    try:
        fused = seconds_per_step()
        with audit() as trace:
            pipe("a red circle moving right", **kwargs)
    finally:
        for transformer in pipe.transformers:
            unfuse_kernels(transformer)
    return dict(model=model_path or "embedded", unfused_s_per_step=unfused, fused_s_per_step=fused,
                ratio=unfused / fused, audit=trace.summary())


def print_table(rows: list[dict], device: str, out=sys.stdout) -> None:
    out.write(f"\nkernels on {device} ({torch.get_num_threads()} threads), eager reference vs fused path\n")
    out.write(f"| {'op':<20} | {'dtype':<8} | {'path':<8} | {'eager ms':>9} | {'fused ms':>9} | {'ratio':>6} | "
              f"{'GB/s':>6} | {'max err':>8} | {'1st call s':>10} |\n")
    out.write("|" + "|".join("-" * w for w in (22, 10, 10, 11, 11, 8, 8, 10, 12)) + "|\n")
    for r in rows:
        out.write(f"| {r['op']:<20} | {r['dtype']:<8} | {r['path']:<8} | {r['eager_ms']:>9.3f} | "
                  f"{r['fast_ms']:>9.3f} | {r['ratio']:>5.2f}x | {r['gbps']:>6.1f} | {r['max_err']:>8.1e} | "
                  f"{r['first_call_s']:>10.2f} |\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (default both)")
    parser.add_argument("--ops", default=None, help="comma-separated op names to run (default all)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 10/5)")
    parser.add_argument("--model", default=None, help="also time the end-to-end pipeline of this model folder "
                                                      "('embedded' for the default model)")
    parser.add_argument("--max-err", type=float, default=None,
                        help="exit 1 if a fused output differs from the reference by more than this (default: "
                             "1e-4 float32, 6e-2 bfloat16)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 10)
    wanted = set(args.ops.split(",")) if args.ops else None
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for case in CASES:
            if wanted and case.name not in wanted and case.op.name not in wanted:
                continue
            rows.extend(run_case(case, args.device, dtype, args.quick, repeats))
            print(f"  measured {case.name} {dtype_name}", file=sys.stderr, flush=True)
    print_table(rows, args.device)
    bad = [r for r in rows if r["max_err"] > (args.max_err or (1e-4 if r["dtype"] == "float32" else 6e-2))]
    if args.model:
        row = end_to_end_row(None if args.model == "embedded" else args.model, device=args.device)
        print(f"\nend to end ({row['model']}): {row['unfused_s_per_step']:.4f} s/step unfused, "
              f"{row['fused_s_per_step']:.4f} s/step fused, {row['ratio']:.2f}x\n{row['audit']}")
    for r in bad:
        print(f"ERROR: {r['op']} {r['dtype']} {r['path']} max error {r['max_err']:.2e}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
