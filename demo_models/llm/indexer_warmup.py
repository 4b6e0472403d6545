"""DeepSeek-V3.2's dense warm-up stage on the embedded LLM: add a lightning indexer to every layer and distil it
from the frozen model's dense attention.

    OMP_NUM_THREADS=1 python -m demo_models.llm.indexer_warmup --work-dir build/demo_llm_dsa
    python -m demo_models.llm.indexer_warmup --work-dir build/demo_llm_dsa --build   # asset

Source: DeepSeek-V3.2 technical report ("DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models") and
the DeepSeek-V3.2-Exp paper (``DeepSeek_V3_2.pdf`` in deepseek-ai/DeepSeek-V3.2-Exp), continued pre-training,
"Dense warm-up stage" (DeepSeek: 1000 steps at learning rate 1e-3, 16 sequences of 128K tokens each). Attention
stays dense and every parameter except the indexer is frozen.
For query token t of a layer, the target ``p_{t,:}`` is the main attention's probabilities summed over all heads
and L1-normalised along the keys; the indexer's scores ``I_{t,s} = sum_j w_{t,j} ReLU(q_{t,j} . k_s)`` (the
report's eq. 1) are turned into a distribution by a softmax over the causal keys, and the loss is
``L_I = sum_t KL(p_{t,:} || Softmax(I_{t,:}))`` (eq. 3), here averaged over the valid query tokens and summed
over layers. The indexer's scoring follows transformers' ``DeepseekV32Indexer`` exactly (half-split rope on the
first ``qk_rope_head_dim`` values, ``softmax_scale = D ** -0.5``, head weights times ``H ** -0.5``), so what is
trained here is what transformers and our engine score with.

The teacher is the embedded ``deepseek_v3`` checkpoint run by transformers with eager attention (which returns
the probabilities); the indexer reads that model's attention-layer inputs and q LoRA residual (``q_resid``).
The run is seeded (weights of the indexers and the data, see :mod:`demo_models.training`) and resumable: its
``state.pt`` holds only the indexers and their optimiser.

The result is written as a standard transformers ``deepseek_v32`` checkpoint (``DeepseekV32ForCausalLM``, the
embedded model's weights unchanged plus ``self_attn.indexer.*``), which transformers and our engine both load.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from demo_models import ASSETS
from demo_models.llm import configs
from demo_models.llm.data import prose_sentences, training_text
from demo_models.llm.train import vocabulary_words
from demo_models.training import ResumableRun

# Indexer size for the tiny model (DeepSeek-V3.2: 64 heads of 128; here the attention's 4 heads, head dim 32 >
# qk_rope_head_dim 16). Top-k 64 is an eighth of the trained context (DeepSeek-V3.2: 2048 of 128K).
INDEXER_CONFIG = dict(index_n_heads=4, index_head_dim=32, index_topk=64)
ASSET_DIR = ASSETS / "demo_llm_dsa"


def v32_config(dense_config, **overrides):
    """A ``DeepseekV32Config`` equal to the dense ``deepseek_v3`` config plus :data:`INDEXER_CONFIG` (and
    ``overrides``)."""
    from transformers import AutoConfig

    fields = dense_config.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype", "head_dim"):
        fields.pop(key, None)
    return AutoConfig.for_model("deepseek_v32", **{**fields, **INDEXER_CONFIG, **overrides})


def index_scores(indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """Differentiable indexer scores, the same values as transformers' ``DeepseekV32Indexer`` (which runs under
    no_grad and returns only indices).

    Args:
        indexer: a transformers ``DeepseekV32Indexer`` (H heads of D).
        hidden: (B, S, hidden) float32, the attention layer's input.
        q_resid: (B, S, q_lora_rank) float32, ``q_a_layernorm(q_a_proj(hidden))``.
        cos, sin: (B, S, qk_rope_head_dim) float32 rotary tables (``cat(freqs, freqs)``).
    Returns:
        (B, S, S) float32 scores, query by key, ``-inf`` above the diagonal (causal).
    """
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    b, s, _ = hidden.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, q_pass = q.split([rope, indexer.head_dim - rope], dim=-1)
    k_rot, k_pass = k.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.einsum("bshd,btd->bsht", q, k) * indexer.softmax_scale)  # (B, S, H, T)
    weights = indexer.weights_proj(hidden) * indexer.n_heads ** -0.5  # (B, S, H)
    out = torch.einsum("bsh,bsht->bst", weights, scores)
    causal = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()
    return out.masked_fill(~causal, float("-inf"))


def attention_target(probs: torch.Tensor) -> torch.Tensor:
    """(B, heads, S, S) attention probabilities -> (B, S, S) target: summed over heads, L1-normalised per query."""
    target = probs.float().sum(1)
    return target / target.sum(-1, keepdim=True).clamp_min(1e-12)


def kl_loss(scores: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid queries of KL(target_t || softmax(scores_t)); scores/target (B, S, S), valid (B, S) bool.
    Keys where the target is 0 (future tokens) contribute nothing."""
    log_q = scores.log_softmax(-1)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_q), torch.zeros_like(target))
    per_query = terms.sum(-1)
    return per_query[valid].mean()


class Teacher:
    """The frozen dense model (transformers ``DeepseekV3ForCausalLM``, eager attention) and, per layer, what its
    attention saw: input hidden states, q LoRA residual, rotary tables, probabilities."""

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        self.captured: list[dict] = [{} for _ in model.model.layers]
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)

    def _pre_hook(self, i: int):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            self.captured[i] = dict(hidden=hidden, q_resid=module.q_a_layernorm(module.q_a_proj(hidden)),
                                    cos=cos, sin=sin)
        return hook

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> list[dict]:
        """ids (B, S) -> per layer dict(hidden, q_resid, cos, sin, target (B, S, S))."""
        out = self.model(ids, output_attentions=True)
        for cap, probs in zip(self.captured, out.attentions):
            cap["target"] = attention_target(probs)
        return self.captured


def encode(tokenizer, texts: list[str], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids padded with eos on the right (L <= context; longer texts keep their end), (B, L) valid mask."""
    rows = []
    for text in texts:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) > context:
            ids = [tokenizer.bos_token_id] + ids[len(ids) - context + 1:]
        rows.append(ids)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
    return ids, valid


def build_student(dense_model, seed: int):
    """A transformers ``DeepseekV32ForCausalLM`` holding the dense model's weights and freshly initialised
    (seeded) indexers; everything but the indexers is frozen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_config(v32_config(dense_model.config), dtype=torch.float32)
    missing, unexpected = student.load_state_dict(dense_model.state_dict(), strict=False)
    if unexpected or any(".indexer." not in name for name in missing):
        raise RuntimeError(f"dense weights do not map onto deepseek_v32: missing {missing}, unexpected {unexpected}")
    student.requires_grad_(False)
    for layer in student.model.layers:
        layer.self_attn.indexer.requires_grad_(True)
    return student


def indexers(student) -> nn.ModuleList:
    return nn.ModuleList(layer.self_attn.indexer for layer in student.model.layers)


def train(work_dir: Path, dense_dir: Path, steps: int, batch_size: int, lr: float, seed: int) -> Path:
    """Run (or resume) the warm-up; returns the folder of the saved ``deepseek_v32`` checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    teacher = Teacher(dense)
    student = build_student(dense, seed)
    trained = indexers(student)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    run = ResumableRun(work_dir, trained, optimizer)
    sentences = prose_sentences()
    words = vocabulary_words(sentences)
    trained.train()
    while run.step < steps:
        run.set_learning_rate(lr, steps, warmup_steps=min(50, steps))
        rng = random.Random(seed * 1_000_003 + run.step)
        texts = [training_text(rng, sentences, words, int(1.9 * configs.CONTEXT), prose_share=0.15).text
                 for _ in range(batch_size)]
        ids, valid = encode(tokenizer, texts, configs.CONTEXT)
        per_layer = [kl_loss(index_scores(ix, c["hidden"], c["q_resid"], c["cos"], c["sin"]), c["target"], valid)
                     for ix, c in zip(trained, teacher(ids))]
        loss = torch.stack(per_layer).sum()
        run.optimizer_step(loss)
        if run.step % 10 == 0 or run.step == steps:
            run.log(loss=round(loss.item(), 4), **{f"kl{i}": round(x.item(), 4) for i, x in enumerate(per_layer)})
        run.maybe_save(force=run.step == steps)
    out = work_dir / "final"
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {out}", flush=True)
    return out


def topk_recall(model_dir: Path, topk: int, num_samples: int = 8, seed: int = 5) -> list[float]:
    """Per layer, the share of the dense attention mass (summed over heads) that falls on the indexer's top-k
    keys, averaged over the query tokens of ``num_samples`` fresh training-mix texts; a distillation check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    sentences = prose_sentences()
    rng = random.Random(seed)
    texts = [training_text(rng, sentences, vocabulary_words(sentences), int(1.9 * configs.CONTEXT), 0.15).text
             for _ in range(num_samples)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, valid = encode(tokenizer, texts, configs.CONTEXT)
    # Dense attention of the same weights: the v32 model with top-k >= the length attends to every earlier token.
    for layer in dense.model.layers:
        layer.self_attn.indexer.index_topk = ids.shape[1]
    teacher = Teacher(dense)
    out = []
    with torch.no_grad():
        for ix, cap in zip(indexers(student), teacher(ids)):
            scores = index_scores(ix, cap["hidden"], cap["q_resid"], cap["cos"], cap["sin"])
            picked = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
            mass = cap["target"].gather(-1, picked)
            mass = torch.where(scores.gather(-1, picked).isfinite(), mass, 0).sum(-1)
            out.append(float(mass[valid].mean()))
    return out


def set_attention(engine, topk: int | None) -> None:
    """Switch every layer of an engine serving a ``deepseek_v32`` checkpoint to dense attention (``topk`` None) or
    to sparse attention over the indexer's top ``topk`` keys.

    Raises:
        TypeError: the engine's layers have no indexer (a ``deepseek_v3`` checkpoint).
    """
    from metainfer_gen.llm.layers.sparse_mla import SparseMLAttention

    for layer in engine.model.model.layers:
        attn = layer.self_attn
        if not isinstance(attn, SparseMLAttention):
            raise TypeError(f"{type(attn).__name__} has no indexer; load a deepseek_v32 checkpoint")
        attn.sparse = topk is not None
        if topk is not None:
            attn.indexer.topk = topk


def evaluate_sparse(model_dir: Path = ASSET_DIR, topks: tuple[int, ...] = (128, 64), num_samples: int = 50,
                    tasks: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """Recall accuracy (0-1) per task of :func:`demo_models.llm.evaluate.task_samples` (the
    embedded LLM's evaluation samples: passkey at 128/256/512 tokens, key-value recall, copying), greedy through
    our engine, with dense attention (``"dense"``) and with sparse attention at each top-k (``"top-K"``);
    ``tasks`` keeps only the named ones (e.g. ``("passkey@512",)``).

    Raises:
        KeyError: a task name the evaluation does not have.

    One engine serves every mode, with prefix caching off: the cached rows of later layers depend on the
    attention mode of earlier ones, so a prefix cached in one mode must not be reused in another.
    """
    from metainfer_gen.llm import EngineConfig, LLMEngine
    from demo_models.llm.evaluate import task_accuracy, task_samples

    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(max_model_len=configs.CONTEXT,
                                                               enable_prefix_caching=False))
    samples = task_samples(engine.tokenizer, num_samples)
    samples = {name: samples[name] for name in tasks} if tasks else samples
    results: dict[str, dict[str, float]] = {}
    for topk in (None, *topks):
        set_attention(engine, topk)
        mode = "dense" if topk is None else f"top-{topk}"
        results[mode] = task_accuracy(engine, samples)
        print(mode, json.dumps(results[mode]), flush=True)
    return results


def build_asset(checkpoint: Path, out_dir: Path = ASSET_DIR) -> int:
    """Copy the checkpoint into the package in bfloat16 (``weights_proj``, router and its bias stay float32 as
    transformers keeps them). Returns the bytes written."""
    from demo_models.llm.build import build

    return build(checkpoint, out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="build/demo_llm_dsa", help="state, log and checkpoint folder")
    parser.add_argument("--dense", default=str(ASSETS / "demo_llm"),
                        help="the dense deepseek_v3 checkpoint to extend (default: the embedded LLM)")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps")
    parser.add_argument("--batch-size", type=int, default=8, help="texts per step (up to 512 tokens each)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (DeepSeek-V3.2: 1e-3)")
    parser.add_argument("--seed", type=int, default=3, help="seed of the indexer weights and the data")
    parser.add_argument("--build", action="store_true", help="copy <work-dir>/final into the package")
    parser.add_argument("--recall-topk", type=int, default=0, help="print the dense-attention mass on the top-k")
    parser.add_argument("--evaluate", default=None, metavar="MODEL_DIR",
                        help="evaluate this deepseek_v32 checkpoint dense vs sparse (e.g. the packaged asset)")
    parser.add_argument("--topks", default="128,64", help="sparse top-k values to evaluate")
    parser.add_argument("--num-samples", type=int, default=50, help="evaluation samples per task")
    parser.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    parser.add_argument("--json", default=None, help="write the evaluation to this JSON file")
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir)
    if args.evaluate:
        topks = tuple(int(k) for k in args.topks.split(","))
        tasks = tuple(args.tasks.split(",")) if args.tasks else None
        results = evaluate_sparse(Path(args.evaluate), topks, args.num_samples, tasks)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"num_samples": args.num_samples, "context": configs.CONTEXT, "accuracy": results}, f,
                          indent=2)
        return
    if args.build:
        size = build_asset(work_dir / "final")
        print(f"wrote {ASSET_DIR} ({size / 2**20:.2f} MiB)")
        return
    if args.recall_topk:
        print(json.dumps({"topk": args.recall_topk, "mass": topk_recall(work_dir / "final", args.recall_topk)}))
        return
    train(work_dir, Path(args.dense), args.steps, args.batch_size, args.lr, args.seed)


if __name__ == "__main__":
    main()
