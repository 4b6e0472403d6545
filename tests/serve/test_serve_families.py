"""DeepSeek-V4 (``deepseek_v4``) and GLM-5 (``glm_moe_dsa``) served as any checkpoint is: ``metainfer-gen serve DIR``
with no flag of their own, on tiny random checkpoints with a BPE tokenizer. The pipeline loads each and gives
transformers' greedy tokens; the real server (a subprocess on a free loopback port, talked to with the ``openai``
client) answers completions (whole and streamed) and chats with the offline engine's greedy text; its warm-up
compiles nothing and says once why the decode steps run eager."""

from __future__ import annotations

import os

import openai
import pytest

from metainfer_gen.llm.compiled_decode import ENFORCE_EAGER_ENV
from tests.llm.checkpoints import hf_greedy, save_text_checkpoint
from tests.serve.processes import start_serve, stop_process

PROMPTS = ["the quick brown fox", "the pass key is 12345. remember it. the pass key is"]
CHAT = [{"role": "user", "content": "the pass key is 12345. what is it?"}]
MAX_TOKENS = 8
# What each family's warm-up line says about its decode steps (their compiled step is refused, with its reason).
EAGER_BECAUSE = {"deepseek_v4": "deepseek_v4: its attention gathers per sequence",
                 "glm_moe_dsa": "sparse MLA (the DSA indexer's top-k) is not traced"}


def _v4(vocab_size: int):
    from tests.llm.v4_checkpoints import make_hf_v4_model

    return make_hf_v4_model(vocab_size=vocab_size, max_position_embeddings=512)


def _glm(vocab_size: int):
    from tests.llm.dsa_checkpoints import make_hf_glm_model

    return make_hf_glm_model(vocab_size=vocab_size)


@pytest.fixture(scope="module", params=["deepseek_v4", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    """(model type, checkpoint folder with its tokenizer, the transformers model saved there)."""
    path = tmp_path_factory.mktemp(request.param)
    model, _ = save_text_checkpoint(path, {"deepseek_v4": _v4, "glm_moe_dsa": _glm}[request.param])
    return request.param, path, model


def test_pipeline_and_server_answer_as_transformers_with_no_new_flags(checkpoint):
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline
    from metainfer_gen.serve.chat import chat_token_ids

    family, path, model = checkpoint
    pipe = TextGenerationPipeline.from_pretrained(path, num_kv_blocks=64, max_num_seqs=8)
    assert pipe.engine.model.config.model_type == family
    refs = pipe(PROMPTS, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    for ref in refs:
        assert ref.token_ids == hf_greedy(model, ref.prompt_token_ids, MAX_TOKENS)
    chat_ref = pipe([chat_token_ids(pipe.tokenizer, CHAT)], max_new_tokens=MAX_TOKENS, ignore_eos=True)[0]

    env = {k: v for k, v in os.environ.items() if k != ENFORCE_EAGER_ENV}  # as a user starts it
    proc, url, lines = start_serve([str(path), "--port", "0", "--video", "none", "--max-num-seqs", "8",
                                    "--log-level", "warning"], env=env, timeout_s=180)
    try:
        warm = [line for line in lines if line.startswith("warmed up in")]
        assert len(warm) == 1 and " 0 graphs compiled; decode steps run eager: " in warm[0], lines
        assert EAGER_BECAUSE[family] in warm[0] and sum(EAGER_BECAUSE[family] in line for line in lines) == 1
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            assert [m.id for m in client.models.list().data] == [path.name]
            extra = {"ignore_eos": True}
            for prompt, ref in zip(PROMPTS, refs):
                whole = client.completions.create(model=path.name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body=extra)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model=path.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body=extra))
                assert whole.choices[0].text == streamed == ref.text
                assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref.prompt_token_ids),
                                                                                      MAX_TOKENS)
            chat = client.chat.completions.create(model=path.name, messages=CHAT, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body=extra)
            assert chat.choices[0].message.content == chat_ref.text
            assert chat.usage.prompt_tokens == len(chat_ref.prompt_token_ids)
    finally:
        stop_process(proc, 15, 5)
    assert proc.returncode in (0, -15)
