"""Tensor state of the step cache: one :class:`BranchState` per CFG branch, and the step clock of a call.

A :class:`BranchState` (a diffusers ``BaseState``, kept per cache context by a ``StateManager``) holds the
tensors the signal was measured on at the previous step, the reference the residual is taken against on the
current computed step (the first block's input or output) and the residuals of the last two computed steps.
The :class:`CallTracker` is shared by the transformers of one pipeline (Wan 2.2's two experts): it numbers
steps from the timesteps it sees, so it works whether or not the pipeline opens cache contexts, and it collects
the per-call stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers.hooks.hooks import BaseState

from metainfer_gen.video.cache.decision import BranchBook
from metainfer_gen.video.cache.stats import StepCacheStats

Parts = tuple[torch.Tensor, "torch.Tensor | None"]  # (image-token tensor, text-token tensor or None)


Reduce = Callable[[torch.Tensor], None]  # in place: sum over the context-parallel ranks that share the tokens


def _l1_terms(new: torch.Tensor, old: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(2,) float32 ``[mean|new - old|, mean|scale|]`` (``scale`` defaults to ``old``), no host sync. Their ratio
    is the relative L1 change; under context parallelism each rank holds an equal share of the tokens, so the
    ratio of the terms summed over the ranks is the ratio over the whole clip."""
    new, old = _one_of_each_repeat(new, old)
    old32 = old.float()
    scale32 = old32 if scale is None else scale.float()
    return torch.stack(((new.float() - old32).abs().mean(), scale32.abs().mean()))


def _ratios(terms: list[torch.Tensor], reduce: Reduce | None) -> torch.Tensor:
    """(k,) float32 relative L1 changes of :func:`_l1_terms`, the terms summed over the ranks first (one
    collective for all)."""
    stacked = torch.stack(terms)  # (k, 2)
    if reduce is not None:
        reduce(stacked)
    return stacked[:, 0] / stacked[:, 1].clamp_min(1e-12)


def _one_of_each_repeat(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors cut to one slice along every dimension that both broadcast (stride 0, as ``expand`` makes):
    the slices along it are equal, so every mean above is unchanged, without reading (and, for the difference,
    allocating) the repeats. Wan 2.2's per-token ``temb`` of one timestep is such a view, (B, S, 6, N) with stride
    0 along S (:mod:`metainfer_gen.kernels.timestep_embed`): the signal reads 1 row instead of S."""
    if new.shape != old.shape:
        return new, old
    index = tuple(slice(0, 1) if size > 1 and a == 0 and b == 0 else slice(None)
                  for size, a, b in zip(new.shape, new.stride(), old.stride()))
    return new[index], old[index]


def signal_between(new: tuple[torch.Tensor, ...], old: tuple[torch.Tensor, ...] | None,
                   reduce: Reduce | None = None) -> float | None:
    """Sum of the relative L1 changes of matching tensors (one host sync for all); None without a previous step.

    Args:
        reduce: under context parallelism, the in-place sum over the ranks that share the tokens, so every rank
            gets the signal of the whole clip (and takes the same decision); None on one rank. Every rank calls
            it here, or none does: whether there is a previous step depends only on the step, never on the shard.
    """
    if old is None or len(old) != len(new) or any(a.shape != b.shape for a, b in zip(new, old)):
        return None
    return float(sum(_ratios([_l1_terms(a, b) for a, b in zip(new, old)], reduce)))


@dataclass(slots=True)
class ComputedResidual:
    """Residual of the cached blocks on a computed step. ``position``: the step index it was computed at;
    ``gated_summary``: the summed module outputs when the blocks are gated (:mod:`~metainfer_gen.video.cache.gated`),
    else None."""

    position: float
    parts: Parts
    gated_summary: list[torch.Tensor] | None = None


Assemble = Callable[[list[torch.Tensor]], torch.Tensor]  # module-output summary -> residual at this step's gates


class BranchState(BaseState):
    """Cache of one CFG branch of one transformer; ``reset()`` drops every tensor and the calibration."""

    def __init__(self) -> None:
        super().__init__()
        self.book = BranchBook()
        self.shape_key: tuple | None = None
        self.signal_sources: tuple[torch.Tensor, ...] | None = None  # what the signal measured, previous step
        self.head_reference: Parts | None = None  # the residual's origin on the current (computed) step
        self.history: list[ComputedResidual] = []  # last two computed residuals, oldest first

    def reset(self) -> None:
        self.book.reset()
        self.shape_key = None
        self.signal_sources = self.head_reference = None
        self.history = []

    def check_shapes(self, key: tuple) -> None:
        """Reset when the inputs' shapes, dtype or device differ from the cached ones (resolution, frames, batch)."""
        if key != self.shape_key:
            self.reset()
            self.shape_key = key

    def estimate(self, position: float, extrapolate: bool, assemble: Assemble | None = None) -> Parts:
        """Residual to add on a reused step: the last computed one, or its first-order extrapolation; with
        ``assemble`` (gated blocks), built from the (extrapolated) module outputs at the current gates."""
        used = self.history if extrapolate and len(self.history) == 2 else self.history[-1:]
        positions = [h.position for h in used]
        if assemble is not None and all(h.gated_summary is not None for h in used):
            encoder = _extrapolate_list([[h.parts[1]] for h in used], positions, position)[0]
            return assemble(_extrapolate_list([h.gated_summary for h in used], positions, position)), encoder
        return tuple(_extrapolate_list([list(h.parts) for h in used], positions, position))

    def store(self, position: float, parts: Parts, gated_summary: list[torch.Tensor] | None = None,
              assemble: Assemble | None = None, reduce: Reduce | None = None) -> tuple[float | None, float | None]:
        """Keep a computed residual (this rank's shard of the tokens under context parallelism); return (reuse
        change, extrapolation error) measured against history, over the whole clip when ``reduce`` is given."""
        measured: list[torch.Tensor] = []
        if self.history:
            last = self.history[-1].parts[0]
            measured.append(_l1_terms(parts[0], last))
            if len(self.history) == 2:
                guess = self.estimate(position, True, assemble if gated_summary is not None else None)[0]
                measured.append(_l1_terms(parts[0], guess, scale=last))
        self.history = [*self.history[-1:], ComputedResidual(position, parts, gated_summary)]
        values: list[float | None] = _ratios(measured, reduce).tolist() if measured else []  # one host sync
        values += [None] * (2 - len(values))
        return values[0], values[1]


def _weight(positions: list[float], position: float) -> float | None:
    """Extrapolation weight of the newer of two points (None: one point, or two at the same position)."""
    if len(positions) < 2 or positions[1] == positions[0]:
        return None
    return (position - positions[1]) / (positions[1] - positions[0])


def _extrapolate_list(values: list[list], positions: list[float], position: float) -> list:
    """First-order extrapolation, item by item, of the newer list from the older (the newer alone when one)."""
    weight = _weight(positions, position)
    if weight is None:
        return values[-1]
    return [None if a is None or b is None or a.shape != b.shape else torch.lerp(a, b, 1.0 + weight)
            for a, b in zip(values[0], values[1])]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the pipeline knows of a call once its loop started: ``spans``, ``{transformer attribute: (first step,
    steps)}`` of Wan 2.2's experts (None: one transformer over the whole schedule), and whether it is ``guided``
    (two CFG branches per step)."""

    spans: dict[str, tuple[int, int]] | None = None
    guided: bool = True


@dataclass(slots=True)
class CallTracker:
    """Step numbering and stats of one pipeline call, shared by the transformers of a pipeline.

    Attributes:
        num_inference_steps: steps of the current call when known (set by our pipelines, or read from the cache
            context diffusers' Wan T2V pipeline opens); None means the last step cannot be singled out.
    """

    policy: str = "auto"
    num_inference_steps: int | None = None
    step: int = -1
    last_position: float | None = None
    first_position: float | None = None  # the timestep of step 0
    step_size: float | None = None  # timestep of the previous step minus this step's (None on step 0)
    branches_this_step: list[str] = field(default_factory=list)
    current: StepCacheStats = field(default_factory=StepCacheStats)
    last: StepCacheStats | None = None
    info_source: Callable[[], CallInfo] | None = None  # set per call by the policy
    info: CallInfo | None = None  # what info_source said on the call's first step

    def _info(self) -> CallInfo:
        if self.info is None:
            self.info = self.info_source() if self.info_source is not None else CallInfo()
        return self.info

    def span(self, model: str) -> tuple[int, int | None]:
        """(first step, steps) of ``model``'s span in the current call: Wan 2.2's two experts split the schedule at
        ``boundary_ratio`` (read from ``info_source`` on the call's first step, once the pipeline has set its
        timesteps); with one transformer, or without a source, the whole schedule."""
        found = (self._info().spans or {}).get(model)
        return found if found is not None else (0, self.num_inference_steps)

    @property
    def guided(self) -> bool:
        """Whether the current call runs classifier-free guidance (True when unknown)."""
        return self._info().guided

    def advance(self, context_name: str | None, position: float) -> tuple[int, str]:
        """Number the call: a new timestep (or a branch seen twice at one timestep) starts a new step."""
        branch = context_name if context_name is not None else f"branch{len(self.branches_this_step)}"
        if position != self.last_position or branch in self.branches_this_step:
            self.step += 1
            self.branches_this_step = []
            branch = context_name if context_name is not None else "branch0"
            if self.step == 0:
                self.first_position, self.step_size = position, None
            else:
                self.step_size = self.last_position - position
        self.last_position = position
        self.branches_this_step.append(branch)
        return self.step, branch

    def step_weight(self, exponent: float) -> float:
        """``(mean step / this step) ** exponent``, the step sizes in timestep units: the mean from the first
        timestep over the step count (schedules end near 0), this step's from the previous timestep. 1 when the
        exponent is 0, on step 0, without a step count, or when the timesteps do not fall."""
        steps, size, first = self.num_inference_steps, self.step_size, self.first_position
        if exponent == 0 or not steps or size is None or first is None or size <= 0 or first <= 0:
            return 1.0
        return (first / steps / size) ** exponent

    def finish_call(self) -> None:
        """Close the call: its stats become ``last``; the clock restarts."""
        if self.current.steps or self.current.disabled_reason:
            self.current.num_inference_steps = self.num_inference_steps
            self.last = self.current
        self.current = StepCacheStats(policy=self.policy)
        self.step, self.last_position, self.branches_this_step = -1, None, []
        self.first_position = self.step_size = None
        self.info = None
        self.num_inference_steps = None  # the next call states its own (a stale count would misplace the last step)
