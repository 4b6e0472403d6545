"""Kernel benchmark: torch's own ops vs our float32 reference vs the fused paths (torch.compile or oneDNN on the CPU,
Triton on CUDA), with each path's error against a float64 reference, one table.

    OMP_NUM_THREADS=1 python benchmarks/kernel_table.py     # this machine's device, float32 and bfloat16
    python benchmarks/kernel_table.py --quick               # smaller shapes, fewer repeats (CI smoke run)
    python benchmarks/kernel_table.py --model PATH          # plus the end-to-end row (seconds per denoising step)

Each row times one op at a realistic shape (Wan 2.1 1.3B: 12 heads of 128, width 1536, 4096 tokens; an LLM prefill
chunk of 2048 x 4096 for the norms; the embedded Wan VAE's convolution and channel norm; its per-token timestep
MLP). Paths per op:

* ``torch``: torch's own op(s) in the input dtype, what the kernel replaces where a model is written in plain torch
  (``F.rms_norm``, ``F.layer_norm`` then modulate, the rotary formula, ``torch.addcmul``, ``index_copy_``,
  ``F.conv3d``, ``F.normalize``, the MLP on every row; the legend under the table names each). Every ratio is
  against this row.
* ``reference``: the registry's torch reference (float32 statistics, one rounding to the input dtype; for adaLN,
  the gated residual, Wan's rotary and the VAE norm this is the line diffusers' Wan runs), where it differs.
* every faster registered implementation that runs on this device, called directly (a path whose ``supports``
  refuses these inputs is skipped with the reason).

All paths of an op are timed alike: inside ``torch.inference_mode()``, the same warm-up calls, then ``--repeats``
rounds over the paths in turn (interleaved, so load drift hits all), each sample long enough to time (several calls
when one is short); the median counts. ``max err`` is each path's max abs difference from the same formula evaluated
in float64 on the same inputs; GB/s counts the bytes the op must read and write once; ``1st call s`` is the first
call (compiles included). Run it with one intra-op thread on a shared machine: ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.kernels import (  # noqa: E402
    adaln, channel_norm, conv, kv_cache, norm, rotary, timestep_embed, upsample,
)
from metainfer_gen.kernels.registry import Op  # noqa: E402
from table import run_footer, run_header  # noqa: E402  (benchmarks/ is on the path when a script here runs)

SAMPLE_S = 0.01  # a timed sample lasts at least this long (several calls of a fast op)


@dataclass(frozen=True)
class Case:
    """One op at one shape: its inputs, torch's own way to compute it, and its byte count."""

    name: str
    op: Op
    make: Callable[[str, torch.dtype, bool], tuple]  # (device, dtype, quick) -> args
    num_bytes: Callable[[tuple], int]  # bytes read + written once
    torch_op: Callable[[tuple], Callable[[], object]]  # args -> a thunk (tables prepared outside it)
    torch_name: str  # what torch_op runs, for the legend
    in_place: bool = False  # writes args[2:4] (the paged caches)
    torch_is_reference: bool = False  # torch_op is the registry's reference itself: no separate reference row


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


class TimestepMLP:
    """The embedded model's condition-embedder timestep MLP (sinusoid -> linear, SiLU, linear -> SiLU, linear) with
    its weights held, so the float64 reference runs on the very values the bf16 path rounds to."""

    def __init__(self, weights: list[torch.Tensor], frequencies: torch.Tensor, dtype: torch.dtype):
        self.weights, self.frequencies, self.dtype = weights, frequencies, dtype

    @classmethod
    def make(cls, device: str, dtype: torch.dtype, freq: int = 256, dim: int = 128) -> "TimestepMLP":
        gen = torch.Generator().manual_seed(0)
        weights = [(torch.randn(o, i, generator=gen) * i ** -0.5).to(device, dtype)
                   for o, i in ((dim, freq), (dim, dim), (6 * dim, dim))]
        half = torch.arange(freq // 2, device=device, dtype=torch.float32)
        return cls(weights, torch.exp(-math.log(10_000) * half / (freq // 2)), dtype)

    def to64(self) -> "TimestepMLP":
        return TimestepMLP([w.double() for w in self.weights], self.frequencies.double(), torch.float64)

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w1, w2, w3 = self.weights
        angles = t.to(self.frequencies.dtype)[:, None] * self.frequencies[None]
        projected = torch.cat([angles.cos(), angles.sin()], dim=1).to(self.dtype)
        temb = F.silu(projected @ w1.T) @ w2.T
        return temb, F.silu(temb) @ w3.T


def _timestep(device, dtype, quick):
    timestep = torch.full((2, 320), 700.0, device=device)  # Wan 2.2 TI2V: 2 x 320 tokens, first frame clean
    timestep[:, :64] = 0.0
    return timestep.flatten(), TimestepMLP.make(device, dtype)


# --- torch's own ops, in the input dtype (tables and casts prepared outside the timed thunk) --------------------

def _torch_rms(a):
    x, w, eps = a
    return lambda: F.rms_norm(x, (x.shape[-1],), w, eps)


def _torch_fused_rms(a):
    x, r, w, eps = a

    def run():
        summed = x + r
        return F.rms_norm(summed, (x.shape[-1],), w, eps), summed
    return run


def _torch_rope(a):
    x, cos, sin, interleaved = a
    c, s = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)  # (S, 1, D/2): over heads
    if interleaved:  # diffusers' WanAttnProcessor.apply_rotary_emb, its tables in x.dtype
        def run():
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * c - x2 * s
            out[..., 1::2] = x1 * s + x2 * c
            return out
        return run
    c2, s2 = torch.cat((c, c), -1), torch.cat((s, s), -1)  # transformers' rotary tables: cat(freqs, freqs)
    half = x.shape[-1] // 2
    return lambda: x * c2 + torch.cat((-x[..., half:], x[..., :half]), -1) * s2  # apply_rotary_pos_emb


def _torch_modulate(a):
    x, scale, shift, eps = a
    scale1, shift = (1 + scale).to(x.dtype), shift.to(x.dtype)
    return lambda: F.layer_norm(x, (x.shape[-1],), eps=eps) * scale1 + shift


def _torch_gated(a):
    residual, y, gate = a
    gate = gate.to(residual.dtype)
    return lambda: torch.addcmul(residual, y, gate)


def _torch_store(a):
    key, value, k_cache, v_cache, slots = a
    k_rows, v_rows = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])

    def run():
        k_rows.index_copy_(0, slots, key)
        v_rows.index_copy_(0, slots, value)
    return run


def _torch_conv(a):
    return lambda: F.conv3d(*a)


def _torch_channel_norm(a):
    x, gamma, bias, eps = a
    scale = math.sqrt(x.shape[1])
    return lambda: F.normalize(x, dim=1, eps=eps) * scale * gamma + bias  # diffusers' WanRMS_norm, in x.dtype


def _torch_upsample(a):
    x, scale, mode = a
    return lambda: upsample.upsample_nearest_reference(x, scale, mode)


def _torch_timestep(a):
    timestep, embed = a
    return lambda: embed(timestep)


CASES = [
    Case("rms_norm", norm.RMS_NORM, _rms, lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1]), _torch_rms, "F.rms_norm"),
    Case("fused_add_rms_norm", norm.FUSED_ADD_RMS_NORM, _fused_rms, lambda a: 4 * _nbytes(a[0]) + _nbytes(a[2]),
         _torch_fused_rms, "x + r, then F.rms_norm"),
    Case("rope interleaved", rotary.ROPE, lambda d, t, q: _rope(d, t, q, True),
         lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1], a[2]), _torch_rope,
         "diffusers Wan apply_rotary_emb (strided writes), tables in x.dtype"),
    Case("rope half-split", rotary.ROPE, lambda d, t, q: _rope(d, t, q, False),
         lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1], a[2]), _torch_rope,
         "transformers x * cos + rotate_half(x) * sin, tables in x.dtype"),
    Case("adaln_modulate", adaln.ADALN_MODULATE, _modulate, lambda a: 2 * _nbytes(a[0]), _torch_modulate,
         "F.layer_norm(x) * (1 + scale) + shift in x.dtype"),
    Case("gated_residual", adaln.GATED_RESIDUAL, _gated, lambda a: 3 * _nbytes(a[0]), _torch_gated,
         "torch.addcmul(residual, y, gate)"),
    Case("store_kv_cache", kv_cache.STORE_KV_CACHE, _store, lambda a: 2 * _nbytes(a[0], a[1]), _torch_store,
         "index_copy_ of the rows into the flattened caches", in_place=True),
    # One latent frame of the embedded Wan VAE decoder (the same shape at --quick: it is small already).
    Case("conv3d (Wan VAE)", conv.CONV3D, lambda d, t, q: conv.CONV3D.example(d, t)[0],
         lambda a: 2 * _nbytes(a[0]) + _nbytes(a[1]), _torch_conv, "F.conv3d (the reference)",
         torch_is_reference=True),
    # A decoder feature map of the embedded Wan VAE (its WanRMS_norm), also at --quick.
    Case("channel_rms_norm", channel_norm.CHANNEL_RMS_NORM,
         lambda d, t, q: channel_norm.CHANNEL_RMS_NORM.example(d, t)[0], lambda a: 2 * _nbytes(a[0]),
         _torch_channel_norm, "F.normalize(x, dim=1) * sqrt(C) * gamma + bias in x.dtype"),
    # The embedded Wan VAE decoder's largest upsampling (its WanUpsample), also at --quick.
    Case("upsample_nearest", upsample.UPSAMPLE_NEAREST, lambda d, t, q: upsample.UPSAMPLE_NEAREST.example(d, t)[0],
         lambda a: 5 * _nbytes(a[0]), _torch_upsample, "F.interpolate in float32, cast back (diffusers' WanUpsample)",
         torch_is_reference=True),
    # The embedded model's condition embedder on 2 x 320 per-token timesteps (TI2V), also at --quick.
    Case("timestep_embedding", timestep_embed.TIMESTEP_EMBEDDING, _timestep, lambda a: _nbytes(a[0]),
         _torch_timestep, "the MLP on every row (the reference)", torch_is_reference=True),
]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _to64(value):
    """A float64 copy of an argument (tensors, the timestep MLP); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value.to64() if isinstance(value, TimestepMLP) else value


def _fresh(case: Case, args: tuple) -> tuple:
    """The arguments a path writes into, copied (in-place ops): each path fills its own caches."""
    if not case.in_place:
        return args
    return (*args[:2], *(torch.zeros_like(t) for t in args[2:4]), *args[4:])


def _result(case: Case, args: tuple, returned):
    return tuple(args[2:4]) if case.in_place else returned


def _max_err(got, want, relative: bool = False) -> float:
    """Largest absolute difference, or with ``relative`` that over the largest magnitude of ``want`` (a bf16 output
    near 16 is one unit in the last place off at 0.0625 absolute, 0.4% relative)."""
    if isinstance(got, (tuple, list)):
        return max(_max_err(g, w, relative) for g, w in zip(got, want))
    err = float((got.double() - want.double()).abs().max())
    return err / max(float(want.double().abs().max()), 1e-12) if relative and want.numel() else err


def _fast_impls(case: Case, device: str) -> list[str]:
    names = []
    for impl in case.op.implementations[:-1]:
        if impl.name == "triton" and not device.startswith("cuda"):
            continue  # the interpreter is for correctness, not speed
        if impl.built_for(torch.device(device).type):
            names.append(impl.name)
    return names


def time_paths(thunks: dict[str, Callable[[], object]], device: str, repeats: int, warmup: int = 2) -> dict:
    """``{path: median ms per call}``: ``warmup`` calls of each, then ``repeats`` rounds over the paths in turn,
    each sample ``n`` calls with ``n`` set so a sample lasts about :data:`SAMPLE_S`. Call inside the caller's
    inference-mode context."""
    for thunk in thunks.values():
        for _ in range(warmup):
            thunk()
    _sync(device)
    calls = {}
    for name, thunk in thunks.items():
        start = time.perf_counter()
        thunk()
        _sync(device)
        calls[name] = max(1, round(SAMPLE_S / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in thunks}
    for _ in range(repeats):
        for name, thunk in thunks.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                thunk()
            _sync(device)
            samples[name].append((time.perf_counter() - start) * 1e3 / calls[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def run_case(case: Case, device: str, dtype: torch.dtype, quick: bool, repeats: int) -> list[dict]:
    """Time one op: torch's own op, the registry's reference, and each faster implementation on ``device``."""
    args = case.make(device, dtype, quick)
    reference = case.op.reference
    with torch.inference_mode():
        exact_args = _fresh(case, tuple(_to64(a) for a in args))
        exact = _result(case, exact_args, case.torch_op(exact_args)())
        paths: dict[str, tuple] = {"torch": (None, case.torch_op)}
        if not case.torch_is_reference:
            paths["reference"] = (reference, None)
        for name in _fast_impls(case, device):
            impl = case.op.implementation(name)
            refusal = impl.supports(*args)
            if refusal:  # e.g. oneDNN's bfloat16 convolution: PyTorch already sends it there
                print(f"  skipped {case.name} {str(dtype).removeprefix('torch.')} {name}: {refusal}",
                      file=sys.stderr, flush=True)
                continue
            paths[name] = (impl, None)
        thunks, errors, firsts, outputs = {}, {}, {}, {}
        for name, (impl, builder) in paths.items():
            own = _fresh(case, args)
            thunk = builder(own) if builder is not None else (lambda impl=impl, own=own: impl(*own))
            start = time.perf_counter()
            returned = thunk()
            _sync(device)
            firsts[name] = time.perf_counter() - start
            outputs[name] = _result(case, own, returned)
            errors[name] = _max_err(outputs[name], exact)
            thunks[name] = thunk
        ms = time_paths(thunks, device, repeats)
    rows = []
    for name in thunks:
        rows.append(dict(op=case.name, dtype=str(dtype).removeprefix("torch."), path=name, ms=ms[name],
                         ratio=ms["torch"] / ms[name], gbps=case.num_bytes(args) / ms[name] / 1e6,
                         max_err=errors[name], first_call_s=firsts[name],
                         err_vs_reference=_max_err(outputs[name], outputs.get("reference", outputs["torch"]),
                                                  relative=True)))
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
    out.write(f"\nkernels on {device} ({torch.get_num_threads()} threads, inference_mode, interleaved, median), "
              f"ratio = torch ms / path ms, max err against float64\n")
    out.write(f"| {'op':<20} | {'dtype':<8} | {'path':<9} | {'ms':>9} | {'vs torch':>8} | {'GB/s':>6} | "
              f"{'max err':>8} | {'1st call s':>10} |\n")
    out.write("|" + "|".join("-" * w for w in (22, 10, 11, 11, 10, 8, 10, 12)) + "|\n")
    for r in rows:
        out.write(f"| {r['op']:<20} | {r['dtype']:<8} | {r['path']:<9} | {r['ms']:>9.3f} | {r['ratio']:>7.2f}x | "
                  f"{r['gbps']:>6.1f} | {r['max_err']:>8.1e} | {r['first_call_s']:>10.2f} |\n")
    out.write("\ntorch = " + "; ".join(f"{c.name}: {c.torch_name}" for c in CASES) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (default both)")
    parser.add_argument("--ops", default=None, help="comma-separated op names to run (default all)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds over the paths, interleaved; the median counts (default 10/5)")
    parser.add_argument("--model", default=None, help="also time the end-to-end pipeline of this model folder "
                                                      "('embedded' for the default model)")
    parser.add_argument("--max-err", type=float, default=None,
                        help="exit 1 if a fused output differs from the registry's reference by more than this, "
                             "relative to the reference's largest magnitude (default: 1e-4 float32, 2e-2 "
                             "bfloat16, as benchmarks/gpu_check.py)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(run_header(), flush=True)
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
    bad = [r for r in rows if r["path"] not in ("torch", "reference")
           and r["err_vs_reference"] > (args.max_err or (1e-4 if r["dtype"] == "float32" else 2e-2))]
    if args.model:
        row = end_to_end_row(None if args.model == "embedded" else args.model, device=args.device)
        print(f"\nend to end ({row['model']}): {row['unfused_s_per_step']:.4f} s/step unfused, "
              f"{row['fused_s_per_step']:.4f} s/step fused, {row['ratio']:.2f}x\n{row['audit']}")
    print(run_footer(time.perf_counter() - started))
    for r in bad:
        print(f"ERROR: {r['op']} {r['dtype']} {r['path']} differs from the reference by {r['err_vs_reference']:.2e} "
              "of its largest magnitude",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
