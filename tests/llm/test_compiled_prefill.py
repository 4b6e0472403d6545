"""The compiled CPU prefill step (``llm/compiled_prefill.py``) against the eager engine, step by step.

One graph with a dynamic token count serves every step of two or more tokens: whole prompts, chunks of a long
prompt (``max_num_batched_tokens=32`` splits the 29-token prompts' neighbours), and mixed steps where decode rows
ride beside a new prompt (six prompts through four sequence slots). Two engines on one checkpoint run in lockstep
(``tests/llm/test_static_decode.py``'s harness): the compiled engine's logits agree with the eager one's, the
tokens are identical, and no step after the warm-up compiles or falls back to eager.
"""

from __future__ import annotations

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine
from metainfer_gen.llm.compiled_decode import ENFORCE_EAGER_ENV
from tests.llm.checkpoints import make_hf_model, random_prompts
from tests.llm.test_static_decode import LENGTHS, greedy, lockstep


@pytest.fixture(autouse=True)
def compiled_allowed(monkeypatch):
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = make_hf_model("moe", n_routed_experts=16)
    path = tmp_path_factory.mktemp("compiled_prefill")
    model.save_pretrained(path)
    return path, model.config.vocab_size


def make(path, **overrides) -> LLMEngine:
    settings = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128) | overrides
    return LLMEngine.from_pretrained(path, EngineConfig(**settings))


def spy_steps(engine, monkeypatch) -> list[tuple[int, int]]:
    """(prefill items, decode items) of every step ``engine``'s runner forwards from now on."""
    kinds = []
    forward = engine.runner.forward_logits

    def spy(out):
        kinds.append((sum(i.num_tokens > 1 for i in out.scheduled), sum(i.num_tokens == 1 for i in out.scheduled)))
        return forward(out)

    monkeypatch.setattr(engine.runner, "forward_logits", spy)
    return kinds


def test_compiled_prefill_equals_eager(checkpoint, monkeypatch):
    from torch._dynamo.utils import counters

    path, vocab = checkpoint
    eager, compiled = make(path, enforce_eager=True), make(path)
    compiled.warmup()
    graph = compiled.runner.compiled_prefill
    assert graph.built and graph.num_compiled_steps == 1  # the warm-up's full-budget prefill built it
    graphs, kinds = counters["stats"]["unique_graphs"], spy_steps(compiled, monkeypatch)
    prompts = random_prompts(6, vocab, LENGTHS[1:], seed=4)  # 3..29 tokens: no prompt is one token
    with kernels.audit() as report:
        seqs, _ = lockstep(eager, compiled, prompts, [greedy(n) for n in (3, 5, 7, 4, 6, 8)], atol=1e-4)
    assert [s.num_output_tokens for s in seqs] == [3, 5, 7, 4, 6, 8]
    assert any(p and d for p, d in kinds), "no mixed step (decode rows beside a prompt) was scheduled"
    assert graph.num_compiled_steps - 1 == sum(1 for p, _ in kinds if p)  # every step with prompt tokens
    assert counters["stats"]["unique_graphs"] == graphs  # ... through the warm-up's graph: nothing compiled
    assert not [e for e in report.entries if e.op == "prefill_step" and e.path == "eager"]


def test_without_warmup_prefill_runs_eager(checkpoint):
    """No graph is built under a request: an engine that was not warmed up prefills eagerly, audited, with the
    tokens of an eager engine."""
    path, vocab = checkpoint
    engine, eager = make(path), make(path, enforce_eager=True)
    prompts = random_prompts(2, vocab, LENGTHS[2:], seed=12)
    with kernels.audit() as report:
        tokens = [o.token_ids for o in engine.generate(prompts, greedy(3))]
    assert tokens == [o.token_ids for o in eager.generate(prompts, greedy(3))]
    assert not engine.runner.compiled_prefill.built and engine.runner.compiled_prefill.num_compiled_steps == 0
    reasons = [str(r) for e in report.entries if e.op == "prefill_step" for r in e.refusals]
    assert any("no compiled prefill graph yet" in r for r in reasons)


def test_a_step_the_graph_does_not_admit_runs_eager(checkpoint):
    """A step no cached graph admits (here: the graph marked built but never compiled) runs the same forward
    eagerly over the step's own metadata, audited, never compiling."""
    path, vocab = checkpoint
    engine, eager = make(path), make(path, enforce_eager=True)
    engine.runner.compiled_prefill.built = True
    prompts = random_prompts(3, vocab, LENGTHS[2:], seed=13)
    with kernels.audit() as report:
        tokens = [o.token_ids for o in engine.generate(prompts, greedy(2))]
    assert tokens == [o.token_ids for o in eager.generate(prompts, greedy(2))]
    assert engine.runner.compiled_prefill.num_compiled_steps == 0
    reasons = [str(r) for e in report.entries if e.op == "prefill_step" for r in e.refusals]
    assert any("guards refused a step of" in r for r in reasons)


def test_prefill_path_is_audited(checkpoint):
    path, _ = checkpoint
    with kernels.audit() as report:
        compiled, eager = make(path), make(path, enforce_eager=True)
    assert compiled.runner.compiled_prefill is not None and eager.runner.compiled_prefill is None
    entries = [e for e in report.entries if e.op == "prefill_step"]
    assert {(e.site, e.path) for e in entries} == {("llm.prefill", "compiled"), ("llm.prefill", "eager")}
    refused = next(e for e in entries if e.path == "eager")
    assert "enforce_eager" in str(refused.refusals[0]) and refused.refusals[0].implementation == "compiled"


def test_step_context_is_required():
    from metainfer_gen.llm import graph_ops

    with pytest.raises(RuntimeError, match="step_context"):
        graph_ops.current_step()
    q = torch.zeros(2, 1, 4)
    with pytest.raises(RuntimeError, match="step_context"):
        graph_ops.mla_store_attend(q, q, torch.zeros(2, 1, 8), torch.zeros(1, 4, 1, 8), 0, 4)
