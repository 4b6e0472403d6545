"""Streamed loading: multi-shard checkpoints, per-rank slices read directly, FP8 kept as FP8 (``quantization="fp8"``;
dequantised at load on the CPU otherwise, see ``test_fp8_load_format.py``), bounded host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.weight_fill import DEQUANT_BYTES
from metainfer_gen.llm.loader import load_config, load_model
from metainfer_gen.llm.parallel import TensorParallel
from tests.llm.checkpoints import hf_greedy, make_hf_model, random_prompts, save_fp8_checkpoint

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
# Every split dimension a multiple of 256, so each TP=2 shard of an fp8 weight falls on 128 boundaries.
ALIGNED = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, q_lora_rank=128,
               kv_lora_rank=64, vocab_size=512)


def _load(path, tp=None, quantization=None, dtype=torch.float32):
    return load_model(path, load_config(path), dtype=dtype, device=torch.device("cpu"), max_positions=128, tp=tp,
                      quantization=quantization)


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """(transformers model, fp32 checkpoint in shards, fp8 checkpoint in shards)."""
    model = make_hf_model("moe", **ALIGNED)
    dense, fp8 = tmp_path_factory.mktemp("aligned_fp32"), tmp_path_factory.mktemp("aligned_fp8")
    model.save_pretrained(dense, max_shard_size="300KB")
    save_fp8_checkpoint(model, fp8, max_shard_size="300KB")
    return model, dense, fp8


def test_multi_shard_checkpoint_loads_as_one_file_does(moe_checkpoint, tmp_path):
    model, single = moe_checkpoint
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 4 and (tmp_path / "model.safetensors.index.json").is_file()
    sharded, whole = _tensors(_load(tmp_path)), _tensors(_load(single))
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    prompts = random_prompts(3, model.config.vocab_size, (5, 12))
    outputs = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=4)).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("kind", ["dense", "fp8", "fp8-dequantised"])
def test_tp2_ranks_hold_exactly_the_slices_of_the_full_weights(aligned, kind):
    _, dense, fp8 = aligned
    path = dense if kind == "dense" else fp8
    quantization = "fp8" if kind == "fp8" else None
    full = _tensors(_load(path, quantization=quantization))
    assert any(t.dtype == torch.float8_e4m3fn for t in full.values()) == (kind == "fp8")
    for rank in range(2):
        shards = _tensors(_load(path, TensorParallel(rank, 2, group=None), quantization=quantization))
        assert 0 < len(shards) < len(full)  # this rank's experts only
        split_names = [n for n, t in shards.items() if getattr(t, "tp_shard", None) is not None
                       and t.tp_shard.length < t.tp_shard.total]
        assert any("q_b_proj" in n for n in split_names) and any("o_proj" in n for n in split_names)
        for name, shard in shards.items():
            reference = full[name]
            split = getattr(shard, "tp_shard", None)
            if split is not None:
                reference = split.take(reference)
            elif name.endswith("weight_scale_inv"):  # the scale rows/columns of this rank's weight shard
                weight = shards[name.removesuffix("_scale_inv")]
                if getattr(weight, "tp_shard", None) is not None:
                    s = weight.tp_shard
                    reference = reference.narrow(s.dim, s.start // 128, -(-s.length // 128))
            assert shard.dtype == reference.dtype and torch.equal(_bits(shard), _bits(reference)), name


def test_fp8_checkpoint_stays_fp8_with_its_own_blocks(aligned):
    from safetensors import safe_open

    _, dense, fp8 = aligned
    model = _load(fp8, quantization="fp8", dtype=torch.bfloat16)  # kept on the CPU because it is asked for
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    name = "model.layers.1.self_attn.q_b_proj.weight"
    file = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(fp8 / file, "pt") as f:
        stored, scale = f.get_tensor(name), f.get_tensor(name.removesuffix("weight") + "weight_scale_inv")
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(_bits(attn.q_b_proj.weight), _bits(stored))
    assert torch.equal(attn.q_b_proj.weight_scale_inv, scale)
    assert moe.experts["3"].down_proj.weight.dtype == torch.float8_e4m3fn  # experts stay fp8 too
    assert moe.shared_experts.up_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16  # read as W_UK / W_UV: dequantised on load
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and moe.gate.weight.dtype == torch.float32
    # The same fp32 weights quantised on load give the same blocks and scales (kv_b_proj aside: the fp8 checkpoint
    # rounded it to e4m3, the fp32 one did not).
    quantised = _tensors(_load(dense, quantization="fp8", dtype=torch.bfloat16))
    ours = _tensors(model)
    fp8_names = [n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_names) == len([n for n, t in quantised.items() if t.dtype == torch.float8_e4m3fn]) > 20
    assert all(torch.equal(_bits(ours[n]), _bits(quantised[n])) for n in fp8_names)
    assert all(torch.equal(ours[n + "_scale_inv"], quantised[n + "_scale_inv"]) for n in fp8_names)
    engine = LLMEngine.from_pretrained(fp8, EngineConfig(block_size=4, dtype="bfloat16", quantization="fp8"))
    with kernels.audit() as report:
        outputs = engine.generate(random_prompts(2, ALIGNED["vocab_size"], (6, 11)), GREEDY)
    assert [len(o.token_ids) for o in outputs] == [8, 8] and "fp8_block_gemm" in report.paths()


def test_misaligned_tp_slice_of_an_fp8_weight_is_refused(tmp_path):
    save_fp8_checkpoint(make_hf_model("moe"), tmp_path)  # dense down_proj (64, 128): rank 1's columns start at 64
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj.weight: this rank's columns \[64, 128\) of the fp8 "
                                         r"weight's 128 do not fall on its 128x128 scale blocks"):
        _load(tmp_path, TensorParallel(1, 2, group=None), quantization="fp8")
    # Dequantised at load (the CPU default), the same slice is fine: it needs no scale block of its own.
    rank = _load(tmp_path, TensorParallel(1, 2, group=None))
    full = _load(tmp_path).model.layers[0].mlp.down_proj.weight
    assert torch.equal(rank.model.layers[0].mlp.down_proj.weight, full[:, 64:])


def test_unsupported_checkpoint_quantisation_is_refused(moe_checkpoint, tmp_path):
    model, _ = moe_checkpoint
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        _load(tmp_path)


def test_a_rank_reads_only_its_bytes_and_never_a_whole_file(aligned, monkeypatch):
    """Every byte that leaves safetensors is counted: a TP=2 rank reads its weights once, no more."""
    import safetensors
    import safetensors.torch

    _, dense, _ = aligned
    read, largest, real_open = [], [0], safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def get_slice(self, name):
            part = self.inner.get_slice(name)

            class Slice:
                def __getattr__(self, attr):
                    return getattr(part, attr)

                def __getitem__(self, index):
                    tensor = part[index]
                    read.append(tensor.numel() * tensor.element_size())
                    return tensor
            return Slice()

        def get_tensor(self, name):
            raise AssertionError("the loader read a whole tensor with get_tensor")

    def refuse(*args, **kwargs):
        raise AssertionError("the loader read a whole file")

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors.torch, "load", refuse)
    rank = _load(dense, TensorParallel(0, 2, group=None))
    held = sum(t.numel() * 4 for t in rank.parameters()) + sum(b.numel() * 4 for n, b in rank.named_buffers()
                                                               if "rotary" not in n)
    checkpoint = sum(f.stat().st_size for f in dense.glob("*.safetensors"))
    assert sum(read) == held < 0.75 * checkpoint
    assert max(read) == max(t.numel() * 4 for t in rank.parameters())


@pytest.fixture(scope="module")
def memory_workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("llm_memory_load")


@pytest.mark.parametrize("case", [("bf16", None, 2), ("fp8", None, 1), ("fp8", "fp8", 1), ("bf16", "fp8", 1)],
                         ids=["bf16-tp2", "fp8-dequantised", "fp8-kept", "bf16-quantised"])
def test_peak_host_memory_while_loading_stays_near_the_weights(memory_workdir, case):
    """In a fresh process: peak RSS above the baseline <= 1.15x the rank's weight bytes + 48 MB (the mapped-page
    budget, one tensor, allocator slack); reading whole shards would add a shard or more. ("fp8", None): an FP8
    checkpoint dequantised at load on the CPU, to bf16 weights twice its size, one 128-row group at a time, that
    group's float32 in flight on top.)"""
    kind, quantization, tp_size = case
    script = f"""
import json, sys, torch
from pathlib import Path
sys.path.insert(0, {str(REPO / 'benchmarks')!r})
import llm_memory_load as bench
from metainfer_gen.llm.parallel import TensorParallel
from metainfer_gen.llm.loader import load_config, load_model
import transformers.models.deepseek_v3.modeling_deepseek_v3, metainfer_gen.llm.weight_fill
small = {{**bench.CONFIG, "num_hidden_layers": 3, "n_routed_experts": 16, "vocab_size": 4096}}
path = bench.write_checkpoints(Path({str(memory_workdir)!r}), small, 4)[{kind!r}]
config = load_config(path)
with bench.PeakRSS() as rss:
    model = load_model(path, config, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
                       tp=TensorParallel(0, {tp_size}, group=None), quantization={quantization!r})
print(json.dumps({{"peak": rss.peak - rss.baseline, "weights": bench.model_bytes(model)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["weights"] > 40 << 20
    # Dequantising at load also holds one float32 group of 128-row tiles (weight_fill.DEQUANT_BYTES) in flight.
    in_flight = DEQUANT_BYTES if (kind, quantization) == ("fp8", None) else 0
    assert result["peak"] <= 1.15 * result["weights"] + (48 << 20) + in_flight, result
