"""timestep_embedding: the distinct-values path equals embedding every row, the fused Wan condition embedder equals
diffusers' on per-token (TI2V) and per-sample timesteps, and bad inputs raise clear errors.

Tolerance: float32 atol = rtol = 1e-5 (a matrix product over fewer rows may round differently in the last bit)."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit, timestep_embedding
from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels
from metainfer_gen.kernels.timestep_embed import TIMESTEP_EMBEDDING


def _mlp():
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 48)

    def embed(t):  # row-wise over the last dimension, so any leading shape works
        angles = t.float().unsqueeze(-1) * torch.linspace(0.01, 1.0, 4)
        hidden = first(torch.cat([angles.sin(), angles.cos()], dim=-1))
        return hidden, second(torch.nn.functional.silu(hidden))

    return embed


@pytest.mark.parametrize("values", [[0.0] * 5 + [700.0] * 27, [312.5] * 9, [3.0, 1.0, 2.0, 1.0, 3.0]])
def test_unique_path_matches_every_row(values):
    embed, timestep = _mlp(), torch.tensor(values)
    calls = []

    def counted(t):
        calls.append(t.numel())
        return embed(t)

    with audit() as report:
        got = timestep_embedding(timestep, counted, site="test")
    assert report.paths() == {"timestep_embedding": {"unique": 1}}
    assert calls == [len(set(values))]  # the MLP saw each distinct timestep once
    expected = embed(timestep)
    assert len(got) == 2
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        # one timestep for all rows (text-to-video): a broadcast view of the one row, no per-row copies
        assert (g.stride(0) == 0) == (len(set(values)) == 1)


def test_a_two_dimensional_timestep_takes_the_reference_with_the_reason():
    embed, timestep = _mlp(), torch.full((2, 3), 500.0)
    with audit() as report:
        got = timestep_embedding(timestep, embed)
    assert report.paths() == {"timestep_embedding": {"torch": 1}}
    _, refusals = TIMESTEP_EMBEDDING.select(timestep, embed)
    assert refusals[0].reason == "timestep is 2-D; the row gather needs a flat (M,) timestep"
    for g, e in zip(got, embed(timestep)):
        assert g.shape == e.shape == (2, 3, g.shape[-1])
        torch.testing.assert_close(g, e, atol=0, rtol=0)  # the reference path is embed itself


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="timestep must be a tensor"):
        timestep_embedding([1.0, 2.0], _mlp())
    with pytest.raises(ValueError, match="embed must be callable"):
        timestep_embedding(torch.ones(3), "mlp")


@pytest.mark.parametrize("expand_timesteps", [True, "uniform", False])
def test_fused_wan_condition_embedder_matches_diffusers(expand_timesteps):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1).eval()
    x, text = torch.randn(2, 4, 3, 8, 8), torch.randn(2, 5, 16)
    if expand_timesteps:  # Wan 2.2 TI2V: the clean first latent frame at 0, the rest at t (48 tokens per sample)
        timestep = torch.full((2, 48), 640.0)
        if expand_timesteps != "uniform":  # uniform: text-to-video, every token at t (a broadcast view)
            timestep[:, :16] = 0.0
    else:
        timestep = torch.tensor([640, 640])
    with torch.no_grad():
        expected = model(x, timestep, text).sample
        report = fuse_kernels(model, FuseKernelsConfig(adaln=False, qk_norm=False, rope=False, rope_table=False))
        assert report.fused == ["condition_embedder"]
        with audit() as trace:
            got = model(x, timestep, text).sample
    assert trace.paths() == {"timestep_embedding": {"unique": 1}}
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert unfuse_kernels(model) == 1
