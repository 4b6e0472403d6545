"""A tiny Wan 2.2 two-expert pipeline (high-noise ``transformer``, low-noise ``transformer_2``, ``boundary_ratio``)
built from a saved tiny Wan pipeline, for the step-cache and context-parallel tests."""

from __future__ import annotations


def two_expert_pipeline(path: str):
    """Our ``TextToVideoPipeline`` over ``diffusers.WanPipeline`` with the saved transformer as the high-noise
    expert and a second one of the same config (seed 3) as the low-noise expert, switching at ratio 0.8."""
    import torch
    from diffusers import WanPipeline

    from metainfer_gen.pipelines import TextToVideoPipeline

    base = WanPipeline.from_pretrained(str(path))
    torch.manual_seed(3)
    second = type(base.transformer)(**base.transformer.config).eval()
    experts = WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                          transformer=base.transformer, transformer_2=second, scheduler=base.scheduler,
                          boundary_ratio=0.8, expand_timesteps=True)
    pipe = TextToVideoPipeline(experts)
    pipe.set_progress_bar_config(disable=True)
    return pipe
