"""IncrementalDetokenizer on the embedded LLM's byte-level BPE tokenizer (CJK and emoji split across tokens)."""

from __future__ import annotations

import pytest

from metainfer_gen.llm.detokenizer import REPLACEMENT, IncrementalDetokenizer, check_stop_strings

TEXT = "hello 你好世界 🙂 END done\n\n### next 👍🏽 ok"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from metainfer_gen.pipelines.text_generation import default_llm_dir

    return AutoTokenizer.from_pretrained(default_llm_dir())


def run(tokenizer, prompt, output, stop=None, step=1):
    """Deltas of ``output`` pushed ``step`` tokens at a time, then the finish flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    deltas = []
    for i in range(0, len(output), step):
        delta = detok.push(output[i:i + step])
        deltas.append(delta.text)
        if delta.stopped:
            break
    deltas.append(detok.finish().text)
    return deltas, detok


def test_text_splits_characters_across_tokens(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert len(ids) > len(TEXT.split()) * 2 and "ä" in pieces  # 你 is three byte tokens here


@pytest.mark.parametrize("step", [1, 2, 3])
def test_every_cut_concatenates_to_the_whole_decode(tokenizer, step):
    ids = tokenizer(TEXT)["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        deltas, detok = run(tokenizer, prompt, output, step=step)
        # A prompt ending inside a character: the completion carries that whole character, the prompt text
        # (decoded alone) ends before it, so prompt text + completion == the whole text and nothing repeats.
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True).rstrip(REPLACEMENT)
        assert prompt_text + "".join(deltas) == whole, cut
        assert "".join(deltas) == detok.text
        assert REPLACEMENT not in "".join(deltas)
        assert all(REPLACEMENT not in d for d in deltas)


def test_completion_emitting_cjk_and_emoji_never_splits_a_character(tokenizer):
    prompt = tokenizer("Say it:")["input_ids"]
    output = tokenizer("你好世界🙂👍🏽", add_special_tokens=False)["input_ids"]
    deltas, _ = run(tokenizer, prompt, output)
    assert "".join(deltas) == "你好世界🙂👍🏽"
    # whole characters, one each
    assert [d for d in deltas if d] == list("你好世界🙂👍🏽") and len(output) > 10


@pytest.mark.parametrize("stop", ["END", "\n\n###", ["zzz", "\n\n###"], "世界"])
def test_stop_strings_spanning_tokens_are_cut_and_never_emitted(tokenizer, stop):
    ids = tokenizer(TEXT)["input_ids"]
    prompt, output = ids[:2], ids[2:]
    deltas, detok = run(tokenizer, prompt, output, stop=stop)
    first = min(s for s in ([stop] if isinstance(stop, str) else stop) if s in TEXT)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    expected = expected[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    expected = expected[:expected.find(first)]
    assert "".join(deltas) == expected and detok.stopped and detok.stop_string == first
    assert not any(first[:n] in "".join(deltas)[-n:] for n in range(1, len(first)) if "".join(deltas)[-n:])


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    prompt = tokenizer("x")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["ENDX"])
    out = [detok.push([token]).text for token in tokenizer(" END done", add_special_tokens=False)["input_ids"]]
    assert not detok.stopped and "".join(out) + detok.finish().text == " END done"
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["ENDX"])
    held = [detok.push([t]).text for t in tokenizer(" EN", add_special_tokens=False)["input_ids"]]
    assert "".join(held) == " " and detok.num_held_back == 2  # "EN" could still become "ENDX"
    assert detok.finish().text == "EN"  # the request ended without the stop string: released


def test_invalid_bytes_at_the_end_come_out_at_finish(tokenizer):
    prompt = tokenizer("x")["input_ids"]
    partial = tokenizer("你", add_special_tokens=False)["input_ids"][:2]  # two of its three bytes
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert [detok.push([t]).text for t in partial] == ["", ""]
    assert detok.finish().text == REPLACEMENT  # the model really produced an incomplete character


def test_special_tokens_are_skipped(tokenizer):
    prompt = tokenizer("x")["input_ids"]
    ids = tokenizer("ab", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, _ = run(tokenizer, prompt, ids)
    assert "".join(deltas) == "ab"


def test_push_after_stop_raises(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [0], stop="a")
    assert detok.push(tokenizer("a", add_special_tokens=False)["input_ids"]).stopped
    with pytest.raises(RuntimeError, match="push after"):
        detok.push([5])


@pytest.mark.parametrize("stop, match", [
    ("", "non-empty"), ([""], "non-empty"), ([1], "non-empty"), (5, "string or a list"), (["a"] * 17, "at most 16"),
    ("x" * 300, "at most 256"),
])
def test_bad_stop_strings(stop, match):
    with pytest.raises(ValueError, match=match):
        check_stop_strings(stop)
    assert check_stop_strings("a") == ("a",) and check_stop_strings(None) == ()
