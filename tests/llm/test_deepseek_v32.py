"""DeepSeek-V3.2 (DSA) and FP8 in the engine against transformers' ``deepseek_v32`` on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.dsa_checkpoints import TOPK, make_hf_v32_model, prefill_logits

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
LENGTHS = (1, TOPK - 1, TOPK, TOPK + 1, 3 * TOPK)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    model = make_hf_v32_model()
    path = tmp_path_factory.mktemp("deepseek_v32")
    model.save_pretrained(path)
    prompts = random_prompts(16, model.config.vocab_size, LENGTHS)
    return model, path, prompts, [hf_greedy(model, p, 32) for p in prompts]


def _set_sparse(engine, sparse: bool) -> None:
    for layer in engine.model.model.layers:
        layer.self_attn.sparse = sparse


@pytest.mark.parametrize("block_size", [4, 64])
def test_greedy_tokens_identical_to_transformers(v32, block_size):
    model, path, prompts, expected = v32
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=block_size, max_num_batched_tokens=96))
    with kernels.audit() as report:
        outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    refusals = report.refusals().get("sparse_mla_pages", set())
    if block_size == 64:
        assert not refusals
    else:
        assert refusals == {"paged-64: page size 4, sparse kernel needs 64: realigned (indexer positions mapped to "
                            "flat cache slots)"}
    assert "sparse_mla" in report.paths() and "indexer_topk" in report.paths()


def test_prefill_logits_match_and_sparse_equals_dense_up_to_topk(v32):
    model, path, _, _ = v32
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    short, long = random_prompts(2, model.config.vocab_size, (TOPK, 3 * TOPK), seed=5)
    with torch.inference_mode():
        torch.testing.assert_close(prefill_logits(engine, long), model(torch.tensor([long])).logits[0], atol=1e-4,
                                   rtol=0)
    sparse_short, sparse_long = prefill_logits(engine, short), prefill_logits(engine, long)
    _set_sparse(engine, False)
    dense_short, dense_long = prefill_logits(engine, short), prefill_logits(engine, long)
    torch.testing.assert_close(sparse_short, dense_short, atol=1e-5, rtol=0)  # top-k >= length: all selected
    assert (sparse_long[TOPK:] - dense_long[TOPK:]).abs().max() > 1e-3  # past top-k the indexer matters


def test_chunked_prefill_and_decode_batches_keep_tokens(v32):
    model, path, prompts, expected = v32
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=16, max_num_batched_tokens=7))
    assert [o.token_ids for o in engine.generate(prompts[:6], GREEDY)] == expected[:6]


def test_fp8_quantise_on_load_halves_weights_and_fp8_latent_cache(v32):
    from metainfer_gen.llm.fp8 import weight_bytes

    model, path, prompts, _ = v32
    base = LLMEngine.from_pretrained(path, EngineConfig(block_size=16, dtype="bfloat16"))
    fp8 = LLMEngine.from_pretrained(path, EngineConfig(block_size=16, dtype="bfloat16", quantization="fp8",
                                                       kv_cache_dtype="fp8"))
    attn = fp8.model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn and attn.indexer.wk.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16 and attn.indexer.weights_proj.weight.dtype == torch.float32
    assert fp8.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    ratio = weight_bytes(fp8.model).linear_weight_bytes / weight_bytes(base.model).linear_weight_bytes
    assert ratio < 0.6
    with kernels.audit() as report:
        out = fp8.generate(prompts[:4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)
    assert {"fp8_act_quant", "fp8_block_gemm"} <= set(report.paths())


def test_deepseek_fp8_checkpoint_loads_its_own_blocks(tmp_path):
    """weight (e4m3) + weight_scale_inv as DeepSeek ships them, with K and N not multiples of 128."""
    from safetensors.torch import load_file, save_file

    from metainfer_gen.kernels.fp8_quant import quantize_fp8_weight

    model = make_hf_v32_model(hidden_size=200, q_lora_rank=136)
    model.save_pretrained(tmp_path)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(file)
    name = "model.layers.1.self_attn.q_a_proj.weight"  # (136, 200): partial blocks in both dimensions
    for key in [k for k in tensors if k.endswith(("q_a_proj.weight", "o_proj.weight", "kv_b_proj.weight"))]:
        tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_weight(tensors[key])
    save_file(tensors, file, metadata={"format": "pt"})
    dense = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=16))
    fp8 = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=16, quantization="fp8"))
    layer = fp8.model.model.layers[1].self_attn.q_a_proj
    assert torch.equal(layer.weight.view(torch.uint8), tensors[name].view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, tensors[name.removesuffix("weight") + "weight_scale_inv"])
    expected = (tensors[name].float() * layer.weight_scale_inv.repeat_interleave(128, 0)[:136]
                .repeat_interleave(128, 1)[:, :200])
    assert torch.equal(dense.model.model.layers[1].self_attn.q_a_proj.weight, expected)


def test_tensor_parallel_shard_not_multiple_of_128_gets_its_own_partial_block():
    from metainfer_gen.llm.fp8 import quantize_linear_fp8
    from metainfer_gen.llm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from metainfer_gen.llm.parallel import TensorParallel

    full = torch.randn(200, 328)
    x = torch.randn(5, 328)
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2, group=None)
        col = ColumnParallelLinear(328, 200, tp=tp)
        quantize_linear_fp8(col, col.weight.tp_shard.take(full))  # rows [100 r, 100 r + 100): one partial block
        assert col.weight_scale_inv.shape == (1, 3)
        ref = x @ full[rank * 100:(rank + 1) * 100].T
        assert float((col(x) - ref).norm() / ref.norm()) < 5e-2
        row = RowParallelLinear(328, 200, tp=tp, reduce=False)
        quantize_linear_fp8(row, row.weight.tp_shard.take(full))  # columns: K = 164 per rank
        assert row.weight_scale_inv.shape == (2, 2)
