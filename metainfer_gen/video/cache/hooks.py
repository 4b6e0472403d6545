"""The step-cache hooks on a diffusers transformer, and ``apply_step_cache`` / ``remove_step_cache``.

Follows diffusers' ``hooks/first_block_cache.py``: a root hook on the transformer numbers the call (step and CFG
branch) and selects the branch's state; the head hook measures the signal on the first block's inputs (or runs
the block and measures its residual) and decides; the other blocks either run or pass their inputs through, and
the tail block stores the new residual. Hooks are
``diffusers.hooks.ModelHook`` objects in each module's ``HookRegistry``, removable by their constant names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from diffusers.hooks.hooks import CacheContext, HookRegistry, ModelHook, StateManager
from diffusers.utils.torch_utils import unwrap_module

from metainfer_gen.video.cache.blocks import ENCODER_ARG, HIDDEN_ARG, BlockIO
from metainfer_gen.video.cache.config import StepCacheConfig
from metainfer_gen.video.cache.decision import Decision, Reason
from metainfer_gen.video.cache.gated import CAPTURE_HOOK, GatedBlocks
from metainfer_gen.video.cache.state import BranchState, CallTracker, signal_between
from metainfer_gen.video.cache.stats import StepRecord

ROOT_HOOK = "metainfer_step_cache_root"
HEAD_HOOK = "metainfer_step_cache_head"
BLOCK_HOOK = "metainfer_step_cache_block"
HOOK_NAMES = (ROOT_HOOK, HEAD_HOOK, BLOCK_HOOK, CAPTURE_HOOK)


@dataclass(slots=True)
class _Run:
    """What the hooks of one transformer share during one forward call."""

    config: StepCacheConfig
    tracker: CallTracker
    model: str
    state: BranchState | None = None
    step: int = 0
    branch: str = ""
    position: float = 0.0  # the step index, the coordinate residuals are extrapolated in
    reuse: bool = False
    disabled_reason: str | None = None
    record: StepRecord | None = None
    gated: GatedBlocks | None = None  # Wan-style blocks with gate_aware on: residuals from module outputs and gates
    temb: torch.Tensor | None = None  # the blocks' temb argument on this step
    span_start: int = 0  # first step of this transformer's span in the call (Wan 2.2's low-noise expert: > 0)
    span_steps: int | None = None  # steps in that span (None: unknown)
    reduce: Callable[[torch.Tensor], None] | None = None  # sums the signal terms over context-parallel ranks

    @property
    def skip_blocks(self) -> int:
        """Blocks before the cached residual: the first runs every step with ``signal="first_block"``."""
        return 0 if self.config.signal == "input" else 1

    def start_capture(self) -> None:
        if self.gated is not None:
            self.gated.start_capture()

    def assembler(self, dtype: torch.dtype):
        """module-output summary -> residual at this step's gates, or None (no gated blocks, or no temb)."""
        gated, temb = self.gated, self.temb
        if gated is None or temb is None:
            return None
        return lambda summary: gated.residual(temb, summary, dtype)

    def decide(self, sources: tuple[torch.Tensor, ...]) -> Decision:
        """Measure the signal on ``sources`` against the previous step's, decide, and record the step."""
        # Warm-up, reuse cap and last step count within this transformer's span: Wan 2.2's experts are two models
        # with their own residuals, each starting cold at its own first step (as the calibration's curves are per
        # model, at the global schedule position).
        state, steps, local = self.state, self.span_steps, self.step - self.span_start
        signal = signal_between(sources, state.signal_sources, self.reduce)
        state.signal_sources = sources
        if self.disabled_reason:
            decision = Decision(False, Reason.DISABLED)
        else:
            calibration = self.config.calibration
            prior = None
            total = self.tracker.num_inference_steps
            if calibration is not None and total is not None and total > 1:
                prior = calibration.ratios_at(self.model, self.step / (total - 1))
            decision = state.book.decide(self.config, local, steps, signal,
                                         can_extrapolate=len(state.history) == 2, prior=prior,
                                         weight=self.tracker.step_weight(self.config.step_size_exponent))
            if decision.reuse and not state.history:
                decision = Decision(False, Reason.NO_SIGNAL)
        self.reuse = decision.reuse
        self.record = StepRecord(self.step, self.branch, self.model, not decision.reuse, decision.reason.value,
                                 signal, decision.predicted_error, self.config.error_budget, decision.extrapolate,
                                 model_step=local)
        self.tracker.current.steps.append(self.record)
        return decision


def _position(timestep, fallback: float) -> float:
    if isinstance(timestep, torch.Tensor):
        return float(timestep.detach().float().max())
    return float(timestep) if isinstance(timestep, (int, float)) else fallback


class StepCacheRootHook(ModelHook):
    """On the transformer: numbers the call, picks the branch state (per cache context, or per call order when
    the pipeline opens none), resets it on a shape change, and closes the call's stats on ``reset_state``."""

    _is_stateful = True

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run
        self.state_manager = StateManager(BranchState)
        self.io: BlockIO | None = None
        self.plan_key = None  # (steps, scheduler) of the previous call: a change resets every branch state

    def initialize_hook(self, module):
        self.io = BlockIO(tuple(inspect.signature(type(unwrap_module(module)).forward).parameters)[1:], None, None)
        return module

    def new_forward(self, module, *args, **kwargs):
        run, tracker = self.run, self.run.tracker
        try:
            context = self.state_manager.context
        except ValueError:  # the pipeline opened no cache context (e.g. a custom loop): number branches by order
            context = None
        if context is not None and context.num_inference_steps and tracker.num_inference_steps is None:
            tracker.num_inference_steps = int(context.num_inference_steps)
        hidden = self.io.argument(HIDDEN_ARG, args, kwargs)
        encoder = self.io.argument(ENCODER_ARG, args, kwargs)
        position = _position(self.io.argument("timestep", args, kwargs), float(tracker.step + 1))
        step, branch = tracker.advance(context.name if context is not None else None, position)
        if context is None:
            self.state_manager.set_context(CacheContext(branch))
        try:
            state = self.state_manager.get_state()
            state.check_shapes(tuple((tuple(t.shape), t.dtype, t.device) for t in (hidden, encoder)
                                     if isinstance(t, torch.Tensor)))
            # Residuals are extrapolated over the step index, not the timestep: schedulers space their steps
            # evenly in their own coordinate (the unshifted sigma of flow matching), and on the embedded model at
            # 50 steps the step index kept 0.0-1.7 dB more than the (shifted) timestep at the same reused steps.
            run.state, run.step, run.branch, run.position, run.reuse = state, step, branch, float(step), False
            run.span_start, run.span_steps = tracker.span(run.model)
            run.disabled_reason = self._disabled_reason()
            return self.fn_ref.original_forward(*args, **kwargs)
        finally:
            run.state = run.temb = None
            if run.gated is not None:
                run.gated.outputs = None
            if context is None:
                self.state_manager.set_context(None)

    def _disabled_reason(self) -> str | None:
        reason = self.run.config.reuse_off_reason(self.run.tracker.num_inference_steps, self.run.tracker.guided)
        if reason is not None:
            self.run.tracker.current.disabled_reason = reason
        return reason

    def reset_state(self, module):
        self.state_manager.reset()
        self.run.tracker.finish_call()
        return module


class _BlockHook(ModelHook):
    """Shared part of the block hooks: the run they report to and the block's input/output contract."""

    def __init__(self, run: _Run, is_tail: bool = False):
        super().__init__()
        self.run = run
        self.is_tail = is_tail
        self.io: BlockIO | None = None

    def initialize_hook(self, module):
        self.io = BlockIO.of(unwrap_module(module))
        return module


class StepCacheHeadHook(_BlockHook):
    """On the first block: decides. ``signal="input"``: from the block's inputs (image tokens and ``temb``), and a
    reused step runs no block at all; ``"first_block"``: runs the block and decides from its residual. On a reused
    step it adds the cached residual to the reference (the input, or the first block's output)."""

    def new_forward(self, module, *args, **kwargs):
        run = self.run
        if run.state is None:  # a block called outside the hooked transformer forward
            return self.fn_ref.original_forward(*args, **kwargs)
        hidden_in, encoder_in = self.io.inputs(args, kwargs)
        temb = self.io.argument("temb", args, kwargs)
        run.temb = temb if isinstance(temb, torch.Tensor) else None
        if run.config.signal == "input":
            decision = run.decide((hidden_in, temb) if run.temb is not None else (hidden_in,))
            if not decision.reuse:
                run.state.head_reference = (hidden_in, encoder_in)
                run.start_capture()
                return self.fn_ref.original_forward(*args, **kwargs)
            return self._reuse(decision, hidden_in, encoder_in, like=None)
        run.start_capture()
        output = self.fn_ref.original_forward(*args, **kwargs)
        hidden_out, encoder_out = self.io.outputs(output)
        decision = run.decide((hidden_out - hidden_in,))
        if not decision.reuse:
            run.state.head_reference = (hidden_out, encoder_out)
            return output
        if run.gated is not None:
            run.gated.outputs = None
        return self._reuse(decision, hidden_out, encoder_out, like=output)

    def _reuse(self, decision: Decision, hidden, encoder, like):
        residual, encoder_residual = self.run.state.estimate(self.run.position, decision.extrapolate,
                                                             self.run.assembler(hidden.dtype))
        if encoder is not None and encoder_residual is not None:
            encoder = encoder + encoder_residual
        return self.io.pack(hidden + residual, encoder, like=like)


class StepCacheBlockHook(_BlockHook):
    """On every later block: passes inputs through on reused steps; the tail stores the computed residual."""

    def new_forward(self, module, *args, **kwargs):
        run = self.run
        if run.state is not None and run.reuse:
            return self.io.pack(*self.io.inputs(args, kwargs))
        output = self.fn_ref.original_forward(*args, **kwargs)
        if self.is_tail and run.state is not None and run.state.head_reference is not None \
                and not run.disabled_reason:
            self._store(output)
        return output

    def _store(self, output) -> None:
        run = self.run
        (head, head_encoder), (hidden, encoder) = run.state.head_reference, self.io.outputs(output)
        run.state.head_reference = None
        if hidden.shape != head.shape:
            run.disabled_reason = f"the last block's output {tuple(hidden.shape)} differs from the first's"
            return
        same = encoder is not None and head_encoder is not None and encoder.shape == head_encoder.shape
        summary = run.gated.take_capture(run.skip_blocks) if run.gated is not None else None
        changes = run.state.store(run.position, (hidden - head, encoder - head_encoder if same else None), summary,
                                  run.assembler(hidden.dtype), reduce=run.reduce)
        run.state.book.computed(run.config, *changes)
        if run.record is not None:
            run.record.change, run.record.extrapolation_error = changes


def _root_hook(transformer: torch.nn.Module) -> StepCacheRootHook | None:
    registry = getattr(transformer, "_diffusers_hook", None)
    return None if registry is None else registry.get_hook(ROOT_HOOK)
