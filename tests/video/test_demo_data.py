"""The demo model's procedural data and the frame reader that scores prompt adherence."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from demo_models.video import data
from demo_models.video.evaluate import read_clip, trail_direction


def to_uint8(video: torch.Tensor) -> np.ndarray:
    return ((video.permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()


def test_held_out_split_is_disjoint_and_keeps_every_pair_in_training():
    held, train = data.held_out_combinations(), data.training_combinations()
    assert len(held) == 24 and len(set(held)) == 24
    assert set(held).isdisjoint(train) and len(train) == 72 - 24
    for i, j in itertools.combinations(range(3), 2):
        wanted = {(c[i], c[j]) for c in data.all_combinations()}
        assert {(c[i], c[j]) for c in train} == wanted


@pytest.mark.parametrize("combo", data.all_combinations()[::5])
def test_clips_keep_the_shape_inside_the_frame_and_move_as_named(combo):
    spec = data.sample_spec(combo, 17, 64, torch.Generator().manual_seed(hash(combo) % 1000))
    video, mask = data.render_clip(spec, 17, 64)
    assert video.shape == (3, 17, 64, 64) and video.min() >= -1 and video.max() <= 1
    area = mask.sum(dim=(1, 2))
    assert torch.allclose(area, area[0], rtol=0.05), "the whole shape stays visible in every frame"
    reading = read_clip(to_uint8(video))
    assert (reading.colour, reading.shape, reading.direction) == (combo[0], combo[1], combo[2])


def test_reader_scores_ground_truth_perfectly_and_rejects_a_static_clip():
    generator = torch.Generator().manual_seed(0)
    hits = 0
    for combo in data.held_out_combinations():
        video, _ = data.render_clip(data.sample_spec(combo, 17, 64, generator), 17, 64)
        r = read_clip(to_uint8(video))
        hits += (r.colour, r.direction) == (combo[0], combo[2])
    assert hits == 24
    video, _ = data.render_clip(data.sample_spec(("red", "circle", "right"), 17, 64, generator), 17, 64)
    static = np.repeat(to_uint8(video)[:1], 17, axis=0)
    assert read_clip(static).direction is None
    blank = np.full((17, 64, 64, 3), 30, dtype=np.uint8)
    assert read_clip(blank).colour is None


def test_same_generator_state_gives_same_batch():
    a = data.sample_batch(3, 9, 32, torch.Generator().manual_seed(7))
    b = data.sample_batch(3, 9, 32, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and a[2] == b[2]


def test_tokenizer_knows_every_prompt_word():
    from demo_models.video.components import UNK, build_tokenizer

    tokenizer = build_tokenizer()
    unk = tokenizer.convert_tokens_to_ids(UNK)
    for colour, shape, direction in data.all_combinations():
        for template in data.TEMPLATES:
            ids = tokenizer(template.format(colour=colour, shape=shape, direction=direction)).input_ids
            assert unk not in ids and ids[-1] == tokenizer.eos_token_id
    assert unk in tokenizer("a magenta hexagon").input_ids


def test_contact_sheet_puts_each_clip_in_a_row():
    from demo_models.video.contact_sheet import contact_sheet

    rng = np.random.default_rng(0)
    clips = [rng.integers(0, 256, (9, 16, 16, 3), dtype=np.uint8) for _ in range(3)]
    sheet = np.asarray(contact_sheet(clips, ["a", "b", "c"], every=2, scale=2))
    frames_per_row = 5  # frames 0, 2, 4, 6, 8
    assert sheet.shape[1] == frames_per_row * (16 + 2) * 2
    assert sheet.shape[0] == 3 * (16 * 2 + 14 + 2)
    first_row_first_frame = sheet[14:14 + 32:2, 0:32:2]
    assert np.array_equal(first_row_first_frame, clips[0][0])


@pytest.mark.parametrize("direction", list(data.DIRECTIONS))
def test_trail_fades_behind_the_shape_and_the_reader_still_reads_the_clip(direction):
    combo = ("green", "square", direction)
    spec = data.sample_spec(combo, 17, 64, torch.Generator().manual_seed(5), trail=2)
    video, mask = data.render_clip(spec, 17, 64)
    _, plain_mask = data.render_clip(dataclasses.replace(spec, trail=0), 17, 64)
    ghost = (mask - plain_mask)[0]  # only the trail: where the trail adds coverage, at opacity <= 1/2
    assert ghost.min() >= 0 and 0.2 < ghost.max() <= 0.5
    dx, dy = data.DIRECTIONS[direction]
    ys, xs = torch.nonzero(ghost > 0.1, as_tuple=True)
    behind = (xs.float().mean() + 0.5 - spec.x0) * dx + (ys.float().mean() + 0.5 - spec.y0) * dy
    assert behind < -spec.radius  # the trail's mass sits more than a radius behind the centre
    reading = read_clip(to_uint8(video))
    assert (reading.colour, reading.direction) == ("green", direction)


def test_centred_starts_share_one_box_for_every_direction_and_keep_the_path_inside():
    starts = {}
    for direction in data.DIRECTIONS:
        for seed in range(50):
            spec = data.sample_spec(("red", "circle", direction), 17, 64, torch.Generator().manual_seed(seed),
                                    centred=True)
            travel = spec.speed * 16
            assert 0.24 * 64 - 1e-4 <= travel <= 0.3 * 64 + 1e-4
            margin = spec.radius + 1
            # the box from which the path fits whichever way it goes
            assert margin + travel <= spec.x0 <= 64 - margin - travel
            assert margin + travel <= spec.y0 <= 64 - margin - travel
            _, mask = data.render_clip(spec, 17, 64)
            assert mask[:, [0, -1]].sum() + mask[:, :, [0, -1]].sum() < 1e-3  # never touches the border
            starts.setdefault(direction, []).append((spec.x0, spec.y0))
    means = torch.tensor([torch.tensor(v).mean(0).tolist() for v in starts.values()])
    assert (means - 32).abs().max() < 2.5  # the start says nothing about the direction
    plain = [data.sample_spec(("red", "circle", "right"), 17, 64, torch.Generator().manual_seed(seed)).x0
             for seed in range(50)]
    # uncentred: a shape moving right starts where its path fits, so the start gives the direction away
    assert max(plain) < 64 - 8 - 0.35 * 64 and sum(plain) / len(plain) < 24


def test_trail_zero_draws_the_shipped_data():
    a = data.sample_batch(3, 9, 32, torch.Generator().manual_seed(1))
    b = data.sample_batch(3, 9, 32, torch.Generator().manual_seed(1), trail=0)
    assert torch.equal(a[0], b[0]) and [s.trail for s in a[2]] == [0, 0, 0]


def test_trail_direction_reads_single_frames_of_ground_truth_trail_clips():
    hits = 0
    for index, combo in enumerate(data.held_out_combinations()):
        spec = data.sample_spec(combo, 17, 64, torch.Generator().manual_seed(index), trail=2)
        video, _ = data.render_clip(spec, 17, 64)
        frames = to_uint8(video)
        hits += trail_direction(frames, combo[0]) == combo[2]
        assert trail_direction(frames[:1], combo[0]) == combo[2]  # one frame is enough
    assert hits == 24
    blank = np.full((3, 64, 64, 3), 30, dtype=np.uint8)
    assert trail_direction(blank, "red") is None  # no shape: nothing to read


def test_first_frame_is_the_clips_first_frame_in_uint8():
    spec = data.sample_spec(("red", "square", "left"), 17, 32, torch.Generator().manual_seed(3))
    image = data.first_frame(spec, 32)
    video, _ = data.render_clip(spec, 17, 32)
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert np.array_equal(image, data.to_uint8(video[:, 0].permute(1, 2, 0)))
    assert np.array_equal(data.to_uint8(torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0])), [0, 0, 128, 255, 255])
