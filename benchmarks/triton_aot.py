"""Compile every registered Triton kernel for sm_80, sm_89, sm_90 and sm_120 without a GPU, and print one table.

Each case calls the op's real Triton wrapper on ``device="meta"`` tensors of DeepSeek-V3 (V3.2 and GLM-5 for the DSA
kernels) or Wan 2.1 1.3B shapes inside :func:`metainfer_gen.kernels.launch.record_launches`, so the launch
configuration compiled is exactly the one the wrapper picks for that architecture;
:func:`metainfer_gen.kernels.aot.compile_launch` then compiles it and reads registers and spills (``ptxas -v``),
shared memory and the warps per SM those allow.

    python benchmarks/triton_aot.py                       # all kernels, all four archs
    python benchmarks/triton_aot.py --archs 90 --ops rms_norm --out benchmarks/results/triton_aot.txt
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from metainfer_gen.kernels.aot import AotResult, compile_launch
from metainfer_gen.kernels.launch import record_launches

ARCHS = (80, 89, 90, 120)
META = "meta"
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, device=META, dtype=dtype)


@dataclass(frozen=True)
class Case:
    """One op at one model's shapes; ``run`` calls the op's Triton implementation on meta tensors."""

    op: str
    shapes: str  # what the shapes are, for the table
    run: Callable[[], object]


def _impl(op: str) -> Callable:
    from metainfer_gen.kernels.catalog import get_op

    return get_op(op).implementation("triton").fn


def cases() -> list[Case]:
    """DeepSeek-V3 (hidden 7168, MLA 512 + 64, 128 heads, indexer 64 x 128, top-k 2048, FP8 128x128 blocks, MoE
    intermediate 2048) and Wan 2.1 1.3B (hidden 1536, 12 heads x 128, FFN 8960)."""
    tokens = 256  # a prefill chunk; every config here depends on widths, not on the token count
    c = []
    add = lambda op, shapes, fn: c.append(Case(op, shapes, fn))  # noqa: E731
    add("rms_norm", "V3 hidden 7168", lambda: _impl("rms_norm")(_t(tokens, 7168), _t(7168), 1e-6))
    add("rms_norm", "Wan qk-norm 1536", lambda: _impl("rms_norm")(_t(tokens, 1536), _t(1536), 1e-6))
    add("fused_add_rms_norm", "V3 hidden 7168",
        lambda: _impl("fused_add_rms_norm")(_t(tokens, 7168), _t(tokens, 7168), _t(7168), 1e-6))
    add("rope", "V3 q_pe 128 x 64", lambda: _impl("rope")(_t(1, tokens, 128, 64), _t(tokens, 32, dtype=FP32),
                                                           _t(tokens, 32, dtype=FP32), True))
    add("rope", "Wan 12 x 128", lambda: _impl("rope")(_t(1, tokens, 12, 128), _t(tokens, 64, dtype=FP32),
                                                       _t(tokens, 64, dtype=FP32), False))
    add("adaln_modulate", "Wan 1536", lambda: _impl("adaln_modulate")(_t(1, tokens, 1536), _t(1, 1, 1536, dtype=FP32),
                                                                       _t(1, 1, 1536, dtype=FP32), 1e-6))
    add("gated_residual", "Wan 1536", lambda: _impl("gated_residual")(_t(1, tokens, 1536), _t(1, tokens, 1536),
                                                                       _t(1, 1, 1536, dtype=FP32)))
    add("store_kv_cache", "V3 MLA row 576",
        lambda: _impl("store_kv_cache")(_t(tokens, 1, 576), None, _t(64, 64, 1, 576), None,
                                        _t(tokens, dtype=torch.int64)))
    add("store_kv_cache", "Wan-size K/V 12 x 128",
        lambda: _impl("store_kv_cache")(_t(tokens, 12, 128), _t(tokens, 12, 128), _t(64, 16, 12, 128),
                                        _t(64, 16, 12, 128), _t(tokens, dtype=torch.int64)))
    add("fp8_act_quant", "V3 hidden 7168", lambda: _impl("fp8_act_quant")(_t(tokens, 7168)))
    add("fp8_weight_dequant", "V3 expert 2048 x 7168",
        lambda: _impl("fp8_weight_dequant")(_t(2048, 7168, dtype=FP8), _t(16, 56, dtype=FP32), BF16))
    for m, label in ((16, "decode M=16"), (tokens, f"prefill M={tokens}")):
        add("fp8_block_gemm", f"V3 expert up 7168->2048, {label}",
            lambda m=m: _impl("fp8_block_gemm")(_t(m, 7168, dtype=FP8), _t(m, 56, dtype=FP32),
                                                _t(2048, 7168, dtype=FP8), _t(16, 56, dtype=FP32), BF16))
    add("fp8_block_gemm", f"Wan FFN 1536->8960, M={tokens}",
        lambda: _impl("fp8_block_gemm")(_t(tokens, 1536, dtype=FP8), _t(tokens, 12, dtype=FP32),
                                        _t(8960, 1536, dtype=FP8), _t(70, 12, dtype=FP32), BF16))
    for keys, label in ((BF16, ""), (FP8, ", fp8 cache")):
        add("indexer_topk", f"V3.2 indexer 64 x 128, 8K keys{label}",
            lambda keys=keys: _impl("indexer_topk")(_t(1, tokens, 64, 128), _t(1, tokens, 64, dtype=FP32),
                                                    _t(1, 8192, 128, dtype=keys), _t(1, tokens, dtype=torch.int64),
                                                    2048, 128 ** -0.5))
    # GLM-5 runs the same DSA kernels at its own head counts (32 indexer heads, 64 query heads; qk 192 + 64).
    add("indexer_topk", "GLM-5 indexer 32 x 128, 8K keys",
        lambda: _impl("indexer_topk")(_t(1, tokens, 32, 128), _t(1, tokens, 32, dtype=FP32), _t(1, 8192, 128),
                                      _t(1, tokens, dtype=torch.int64), 2048, 128 ** -0.5))
    add("sparse_mla", "GLM-5 64 heads, 512+64, top-k 2048, bfloat16",
        lambda: _impl("sparse_mla")(_t(tokens, 64, 576), _t(32768, 576), _t(tokens, 2048, dtype=torch.int64), 512,
                                    256 ** -0.5))
    for dtype, rows, label in ((BF16, BF16, "bfloat16"), (FP32, FP32, "float32"), (BF16, FP8, "fp8 cache")):
        add("sparse_mla", f"V3 128 heads, 512+64, top-k 2048, {label}",
            lambda dtype=dtype, rows=rows: _impl("sparse_mla")(_t(tokens, 128, 576, dtype=dtype),
                                                               _t(32768, 576, dtype=rows),
                                                               _t(tokens, 2048, dtype=torch.int64), 512, 192 ** -0.5))
    for dtype, rows, label in ((BF16, BF16, "bfloat16"), (FP32, FP32, "float32"), (BF16, FP8, "fp8 cache")):
        add("paged_mla_decode", f"V3 128 heads, 512+64, 16 decodes x 32K, page 64, {label}",
            lambda dtype=dtype, rows=rows: _impl("paged_mla_decode")(
                _t(16, 128, 576, dtype=dtype), _t(8192 * 64, 576, dtype=rows), _t(16, 512, dtype=torch.int64),
                _t(16, dtype=torch.int64), 64, 512, 192 ** -0.5))
    return c


def triton_ops() -> list[str]:
    """Registered ops with a ``triton`` implementation (the ones this script must cover)."""
    from metainfer_gen.kernels.catalog import registered_ops

    return [op.name for op in registered_ops() if "triton" in op.names]


def _config(meta: dict) -> str:
    keys = [k for k in meta if k.startswith("BLOCK")] + ["num_warps", "num_stages"]
    short = lambda k: (  # noqa: E731
        k.removeprefix("BLOCK_").lower().replace("num_warps", "warps").replace("num_stages", "stages"))
    soft = " soft-e4m3" if meta.get("SOFT_FP8") else ""  # fp8 decoded/encoded in software (fp8_codec)
    return " ".join(f"{short(k)}={meta[k]}" for k in keys if k in meta) + soft


def _markdown(head: tuple[str, ...], body: list[tuple]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda row: "| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in body])


def format_table(rows: list[tuple[Case, AotResult]], configs: dict[tuple, str]) -> str:
    """One row per (case, kernel, arch): the config the wrapper chose and what the compile used (or its error)."""
    head = ("op", "shapes", "kernel", "arch", "config", "status", "regs", "spill B", "smem B", "warps/SM")
    body = []
    for case, r in rows:
        cfg = configs.get((case.op, case.shapes, r.arch), "")
        if r.error:
            body.append((case.op, case.shapes, r.kernel, f"sm_{r.arch}", cfg, r.error, "", "", "", ""))
        else:
            body.append((case.op, case.shapes, r.kernel, f"sm_{r.arch}", cfg, "compiled", str(r.registers),
                         str(r.spilled), str(r.shared), str(r.warps_per_sm)))
    return _markdown(head, body)


def format_summary(rows: list[tuple[Case, AotResult]], archs: tuple[int, ...]) -> str:
    """One row per (case, kernel), one column per arch: ``registers / spill bytes / warps per SM``, or FAIL."""
    cells: dict[tuple, dict[int, str]] = {}
    for case, r in rows:
        cell = "FAIL" if r.error else f"{r.registers} / {r.spilled} / {r.warps_per_sm}"
        cells.setdefault((case.op, case.shapes, r.kernel), {})[r.arch] = cell
    head = ("op", "shapes", *(f"sm_{a} regs / spill B / warps" for a in archs))
    return _markdown(head, [(op, shapes, *(by_arch.get(a, "") for a in archs))
                            for (op, shapes, _), by_arch in cells.items()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(map(str, ARCHS)),
                        help="comma-separated sm numbers (default 80,89,90,120; 86 also has limits in kernels/aot.py)")
    parser.add_argument("--ops", default=None, help="comma-separated op names (default every Triton op)")
    parser.add_argument("--out", default=None, help="also write the table, with command, date and versions, here")
    args = parser.parse_args(argv)
    import triton

    archs = tuple(int(a) for a in args.archs.split(","))
    selected = [c for c in cases() if args.ops is None or c.op in args.ops.split(",")]
    missing = sorted(set(triton_ops()) - {c.op for c in cases()})
    rows, configs = [], {}
    for case in selected:
        for arch in archs:
            with record_launches(arch) as launches:
                case.run()
            for launch in launches:
                configs[(case.op, case.shapes, arch)] = _config(launch.meta)
                rows.append((case, compile_launch(launch, arch)))
    header = [
        f"# python "
        f"{' '.join(shlex.quote(a) for a in (sys.argv if argv is None else ['benchmarks/triton_aot.py', *argv]))}",
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, triton {triton.__version__}, "
        f"torch {torch.__version__}; compiled on a CPU-only machine (no GPU), ptxas -v on the PTX",
        "# moe_experts has no Triton implementation (grouped torch matmuls): nothing to compile",
        "# soft-e4m3: below sm_89 (no e4m3 conversion, no fp8 MMA) the fp8 kernels take uint8 codes and",
        "#   decode/encode in software (metainfer_gen/kernels/fp8_codec.py); the GEMM then takes fp16 dots",
        "# warps/SM: resident warps that registers (65536/SM, 256-register units per warp) and shared memory",
        "#   (164 KB sm_80, 100 KB sm_86/sm_89/sm_120, 228 KB sm_90, 1 KB reserved per block) allow, within",
        "#   the warp (64 sm_80/sm_90, 48 sm_86/sm_89/sm_120) and block (32; 24 sm_89, 16 sm_86) limits",
    ]
    if missing:
        header.append(f"# NOT COVERED: {', '.join(missing)}")
    spilled = sorted({f"{case.op} ({case.shapes}) sm_{r.arch}" for case, r in rows if r.spilled})
    header.append(f"# spills: {'; '.join(spilled) if spilled else 'none, on every arch'}")
    text = "\n".join(header) + "\n\n" + format_table(rows, configs) + "\n\n" + format_summary(rows, archs) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    failed = [r for _, r in rows if r.error]
    return 1 if missing or failed else 0


if __name__ == "__main__":
    sys.exit(main())
