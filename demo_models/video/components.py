"""Build the demo model's components from :mod:`configs` and assemble them into a standard diffusers Wan pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from demo_models.video import configs
from demo_models.video.data import vocabulary

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"


def build_tokenizer():
    """A word-level T5-style tokenizer (lower-cases, splits on whitespace and punctuation, appends ``</s>``)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for word in vocabulary():
        vocab[word] = len(vocab)
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, model_max_length=512
    )


def build_text_encoder(seed: int = 0):
    """A small random UMT5 encoder; it stays frozen (the transformer learns to read its features)."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=len(vocabulary()) + 3, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0, **configs.TEXT_ENCODER_CONFIG)
    return UMT5EncoderModel(config).eval().requires_grad_(False)


def build_transformer(seed: int = 0, **overrides):
    """A randomly initialised ``WanTransformer3DModel`` of :data:`configs.TRANSFORMER_CONFIG` (``overrides`` win)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**configs.TRANSFORMER_CONFIG, **overrides})


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**configs.SCHEDULER_CONFIG)


def assemble_pipeline(vae, transformer, text_encoder=None, tokenizer=None):
    """A ``diffusers.WanPipeline`` (Wan 2.2 TI2V-style: ``expand_timesteps=True``) from trained parts."""
    from diffusers import WanPipeline

    return WanPipeline(
        tokenizer=tokenizer or build_tokenizer(),
        text_encoder=text_encoder or build_text_encoder(),
        vae=vae,
        transformer=transformer,
        scheduler=build_scheduler(),
        expand_timesteps=True,
    )


def save_pipeline(pipe, out_dir: str | Path) -> None:
    """Save in diffusers layout with safetensors weights."""
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
