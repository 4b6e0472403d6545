"""The step-cache decision, as plain Python bookkeeping (no tensors): reuse or compute, and online calibration.

Per CFG branch, :class:`BranchBook` keeps what the decision needs: how many steps were computed, the current run
of reused steps, the signal accumulated since the last computed step, and the fitted ratios that map that signal
to the relative change of the full residual. The tensor side (``hooks.py``) measures the numbers; this file
decides. The error model follows TeaCache/MagCache (accumulate a per-step estimate until a threshold): the drift
of the reused residual grows by ``ratio * signal`` each reused step, and the run's error is the sum of those
drifts (each reused step adds its own output error to the latents), each weighted by how much an error on that
step costs the finished clip (``weight``: more on the short early steps of a shifted schedule). The ratio comes
from a calibration by schedule position (MagCache's per-step ratios, measured by ``metainfer-gen calibrate``), or
is fitted online from the computed steps; never from polynomials fitted by hand per model (TeaCache).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from metainfer_gen.video.cache.config import StepCacheConfig

_TINY = 1e-12


class Reason(str, enum.Enum):
    """Why a step was computed or reused (stored in the stats as its value)."""

    WARMUP = "warm-up"
    NO_SIGNAL = "no previous step"
    CALIBRATING = "calibrating"
    LAST_STEP = "last step"
    REUSE_CAP = "reuse cap"
    OVER_BUDGET = "over budget"
    DISABLED = "disabled"
    WITHIN_BUDGET = "within budget"


@dataclass(slots=True)
class Decision:
    """Outcome for one step of one branch. ``predicted_error`` is the accumulated estimate if reused."""

    reuse: bool
    reason: Reason
    predicted_error: float | None = None
    extrapolate: bool = False


@dataclass(slots=True)
class BranchBook:
    """Decision state of one CFG branch of one transformer; ``reset()`` between generations."""

    num_computed: int = 0
    consecutive_reuses: int = 0
    signal_since_compute: float = 0.0
    drift_reuse: float = 0.0  # predicted relative change of the residual since the last computed step
    drift_extrapolation: float = 0.0  # the same for the first-order extrapolation's error
    error_since_compute: float = 0.0  # sum of the drifts of the reused steps of the current run
    reuse_ratio: float | None = None  # relative residual change per unit of signal, plain reuse (fitted online)
    extrapolation_ratio: float | None = None  # the same for the first-order extrapolation's error
    pending_signal: float = 0.0  # signal accumulated up to the step being computed, for the refit

    def reset(self) -> None:
        self.num_computed = self.consecutive_reuses = 0
        self._clear_run()
        self.reuse_ratio = self.extrapolation_ratio = None

    def _clear_run(self) -> None:
        self.signal_since_compute = self.drift_reuse = self.drift_extrapolation = self.error_since_compute = 0.0
        self.pending_signal = 0.0

    def decide(self, config: StepCacheConfig, step: int, num_steps: int | None, signal: float | None,
               can_extrapolate: bool, prior: tuple[float, float | None] | None = None,
               weight: float = 1.0) -> Decision:
        """Decide for ``step`` (0-based) of ``num_steps`` (None when unknown) given this step's ``signal``.

        Args:
            prior: (reuse ratio, extrapolation ratio or None) of a calibration at this step's position in the
                schedule; None uses the ratios fitted online.
            weight: how much an error made on this step counts against the budget (see
                ``StepCacheConfig.step_size_exponent``); 1 counts the predicted drift as it is.
        """
        if signal is None:
            return self._compute(Reason.NO_SIGNAL)
        signal_total = self.signal_since_compute + signal
        if self.num_computed < config.warmup_steps(num_steps):
            return self._compute(Reason.WARMUP, signal_total)
        if config.compute_last_step and num_steps is not None and step >= num_steps - 1:
            return self._compute(Reason.LAST_STEP, signal_total)
        reuse_ratio, extrapolation_ratio = prior if prior is not None else (self.reuse_ratio,
                                                                            self.extrapolation_ratio)
        if reuse_ratio is None:
            return self._compute(Reason.CALIBRATING, signal_total)
        if self.consecutive_reuses >= config.reuse_cap(num_steps):
            return self._compute(Reason.REUSE_CAP, signal_total)
        drift_reuse = self.drift_reuse + reuse_ratio * signal
        drift_extrapolation = (self.drift_extrapolation + extrapolation_ratio * signal
                               if extrapolation_ratio is not None else None)
        # A reused step always extrapolates when it can (TaylorSeer's first order, on the whole residual): on the
        # embedded model at 50 steps that kept 1.6-3.3 dB more than extrapolating only where the predicted
        # extrapolation drift was the smaller, at the same reused steps. The budget counts the smaller prediction.
        extrapolate = bool(config.extrapolate and can_extrapolate)
        cheaper = extrapolate and drift_extrapolation is not None and drift_extrapolation < drift_reuse
        predicted = self.error_since_compute + weight * (drift_extrapolation if cheaper else drift_reuse)
        if predicted > config.error_budget:
            return self._compute(Reason.OVER_BUDGET, signal_total, predicted)
        self.signal_since_compute = signal_total
        self.drift_reuse = drift_reuse
        self.drift_extrapolation = drift_extrapolation if drift_extrapolation is not None else drift_reuse
        self.error_since_compute = predicted
        self.consecutive_reuses += 1
        return Decision(True, Reason.WITHIN_BUDGET, predicted, extrapolate)

    def _compute(self, reason: Reason, signal_total: float = 0.0, predicted: float | None = None) -> Decision:
        self.pending_signal = signal_total
        return Decision(False, reason, predicted)

    def computed(self, config: StepCacheConfig, reuse_change: float | None,
                 extrapolation_change: float | None) -> None:
        """Record a computed step and refit the ratios.

        Args:
            reuse_change: measured relative change of the full residual since the last computed step (None on
                the first computed step or after a shape change).
            extrapolation_change: measured relative error the first-order extrapolation would have made here
                (None when fewer than two earlier computed steps exist).
        """
        signal = self.pending_signal
        if signal > _TINY:
            if reuse_change is not None:
                self.reuse_ratio = self._blend(self.reuse_ratio, reuse_change / signal, config)
            if extrapolation_change is not None:
                self.extrapolation_ratio = self._blend(self.extrapolation_ratio, extrapolation_change / signal,
                                                       config)
        self.num_computed += 1
        self.consecutive_reuses = 0
        self._clear_run()

    @staticmethod
    def _blend(old: float | None, new: float, config: StepCacheConfig) -> float:
        # A ratio that grows is trusted at once (safer); one that shrinks is blended, so one quiet step
        # does not open the gate wide.
        if old is None or new >= old:
            return new
        return config.calibration_momentum * old + (1 - config.calibration_momentum) * new
