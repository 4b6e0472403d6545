"""Procedural training clips for the embedded demo model: coloured shapes moving in named directions.

Every clip is a solid, anti-aliased shape (circle, square or triangle) in one of six saturated colours on a
dark, slightly tinted background, moving in a straight line. Because the generator knows the colour and the
direction, prompt adherence of the trained model can be scored automatically from decoded frames
(see :mod:`demo_models.video.evaluate`).

All functions are seeded and pure: the same ``torch.Generator`` state gives the same clips.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.92, 0.12, 0.10),
    "green": (0.10, 0.85, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.88, 0.12),
    "purple": (0.70, 0.20, 0.90),
    "cyan": (0.10, 0.85, 0.90),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Unit motion vectors in (dx, dy) image coordinates (y grows downwards).
DIRECTIONS: dict[str, tuple[float, float]] = {
    "right": (1.0, 0.0),
    "left": (-1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
TEMPLATES: tuple[str, ...] = (
    "a {colour} {shape} moving {direction}",
    "the {colour} {shape} moves {direction}",
    "a {colour} {shape} sliding {direction}",
)
# Extra words the tokenizer knows so that plain user prompts tokenize meaningfully.
EXTRA_WORDS: tuple[str, ...] = ("to", "the", "a", "an", "and", "on", "of", "is", "slowly", "quickly", "background")


@dataclass(frozen=True, slots=True)
class ClipSpec:
    """What one clip shows: the words of its prompt and the geometry of its motion.

    Attributes:
        colour, shape, direction: keys of :data:`COLOURS`, :data:`SHAPES`, :data:`DIRECTIONS`.
        x0, y0: start centre in pixels. speed: pixels per frame. radius: half size in pixels.
        background: RGB in [0, 1].
        trail: fading copies drawn behind the shape (0: none), so that one frame shows the direction as the colour
            shows the colour word (an experiment for direction adherence, docs/demo_model.md).
    """

    colour: str
    shape: str
    direction: str
    x0: float
    y0: float
    speed: float
    radius: float
    background: tuple[float, float, float]
    trail: int = 0

    def prompt(self, template: int = 0) -> str:
        return TEMPLATES[template].format(colour=self.colour, shape=self.shape, direction=self.direction)


def all_combinations() -> list[tuple[str, str, str]]:
    """Every (colour, shape, direction) triple, in a fixed order."""
    return list(itertools.product(COLOURS, SHAPES, DIRECTIONS))


def held_out_combinations() -> list[tuple[str, str, str]]:
    """24 of the 72 triples never used in training, for the adherence evaluation.

    Chosen so each colour is held out with 4 (shape, direction) pairs and each direction 6 times, which keeps every
    (colour, direction), (shape, direction) and (colour, shape) pair present in training.
    """
    held = []
    colours, directions = list(COLOURS), list(DIRECTIONS)
    for ci, colour in enumerate(colours):
        for k in range(4):
            shape = SHAPES[(ci + k) % len(SHAPES)]
            direction = directions[(ci + k) % len(directions)]
            held.append((colour, shape, direction))
    return held


def training_combinations() -> list[tuple[str, str, str]]:
    held = set(held_out_combinations())
    return [c for c in all_combinations() if c not in held]


def vocabulary() -> list[str]:
    """Every word the demo tokenizer knows (special tokens excluded)."""
    words: list[str] = []
    for template in TEMPLATES:
        words += [w for w in template.split() if not w.startswith("{")]
    words += list(COLOURS) + list(SHAPES) + list(DIRECTIONS) + list(EXTRA_WORDS)
    return sorted(set(words))


def sample_spec(
    combo: tuple[str, str, str], num_frames: int, size: int, generator: torch.Generator, trail: int = 0,
    centred: bool = False,
) -> ClipSpec:
    """Random geometry for one clip of ``combo`` that keeps the shape inside the frame for all ``num_frames``
    (the trail, if any, may leave it).

    ``centred``: the start is drawn from the central box from which the shape could travel its whole path in any of
    the four directions (and the path is 24-30% of the frame instead of 35-50%), so where a clip starts says
    nothing about where it goes: the direction word is the only cue to it. Otherwise the start is drawn from
    where this clip's own path fits, so a shape near the left edge can only be moving right, up or down.
    """

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * torch.rand((), generator=generator).item()

    colour, shape, direction = combo
    radius = uniform(0.11, 0.17) * size
    speed = (uniform(0.24, 0.3) if centred else uniform(0.35, 0.5)) * size / max(num_frames - 1, 1)
    travel = speed * (num_frames - 1)
    dx, dy = DIRECTIONS[direction]
    margin = radius + 1.0
    if centred:  # the box every direction's path fits from: 2 * (margin + travel) <= size at the largest radius
        lo_x = lo_y = margin + travel
        hi_x = hi_y = size - margin - travel
    else:
        lo_x = margin - min(dx, 0.0) * travel
        hi_x = size - margin - max(dx, 0.0) * travel
        lo_y = margin - min(dy, 0.0) * travel
        hi_y = size - margin - max(dy, 0.0) * travel
    background = tuple(uniform(0.0, 0.22) for _ in range(3))
    return ClipSpec(colour, shape, direction, uniform(lo_x, hi_x), uniform(lo_y, hi_y), speed, radius, background,
                    trail)


def shape_coverage(shape: str, cx: torch.Tensor, cy: torch.Tensor, radius: torch.Tensor, size: int) -> torch.Tensor:
    """Anti-aliased coverage in [0, 1] of ``shape`` centred at (cx, cy) per frame.

    Args:
        cx, cy, radius: float tensors of shape (F,), pixels.
    Returns:
        float32 tensor (F, size, size).
    """
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    x = coords.view(1, 1, size) - cx.view(-1, 1, 1)
    y = coords.view(1, size, 1) - cy.view(-1, 1, 1)
    r = radius.view(-1, 1, 1)
    if shape == "circle":
        signed = torch.sqrt(x * x + y * y) - r
    elif shape == "square":
        signed = torch.maximum(x.abs(), y.abs()) - 0.85 * r
    elif shape == "triangle":
        # Upward equilateral triangle: the max of three half-plane distances.
        s3 = 3**0.5 / 2
        signed = torch.maximum(torch.maximum(y - 0.5 * r, s3 * x - 0.5 * y - 0.5 * r), -s3 * x - 0.5 * y - 0.5 * r)
        signed = signed * 1.2
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")
    return (0.5 - signed).clamp(0.0, 1.0)


def render_clip(spec: ClipSpec, num_frames: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one clip.

    Returns:
        video: float32 (3, F, size, size) in [-1, 1] (the VAE's input range).
        mask: float32 (F, size, size) in [0, 1], the shape's coverage (the trail's copies at opacity 1/2, 1/4, ...,
            spaced 0.7 radius apart behind it).
    """
    t = torch.arange(num_frames, dtype=torch.float32)
    dx, dy = DIRECTIONS[spec.direction]
    cx = spec.x0 + dx * spec.speed * t
    cy = spec.y0 + dy * spec.speed * t
    radius = torch.full_like(t, spec.radius)
    mask = shape_coverage(spec.shape, cx, cy, radius, size)
    for k in range(1, spec.trail + 1):
        back = 0.7 * spec.radius * k
        ghost = shape_coverage(spec.shape, cx - dx * back, cy - dy * back, radius, size)
        mask = torch.maximum(mask, ghost * 0.5 ** k)
    colour = torch.tensor(COLOURS[spec.colour]).view(3, 1, 1, 1)
    background = torch.tensor(spec.background).view(3, 1, 1, 1)
    video = background * (1 - mask) + colour * mask
    return video * 2 - 1, mask


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """Pixels in [-1, 1] (the VAE's range), channels last, to uint8 (values outside are clipped)."""
    return ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()


def first_frame(spec: ClipSpec, size: int) -> np.ndarray:
    """The first frame of ``spec``'s clip as uint8 (size, size, 3): the image an image-to-video call starts from."""
    video, _ = render_clip(spec, 1, size)
    return to_uint8(video[:, 0].permute(1, 2, 0))


def sample_batch(
    batch_size: int,
    num_frames: int,
    size: int,
    generator: torch.Generator,
    combos: list[tuple[str, str, str]] | None = None,
    trail: int = 0,
    centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[ClipSpec]]:
    """A batch of random clips drawn from ``combos`` (default: the training combinations), with ``trail`` fading
    copies behind each shape, and starts drawn as :func:`sample_spec`'s ``centred`` says.

    Returns:
        videos (B, 3, F, size, size) in [-1, 1], masks (B, F, size, size), and the specs.
    """
    combos = combos or training_combinations()
    specs, videos, masks = [], [], []
    for _ in range(batch_size):
        combo = combos[int(torch.randint(len(combos), (), generator=generator))]
        spec = sample_spec(combo, num_frames, size, generator, trail, centred)
        video, mask = render_clip(spec, num_frames, size)
        specs.append(spec)
        videos.append(video)
        masks.append(mask)
    return torch.stack(videos), torch.stack(masks), specs
