"""Recall accuracy of the embedded LLM, served by our engine: passkey retrieval at several context lengths,
key-value recall and copying, on samples drawn from seeds the training never used.

    python -m demo_models.llm.evaluate [--model DIR] [--json docs/demo_llm_eval.json]

A sample is correct when the greedy continuation starts with the exact answer (digits and the final period).
"""

from __future__ import annotations

import argparse
import json
import random

from demo_models.llm import configs
from demo_models.llm.data import Example, copy_example, kv_example, passkey_example, prose_sentences

EVAL_SEED = 987_654_321  # far from any training seed (training draws seed * 1_000_003 + step)


def fit_passkey(rng: random.Random, tokenizer, sentences: list[str], num_tokens: int) -> Example:
    """A passkey sample whose prompt is at most ``num_tokens`` tokens (shrinking the prose until it fits)."""
    num_chars = int(num_tokens * 2.2)
    while True:
        state = rng.getstate()
        ex = passkey_example(rng, sentences, num_chars)
        if len(tokenizer(ex.prompt)["input_ids"]) <= num_tokens - 8:
            return ex
        rng.setstate(state)
        num_chars = int(num_chars * 0.92)


def task_samples(tokenizer, num_samples: int) -> dict[str, list[Example]]:
    from demo_models.llm.train import vocabulary_words

    sentences = prose_sentences()
    words = vocabulary_words(sentences)
    rng = random.Random(EVAL_SEED)
    tasks: dict[str, list[Example]] = {}
    for length in (128, 256, configs.CONTEXT):
        tasks[f"passkey@{length}"] = [fit_passkey(rng, tokenizer, sentences, length) for _ in range(num_samples)]
    tasks["kv_recall(8 pairs)"] = [kv_example(rng, 8) for _ in range(num_samples)]
    tasks["copy(8 words)"] = [copy_example(rng, words, 8) for _ in range(num_samples)]
    return tasks


def evaluate(model_dir: str | None = None, num_samples: int = 50, dtype: str | None = None) -> dict[str, float]:
    """Accuracy per task (0-1), greedy decoding through :class:`~metainfer_gen.llm.engine.LLMEngine` in ``dtype``
    ("float32", "bfloat16"; None: the engine's default here)."""
    from metainfer_gen.llm import EngineConfig, LLMEngine
    from metainfer_gen.pipelines.text_generation import default_llm_dir

    engine = LLMEngine.from_pretrained(model_dir or default_llm_dir(), EngineConfig(max_model_len=configs.CONTEXT,
                                                                                    dtype=dtype))
    return task_accuracy(engine, task_samples(engine.tokenizer, num_samples))


def task_accuracy(engine, tasks: dict[str, list[Example]]) -> dict[str, float]:
    """Share (0-1) of each task's samples whose greedy continuation from ``engine`` (an
    :class:`~metainfer_gen.llm.engine.LLMEngine`) starts with the exact answer."""
    from metainfer_gen.llm import SamplingParams

    tokenizer = engine.tokenizer
    results = {}
    for name, samples in tasks.items():
        max_new = max(len(tokenizer(s.answer, add_special_tokens=False)["input_ids"]) for s in samples) + 1
        outputs = engine.generate([s.prompt for s in samples], SamplingParams(max_new_tokens=max_new, temperature=0))
        correct = sum(o.text.strip().startswith(s.answer.strip()) for o, s in zip(outputs, samples))
        results[name] = correct / len(samples)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded LLM)")
    parser.add_argument("--num-samples", type=int, default=50, help="samples per task")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the engine's default here)")
    args = parser.parse_args(argv)
    results = evaluate(args.model, args.num_samples, args.dtype)
    print(f"{'task':<22} accuracy")
    for name, acc in results.items():
        print(f"{name:<22} {acc:7.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_samples": args.num_samples, "accuracy": results}, f, indent=2)


if __name__ == "__main__":
    main()
