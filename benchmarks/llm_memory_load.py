"""Peak host memory while loading a random DeepSeek-V3 checkpoint, against the bytes the rank's weights take.

    OMP_NUM_THREADS=1 python benchmarks/llm_memory_load.py --workdir /tmp/llm_memory_load

Writes (once; reused from ``--workdir`` afterwards) a random DeepSeek-V3 checkpoint of 2.26 GB in bf16 in
five shards, and the same weights in DeepSeek's FP8 release format (e4m3 linear weights + ``weight_scale_inv``
128x128 block scales, config ``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``),
shard by shard with safetensors (no model in memory). Then each case loads in a fresh process (TP=2: two ranks
under torchrun, gloo): the bf16 checkpoint in bf16, the same checkpoint quantised to fp8 on load, and the fp8
checkpoint as it is. Per rank: resident memory before loading (the baseline, after imports and process-group
set-up), the peak above it (the kernel's high-water mark ``VmHWM`` reset through ``/proc/self/clear_refs``, and a
thread sampling ``VmRSS`` every millisecond; the larger), the resident growth once loaded, and the bytes of the
rank's parameters and buffers (each storage once). Target: peak above baseline <= 1.15x the rank's weight bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
              num_hidden_layers=9, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
              q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
              n_routed_experts=80, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
              max_position_embeddings=4096, num_mtp_layers=0)
FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
CASES = {"bf16": ("bf16", None), "bf16->fp8": ("bf16", "fp8"), "fp8": ("fp8", "fp8"), "fp8->bf16": ("fp8", None)}
GIB = 1 << 30


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM, RssFile, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakRSS:
    """Peak resident set of this process inside the ``with`` block, in bytes, and its baseline at entry.

    ``peak`` is the larger of the kernel's high-water mark (``VmHWM``, reset to the current RSS at entry by
    writing 5 to ``/proc/self/clear_refs``; ignored where that is refused) and a 1 ms sampling thread's maximum.
    """

    def __enter__(self) -> "PeakRSS":
        self.baseline = self.sampled = _status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.sampled = max(self.sampled, _status("VmRSS"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.sampled, _status("VmHWM") if self.hwm_reset else 0)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers of ``model``, each storage counted once (stacked experts, ties)."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _random(shape, dtype, gen: torch.Generator, name: str) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if name.endswith("mlp.gate.weight"):
        return torch.randn(shape, generator=gen) * 0.02
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_checkpoints(workdir: Path, config_fields: dict, num_shards: int, seed: int = 0) -> dict[str, Path]:
    """``{"bf16": dir, "fp8": dir}``: the same random weights saved in ``num_shards`` safetensors shards (plus
    ``model.safetensors.index.json`` and ``config.json``), bf16 and DeepSeek FP8; reused when already written with
    the same fields. One shard's tensors are in memory at a time."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from metainfer_gen.kernels import quantize_fp8_weight
    from metainfer_gen.llm.layers.linear import LinearBase
    from metainfer_gen.llm.models.deepseek_v3 import DeepseekV3ForCausalLM

    key = json.dumps({"fields": config_fields, "shards": num_shards, "seed": seed}, sort_keys=True)
    dirs = {kind: workdir / f"deepseek_v3_{kind}" for kind in ("bf16", "fp8")}
    if all((d / "done.json").is_file() and (d / "done.json").read_text() == key for d in dirs.values()):
        return dirs
    config = AutoConfig.for_model("deepseek_v3", bos_token_id=None, eos_token_id=None, **config_fields)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, 64)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, LinearBase)}
    tensors = [(n, t.shape) for n, t in model.state_dict().items()]
    budget = sum(s.numel() * 2 for _, s in tensors) / num_shards
    gen = torch.Generator().manual_seed(seed)
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
        (d / "done.json").unlink(missing_ok=True)
    shard = {"bf16": {}, "fp8": {}}
    maps, index, filled = {"bf16": {}, "fp8": {}}, 0, 0

    def flush():
        for kind, part in shard.items():
            file = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file(part, dirs[kind] / file, metadata={"format": "pt"})
            maps[kind].update((n, file) for n in part)
            part.clear()

    for name, shape in tensors:
        value = _random(shape, torch.bfloat16, gen, name)
        shard["bf16"][name] = value
        if name in linear:
            shard["fp8"][name], shard["fp8"][name.removesuffix("weight") + "weight_scale_inv"] = \
                quantize_fp8_weight(value)
        else:
            shard["fp8"][name] = value
        filled += value.numel() * 2
        if filled >= budget * (index + 1) and index < num_shards - 1:
            flush()
            index += 1
    flush()
    for kind, d in dirs.items():
        if kind == "fp8":
            config.quantization_config = FP8_CONFIG
        config.save_pretrained(d)
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": maps[kind]}))
        (d / "done.json").write_text(key)
    return dirs


def measure(path: Path, quantization: str | None, tp_size: int) -> dict:
    """Load ``path`` in bf16 as this process's rank (TP > 1: under torchrun, after the gloo group is up) and
    return its memory figures in bytes."""
    from metainfer_gen.llm.loader import load_config, load_model
    from metainfer_gen.llm.parallel import TensorParallel

    tp = TensorParallel.single()
    if tp_size > 1:
        from metainfer_gen import collectives

        group = collectives.init_distributed(tensor_parallel_size=tp_size).groups["tp"]
        tp = TensorParallel(rank=group.rank, size=group.size, group="tp")
    config = load_config(path)
    # The model code (transformers' DeepSeek-V3 module: about 190 MB resident) is imported by any process that
    # runs the engine; it belongs to the baseline, not to loading.
    import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401

    import metainfer_gen.kernels.fp8_gemm  # noqa: F401
    import metainfer_gen.llm.models.deepseek_v3  # noqa: F401
    import metainfer_gen.llm.weight_fill  # noqa: F401

    start = time.perf_counter()
    with PeakRSS() as rss:
        model = load_model(path, config, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=4096,
                           tp=tp, quantization=quantization)
    seconds = time.perf_counter() - start
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    return {"rank": tp.rank, "weights": model_bytes(model), "baseline": rss.baseline, "peak": rss.peak - rss.baseline,
            "resident": _status("VmRSS") - rss.baseline, "seconds": seconds, "fp8_params": fp8,
            "hwm_reset": rss.hwm_reset}


def run_case(path: Path, quantization: str | None, tp_size: int, out: Path) -> list[dict]:
    """``measure`` in a fresh process (TP > 1: ``tp_size`` ranks under torchrun), one dict per rank."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    worker = [str(Path(__file__).resolve()), "--worker", str(path), "--quantization", quantization or "none",
              "--tp", str(tp_size), "--out", str(out)]
    launcher = [sys.executable] if tp_size == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                      "--standalone", "--nproc-per-node", str(tp_size)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(launcher + worker, check=True, env=env)
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


def _worker(args) -> None:
    torch.set_num_threads(1)
    result = measure(Path(args.worker), None if args.quantization == "none" else args.quantization, int(args.tp))
    (Path(args.out) / f"rank{result['rank']}.json").write_text(json.dumps(result))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import print_table, run_footer, run_header

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/llm_memory_load", help="where the checkpoints are cached")
    parser.add_argument("--shards", type=int, default=5, help="safetensors shards per checkpoint")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--output", default=str(REPO / "benchmarks/results/llm_memory_load.txt"),
                        help="file the table is written to ('' for none)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    started = time.perf_counter()
    header = run_header()
    dirs = write_checkpoints(Path(args.workdir), CONFIG, args.shards)
    rows, resident = [], {}
    for case in args.cases.split(","):
        kind, quantization = CASES[case]
        size = sum(f.stat().st_size for f in dirs[kind].glob("*.safetensors"))
        for tp_size in map(int, args.tp.split(",")):
            for r in run_case(dirs[kind], quantization, tp_size, Path(args.workdir) / f"out-{case}-tp{tp_size}"):
                resident[(case, tp_size, r["rank"])] = r["weights"]
                rows.append([case, f"{size / GIB:.2f} ({args.shards})", str(tp_size), str(r["rank"]),
                             f"{r['weights'] / GIB:.3f}", f"{r['baseline'] / GIB:.3f}", f"{r['peak'] / GIB:.3f}",
                             f"{r['peak'] / r['weights']:.3f}x", f"{r['resident'] / GIB:.3f}",
                             f"{r['seconds']:.1f}"])
    import io
    from contextlib import redirect_stdout

    text = io.StringIO()
    with redirect_stdout(text):
        print(header)
        print_table(["case", "checkpoint GiB (shards)", "TP", "rank", "rank weights GiB", "baseline RSS GiB",
                     "peak above baseline GiB", "peak / weights", "resident growth GiB", "load s"], rows)
        for tp_size in map(int, args.tp.split(",")):
            if ("fp8", tp_size, 0) in resident and ("bf16", tp_size, 0) in resident:
                print(f"fp8 / bf16 resident weights, TP={tp_size} rank 0: "
                      f"{resident[('fp8', tp_size, 0)] / resident[('bf16', tp_size, 0)]:.3f}")
        print(run_footer(time.perf_counter() - started))
    print(text.getvalue(), end="")
    if args.output:
        Path(args.output).write_text(text.getvalue())


if __name__ == "__main__":
    main()
