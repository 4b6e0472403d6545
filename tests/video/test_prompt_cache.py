"""The prompt-embedding cache returns the uncached embeddings exactly, runs the encoder once per distinct prompt
(the negative prompt once in all), stays within its bound, and never serves an embedding of changed weights."""

from __future__ import annotations

import threading

import pytest
import torch

from metainfer_gen.video.prompt_cache import (apply_prompt_cache, get_prompt_cache, prompt_cache_refusal,
                                              remove_prompt_cache)

PROMPTS = ["a red circle moving right", "a blue square moving up", "the green triangle moves left",
           "a cyan circle sliding down", "the yellow square moves right"]


def _encode(pipe, prompt, negative="blurry"):
    return pipe.encode_prompt(prompt, negative, do_classifier_free_guidance=True, max_sequence_length=16,
                              device="cpu")


def _count_encoder_runs(pipe) -> list[int]:
    runs = [0]
    pipe.text_encoder.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def test_cached_embeddings_equal_the_uncached_ones_and_the_negative_is_encoded_once(fresh_t2v):
    pipe = fresh_t2v.diffusers_pipeline
    with torch.inference_mode():
        uncached = [_encode(pipe, p) for p in PROMPTS[:3]]
    runs = _count_encoder_runs(pipe)
    cache = apply_prompt_cache(pipe)
    with torch.inference_mode():
        for _ in range(2):
            for prompt, (positive, negative) in zip(PROMPTS[:3], uncached):
                got_positive, got_negative = _encode(pipe, prompt)
                assert torch.equal(got_positive, positive) and torch.equal(got_negative, negative)
    assert runs[0] == 4  # 3 prompts + the negative prompt, once each over 12 look-ups
    assert (cache.num_misses, cache.num_hits) == (4, 8)
    remove_prompt_cache(pipe)
    assert get_prompt_cache(pipe) is None
    with torch.inference_mode():
        _encode(pipe, PROMPTS[0])
    assert runs[0] == 6  # diffusers' own encoder call is back


def test_the_cache_stays_within_its_bound_and_evicts_the_least_recently_used(fresh_t2v):
    pipe = fresh_t2v.diffusers_pipeline
    cache = apply_prompt_cache(pipe, max_entries=2)
    with torch.inference_mode():
        for prompt in PROMPTS:
            pipe._get_t5_prompt_embeds(prompt, max_sequence_length=16, device="cpu")
            assert len(cache) <= 2
        misses = cache.num_misses
        pipe._get_t5_prompt_embeds(PROMPTS[-1], max_sequence_length=16, device="cpu")  # kept: a hit
        pipe._get_t5_prompt_embeds(PROMPTS[0], max_sequence_length=16, device="cpu")  # evicted: a miss
    assert cache.num_misses == misses + 1 and len(cache) == 2
    remove_prompt_cache(pipe)
    with pytest.raises(ValueError, match="max_entries"):
        apply_prompt_cache(pipe, max_entries=0)


def test_changed_encoder_weights_or_dtype_miss_instead_of_serving_stale_embeddings(fresh_t2v):
    pipe = fresh_t2v.diffusers_pipeline
    cache = apply_prompt_cache(pipe)
    with torch.inference_mode():
        before = pipe._get_t5_prompt_embeds(PROMPTS[0], max_sequence_length=16, device="cpu")
    with torch.no_grad():
        next(pipe.text_encoder.parameters()).mul_(1.5)
    with torch.inference_mode():
        after = pipe._get_t5_prompt_embeds(PROMPTS[0], max_sequence_length=16, device="cpu")
        other_dtype = pipe._get_t5_prompt_embeds(PROMPTS[0], max_sequence_length=16, device="cpu",
                                                 dtype=torch.bfloat16)
    assert cache.num_misses == 3 and cache.num_hits == 0
    assert not torch.equal(before, after) and other_dtype.dtype == torch.bfloat16


def test_threads_share_one_cache_and_each_gets_its_own_prompt(fresh_t2v):
    pipe = fresh_t2v.diffusers_pipeline
    with torch.inference_mode():
        expected = {p: pipe._get_t5_prompt_embeds(p, max_sequence_length=16, device="cpu") for p in PROMPTS}
    apply_prompt_cache(pipe, max_entries=3)
    failures = []

    def worker(offset: int) -> None:
        with torch.inference_mode():
            for i in range(10):
                prompt = PROMPTS[(i + offset) % len(PROMPTS)]
                if not torch.equal(pipe._get_t5_prompt_embeds(prompt, max_sequence_length=16, device="cpu"),
                                   expected[prompt]):
                    failures.append(prompt)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and len(get_prompt_cache(pipe)) <= 3


def test_pipelines_without_the_wan_encoder_are_refused_with_the_reason():
    class NotWan:
        text_encoder = None

    assert "no _get_t5_prompt_embeds" in prompt_cache_refusal(NotWan())
    with pytest.raises(ValueError, match="cannot apply"):
        apply_prompt_cache(NotWan())
