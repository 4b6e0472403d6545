"""DeepSeek-V4's KV bytes per token in the engine at 8K and 32K context, from the engine's own accounting (the blocks
its block manager holds for the sequence x ``kv_sizing.bytes_per_block``, plus the side table's tensors: window rows
and compressor buffers) against the formulas from config.json: the paged layout's (``v4_paged_bytes_per_block``,
equal) and the least a sequence needs (``v4_state_bytes``). The pool holds only compressed entries and indexer keys,
so the two differ only by the entries' block rounding. docs/llm_deepseek_v4.md gives the figures."""

from __future__ import annotations

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import random_prompts
from tests.llm.test_deepseek_v4_engine import CSA, HCA, SLIDING
from tests.llm.v4_checkpoints import make_hf_v4_model

CONTEXTS, CHUNK, BLOCK = (8192, 32768), 4096, 16


def _side_table_bytes(states) -> dict[str, int]:
    """Bytes of the window rows and compressor buffers the engine holds after each sequence's last step (each
    storage once)."""
    seen = {"window": {}, "buffers": {}}
    for held in states._states.values():
        for layer in held.after:
            tensors = [("window", layer.window)]
            for state in (layer.compressor, layer.indexer):
                tensors += [("buffers", t) for t in (state.kv, state.gate, state.prior_kv, state.prior_gate)]
            for part, t in tensors:
                if t is not None:
                    seen[part][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return {part: sum(s.values()) for part, s in seen.items()}


def test_kv_bytes_per_token_at_8k_and_32k_against_the_config(tmp_path):
    """A 32K-token prompt prefilled in 4K chunks (sliding, CSA, HCA; window 128, rates 4 / 128, float32): after
    8K and after 32K tokens the pool holds ceil(context / 16) blocks of the paged formula's bytes (56 bytes a token
    here: 4 CSA entries + keys and one HCA slot a block), the side table exactly ``v4_state_bytes``' window rows and
    buffers (no view of a step's projections kept), and the two together exceed the least state from the config by
    exactly the HCA slot's rounding (a 32-value slot in every block, one entry per 8 blocks used: 7 bytes a token),
    1.13x / 1.14x (62.1 / 57.5 bytes a token against 55.1 / 50.5)."""
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
    assert per_block == v4_paged_bytes_per_block(cfg, BLOCK, 4) == (4 * 48 + 32) * 4
    measured = {}
    for done in range(CHUNK, CONTEXTS[-1] + 1, CHUNK):
        engine.step()
        if done in CONTEXTS:
            pool = (manager.num_blocks - manager.num_free_blocks) * per_block
            measured[done] = (pool, _side_table_bytes(engine.model.states))
    for ctx, (pool, side) in measured.items():
        least = v4_state_bytes(cfg, ctx, 4)
        blocks = -(-ctx // BLOCK)
        assert pool == blocks * per_block, ctx
        assert side == {"window": least["window"], "buffers": least["buffers"]}, ctx
        rounding = blocks * (32 - 32 * BLOCK // 128) * 4  # the HCA slot's unused share
        assert pool + sum(side.values()) == least["total"] + rounding, ctx
        ratio = (pool + sum(side.values())) / least["total"]
        assert abs(ratio - {8192: 1.13, 32768: 1.14}[ctx]) < 0.005, (ctx, ratio)
