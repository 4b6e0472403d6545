"""The compiled CPU decode step (``llm/compiled_decode.py``) against the eager engine, step by step.

Two engines on one checkpoint run in lockstep (``tests/llm/test_static_decode.py``'s harness: same schedule, greedy,
buffers poisoned before every step, no cache row outside the step's slots and the sink block may change): the
compiled engine's logits agree with the eager one's and the tokens are identical. ``max_num_seqs=4`` keeps the ladder
at three sizes (three graphs per engine). Two MoE widths: 8 experts of top-2 run every expert inside the graph
(``moe_experts_dense``), 16 experts of top-2 call the sorted experts as an opaque op.
"""

from __future__ import annotations

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine
from metainfer_gen.llm.compiled_decode import ENFORCE_EAGER_ENV, compiled_decode_refusal
from tests.llm.checkpoints import make_hf_model, random_prompts
from tests.llm.test_static_decode import LENGTHS, greedy, lockstep, sizes


@pytest.fixture(autouse=True)
def compiled_allowed(monkeypatch):
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)


@pytest.fixture(scope="module", params=[8, 16], ids=["experts-in-graph", "experts-opaque-op"])
def checkpoint(request, tmp_path_factory):
    model = make_hf_model("moe", n_routed_experts=request.param)
    path = tmp_path_factory.mktemp(f"compiled_decode_{request.param}")
    model.save_pretrained(path)
    return path, model.config.vocab_size


def make(path, **overrides) -> LLMEngine:
    settings = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128) | overrides
    return LLMEngine.from_pretrained(path, EngineConfig(**settings))


def test_compiled_equals_eager(checkpoint):
    path, vocab = checkpoint
    eager, compiled = make(path, enforce_eager=True), make(path)
    assert (eager.decode_path, compiled.decode_path) == ("eager", "compiled")
    compiled.warmup()
    prompts = random_prompts(3, vocab, LENGTHS, seed=3)  # three rows padded to four
    seqs, shapes = lockstep(eager, compiled, prompts, [greedy(n) for n in (6, 9, 12)], poison_seed=5, atol=1e-4)
    assert {4, 2, 1} <= sizes(shapes)  # rows finish: sizes 4, then 2, then 1
    assert compiled.runner.static.compiled.sizes == [1, 2, 4]
    assert [s.num_output_tokens for s in seqs] == [6, 9, 12]
    assert compiled.block_manager.num_free_blocks == compiled.block_manager.num_blocks


def test_warmup_compiles_every_size_then_nothing(checkpoint):
    path, vocab = checkpoint
    engine = make(path)
    engine.warmup()
    assert engine.runner.static.compiled.sizes == [1, 2, 4]
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    outputs = engine.generate(random_prompts(4, vocab, LENGTHS, seed=8), greedy(5))
    assert all(len(o.token_ids) == 5 for o in outputs)
    assert counters["stats"]["unique_graphs"] == graphs  # no step compiled anything new


def test_decode_path_is_audited(checkpoint):
    path, _ = checkpoint
    with kernels.audit() as report:
        make(path)
        make(path, enforce_eager=True)
    entries = [e for e in report.entries if e.op == "decode_step"]
    assert {(e.site, e.path) for e in entries} == {("llm.decode", "compiled"), ("llm.decode", "eager")}
    eager = next(e for e in entries if e.path == "eager")
    assert "enforce_eager" in str(eager.refusals[0]) and eager.refusals[0].implementation == "compiled"


def test_refusals(checkpoint):
    engine = make(checkpoint[0], enforce_eager=True)
    cpu = torch.device("cpu")
    assert compiled_decode_refusal(engine.model, cpu, 1) is None
    assert "tensor_parallel_size=2" in compiled_decode_refusal(engine.model, cpu, 2)
    assert "CUDA graphs" in compiled_decode_refusal(engine.model, torch.device("cuda"), 1)


def test_sparse_mla_is_refused(tmp_path):
    from tests.llm.dsa_checkpoints import make_hf_v32_model

    model = make_hf_v32_model()
    model.save_pretrained(tmp_path)
    engine = make(tmp_path)
    assert engine.decode_path == "eager"
    assert "sparse MLA" in compiled_decode_refusal(engine.model, torch.device("cpu"), 1)


def test_compiled_steps_need_a_sink_slot(checkpoint):
    from metainfer_gen.llm.static_decode import StaticDecode

    engine = make(checkpoint[0], enforce_eager=True)
    with pytest.raises(ValueError, match="sink_slot"):
        StaticDecode(engine.model, engine.runner.kv_caches, max_num_seqs=4, max_model_len=64, block_size=4,
                     use_cuda_graphs=False, compiled=True)


def test_without_warmup_steps_run_eager(checkpoint):
    """An engine that was not warmed up builds no graph under a request: its decode steps run the eager path, audited,
    with the tokens of an eager engine."""
    path, vocab = checkpoint
    engine, eager = make(path), make(path, enforce_eager=True)
    prompts = random_prompts(2, vocab, LENGTHS, seed=12)
    with kernels.audit() as report:
        tokens = [o.token_ids for o in engine.generate(prompts, greedy(4))]
    assert tokens == [o.token_ids for o in eager.generate(prompts, greedy(4))]
    assert engine.runner.static.compiled.sizes == [] and engine.runner.static.num_steps == 0
    reasons = [str(r) for e in report.entries if e.op == "decode_step" for r in e.refusals]
    assert any("has no compiled graph" in r for r in reasons)
