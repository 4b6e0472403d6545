"""Training text for the embedded LLM: prose available offline plus recall tasks with checkable answers.

Prose comes from Python's own standard library (the Zen of Python and module docstrings), so the corpus needs no
download. Three task families are mixed in, each with an answer that a script can check exactly:

- passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): a five-digit key hidden at a random depth in
  filler prose, asked for at the end;
- key-value recall: a list of ``key NN = VVV`` pairs, then one key asked for;
- copying: a random word sequence repeated after ``repeat:``.

Every function is seeded and pure (``random.Random``), so the same seed gives the same text.
"""

from __future__ import annotations

import codecs
import random
import re
from dataclasses import dataclass

_DOC_MODULES = ("json", "collections", "itertools", "functools", "pathlib", "argparse", "random", "statistics",
                "heapq", "bisect", "textwrap", "string", "fractions", "decimal", "contextlib", "dataclasses",
                "enum", "typing", "csv", "calendar", "difflib", "shutil", "tempfile", "logging", "unittest",
                "sqlite3", "zipfile", "tarfile", "gzip", "hashlib", "base64", "datetime", "time", "math")


def prose_sentences() -> list[str]:
    """Sentences of English prose from the standard library (deterministic for a given Python version)."""
    import contextlib
    import importlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing ``this`` prints the Zen
        import this
    texts = [codecs.decode(this.s, "rot13")]
    for name in _DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        texts.append(module.__doc__ or "")
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and not attr.startswith("_"):
                texts.append(doc)
    sentences = []
    for text in texts:
        flat = re.sub(r"\s+", " ", text)
        for sentence in re.split(r"(?<=[.!?])\s+", flat):
            if 20 <= len(sentence) <= 200 and sentence[0].isupper() and not re.search(r"[<>{}\\]|>>>", sentence):
                sentences.append(sentence.strip())
    return sorted(set(sentences))


@dataclass(frozen=True, slots=True)
class Example:
    """A training or evaluation text; ``prompt + answer`` is the full text, ``answer`` the checkable part."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def filler(rng: random.Random, sentences: list[str], num_chars: int) -> str:
    out, size = [], 0
    while size < num_chars:
        s = rng.choice(sentences)
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


def passkey_example(rng: random.Random, sentences: list[str], num_chars: int) -> Example:
    """A passkey hidden at a random depth of about ``num_chars`` characters of prose."""
    key = f"{rng.randrange(10000, 100000)}"
    depth = rng.random()
    before = filler(rng, sentences, int(num_chars * depth))
    after = filler(rng, sentences, int(num_chars * (1 - depth)))
    prompt = (f"{before} The pass key is {key}. Remember it. {key} is the pass key. {after} "
              f"What is the pass key? The pass key is ")
    return Example(prompt, key + ".")


def kv_example(rng: random.Random, num_pairs: int) -> Example:
    keys = rng.sample(range(10, 100), num_pairs)
    values = [rng.randrange(100, 1000) for _ in keys]
    pairs = " ".join(f"key {k} = {v}." for k, v in zip(keys, values))
    i = rng.randrange(num_pairs)
    return Example(f"{pairs} Question: key {keys[i]} = ", f"{values[i]}.")


def copy_example(rng: random.Random, words: list[str], num_words: int) -> Example:
    seq = " ".join(rng.choice(words) for _ in range(num_words))
    return Example(f"{seq} repeat: ", seq + ".")


def training_text(rng: random.Random, sentences: list[str], words: list[str], num_chars: int,
                  prose_share: float = 0.3) -> Example:
    """One training sample of about ``num_chars`` characters: plain prose with probability ``prose_share``, else
    a task (passkey 4/7, key-value recall 3/14, copying 3/14 of the rest)."""
    kind = rng.random()
    if kind < prose_share:
        return Example("", filler(rng, sentences, num_chars))
    kind = (kind - prose_share) / (1 - prose_share)
    if kind < 4 / 7:
        return passkey_example(rng, sentences, rng.randint(num_chars // 4, num_chars))
    if kind < 11 / 14:
        return kv_example(rng, rng.randint(2, 12))
    return copy_example(rng, words, rng.randint(3, 12))
