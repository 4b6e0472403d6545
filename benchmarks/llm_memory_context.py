"""Peak memory above the KV pool of one engine step at long contexts: prefill chunks and a decode batch.

    OMP_NUM_THREADS=1 python benchmarks/llm_memory_context.py --out benchmarks/results/llm_memory_context.txt
    python benchmarks/llm_memory_context.py --quick        # 1K/2K/4K contexts, 512-token chunks (smoke run)

A random DeepSeek-V3 small enough for a CPU (hidden 256, 2 layers, 8 heads, MLA 64 + 16, dense MLP, float32) runs
one step per case, each case in a fresh subprocess: a 2,048-token prefill chunk ending at 2K, 8K and 32K tokens of
context, and a decode step of 16 sequences at 8K and 32K. The child builds the model and a KV pool holding the
case's context (filled with random rows, so its pages are resident), then measures two ways:

- RSS: the kernel's peak resident set (``VmHWM``) above the resident set just before the step, after a warm-up
  step, ``malloc_trim`` and a reset of the peak (``/proc/self/clear_refs``), with glibc's mmap threshold fixed at
  128 KiB (``MALLOC_MMAP_THRESHOLD_``) so that large tensors are mapped and unmapped one by one; everything the
  process touches, allocator slack and kernel scratch included.
- tensors: :class:`metainfer_gen.llm.memory_profile.StorageTracker`, the bytes of every storage the step creates
  (what KV sizing measures).

Beside them: the planner's prediction for the blockwise path (:mod:`metainfer_gen.llm.plan_activations`) and its
figure for the whole-context path the engine ran before ("materialised": (heads, tokens, context) float32 scores,
the whole context gathered and expanded), which no longer exists to be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32,
              v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
              first_k_dense_replace=2, n_group=1, topk_group=1, max_position_embeddings=32768, num_mtp_layers=0)
BLOCK = 16
MIB = 2**20


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_case(kind: str, num: int, context: int) -> dict:
    """One step in this process: ``kind`` "prefill" (``num`` tokens ending at ``context``) or "decode" (``num``
    sequences at ``context``). Returns bytes above the KV pool, by RSS and by tensor storages."""
    import ctypes

    import torch
    from transformers import AutoConfig

    from metainfer_gen.llm.attention_metadata import AttentionMetadata
    from metainfer_gen.llm.memory_profile import StorageTracker
    from metainfer_gen.llm.models.deepseek_v3 import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", bos_token_id=None, eos_token_id=None, **CONFIG)
    with torch.inference_mode():
        model = DeepseekV3ForCausalLM(config, max_positions=context).eval()
        for p in model.parameters():
            p.normal_(0, 0.05)
        seqs = 1 if kind == "prefill" else num
        blocks_per_seq = -(-context // BLOCK)
        caches = [torch.randn(seqs * blocks_per_seq, BLOCK, 1, row) for row in model.cache_row_sizes]
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(seqs)]
        starts, lens = ([context - num], [num]) if kind == "prefill" else ([context - 1] * num, [1] * num)
        ids = torch.randint(0, config.vocab_size, (sum(lens),))
        last = torch.tensor(lens).cumsum(0) - 1

        def step():
            meta = AttentionMetadata.build(starts, lens, tables, BLOCK)
            return model.compute_logits(model(ids, meta, caches)[last])

        step()  # warm-up: lazy kernel state, allocator arenas
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the warm-up's freed pages back, so the step's are counted
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kib("VmRSS")
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        rss = (_rss_kib("VmHWM") - base) * 1024
        with StorageTracker() as tracker:
            step()
    kv = sum(c.numel() * c.element_size() for c in caches)
    return {"rss": rss, "tensors": tracker.peak, "kv": kv, "seconds": seconds}


def _child(kind: str, num: int, context: int) -> dict:
    # A fixed mmap threshold keeps glibc from growing it after frees, so every tensor over 128 KiB is mapped and
    # unmapped on its own and the resident set follows what is alive (the default would serve them from the heap).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
           "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, __file__, "--child", f"{kind},{num},{context}"], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts 1K, 2K, 4K with 512-token chunks")
    parser.add_argument("--out", default=None, help="also write the table, with the command and machine, here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, num, context = args.child.split(",")
        print(json.dumps(run_case(kind, int(num), int(context))))
        return
    from table import print_table

    from metainfer_gen.llm.plan_activations import decode_activation_bytes, prefill_activation_bytes
    from metainfer_gen.llm.plan_model import ModelDims

    chunk, contexts, seqs = (512, (1024, 2048, 4096), 16) if args.quick else (2048, (2048, 8192, 32768), 16)
    cases = [("prefill", chunk, c) for c in contexts] + [("decode", seqs, c) for c in contexts[1:]]
    dims = ModelDims.from_config(CONFIG)
    load = os.getloadavg()
    rows, results = [], {}
    for kind, num, context in cases:
        r = results[(kind, context)] = _child(kind, num, context)
        formula = prefill_activation_bytes if kind == "prefill" else decode_activation_bytes
        predicted = formula(dims, num, context, 1, 1, act_bytes=4)
        old = formula(dims, num, context, 1, 1, act_bytes=4, attention="materialised")
        what = f"prefill {num} tokens" if kind == "prefill" else f"decode {num} seqs"
        rows.append([what, f"{context:,}", f"{r['kv'] / MIB:,.0f}", f"{r['rss'] / MIB:,.1f}",
                     f"{r['tensors'] / MIB:,.1f}", f"{predicted / MIB:,.1f}", f"{old / MIB:,.1f}",
                     f"{r['seconds']:.2f}"])
    growth = []
    for kind in ("prefill", "decode"):
        lo, hi = results[(kind, contexts[1])], results[(kind, contexts[2])]
        growth.append(f"{kind} {contexts[1] // 1024}K -> {contexts[2] // 1024}K: RSS x{hi['rss'] / lo['rss']:.3f}, "
                      f"tensors x{hi['tensors'] / lo['tensors']:.3f}")
    lines = [f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python benchmarks/llm_memory_context.py"
             + (" --quick" if args.quick else ""),
             f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load[0]:.2f} {load[1]:.2f} "
             f"{load[2]:.2f}; each case in a fresh process; RSS = VmHWM above VmRSS before the step (peak reset "
             f"through /proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=131072), tensors = StorageTracker peak; MiB",
             f"# model: random DeepSeek-V3 {json.dumps(CONFIG)}, float32, block {BLOCK}"]
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        print_table(["step", "context", "KV pool", "peak RSS above", "peak tensors", "predicted",
                     "old path (formula)", "step s"], rows)
    text = "\n".join(lines) + "\n" + buffer.getvalue() + "\n".join(growth) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
