"""DeepSeek-V4 FP8 block checkpoints (``llm/models/deepseek_v4_fp8.py``) in DeepSeek's layout: e4m3 linear weights
with 128x128 block scales named ``.scale`` (float32 or ue8m0) or ``.weight_scale_inv``, routed experts in FP8 blocks
or in FP4 (as DeepSeek-V4-Flash), the compressors, routers, embedding and head dense. They load dequantised to
exactly the values of a dense checkpoint holding them, so greedy tokens equal transformers' ``generate`` on those
values, at TP=1 and at TP=2 (each rank dequantising its slices, cut inside scale blocks) on two layer mixes; what
the engine cannot read is refused from config.json and the tensor headers before any tensor is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.checkpoint import SafetensorsCheckpoint
from metainfer_gen.llm.fp8 import AUDIT_OP
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.test_deepseek_v4_engine import CSA, HCA, SLIDING
from tests.llm.test_deepseek_v4_tp import SPLIT
from tests.llm.v4_checkpoints import make_hf_v4_model, save_v4_fp8_checkpoint

# layer types, block size, scale name, ue8m0 scales, FP4 experts and the release's tensor names (DeepSeek-V4-Flash's)
# or float32 scales, FP8 experts and transformers' names (V4-Flash-Base's, as save_pretrained writes them)
MIXES = {"sliding-csa-hca": ([SLIDING, CSA, HCA], 16, "scale", True),
         "hca-csa-csa": ([HCA, CSA, CSA], 4, "weight_scale_inv", False)}
FORMATS = {"sliding-csa-hca": "dequantised from fp8 (routed experts fp4) at load to float32",
           "hca-csa-csa": "dequantised from fp8 at load to float32"}
HIDDEN = 160  # every projection of the hidden state has a partial last 128-column block
LENGTHS = (17, 45, 70, 33)
NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def _reference(grid):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(grid, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per mix: (fp8 checkpoint, dense checkpoint of its dequantised values, block size, transformers' model on
    those values, its greedy tokens for the prompts); and the prompts."""
    prompts = random_prompts(len(LENGTHS), 128, LENGTHS, seed=4)
    out = {}
    for name, (types, block_size, suffix, ue8m0) in MIXES.items():
        root = tmp_path_factory.mktemp(f"v4_fp8_{name}")
        model = make_hf_v4_model(num_hidden_layers=len(types), layer_types=types, max_position_embeddings=128,
                                 hidden_size=HIDDEN, mlp_layer_types=["hash_moe"] + ["moe"] * (len(types) - 1))
        save_v4_fp8_checkpoint(model, root / "fp8", root / "grid", suffix, ue8m0, fp4_experts=ue8m0,
                               deepseek_names=ue8m0)
        reference = _reference(root / "grid")
        expected = [hf_greedy(reference, p, NEW) for p in prompts]
        out[name] = (root / "fp8", root / "grid", block_size, reference, expected)
    return out, prompts


def _engine(path, block_size, **kw):
    return LLMEngine.from_pretrained(path, EngineConfig(block_size=block_size, dtype="float32", max_num_seqs=4,
                                                        max_num_batched_tokens=13, **kw))


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_fp8_checkpoint_loads_dequantised_to_transformers_tokens(saved, mix):
    """13-token steps: prefill chunks end inside CSA and HCA windows and mix with decodes."""
    (runs, prompts) = saved
    fp8, grid, block_size, _, expected = runs[mix]
    layers = "layers." if MIXES[mix][3] else "model.layers."  # the release's names, or save_pretrained's
    with SafetensorsCheckpoint(fp8) as ckpt:
        assert ckpt.dtype(layers + "0.attn.wq_a.weight") == "F8_E4M3"
        assert ckpt.dtype(layers + "1.attn.compressor.wkv.weight") == "F32"  # dense, as DeepSeek ships it
        assert ckpt.dtype(layers + "1.ffn.experts.0.w1.weight") == ("I8" if MIXES[mix][3] else "F8_E4M3")
    with kernels.audit() as report:
        engine = _engine(fp8, block_size)
    fmt = engine.weight_format
    assert fmt.dequantise and not fmt.fp8 and str(fmt) == FORMATS[mix]
    assert fmt.reason.startswith("CPU: no FP8 GEMM") and "deepseek_v4 has no FP8 layers" in fmt.reason
    assert report.paths()[AUDIT_OP] == {"dense": 1}
    ours, dense = engine.model.state_dict(), _engine(grid, block_size).model.state_dict()
    assert ours.keys() == dense.keys()
    assert all(torch.equal(ours[name], dense[name]) for name in dense)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected


def test_tp2_ranks_dequantise_their_slices(saved, tmp_path):
    """TP=2 cuts q_b / o_a rows, o_b / the shared expert's down columns inside 128x128 scale blocks and gives each
    rank two whole experts: each rank holds exactly its slice of the dequantised weights, tokens unchanged."""
    from tests.collectives.harness import run_ranks

    runs, prompts = saved
    mixes = sorted(MIXES)
    results = run_ranks("tests.llm.tp_workers:greedy_v4_tp", tmp_path, timeout_s=150, prompts=prompts,
                        runs=[(str(runs[m][0]), runs[m][2]) for m in mixes], max_new_tokens=NEW, budget=13,
                        weights=list(SPLIT))
    for rank, out in results.items():
        for mix, run in zip(mixes, out["runs"]):
            _, _, _, reference, expected = runs[mix]
            assert run["tokens"] == expected, f"rank {rank} {mix}"
            full = reference.state_dict()
            for name, dim in SPLIT.items():
                size = full[name].shape[dim] // 2
                assert torch.equal(torch.tensor(run["weights"][name]), full[name].narrow(dim, rank * size, size)), name


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _fp4_attention(tensors):
    """wq_a packed as FP4 (only routed experts are FP4 in DeepSeek's releases)."""
    name = "layers.0.attn.wq_a.weight"
    tensors[name] = torch.randint(-128, 127, (32, HIDDEN // 2), dtype=torch.int8)
    tensors[name.removesuffix("weight") + "scale"] = torch.ones(32, HIDDEN // 32).to(torch.float8_e8m0fnu)


CASES = {  # what is broken -> the error it gets
    "scale missing": (lambda t: t.pop("layers.1.attn.wo_a.scale"), {},
                      r"layers.1.attn.wo_a.weight is stored in fp8 \(F8_E4M3\) but the checkpoint has no "
                      r"layers.1.attn.wo_a.scale"),
    "scale grid": (lambda t: t.update({"layers.0.attn.wq_a.scale": torch.ones(1, 1)}), {},
                   r"layers.0.attn.wq_a.scale is F32 \(1, 1\), but the fp8 weight "
                   r"layers.0.attn.wq_a.weight \(32, 160\) needs one float32 \(or ue8m0\) scale per "
                   r"128x128 block: shape \(1, 2\)"),
    "fp4 scale grid": (lambda t: t.update({"layers.1.ffn.experts.0.w1.scale": torch.ones(32, 4)}), {},
                       r"layers.1.ffn.experts.0.w1.scale is F32 \(32, 4\), but the FP4 expert weight "
                       r"layers.1.ffn.experts.0.w1.weight \(N, K\) = \(32, 160\) needs one float32 \(or "
                       r"ue8m0\) scale per 32 values of a row: shape \(32, 5\)"),
    "fp4 attention": (_fp4_attention, {}, r"layers.0.attn.wq_a.weight is FP4-packed \(I8 with "
                                          r"layers.0.attn.wq_a.scale\), but only DeepSeek-V4's routed experts"),
    "int4 experts": (None, {"expert_dtype": "int4"}, r"deepseek_v4 checkpoint with expert_dtype 'int4': the engine "
                                                     r"reads FP8-block \('fp8'\) and MXFP4 \('fp4'\)"),
    "64x64 blocks": (None, {"weight_block_size": [64, 64]}, r"fp8 checkpoint weight_block_size \[64, 64\] is not "
                                                          r"supported"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_fp8_checkpoint_is_refused_before_any_read(saved, tmp_path, monkeypatch, case):
    runs, _ = saved
    shutil.copytree(runs["sliding-csa-hca"][0], tmp_path, dirs_exist_ok=True)
    edit, config, message = CASES[case]
    if edit is not None:
        _edit_tensors(tmp_path, edit)
    _edit_config(tmp_path, **config)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the checkpoint was refused")

    monkeypatch.setattr(SafetensorsCheckpoint, "read", no_read)
    with pytest.raises(ValueError, match=message):
        _engine(tmp_path, 16)


def test_fp8_weights_in_the_model_are_refused(saved):
    runs, _ = saved
    with pytest.raises(ValueError, match=r"quantization='fp8': not yet for deepseek_v4 \(its layers have no FP8 "
                                         r"weights or FP8 KV cache yet; an FP8 checkpoint loads, dequantised\)"):
        _engine(runs["sliding-csa-hca"][0], 16, quantization="fp8")


def test_fp4_and_ue8m0_blocks_decode_as_transformers_does(tmp_path, monkeypatch):
    """The loader's FP4 expert decoding (a few rows at a time) and its ue8m0 128x128 blocks give exactly the values
    of transformers' ``Fp8Dequantize`` (what transformers' own load of such a checkpoint computes on a CPU)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from metainfer_gen.llm.models import deepseek_v4_fp8
    from metainfer_gen.llm.weight_fill import dequantise_into
    from tests.llm.v4_checkpoints import quantise_block, quantise_fp4

    torch.manual_seed(0)
    fp4, fp4_scale = quantise_fp4(torch.randn(40, 160) * 0.05)
    fp8, fp8_scale = quantise_block(torch.randn(256, 384) * 0.05, ue8m0=True)
    save_file({"e.w1.weight": fp4, "e.w1.scale": fp4_scale, "a.weight": fp8, "a.scale": fp8_scale},
              tmp_path / "model.safetensors")
    monkeypatch.setattr(deepseek_v4_fp8, "FP4_ROWS", 16)
    reference = Fp8Dequantize(None)._dequantize_one
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        ours = torch.empty(40, 160)
        deepseek_v4_fp8.dequantise_fp4_into(ours, ckpt, "e.w1.weight", "e.w1.scale")
        assert torch.equal(ours, reference(fp4, fp4_scale, output_dtype=torch.float32))
        ours = torch.empty(256, 384)
        dequantise_into(ours, ckpt, "a.weight", "a.scale", None)
        assert torch.equal(ours, reference(fp8, fp8_scale, output_dtype=torch.float32))
