"""Helpers of the demo model's transformer training: noise levels and the object-path loss weight."""

from __future__ import annotations

import json

import pytest
import torch

from demo_models.video.train_transformer import path_weight, shifted_sigmas


def test_path_weight_marks_every_position_the_object_crosses():
    x0 = torch.zeros(2, 4, 3, 8, 8)
    x0[:, :, 0, 2, 1] = 5.0  # the object moves right along row 2: columns 1, 3, 5 in latent frames 0, 1, 2
    x0[:, :, 1, 2, 3] = 5.0
    x0[:, :, 2, 2, 5] = 5.0
    x0[:, :, :, 6, 6] = 0.5  # a faint mark (a tenth of the object's distance) stays below the floor
    weight = path_weight(x0, 4.0)
    assert weight.shape == (2, 1, 1, 8, 8)
    on_path = weight[0, 0, 0] > 1
    assert on_path.nonzero().tolist() == [[2, 1], [2, 3], [2, 5]]
    assert torch.all(weight[0, 0, 0][on_path] == 5.0) and torch.all(weight[0, 0, 0][~on_path] == 1.0)
    assert torch.equal(path_weight(x0, 0.0), torch.ones(2, 1, 1, 8, 8))


def test_shifted_sigmas_stay_in_range_and_high_noise_draws_only_when_asked():
    g = torch.Generator().manual_seed(0)
    plain = shifted_sigmas(1000, 3.0, g)
    assert 0 <= plain.min() and plain.max() < 1 and plain.median() > 0.5  # shift 3 leans to high noise
    high = shifted_sigmas(1000, 3.0, torch.Generator().manual_seed(0), high_noise_fraction=1.0)
    assert high.min() >= 0.9


def test_shards_of_other_data_are_refused_before_any_encoding(tmp_path):
    from demo_models.video.latents import encode_shards

    shards = tmp_path / "shards"
    shards.mkdir()
    torch.save({}, shards / "shard_0000.pt")  # a shard from before the record: the shipped data, trail 0
    with pytest.raises(ValueError, match="'trail': 0, 'centred': False}, not {'trail': 2"):
        encode_shards(None, tmp_path, 64, trail=2)
    with pytest.raises(ValueError, match="not {'trail': 0, 'centred': True}"):
        encode_shards(None, tmp_path, 64, centred=True)
    assert encode_shards(None, tmp_path, 64) == [shards / "shard_0000.pt"]  # same data: reused, nothing encoded
    assert json.loads((shards / "data.json").read_text()) == {"trail": 0, "centred": False}
