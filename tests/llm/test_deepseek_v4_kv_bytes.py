"""DeepSeek-V4's KV bytes per token in the engine at 8K and 32K context, from the engine's own accounting (the blocks
its block manager holds for the sequence x ``kv_sizing.bytes_per_block``, plus the compressor side table's
tensors) against the formulas from config.json: the paged layout's (``v4_paged_bytes_per_block``, equal) and the
least a sequence needs (``v4_state_bytes``, the window bounded; the pool keeps every token's K=V row, so it is
several times that). docs/llm_deepseek_v4.md gives the figures."""

from __future__ import annotations

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import random_prompts
from tests.llm.test_deepseek_v4_engine import CSA, HCA, SLIDING
from tests.llm.v4_checkpoints import make_hf_v4_model

CONTEXTS, CHUNK, BLOCK = (8192, 32768), 4096, 16


def _side_table_bytes(states) -> int:
    """Bytes of the compressor buffers the engine holds after each sequence's last step (each storage once)."""
    seen = {}
    for held in states._states.values():
        for layer in held.after:
            for state in layer or ():
                for t in (state.kv, state.gate, state.prior_kv, state.prior_gate):
                    if t is not None:
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_kv_bytes_per_token_at_8k_and_32k_against_the_config(tmp_path):
    """A 32K-token prompt prefilled in 4K chunks (sliding, CSA, HCA; window 128, rates 4 / 128, float32): after
    8K and after 32K tokens the pool holds ceil(context / 16) blocks of the paged formula's bytes (440 bytes a
    token here), the side table exactly ``v4_state_bytes``' buffers (no view of a step's projections kept), and
    the two together are 8.0x / 8.7x the least state from the config (55 / 50.5 bytes a token)."""
    from metainfer_gen.llm.plan_v4 import v4_state_bytes
    from metainfer_gen.llm.plan_v4_pool import v4_paged_bytes_per_block

    model = make_hf_v4_model(num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA], sliding_window=128,
                             compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=CONTEXTS[-1] + BLOCK,
                             mlp_layer_types=["hash_moe", "moe", "moe"])
    model.save_pretrained(tmp_path)
    cfg = model.config.to_dict()
    engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(
        block_size=BLOCK, dtype="float32", max_num_seqs=1, max_num_batched_tokens=CHUNK,
        num_kv_blocks=CONTEXTS[-1] // BLOCK + 4, max_model_len=CONTEXTS[-1] + BLOCK))
    engine.add_request(random_prompts(1, cfg["vocab_size"], (CONTEXTS[-1],))[0],
                       SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    manager, per_block = engine.block_manager, engine.kv_sizing.bytes_per_block
    assert per_block == v4_paged_bytes_per_block(cfg, BLOCK, 4) == (BLOCK * 32 * 3 + 4 * 48 + 32) * 4
    measured = {}
    for done in range(CHUNK, CONTEXTS[-1] + 1, CHUNK):
        engine.step()
        if done in CONTEXTS:
            pool = (manager.num_blocks - manager.num_free_blocks) * per_block
            measured[done] = (pool, _side_table_bytes(engine.model.states))
    for ctx, (pool, side) in measured.items():
        least = v4_state_bytes(cfg, ctx, 4)
        assert pool == -(-ctx // BLOCK) * per_block, ctx
        assert side == least["buffers"], ctx
        ratio = (pool + side) / least["total"]
        assert abs(ratio - {8192: 8.0, 32768: 8.7}[ctx]) < 0.05, (ctx, ratio)
