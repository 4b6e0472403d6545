"""One request's failure stays its own (issue 31, class 1), in the engine: a forward that raises because of one
request's tokens ends that request alone, the others get the tokens of a run without it, and a model that fails
for every request still raises."""

from __future__ import annotations

import contextlib

import pytest

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.sequence import FinishReason
from tests.llm.checkpoints import random_prompts

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=1234, ignore_eos=True)
SECRET = "injected fault in /srv/secret/path"


def _engine(path, **overrides) -> LLMEngine:
    settings = dict(block_size=4, num_kv_blocks=160, max_num_seqs=16, enforce_eager=True)
    return LLMEngine.from_pretrained(path, EngineConfig(**{**settings, **overrides}))


@contextlib.contextmanager
def _poison(engine: LLMEngine, tokens: set[int] | None):
    """The second decoder layer raises in every forward whose input ids hold one of ``tokens`` (all: None), after
    the first layer wrote the step's KV for every row. Yields a list with an entry per forward that raised."""
    model = engine.model.model
    seen, raised = {}, []

    def look(module, args):
        seen["ids"] = set(args[0].tolist())

    def maybe_raise(module, args):
        if tokens is None or seen["ids"] & tokens:
            raised.append(len(seen["ids"]))
            raise RuntimeError(SECRET)

    handles = [model.embed_tokens.register_forward_pre_hook(look),
               model.layers[1].register_forward_pre_hook(maybe_raise)]
    try:
        yield raised
    finally:
        for handle in handles:
            handle.remove()


def _unused_tokens(outputs, prompts, vocab: int) -> list[int]:
    used = {t for p in prompts for t in p} | {t for o in outputs for t in o.token_ids}
    return [t for t in range(vocab) if t not in used]


def _assert_nothing_left(engine: LLMEngine, poison: set[int]) -> None:
    pool = engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks and not engine.has_unfinished_requests
    for block_id in pool._hash_to_block.values():  # no KV of a failed forward reached the prefix cache
        assert not set(pool.blocks[block_id].token_ids) & poison


@pytest.fixture(scope="module")
def clean(moe_checkpoint):
    """Ten prompts (two seeded random, the rest greedy) and their outputs from a run without any fault."""
    _, path = moe_checkpoint
    prompts = random_prompts(10, 160, (3, 6, 9, 13), seed=5)
    params = [SEEDED if i in (1, 6) else GREEDY for i in range(len(prompts))]
    return path, prompts, params, _engine(path).generate(prompts, params)


@pytest.mark.parametrize("budget, head", [(2048, False), (7, True)])
def test_poisoned_prompts_fail_alone_in_a_batch(clean, budget, head):
    """Two poisoned prompts among ten: they end with an error that names no internal detail; the eight others get
    their clean tokens; nothing is left in the pool and no poisoned block is cached. Budget 2048: all ten prefill in
    one step, the poison in the sampling row; budget 7: chunked prefill, the poison in a first chunk (no sampling)."""
    path, prompts, params, expected = clean
    poison = _unused_tokens(expected, prompts, 160)[:2]

    def poisoned(prompt, token):
        return [token] + prompt if head else prompt + [token]

    batch = [poisoned(p, poison[0]) if i == 3 else poisoned(p, poison[1]) if i == 8 else p
             for i, p in enumerate(prompts)]
    engine = _engine(path, max_num_batched_tokens=budget)
    with _poison(engine, set(poison)) as raised:
        outputs = engine.generate(batch, params)
    assert 0 < len(raised) <= 4 * len(batch)  # each of the two failing steps: under 2n forwards
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        if i in (3, 8):
            assert out.finish_reason == FinishReason.ERROR and out.token_ids == []
            assert out.error == "computing its tokens failed (RuntimeError); the server's log has the details"
        else:
            assert (out.token_ids, out.finish_reason) == (ref.token_ids, FinishReason.LENGTH), i
    _assert_nothing_left(engine, set(poison))
    again = engine.generate(prompts, params)  # warm prefix cache: what the failed steps cached is right
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]


def _decode_poison(expected, prompts) -> tuple[int, int, int]:
    """(request, output index, token): a token that request generates there and nobody else ever sees."""
    for i, out in enumerate(expected):
        for k in range(1, 6):
            token = out.token_ids[k]
            others = {t for j, o in enumerate(expected) if j != i for t in o.token_ids + prompts[j]}
            if token not in others and token not in prompts[i] + out.token_ids[:k]:
                return i, k, token
    raise AssertionError("no output token seen by one request only: change the prompts' seed")


@pytest.mark.parametrize("budget", [2048, 7])
def test_a_request_failing_mid_generation_ends_alone(clean, budget):
    """The fault comes with a token one greedy request generates: the decode step after it fails, beside other
    decodes (budget 7, staggered arrivals: prefill chunks too, when they are still arriving); that request keeps the
    tokens it had, the others get their clean tokens."""
    path, prompts, params, expected = clean
    victim, index, token = _decode_poison(expected, prompts)
    engine = _engine(path, max_num_batched_tokens=budget)
    ids, finals = {}, {}
    with _poison(engine, {token}) as raised:
        pending = list(enumerate(prompts))
        for _ in range(500):  # bounded: ten requests of ten tokens finish in far fewer steps
            if pending:
                i, prompt = pending.pop(0)
                ids[engine.add_request(prompt, params[i])] = i
            for out in engine.step():
                if out.finished:
                    finals[ids[out.request_id]] = out
            if not pending and not engine.has_unfinished_requests:
                break
    assert raised and sorted(finals) == list(range(len(prompts)))
    assert finals[victim].finish_reason == FinishReason.ERROR
    assert finals[victim].token_ids == expected[victim].token_ids[:index + 1]
    assert "RuntimeError" in finals[victim].error and "secret" not in finals[victim].error
    for i, out in finals.items():
        if i != victim:
            assert out.token_ids == expected[i].token_ids, i
    _assert_nothing_left(engine, {token})


def test_a_model_that_fails_for_every_request_still_raises(clean):
    """Every sequence of a batch fails on its own: not a per-request failure, the step raises (after a bounded
    search). A lone failing sequence ends alone with its error, after one forward, and the queue goes on."""
    path, prompts, params, expected = clean
    engine = _engine(path)
    with _poison(engine, None) as raised, pytest.raises(RuntimeError, match="injected fault"):
        engine.generate(prompts, params)
    assert len(prompts) < len(raised) < 2 * len(prompts)
    lone = _engine(path)
    with _poison(lone, None) as raised:
        out = lone.generate(prompts[:1], params[:1])[0]
    assert len(raised) == 1
    assert out.finish_reason == "error" and "RuntimeError" in out.error and "injected" not in out.error
    assert lone.generate(prompts[:1], params[:1])[0].token_ids == expected[0].token_ids  # fault gone: served
