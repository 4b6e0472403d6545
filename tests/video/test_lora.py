"""LoRA on the video pipelines (``video/lora.py``, ``video/lora_keys.py``) on the tiny random Wan checkpoints.

Every layout of one LoRA must give the same clip; partial and extra-key LoRAs load with a report; bad LoRAs are
refused before the model changes; fuse/unfuse cycles restore the base exactly; swaps never reload the base.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline
from tests.video import lora_files

PROMPT = "a red circle moving right"
CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=5.0, seed=0)


def base_weights(pipe) -> dict[str, torch.Tensor]:
    """The transformer's own parameters (peft's lora_* excluded), keyed as before any adapter was added."""
    return {k.replace(".base_layer", ""): v.detach().clone()
            for k, v in pipe.diffusers_pipeline.transformer.state_dict().items() if "lora_" not in k}


def test_the_five_layouts_give_the_same_clip(fresh_t2v, tmp_path):
    base = fresh_t2v(PROMPT, **CALL).frames
    lora = lora_files.make_lora(fresh_t2v.diffusers_pipeline.transformer)
    clips, reports = {}, {}
    for fmt in lora_files.FORMATS:
        reports[fmt] = fresh_t2v.load_lora(lora_files.write(lora, fmt, tmp_path), adapter_name=fmt)
        clips[fmt] = fresh_t2v(PROMPT, **CALL).frames
        fresh_t2v.unload_lora(fmt)
    for fmt in lora_files.FORMATS:
        assert reports[fmt].modules == sorted(lora) and reports[fmt].skipped == {}, fmt
        np.testing.assert_array_equal(clips[fmt], clips["diffusers"], err_msg=fmt)  # alpha folded identically
    assert np.abs(clips["diffusers"].astype(int) - base).mean() > 1.0  # the LoRA does change the clip
    np.testing.assert_array_equal(fresh_t2v(PROMPT, **CALL).frames, base)  # unloaded: the base again


def test_original_wan_names_map_as_diffusers_own_converter_maps_them(fresh_t2v):
    """Our table of original-Wan names agrees with diffusers' converter on a LoRA it can convert."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    from metainfer_gen.video.lora_keys import normalise_lora

    transformer = fresh_t2v.diffusers_pipeline.transformer
    original = lora_files.state_dict(lora_files.make_lora(transformer), "wan")
    # Copies: the converter scales cross-attention and FFN tensors in place (``*=``), i.e. the caller's tensors.
    theirs = _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in original.items()})
    ours, _, skipped = normalise_lora(original, transformer)
    assert skipped == {} and set(ours) == set(theirs)
    for key in ours:  # diffusers splits alpha / rank between A and B; the product is what counts
        if key.endswith("lora_A.weight"):
            up = key.replace("lora_A", "lora_B")
            torch.testing.assert_close(ours[up] @ ours[key], theirs[up] @ theirs[key], rtol=1e-6, atol=1e-7)


def test_partial_and_extra_key_loras_load_with_a_report(fresh_t2v):
    transformer = fresh_t2v.diffusers_pipeline.transformer
    lora = lora_files.make_lora(transformer)
    partial = {k: v for k, v in lora.items() if k.startswith("blocks.1.")}
    state = lora_files.state_dict(partial, "wan")
    extra = {
        "diffusion_model.blocks.1.cross_attn.k_img.lora_down.weight": torch.ones(4, 16),  # image attention (2.1 I2V)
        "diffusion_model.blocks.1.cross_attn.k_img.lora_up.weight": torch.ones(16, 4),
        "diffusion_model.blocks.7.self_attn.q.lora_down.weight": torch.ones(4, 16),  # a block this model lacks
        "diffusion_model.blocks.1.norm3.diff": torch.ones(16),  # a full-weight norm delta
        "diffusion_model.blocks.1.ffn.2.lora_down.weight": torch.ones(4, 32),  # half a pair
        "diffusion_model.blocks.0.self_attn.k.lora_down.weight": torch.ones(4, 99),  # wrong shape
        "diffusion_model.blocks.0.self_attn.k.lora_up.weight": torch.ones(16, 4),
    }
    report = fresh_t2v.load_lora({**state, **extra}, adapter_name="partial")
    assert report.modules == sorted(partial)
    assert set(report.skipped) == set(extra) and report.num_skipped == len(extra) == 7
    assert "no module" in report.skipped["diffusion_model.blocks.7.self_attn.q.lora_down.weight"]
    assert "missing" in report.skipped["diffusion_model.blocks.1.ffn.2.lora_down.weight"]
    assert "does not fit" in report.skipped["diffusion_model.blocks.0.self_attn.k.lora_up.weight"]
    assert f"{len(extra)} of {len(state) + len(extra)} keys skipped" in report.summary()
    adapted = {n.removesuffix(".lora_A.partial") for n, _ in transformer.named_modules()
               if n.endswith("lora_A.partial")}
    assert adapted == set(partial)
    fresh_t2v(PROMPT, **CALL)  # and it runs


@pytest.mark.parametrize("case, state, words", [
    ("another architecture", {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.ones(4, 8),
                              "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.ones(8, 4)},
     "none of its 2 keys matches a layer of WanTransformer3DModel"),
    ("NaN", {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.full((4, 16), float("nan")),
             "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.ones(16, 4)}, "1 tensors hold NaN or Inf"),
    ("Inf", {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.ones(4, 16),
             "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.tensor([[float("inf")] * 4] * 16)},
     "hold NaN or Inf"),
])
def test_bad_loras_are_refused_and_the_model_is_unchanged(fresh_t2v, case, state, words):
    fresh_t2v.load_lora(lora_files.state_dict(lora_files.make_lora(fresh_t2v.diffusers_pipeline.transformer),
                                              "diffusers"), adapter_name="good")
    before = base_weights(fresh_t2v)
    clip = fresh_t2v(PROMPT, **CALL).frames
    with pytest.raises(ValueError, match=words):
        fresh_t2v.load_lora(state, adapter_name="bad")
    after = base_weights(fresh_t2v)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), case
    assert [info["name"] for info in fresh_t2v.list_loras()] == ["good"]
    np.testing.assert_array_equal(fresh_t2v(PROMPT, **CALL).frames, clip)


def test_five_fuse_unfuse_cycles_with_two_adapters_restore_the_base_exactly(fresh_t2v):
    transformer = fresh_t2v.diffusers_pipeline.transformer
    before = base_weights(fresh_t2v)
    fresh_t2v.load_lora(lora_files.state_dict(lora_files.make_lora(transformer, seed=1), "kohya"), adapter_name="a")
    fresh_t2v.load_lora(lora_files.state_dict(lora_files.make_lora(transformer, seed=2), "wan"), adapter_name="b",
                        weight=0.7)
    unfused = fresh_t2v(PROMPT, **CALL).frames
    for cycle in range(5):
        fresh_t2v.fuse_lora()
        assert fresh_t2v.list_loras()[0]["fused"]
        with pytest.raises(ValueError, match="unfuse_lora"):
            fresh_t2v.set_lora_weights({"a": 0.5})
        if cycle == 0:
            fused = fresh_t2v(PROMPT, **CALL).frames
            assert np.abs(fused.astype(int) - unfused).max() <= 1  # merged vs separate: fp32 rounding only
        fresh_t2v.unfuse_lora()
    after = base_weights(fresh_t2v)
    # Tolerance zero: the restored fp32 base is bit-identical (peft's own unmerge subtracts and drifts).
    assert all(torch.equal(before[k], after[k]) for k in before)
    np.testing.assert_array_equal(fresh_t2v(PROMPT, **CALL).frames, unfused)


def test_hot_swap_between_calls_never_reloads_the_base(fresh_t2v, monkeypatch):
    transformer = fresh_t2v.diffusers_pipeline.transformer
    pointers = {n: p.data_ptr() for n, p in transformer.named_parameters() if "lora_" not in n}
    monkeypatch.setattr(TextToVideoPipeline, "from_pretrained", lambda *a, **k: pytest.fail("base reloaded"))
    base = fresh_t2v(PROMPT, **CALL).frames
    fresh_t2v.load_lora(lora_files.state_dict(lora_files.make_lora(transformer, seed=1), "diffusers"), "a")
    with_a = fresh_t2v(PROMPT, **CALL).frames
    fresh_t2v.load_lora(lora_files.state_dict(lora_files.make_lora(transformer, seed=2), "diffusers"), "b")
    fresh_t2v.set_lora_weights({"a": 0.0})
    with_b = fresh_t2v(PROMPT, **CALL).frames
    fresh_t2v.set_lora_weights({"a": 1.0, "b": 0.0})
    np.testing.assert_array_equal(fresh_t2v(PROMPT, **CALL).frames, with_a)
    fresh_t2v.disable_lora()
    np.testing.assert_array_equal(fresh_t2v(PROMPT, **CALL).frames, base)
    fresh_t2v.enable_lora()
    fresh_t2v.unload_lora("a")
    fresh_t2v.set_lora_weights({"b": 1.0})
    np.testing.assert_array_equal(fresh_t2v(PROMPT, **CALL).frames, with_b)
    assert not np.array_equal(with_a, with_b) and not np.array_equal(with_a, base)
    assert {n.replace(".base_layer", ""): p.data_ptr() for n, p in transformer.named_parameters()
            if "lora_" not in n} == pointers  # the very same base tensors
    with pytest.raises(ValueError, match="no LoRA named 'a'"):
        fresh_t2v.set_lora_weights({"a": 1.0})
    with pytest.raises(ValueError, match="already loaded"):
        fresh_t2v.load_lora(lora_files.state_dict(lora_files.make_lora(transformer), "diffusers"), "b")


def test_image_to_video_loads_loras_and_from_pipe_shares_them(fresh_i2v, fresh_t2v, tmp_path):
    lora = lora_files.make_lora(fresh_i2v.diffusers_pipeline.transformer)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    base = fresh_i2v(image, PROMPT, **CALL).frames
    report = fresh_i2v.load_lora(lora_files.write(lora, "kohya", tmp_path))
    assert report.adapter_name == "kohya" and report.skipped == {}
    assert not np.array_equal(fresh_i2v(image, PROMPT, **CALL).frames, base)
    fresh_t2v.load_lora(lora_files.state_dict(lora, "wan"), adapter_name="shared")
    ti2v = ImageToVideoPipeline.from_pipe(fresh_t2v)
    assert [info["name"] for info in ti2v.list_loras()] == ["shared"]
