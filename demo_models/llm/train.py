"""Train the embedded LLM (transformers' ``DeepseekV3ForCausalLM``, the engine's reference) from scratch.

Run (resumable; rerun the same command after a stop)::

    OMP_NUM_THREADS=2 python -m demo_models.llm.train --work-dir build/demo_llm

First run trains the tokenizer on 4,000 samples of the training mix and saves it; then AdamW on batches of
``--batch-size`` samples of up to ``CONTEXT`` tokens, loss = next-token cross-entropy with the checkable answer
tokens weighted 4x (so recall is learned early). Batches are drawn from ``seed + step`` (see
:mod:`demo_models.training`), so a resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from demo_models.llm import configs
from demo_models.llm.data import prose_sentences, training_text
from demo_models.llm.tokenizer import train_tokenizer
from demo_models.training import ResumableRun

ANSWER_WEIGHT = 4.0


def vocabulary_words(sentences: list[str]) -> list[str]:
    return sorted({w for s in sentences for w in s.split() if w.isalpha() and w.islower()})


def load_or_train_tokenizer(work_dir, sentences, words, seed: int):
    from transformers import AutoTokenizer

    path = work_dir / "tokenizer"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    texts = [training_text(rng, sentences, words, 2 * configs.CONTEXT).text for _ in range(4000)]
    tokenizer = train_tokenizer(texts, configs.VOCAB_SIZE)
    tokenizer.save_pretrained(path)
    return tokenizer


def encode_batch(tokenizer, examples, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) input ids padded with eos to the longest sample (L <= context), and (B, L) loss weights (0 on
    padding, 4 on answers). A sample longer than ``context`` keeps its answer and loses the start of its prose."""
    rows = []
    for ex in examples:
        prompt = tokenizer(ex.prompt)["input_ids"]
        answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        tokens = prompt + answer
        if len(tokens) > context:
            tokens = [tokenizer.bos_token_id] + tokens[len(tokens) - context + 1:]
        rows.append((tokens, len(answer)))
    width = max(len(t) for t, _ in rows)
    ids = torch.full((len(examples), width), tokenizer.eos_token_id, dtype=torch.long)
    weights = torch.zeros(len(examples), width)
    for row, (tokens, num_answer) in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        weights[row, : len(tokens)] = 1.0
        weights[row, len(tokens) - num_answer: len(tokens)] = ANSWER_WEIGHT
    return ids, weights


def loss_fn(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted next-token cross-entropy; ``weights[:, t]`` weighs predicting token t."""
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, 1:].flatten()
    return (per_token * w).sum() / w.sum()


def build_model(vocab_size: int, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v3", **{**configs.MODEL_CONFIG, "vocab_size": vocab_size},
                                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="build/demo_llm", help="checkpoint, tokenizer and log folder")
    parser.add_argument("--steps", type=int, default=1500, help="optimiser steps")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, tokenizer and data")
    parser.add_argument("--max-chars", type=int, default=int(1.9 * configs.CONTEXT),
                        help="characters of prose per sample at most (about 2 per token)")
    parser.add_argument("--prose-share", type=float, default=0.3, help="share of plain-prose samples")
    parser.add_argument("--init-from", default=None,
                        help="start a new stage (fresh optimiser and schedule) from a saved checkpoint and its "
                             "tokenizer")
    args = parser.parse_args(argv)

    sentences = prose_sentences()
    words = vocabulary_words(sentences)
    from pathlib import Path

    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if args.init_from and not (work_dir / "tokenizer" / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.init_from).save_pretrained(work_dir / "tokenizer")
    tokenizer = load_or_train_tokenizer(work_dir, sentences, words, args.seed)
    model = build_model(len(tokenizer), args.seed)
    if args.init_from:
        from transformers import AutoModelForCausalLM

        model.load_state_dict(AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    run = ResumableRun(work_dir, model, optimizer)
    model.train()
    while run.step < args.steps:
        run.set_learning_rate(args.lr, args.steps, warmup_steps=100)
        rng = random.Random(args.seed * 1_000_003 + run.step)
        examples = [training_text(rng, sentences, words, args.max_chars, args.prose_share)
                    for _ in range(args.batch_size)]
        ids, weights = encode_batch(tokenizer, examples, configs.CONTEXT)
        loss = loss_fn(model(ids).logits, ids, weights)
        run.optimizer_step(loss)
        if run.step % 25 == 0:
            run.log(loss=round(loss.item(), 4))
        run.maybe_save(force=run.step == args.steps)
    model.save_pretrained(work_dir / "final")
    tokenizer.save_pretrained(work_dir / "final")
    print(f"saved {work_dir / 'final'}", flush=True)


if __name__ == "__main__":
    main()
