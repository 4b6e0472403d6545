"""What the step cache did in one generation: one record per step and branch, and totals (plain data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class StepRecord:
    """One transformer call of one CFG branch.

    Attributes:
        step: denoising step index (0-based, counted across Wan 2.2's two experts).
        model_step: the step index within this transformer's span (equals ``step`` with one transformer; for Wan
            2.2's low-noise expert it starts at 0 at the switch): warm-up, reuse cap and last step count in it.
        branch: cache context name ("cond", "uncond", "cond_uncond") or "branch<k>" when the pipeline sets none.
        model: which transformer ran it ("transformer" or "transformer_2").
        computed: True when all blocks ran; False when the cached residual was reused.
        reason: why (see ``decision.Reason``). signal: relative L1 change of the first block's residual (None on
            a branch's first step). predicted_error: accumulated predicted error if reused. budget: the budget.
        extrapolated: the reused residual was extrapolated from the last two computed steps.
        change: on a computed step, the measured relative L1 change of the transformer residual since the
            previous computed step (what a reuse would have missed); None otherwise. extrapolation_error: the
            same for the first-order extrapolation. ``metainfer-gen calibrate`` fits its ratios from these.
    """

    step: int
    branch: str
    model: str
    computed: bool
    reason: str
    signal: float | None
    predicted_error: float | None
    budget: float
    extrapolated: bool = False
    change: float | None = None
    extrapolation_error: float | None = None
    model_step: int | None = None


@dataclass(slots=True)
class StepCacheStats:
    """Per-call report of a step-cache policy (``VideoOutput.stats.cache``).

    Attributes:
        policy: policy name ("auto", "fbcache", ...). num_inference_steps: steps of the call (None if unknown).
        disabled_reason: why the cache stood aside for the whole call (e.g. too few steps), else None.
        ratios: where the signal-to-error ratios came from: a calibration file's path, or ``"online"``.
        steps: one :class:`StepRecord` per transformer call (empty for the baseline policies, which report none).
    """

    policy: str = "auto"
    num_inference_steps: int | None = None
    disabled_reason: str | None = None
    ratios: str = "online"
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def num_computed(self) -> int:
        return sum(record.computed for record in self.steps)

    @property
    def num_reused(self) -> int:
        return sum(not record.computed for record in self.steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields plus the computed/reused counts per branch and per transformer (``per_model``:
        Wan 2.2's two experts apart)."""
        per_branch: dict[str, dict[str, int]] = {}
        per_model: dict[str, dict[str, int]] = {}
        for record in self.steps:
            for key, table in ((record.branch, per_branch), (record.model, per_model)):
                counts = table.setdefault(key, {"computed": 0, "reused": 0})
                counts["computed" if record.computed else "reused"] += 1
        data = asdict(self)
        data.update(num_computed=self.num_computed, num_reused=self.num_reused, per_branch=per_branch,
                    per_model=per_model)
        return data
