"""Static-shape decode (``llm/static_decode.py``) against the dynamic decode path, step by step.

Two engines on the same checkpoint run in lockstep (same schedule, greedy): every step's logits agree within 1e-5
and the tokens are identical. The static engine's buffers can be poisoned before every step (random slots, block
tables, lengths, ids; NaN hidden states), and every static step checks that no cache row outside the step's real
slots changed: stale rows and padding rows that write KV are what graph replay gets wrong.
"""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.static_decode import batch_size_ladder
from tests.llm.checkpoints import make_hf_model, random_prompts

LENGTHS = (1, 3, 7, 12, 16, 17, 29)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture and replay need a CUDA device")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = make_hf_model("moe")
    path = tmp_path_factory.mktemp("static_decode_moe")
    model.save_pretrained(path)
    return path, model.config.vocab_size


def make(path, static: bool, **overrides) -> LLMEngine:
    settings = dict(block_size=4, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128,
                    static_decode=static) | overrides
    return LLMEngine.from_pretrained(path, EngineConfig(**settings))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def poison(engine: LLMEngine, gen: torch.Generator) -> None:
    """Garbage that points at live KV: a row the step forgets to rewrite corrupts the cache or the tokens."""
    buffers = engine.runner.static.buffers
    num_slots = engine.block_manager.num_blocks * engine.config.block_size
    for buffer in buffers.int_buffers:
        buffer.copy_(torch.randint(0, num_slots, buffer.shape, generator=gen).to(buffer.device))
    buffers.block_tables.remainder_(engine.block_manager.num_blocks)
    buffers.input_ids.remainder_(engine.model.config.vocab_size)
    buffers.positions.remainder_(engine.max_model_len)
    buffers.hidden.fill_(float("nan"))


def real_slots(out, block_size: int) -> list[int]:
    slots = []
    for item in out.scheduled:
        for pos in range(item.start, item.start + item.num_tokens):
            slots.append(item.seq.block_table[pos // block_size] * block_size + pos % block_size)
    return slots


def sink_slots(engine: LLMEngine) -> list[int]:
    """Slots past the block pool (the sink block the padding rows of a compiled step write), free to change."""
    pool = engine.block_manager.num_blocks * engine.config.block_size
    cache = engine.runner.kv_caches[0]
    return list(range(pool, cache.shape[0] * cache.shape[1]))


def assert_only_real_slots_written(before, after, slots: list[int]) -> None:
    keep = torch.ones(before[0].shape[0] * before[0].shape[1], dtype=torch.bool)
    keep[slots] = False
    for layer, (b, a) in enumerate(zip(before, after)):
        b, a = b.flatten(0, 1).cpu().view(torch.uint8), a.flatten(0, 1).cpu().view(torch.uint8)  # any dtype, fp8 too
        changed = (b[keep] != a[keep]).any(-1).nonzero().flatten().tolist()
        assert not changed, f"layer {layer}: cache rows outside the step's slots changed ({len(changed)} rows)"


def lockstep(dynamic: LLMEngine, static: LLMEngine, prompts, params, *, poison_seed: int | None = None,
             atol: float = 1e-5) -> tuple[list, set[tuple[int, int]]]:
    """Run both engines step by step; returns (the static engine's sequences, the (size, width) shapes its static
    path ran)."""
    seqs = {}
    for engine in (dynamic, static):
        seqs[id(engine)] = [engine._requests[engine.add_request(p, q)] for p, q in
                            zip(prompts, params if isinstance(params, list) else [params] * len(prompts))]
    gen = torch.Generator().manual_seed(poison_seed or 0)
    sizes = set()
    while static.has_unfinished_requests:
        out_d, out_s = dynamic.scheduler.schedule(), static.scheduler.schedule()
        assert [(i.start, i.num_tokens) for i in out_d.scheduled] == [(i.start, i.num_tokens) for i in out_s.scheduled]
        runner = static.runner
        is_static = runner.static.can_run(out_s)
        if poison_seed is not None:
            poison(static, gen)
        before = [c.clone() for c in runner.kv_caches] if is_static else None
        logits_d, rows_d = dynamic.runner.forward_logits(out_d)
        logits_s, rows_s = runner.forward_logits(out_s)
        if is_static:
            sizes.add(runner.static.last_shape)
            assert_only_real_slots_written(before, runner.kv_caches, real_slots(out_s, static.config.block_size)
                                           + sink_slots(static))
        assert rows_d == rows_s
        if rows_s:
            torch.testing.assert_close(logits_s, logits_d, atol=atol, rtol=0)
        for engine, out, logits, rows in ((dynamic, out_d, logits_d, rows_d), (static, out_s, logits_s, rows_s)):
            tokens = logits.argmax(-1).tolist() if rows else []
            engine.scheduler.update(out, {out.scheduled[r].seq.seq_id: t for r, t in zip(rows, tokens)})
        assert [s.token_ids for s in seqs[id(dynamic)]] == [s.token_ids for s in seqs[id(static)]]
    assert not dynamic.has_unfinished_requests
    return seqs[id(static)], sizes


def sizes(shapes) -> set[int]:
    return {size for size, _ in shapes}


def test_batch_size_ladder():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(16) == [1, 2, 4, 8, 16]
    assert batch_size_ladder(13) == [1, 2, 4, 8, 13]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_size_ladder(32) == [1, 2, 4, 8, 16, 32]  # table widths of max_model_len 128, block 4


def test_config_flags():
    assert EngineConfig().static_decode is None and EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="static_decode"):
        EngineConfig(static_decode="yes")
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager=1)


@pytest.mark.parametrize("num_seqs, padded", [(1, 1), (3, 4), (8, 8), (13, 16)])
def test_static_equals_dynamic(checkpoint, num_seqs, padded):
    path, vocab = checkpoint
    prompts = random_prompts(num_seqs, vocab, LENGTHS, seed=num_seqs)
    seqs, shapes = lockstep(make(path, False), make(path, True), prompts, greedy(10))
    assert padded in sizes(shapes)
    assert all(s.num_output_tokens == 10 for s in seqs)


def test_static_engine_generate_matches_dynamic(checkpoint):
    """Through ``generate`` (the runner's own sampling), with the static path counting its steps."""
    path, vocab = checkpoint
    prompts = random_prompts(13, vocab, LENGTHS, seed=5)
    static = make(path, True)
    expected = [o.token_ids for o in make(path, False).generate(prompts, greedy(12))]
    assert [o.token_ids for o in static.generate(prompts, greedy(12))] == expected
    assert static.runner.static.num_steps >= 11
    assert static.block_manager.num_free_blocks == static.block_manager.num_blocks


def test_static_with_prefix_caching(checkpoint):
    path, vocab = checkpoint
    dynamic, static = make(path, False), make(path, True)
    prefix = random_prompts(1, vocab, (24,), seed=3)[0]
    tails = random_prompts(5, vocab, (3, 5), seed=4)
    lockstep(dynamic, static, [prefix + [1]], greedy(4))  # warms the prefix
    seqs, _ = lockstep(dynamic, static, [prefix + t for t in tails], greedy(8), poison_seed=1)
    assert all(s.num_cached_tokens == 24 for s in seqs)
    assert static.block_manager.num_free_blocks == static.block_manager.num_blocks


def test_static_with_fp8_kv_cache(checkpoint):
    path, vocab = checkpoint
    dynamic, static = make(path, False, kv_cache_dtype="fp8"), make(path, True, kv_cache_dtype="fp8")
    lockstep(dynamic, static, random_prompts(5, vocab, LENGTHS, seed=23), greedy(8), poison_seed=6, atol=1e-4)


def test_cuda_graphs_need_cuda(checkpoint):
    from metainfer_gen.llm.static_decode import StaticDecode

    engine = make(checkpoint[0], False)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticDecode(engine.model, engine.runner.kv_caches, max_num_seqs=4, max_model_len=64, block_size=4,
                     use_cuda_graphs=True)


def test_static_with_preemption(checkpoint):
    """A pool of 24 blocks for 6 sequences forces recompute preemption; the tokens stay those of the dynamic path."""
    path, vocab = checkpoint
    settings = dict(num_kv_blocks=24, enable_prefix_caching=False)
    dynamic, static = make(path, False, **settings), make(path, True, **settings)
    prompts = random_prompts(6, vocab, LENGTHS, seed=9)
    lockstep(dynamic, static, prompts, greedy(32), poison_seed=2)
    assert static.scheduler.num_preemptions > 0
    assert static.runner.static.num_steps > 0


@pytest.mark.parametrize("poison_seed", [None, 7])
def test_stale_buffers_smaller_batch_same_ladder_size(checkpoint, poison_seed):
    """Eight sequences finish one by one: steps of 8, 7, 6, 5 rows all replay ladder size 8 on the same buffers
    (then 4, 3 on size 4), so rows of the earlier, larger batch must not survive; with a seed the buffers are also
    filled with garbage before every step."""
    path, vocab = checkpoint
    prompts = random_prompts(8, vocab, LENGTHS, seed=11)
    params = [greedy(n) for n in (4, 5, 6, 7, 8, 9, 10, 11)]
    seqs, shapes = lockstep(make(path, False), make(path, True), prompts, params, poison_seed=poison_seed)
    assert {8, 4} <= sizes(shapes)
    assert len({width for size, width in shapes if size == 8}) > 1  # the table width grows within size 8
    assert [s.num_output_tokens for s in seqs] == [4, 5, 6, 7, 8, 9, 10, 11]


def test_padding_rows_write_no_kv(checkpoint):
    """Three decodes padded to four, buffers poisoned: only the three real slots of each layer's cache change."""
    path, vocab = checkpoint
    engine = make(path, True)
    for p in random_prompts(3, vocab, LENGTHS, seed=13):
        engine.add_request(p, greedy(4))
    out = engine.scheduler.schedule()  # the three prefills
    engine.scheduler.update(out, engine.runner.run(out))
    out = engine.scheduler.schedule()
    assert engine.runner.static.can_run(out) and engine.runner.static.padded_size(3) == 4
    poison(engine, torch.Generator().manual_seed(3))
    before = [c.clone() for c in engine.runner.kv_caches]
    engine.runner.run(out)
    slots = real_slots(out, engine.config.block_size)
    assert_only_real_slots_written(before, engine.runner.kv_caches, slots)
    assert all((a.flatten(0, 1)[slots] != b.flatten(0, 1)[slots]).any() for a, b in zip(engine.runner.kv_caches,
                                                                                         before))


def test_static_dsa_sparse_decode(tmp_path):
    """DeepSeek-V3.2's sparse path reads ``decode_block_tables``/``decode_context_lens`` from the static buffers too."""
    from tests.llm.dsa_checkpoints import make_hf_v32_model

    model = make_hf_v32_model()
    model.save_pretrained(tmp_path)
    prompts = random_prompts(5, model.config.vocab_size, LENGTHS, seed=17)
    _, shapes = lockstep(make(tmp_path, False), make(tmp_path, True), prompts, greedy(16), poison_seed=4)
    assert 8 in sizes(shapes)


@pytest.mark.parametrize("form", ["moe_experts_dense", "moe_experts_folded"])
def test_capture_safe_moe_matches_sorted_path(form):
    from metainfer_gen.kernels.moe import moe_experts
    from metainfer_gen.llm.layers import moe

    moe_experts_dense = getattr(moe, form)
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(13, 32, generator=g), torch.randn(6, 40, 32, generator=g), torch.randn(6, 32, 20,
                                                                                                   generator=g)
    ids = torch.rand(13, 8, generator=g).argsort(-1)[:, :2]  # experts 0..7, this rank holds 2..7
    weights = torch.rand(13, 2, generator=g)
    torch.testing.assert_close(moe_experts_dense(x, weights, ids, w13, w2, 2), moe_experts(x, weights, ids, w13, w2, 2),
                               atol=1e-4, rtol=1e-5)


def test_static_with_capture_safe_moe(checkpoint, monkeypatch):
    """The MoE branch a CUDA graph captures, run eagerly on the CPU inside the engine: same tokens."""
    from metainfer_gen.llm.layers import moe

    path, vocab = checkpoint
    dynamic, static = make(path, False), make(path, True)
    real, forward = moe.moe_experts_dense, static.runner.static._forward
    inside, calls = [], []
    monkeypatch.setattr(static.runner.static, "_forward", lambda size: (inside.append(1), forward(size), inside.pop()))
    monkeypatch.setattr(moe, "_capturing", lambda x: bool(inside))  # only the static engine's decode steps
    monkeypatch.setattr(moe, "moe_experts_dense", lambda *a: calls.append(1) or real(*a))
    lockstep(dynamic, static, random_prompts(5, vocab, LENGTHS, seed=21), greedy(8), atol=1e-4)
    assert calls


@CUDA
@pytest.mark.parametrize("num_seqs", [3, 13])
def test_cuda_graph_replay_equals_eager(checkpoint, num_seqs):
    """On CUDA: graphs captured per ladder size and replayed on poisoned buffers give the eager path's tokens."""
    path, vocab = checkpoint
    prompts = random_prompts(num_seqs, vocab, LENGTHS, seed=num_seqs)
    cuda = dict(device="cuda", dtype="float32")
    graphed = make(path, True, **cuda)
    assert graphed.runner.static.use_cuda_graphs
    lockstep(make(path, False, **cuda), graphed, prompts, greedy(12), poison_seed=5, atol=1e-4)
    assert graphed.runner.static.use_cuda_graphs, "capture failed and fell back to eager"
    assert graphed.runner.static.padded_size(num_seqs) in sizes(graphed.runner.static.graphs)
    eager = make(path, True, enforce_eager=True, **cuda)
    assert eager.runner.static is not None and not eager.runner.static.use_cuda_graphs
    expected = [o.token_ids for o in eager.generate(prompts, greedy(12))]
    assert [o.token_ids for o in make(path, True, **cuda).generate(prompts, greedy(12))] == expected
