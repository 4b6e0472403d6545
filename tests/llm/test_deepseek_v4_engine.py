"""DeepSeek-V4 in the engine (``llm/models/deepseek_v4_engine.py``) against transformers' ``generate`` on tiny random
checkpoints saved by ``save_pretrained``: several layer-type mixes and block sizes (entry rate above and below the
block size), prompts past the sliding window (16) over many CSA (4) and HCA (8) windows, chunked prefill ending
inside windows, 16 prompts in one batch, preemption; the pool's bytes against the config formula; refusals
(tensor parallelism: tests/llm/test_deepseek_v4_tp.py)."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.v4_checkpoints import make_hf_v4_model

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MIXES = {  # layer types, block size (4: an HCA entry every other block; 16: four CSA entries a block)
    "sliding-csa-hca": ([SLIDING, CSA, HCA], 16),
    "hca-csa-csa": ([HCA, CSA, CSA], 4),
    "csa-sliding-hca-csa": ([CSA, SLIDING, HCA, CSA], 8),
}
LENGTHS = (5, 17, 45, 70, 33, 9, 62, 24, 3, 51, 40, 12, 66, 28, 8, 57)
NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def _save(path, types):
    model = make_hf_v4_model(num_hidden_layers=len(types), layer_types=types, max_position_embeddings=128,
                             mlp_layer_types=["hash_moe"] + ["moe"] * (len(types) - 1))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(MIXES))
def v4(request, tmp_path_factory):
    """(checkpoint dir, block size, 16 prompts, transformers' greedy tokens for each)."""
    types, block_size = MIXES[request.param]
    path = tmp_path_factory.mktemp(f"v4_{request.param}")
    model = _save(path, types)
    prompts = random_prompts(len(LENGTHS), model.config.vocab_size, LENGTHS, seed=4)
    return path, block_size, prompts, [hf_greedy(model, p, NEW) for p in prompts]


def _engine(path, block_size, **kw):
    return LLMEngine.from_pretrained(path, EngineConfig(block_size=block_size, dtype="float32", **kw))


def _check_clean(engine):
    """Every block back in the pool and no compressor state left behind."""
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert len(engine.model.states) == 0


def test_16_prompts_in_one_batch_equal_transformers(v4):
    """Prompts of 3-70 tokens (below the window, past it, up to 17 CSA / 8 HCA windows) prefilled and decoded
    together; prefix caching is asked for and refused (audited)."""
    from metainfer_gen.kernels.audit_log import audit

    path, block_size, prompts, expected = v4
    with audit() as seen:
        engine = _engine(path, block_size, max_num_seqs=16, max_num_batched_tokens=1024)
    assert not engine.block_manager.enable_prefix_caching
    assert any(e.op == "prefix_cache" and e.path == "off" and "deepseek_v4" in str(e.refusals[0])
               for e in seen.entries)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert engine.decode_path == "eager"
    _check_clean(engine)


@pytest.mark.parametrize("budget", [7, 13])
def test_chunked_prefill_ending_inside_windows(v4, budget):
    """A step budget of 7 or 13 tokens: prefill chunks end inside CSA and HCA windows (and mix with decodes), so
    the compressor buffers carry over between steps."""
    path, block_size, prompts, expected = v4
    engine = _engine(path, block_size, max_num_seqs=4, max_num_batched_tokens=budget)
    picks = [1, 2, 3, 6]  # 17, 45, 70 and 62 tokens
    outputs = engine.generate([prompts[i] for i in picks], GREEDY)
    assert [o.token_ids for o in outputs] == [expected[i] for i in picks]
    _check_clean(engine)


def test_preemption_recomputes_and_keeps_tokens(v4):
    """A pool too small for every running sequence: sequences are preempted (their compressor state freed) and
    recomputed from position 0; tokens unchanged. Whole prefills here: a chunk boundary changes how many entries
    the indexer's top-k sees, and its ties at a zero score (relu) break differently (docs/llm_deepseek_v4.md)."""
    path, block_size, prompts, expected = v4
    num_blocks = 2 * -(-86 // block_size)  # two 70 + 16 token sequences
    engine = _engine(path, block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=1024)
    picks = [3, 6, 12, 10, 2]  # 70, 62, 66, 40, 45 tokens
    outputs = engine.generate([prompts[i] for i in picks], GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [expected[i] for i in picks]
    _check_clean(engine)


def test_state_lost_between_chunks_is_an_error(v4):
    """A sequence resuming past position 0 without its compressor state is refused, not computed wrong."""
    path, block_size, prompts, _ = v4
    engine = _engine(path, block_size, max_num_batched_tokens=8)
    engine.add_request(prompts[2], GREEDY)
    engine.step()  # the first 8 tokens: state committed
    (seq_id,) = list(engine.model.states._states)
    engine.model.release_sequence(seq_id)
    with pytest.raises(RuntimeError, match="its compressor state was freed"):
        engine.runner.run(engine.scheduler.schedule())


def test_a_step_run_twice_starts_from_the_same_state(v4):
    """``step_recovery`` may rerun a step whose forward completed (its LM head or sampling raised): each rerun
    starts from the compressor state the step started from, and the tokens stay transformers'."""
    path, block_size, prompts, expected = v4
    engine = _engine(path, block_size, max_num_batched_tokens=13)
    ids = [engine.add_request(p, GREEDY) for p in prompts[1:3]]
    done = {}
    while engine.has_unfinished_requests:
        out = engine.scheduler.schedule()
        first = engine.runner.run(out)
        assert engine.runner.run(out) == first
        for seq in engine.scheduler.update(out, first):
            done[seq.request_id] = seq.output_token_ids
            engine.runner.release(seq)
    assert [done[i] for i in ids] == expected[1:3]
    _check_clean(engine)


def test_warmup_and_abort_leave_no_state(v4):
    """The warm-up's stand-in sequences keep no compressor state (and do not trip the lost-state check); an aborted
    request's state is freed; tokens after a warm-up are unchanged."""
    path, block_size, prompts, expected = v4
    engine = _engine(path, block_size, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64)
    report = engine.warmup()
    assert report.decode_batches and len(engine.model.states) == 0
    request = engine.add_request(prompts[3], GREEDY)
    engine.step()
    assert len(engine.model.states) == 1
    engine.abort(request)
    _check_clean(engine)
    assert [o.token_ids for o in engine.generate(prompts[:2], GREEDY)] == expected[:2]


def test_compiled_decode_refused_once_and_warmup_compiles_nothing(v4, monkeypatch):
    """Where a CPU engine would compile its decode steps (``METAINFER_ENFORCE_EAGER`` unset, as a user runs it), V4
    refuses them: one audit entry with the family's reason, no static buffers, a warm-up that compiles no graph
    and reports the reason (the server prints it once); every forward names V4's attention path."""
    from metainfer_gen.kernels.audit_log import audit
    from metainfer_gen.llm.compiled_decode import ENFORCE_EAGER_ENV
    from metainfer_gen.llm.models.families import FAMILIES

    path, block_size, prompts, expected = v4
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    why = FAMILIES["deepseek_v4"].refuses["compiled_decode"]
    with audit() as seen:
        engine = _engine(path, block_size, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64)
        report = engine.warmup()
        assert [o.token_ids for o in engine.generate(prompts[:2], GREEDY)] == expected[:2]
    assert engine.decode_path == "eager" and engine.runner.static is None
    decode = [e for e in seen.entries if e.op == "decode_step"]
    assert [(e.path, e.num_calls, [r.reason for r in e.refusals]) for e in decode] == [("eager", 1, [why])]
    assert report.num_graphs_compiled == 0 and report.decode_refusal == why
    assert [e.path for e in seen.entries if e.op == "llm_attention"] == [engine.model.attention_path]
    assert engine.model.attention_path.startswith("deepseek_v4: sliding-window K=V rows + compressed entries")


def test_pool_bytes_equal_the_config_formula(tmp_path):
    """The bytes the runner allocates per block, what the sizing counts and the formula from config.json agree; for
    this config (sliding, CSA, HCA; head_dim 32, index_head_dim 16; rates 4, 8) at block size 16 that is 4 CSA
    entries of 32 + 16 and 2 HCA entries of 32 (the window rows are per sequence, not paged): 256 float32 values,
    64 bytes a token; measured sizing (no block count given) runs its profile steps without sequences."""
    from metainfer_gen.llm.plan_v4_pool import v4_paged_bytes_per_block

    model = _save(tmp_path, [SLIDING, CSA, HCA])
    engine = _engine(tmp_path, 16, max_num_seqs=4, max_num_batched_tokens=64, memory_budget_gib=0.5)
    num_blocks = engine.block_manager.num_blocks
    allocated = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    assert engine.kv_sizing.source == "measured"
    assert allocated == num_blocks * engine.kv_sizing.bytes_per_block
    assert engine.kv_sizing.bytes_per_block == v4_paged_bytes_per_block(model.config.to_dict(), 16, 4) == 256 * 4
    assert v4_paged_bytes_per_block(model.config.to_dict(), 4, 2) == (1 * 48 + 1 * 32) * 2
    assert len(engine.model.states) == 0  # profiling left no state behind


def test_refused_settings_name_what_is_missing(tmp_path):
    _save(tmp_path, [SLIDING, CSA, HCA])
    with pytest.raises(ValueError, match="quantization='fp8': not yet for deepseek_v4"):
        LLMEngine.from_pretrained(tmp_path, EngineConfig(quantization="fp8"))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': not yet for deepseek_v4"):
        LLMEngine.from_pretrained(tmp_path, EngineConfig(kv_cache_dtype="fp8"))


def test_checkpoint_names_map_to_every_parameter(tmp_path):
    """Every saved tensor fills its parameter: the loaded weights equal transformers' in-memory ones."""
    model = _save(tmp_path, [SLIDING, CSA, HCA])
    engine = _engine(tmp_path, 16, num_kv_blocks=4)
    ours = engine.model.state_dict()
    theirs = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
