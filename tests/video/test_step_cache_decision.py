"""The step-cache bookkeeping on its own: config validation, the reuse decision, calibration, stats, policy specs."""

from __future__ import annotations

import pytest

from metainfer_gen.video.cache.config import PRESETS, StepCacheConfig
from metainfer_gen.video.cache.decision import BranchBook, Reason
from metainfer_gen.video.cache.policies import make_policy, parse_spec, policy_names
from metainfer_gen.video.cache.stats import StepCacheStats, StepRecord


@pytest.mark.parametrize("bad, field", [
    (dict(error_budget=0), "error_budget"), (dict(error_budget=-1.0), "error_budget"),
    (dict(error_budget=float("nan")), "error_budget"), (dict(error_budget=True), "error_budget"),
    (dict(num_warmup_steps=0), "num_warmup_steps"), (dict(num_warmup_steps=1.5), "num_warmup_steps"),
    (dict(max_consecutive_reuses=0), "max_consecutive_reuses"), (dict(cap_reference_steps=0), "cap_reference_steps"),
    (dict(extrapolate="yes"), "extrapolate"),
    (dict(calibration_momentum=1.0), "calibration_momentum"), (dict(warmup_fraction=1.0), "warmup_fraction"),
    (dict(warmup_fraction=-0.1), "warmup_fraction"), (dict(gate_aware=1), "gate_aware"),
    (dict(step_size_exponent=-1.0), "step_size_exponent"),
    (dict(step_size_exponent=float("inf")), "step_size_exponent"),
])
def test_bad_config_raises_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        StepCacheConfig(**bad)


def test_presets_order_budget_from_quality_to_fast_and_auto_is_balanced():
    budgets = [StepCacheConfig.preset(name).error_budget for name in ("quality", "balanced", "fast")]
    assert budgets == sorted(budgets) and len(set(budgets)) == 3
    assert StepCacheConfig.preset("auto") == StepCacheConfig.preset("balanced")
    assert StepCacheConfig.preset("fast", num_warmup_steps=4).num_warmup_steps == 4
    with pytest.raises(ValueError, match="preset"):
        StepCacheConfig.preset("turbo")


def _run(book: BranchBook, config: StepCacheConfig, signals, num_steps, changes=None):
    """Drive the book like the hooks do; ``changes[i]`` is the measured residual change on computed step i."""
    decisions = []
    for step, signal in enumerate(signals):
        decision = book.decide(config, step, num_steps, signal, can_extrapolate=False)
        decisions.append(decision)
        if not decision.reuse:
            change = None if step == 0 else (changes or {}).get(step, 0.01)
            book.computed(config, change, None)
    return decisions


def test_warmup_last_step_and_cap_are_always_computed():
    config = StepCacheConfig(error_budget=1e6, num_warmup_steps=2, max_consecutive_reuses=2, extrapolate=False,
                             cap_reference_steps=None)  # a fixed cap (the scaled one: test_reuse_cap_scales...)
    decisions = _run(BranchBook(), config, [None] + [0.01] * 9, num_steps=10)
    reasons = [d.reason for d in decisions]
    assert reasons[:2] == [Reason.NO_SIGNAL, Reason.WARMUP]
    assert reasons[-1] == Reason.LAST_STEP
    reused = [d.reuse for d in decisions]
    assert reused == [False, False, True, True, False, True, True, False, True, False]
    assert Reason.REUSE_CAP in reasons


def test_budget_stops_reuse_and_error_accumulates():
    config = StepCacheConfig(error_budget=0.05, num_warmup_steps=2, max_consecutive_reuses=10, extrapolate=False)
    book = BranchBook()
    # signal 0.01 per step and a measured change of 0.01 on step 1: ratio 1.0
    decisions = _run(book, config, [None, 0.01, 0.01, 0.01, 0.01], num_steps=None, changes={1: 0.01})
    assert book.reuse_ratio is not None
    assert [d.reuse for d in decisions] == [False, False, True, True, False]
    # reused step 2: 1.0 * 0.01; step 3: 0.01 + 1.0 * 0.02 = 0.03; step 4 would be 0.03 + 0.03 > 0.05
    assert decisions[2].predicted_error == pytest.approx(0.01)
    assert decisions[3].predicted_error == pytest.approx(0.03)
    assert decisions[4].reason == Reason.OVER_BUDGET


@pytest.mark.parametrize("prior, expected_drift", [((1.0, 3.0), 0.01), ((1.0, 0.5), 0.005), ((1.0, None), 0.01)])
def test_reused_steps_extrapolate_whenever_they_can_and_the_budget_counts_the_smaller_drift(prior, expected_drift):
    config = StepCacheConfig(error_budget=1.0, num_warmup_steps=2, max_consecutive_reuses=10)
    book = BranchBook()
    for step, signal in enumerate([None, 0.01]):
        assert not book.decide(config, step, 10, signal, can_extrapolate=False, prior=prior).reuse
        book.computed(config, None if step == 0 else 0.01, None)
    decision = book.decide(config, 2, 10, 0.01, can_extrapolate=True, prior=prior)
    assert decision.reuse and decision.extrapolate  # even where extrapolation is predicted to drift more
    assert decision.predicted_error == pytest.approx(expected_drift)
    assert not book.decide(StepCacheConfig(error_budget=1.0, extrapolate=False), 3, 10, 0.01, can_extrapolate=True,
                           prior=prior).extrapolate
    one_residual = BranchBook(num_computed=2, reuse_ratio=1.0)
    assert not one_residual.decide(config, 2, 10, 0.01, can_extrapolate=False).extrapolate


def test_calibration_trusts_a_larger_ratio_at_once_and_blends_a_smaller_one():
    config = StepCacheConfig(calibration_momentum=0.5)
    book = BranchBook()
    book.pending_signal = 0.1
    book.computed(config, 0.2, None)
    assert book.reuse_ratio == pytest.approx(2.0)
    book.pending_signal = 0.1
    book.computed(config, 0.1, None)
    assert book.reuse_ratio == pytest.approx(1.5)
    book.pending_signal = 0.1
    book.computed(config, 0.5, None)
    assert book.reuse_ratio == pytest.approx(5.0)
    book.reset()
    assert book.reuse_ratio is None and book.num_computed == 0


def test_warmup_grows_with_the_schedule_but_not_below_the_minimum():
    config = StepCacheConfig(num_warmup_steps=2, warmup_fraction=0.08)
    assert [config.warmup_steps(n) for n in (None, 1, 7, 20, 30, 50, 100)] == [2, 2, 2, 2, 2, 4, 8]
    book = BranchBook()
    reasons = []
    for step in range(6):
        decision = book.decide(config, step, 50, 0.01, can_extrapolate=False)
        reasons.append(decision.reason)
        if not decision.reuse:
            book.computed(config, 0.01, None)
    assert reasons[:4] == [Reason.WARMUP] * 4 and Reason.WARMUP not in reasons[4:]


def test_too_few_steps_threshold():
    assert StepCacheConfig(num_warmup_steps=2).min_steps_for_reuse() == 4
    assert StepCacheConfig(num_warmup_steps=2, compute_last_step=False).min_steps_for_reuse() == 3


def test_stats_count_per_branch():
    stats = StepCacheStats(policy="auto", num_inference_steps=2, steps=[
        StepRecord(0, "cond", "transformer", True, "warm-up", None, None, 0.1),
        StepRecord(1, "cond", "transformer", False, "within budget", 0.01, 0.02, 0.1),
        StepRecord(1, "uncond", "transformer", True, "over budget", 0.5, 0.3, 0.1),
    ])
    data = stats.to_dict()
    assert data["num_computed"] == 2 and data["num_reused"] == 1
    assert data["per_branch"] == {"cond": {"computed": 1, "reused": 1}, "uncond": {"computed": 1, "reused": 0}}
    assert data["steps"][1]["signal"] == 0.01


def test_policy_specs_parse_and_bad_ones_raise():
    assert parse_spec("FBCache=0.1") == ("fbcache", 0.1)
    assert parse_spec("auto") == ("auto", None)
    assert set(policy_names()) >= {"off", "auto", *PRESETS, "fbcache", "magcache", "taylorseer", "dbcache"}
    assert make_policy("off") is None
    assert make_policy("fast=0.3").config.error_budget == 0.3
    assert make_policy(StepCacheConfig(error_budget=0.2)).config.error_budget == 0.2
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_policy("teacache")
    with pytest.raises(ValueError, match="number"):
        make_policy("fbcache=high")
    with pytest.raises(ValueError, match="error_budget"):
        make_policy("auto=-1")
    for spec in ("fbcache=-0.1", "magcache=0", "dbcache=-1", "fbcache=inf"):
        with pytest.raises(ValueError, match=r"threshold must be a finite number > 0 \(e.g. "):
            make_policy(spec)
    for spec in ("taylorseer=0", "taylorseer=2.5"):  # 0 divided by zero deep inside diffusers before
        with pytest.raises(ValueError, match="interval must be a whole number of steps >= 1"):
            make_policy(spec)
    assert make_policy("taylorseer=3").name == "taylorseer=3"
    with pytest.raises(TypeError):
        make_policy(3)


def test_signal_on_broadcast_views_equals_the_signal_on_their_copies():
    import torch

    from metainfer_gen.video.cache.state import _one_of_each_repeat, signal_between

    torch.manual_seed(0)
    rows = torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)  # per-token temb of one timestep: rows repeated
    new, old = (r.expand(2, 40, 6, 8) for r in rows)
    hidden_new, hidden_old = torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    expected = signal_between((hidden_new, new.contiguous()), (hidden_old, old.contiguous()))
    got = signal_between((hidden_new, new), (hidden_old, old))
    assert got == pytest.approx(expected, rel=1e-6)
    assert _one_of_each_repeat(new, old)[0].shape == (2, 1, 6, 8)  # one row read, not 40
    # a view on one side only is read in full (its repeats are not known to match the other's)
    assert _one_of_each_repeat(new, old.contiguous())[0].shape == (2, 40, 6, 8)
    assert signal_between((new,), (old.contiguous(),)) == pytest.approx(expected - signal_between(
        (hidden_new,), (hidden_old,)), rel=1e-6)


def test_a_weighted_step_spends_the_budget_faster():
    config = StepCacheConfig(error_budget=1.0, num_warmup_steps=1, warmup_fraction=0.0, max_consecutive_reuses=10)
    outcomes = {}
    for weight in (1.0, 3.0):
        book = BranchBook()
        book.decide(config, 0, 20, 0.5, can_extrapolate=False)
        book.computed(config, None, None)
        decisions = [book.decide(config, step, 20, 0.5, can_extrapolate=False, prior=(0.4, None), weight=weight)
                     for step in range(1, 4)]
        outcomes[weight] = [(d.reuse, None if d.predicted_error is None else round(d.predicted_error, 6))
                            for d in decisions]
    # drifts 0.2, 0.4, 0.6: the run's error 0.2, 0.6, 1.2 (over) at weight 1; 0.6, 1.8 (over) at weight 3
    assert outcomes[1.0] == [(True, 0.2), (True, 0.6), (False, 1.2)]
    assert outcomes[3.0][:2] == [(True, 0.6), (False, 1.8)]  # (then computed; the third is a new run)


def test_step_weight_follows_the_timestep_spacing():
    from metainfer_gen.video.cache.state import CallTracker

    tracker = CallTracker(num_inference_steps=4)
    weights = []
    for timestep in (1000.0, 950.0, 800.0, 400.0):  # steps of 50, 150, 400; mean step 1000 / 4 = 250
        tracker.advance("cond", timestep)
        weights.append(tracker.step_weight(1.0))
    assert weights == [1.0, pytest.approx(5.0), pytest.approx(250 / 150), pytest.approx(0.625)]
    assert tracker.step_weight(0.0) == 1.0
    assert tracker.step_weight(2.0) == pytest.approx(0.625 ** 2)
    tracker.finish_call()
    tracker.num_inference_steps = 4
    for position in (1.0, 2.0):  # no timestep given: the hooks number steps upward, and nothing is weighted
        tracker.advance(None, position)
    assert tracker.step_weight(1.0) == 1.0


def test_reuse_cap_scales_with_the_schedule_so_a_run_of_reuses_spans_the_same_share():
    fast = StepCacheConfig.preset("fast")  # 6 in a row at 50 steps
    assert [fast.reuse_cap(n) for n in (None, 4, 20, 30, 50, 100)] == [6, 1, 3, 4, 6, 12]
    assert StepCacheConfig.preset("fast", cap_reference_steps=None).reuse_cap(20) == 6
    config = StepCacheConfig(error_budget=1e6, num_warmup_steps=2, max_consecutive_reuses=4, extrapolate=False)
    reused = [d.reuse for d in _run(BranchBook(), config, [None] + [0.01] * 19, num_steps=20)]
    longest = max(len(run) for run in "".join("r" if r else "." for r in reused).split("."))
    assert longest == 2  # ceil(4 * 20 / 50)
