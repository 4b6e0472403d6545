"""Public entry points: ``apply_step_cache``, ``remove_step_cache``, and the per-call begin/end our pipelines use."""

from __future__ import annotations

import torch
from diffusers.hooks.hooks import HookRegistry

from metainfer_gen.video.cache.blocks import find_blocks
from metainfer_gen.video.cache.gated import GatedBlocks
from metainfer_gen.video.cache.config import StepCacheConfig
from metainfer_gen.video.cache.hooks import (
    BLOCK_HOOK, HEAD_HOOK, HOOK_NAMES, ROOT_HOOK, StepCacheBlockHook, StepCacheHeadHook, StepCacheRootHook, _root_hook,
    _Run,
)
from metainfer_gen.video.cache.state import CallTracker
from metainfer_gen.video.cache.stats import StepCacheStats


def apply_step_cache(transformer: torch.nn.Module, config: StepCacheConfig | None = None, *,
                     tracker: CallTracker | None = None, model_name: str = "transformer") -> CallTracker:
    """Attach the state-driven step cache to a diffusers video transformer (Wan, HunyuanVideo, CogVideoX, LTX...).

    Works inside any pipeline: with ``cache_context("cond"/"uncond"/"cond_uncond")`` each context keeps its own
    state; without one, the calls at one timestep are numbered ``branch0``, ``branch1``... State is reset when
    the pipeline resets its stateful hooks (diffusers pipelines do at the end of every call) and whenever input
    shapes change. Memory: per branch, up to three residual-sized tensors (two with ``extrapolate=False``).

    Args:
        transformer: a model whose blocks sit in ``ModuleList`` children (see ``blocks.BLOCK_LIST_NAMES``).
        config: a :class:`StepCacheConfig`; default the "balanced" preset.
        tracker: share one :class:`CallTracker` between the transformers of one pipeline (Wan 2.2's experts),
            so steps are numbered across both; default a new one.
        model_name: how the stats name this transformer.
    Returns:
        The tracker (pass it on to a second expert; read ``tracker.last`` for the last call's stats).
    Raises:
        ValueError: the step cache or a diffusers cache is already enabled; fewer than two blocks; no blocks.
        TypeError: ``config`` is not a :class:`StepCacheConfig`.
    Example::

        tracker = apply_step_cache(pipe.transformer, StepCacheConfig.preset("fast"))
        pipe("a red circle moving right", num_inference_steps=50)
        print(tracker.last.num_reused)
        remove_step_cache(pipe.transformer)
    """
    config = StepCacheConfig() if config is None else config
    if not isinstance(config, StepCacheConfig):
        raise TypeError(f"config must be a StepCacheConfig; got {type(config).__name__}")
    if _root_hook(transformer) is not None:
        raise ValueError("the step cache is already enabled on this transformer; call remove_step_cache first")
    if getattr(transformer, "is_cache_enabled", False):
        raise ValueError("a diffusers cache is enabled on this transformer (enable_cache); disable_cache() first: "
                         "caches run one at a time")
    blocks = find_blocks(transformer)
    if len(blocks) < 2:
        raise ValueError(f"{type(transformer).__name__} has {len(blocks)} block; the step cache needs at least 2")
    tracker = tracker if tracker is not None else CallTracker()
    run = _Run(config=config, tracker=tracker, model=model_name)
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(StepCacheRootHook(run), ROOT_HOOK)
    HookRegistry.check_if_exists_or_initialize(blocks[0][1]).register_hook(StepCacheHeadHook(run), HEAD_HOOK)
    for index, (_, block) in enumerate(blocks[1:], start=1):
        hook = StepCacheBlockHook(run, is_tail=index == len(blocks) - 1)
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, BLOCK_HOOK)
    if config.gate_aware:  # capture hooks only where they are used
        run.gated = GatedBlocks.of([block for _, block in blocks])
    # Contexts set later must reach the new hooks (diffusers caches the list of child registries).
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
    return tracker


def remove_step_cache(transformer: torch.nn.Module) -> None:
    """Remove every step-cache hook; the transformer then computes exactly as before ``apply_step_cache``.

    Raises:
        ValueError: the step cache is not enabled on ``transformer``.
    """
    if _root_hook(transformer) is None:
        raise ValueError("the step cache is not enabled on this transformer")
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    for name in HOOK_NAMES:
        registry.remove_hook(name, recurse=True)
    registry.invalidate_child_registries_cache()


def is_step_cache_enabled(transformer: torch.nn.Module) -> bool:
    """True when ``apply_step_cache`` hooks are on ``transformer``."""
    return _root_hook(transformer) is not None


def begin_step_cache_call(transformer: torch.nn.Module, num_inference_steps: int, plan_key=None,
                          info_source=None) -> None:
    """Tell the cache the step count of the coming call; a different plan (steps, scheduler) resets all state.

    Args:
        info_source: a callable returning the call's :class:`~metainfer_gen.video.cache.state.CallInfo` (Wan
            2.2's expert spans, guidance on or off), read on its first step
            (:func:`~metainfer_gen.video.cache.policy.call_info`); None: one transformer over the whole schedule,
            guided.
    """
    hook = _root_hook(transformer)
    if hook is None:
        return
    if plan_key != hook.plan_key:
        hook.reset_state(transformer)
        hook.plan_key = plan_key
    hook.run.tracker.num_inference_steps = num_inference_steps
    hook.run.tracker.info_source = info_source


def set_step_cache_reduction(transformer: torch.nn.Module, reduce) -> None:
    """Under context parallelism: ``reduce(tensor)`` sums, in place, the cache's signal terms over the ranks that
    share the clip's tokens, so every rank decides from the whole clip and all take the same decisions; None
    (after the call) measures this rank alone again. No-op without the step cache."""
    hook = _root_hook(transformer)
    if hook is not None:
        hook.run.reduce = reduce


def end_step_cache_call(transformer: torch.nn.Module) -> StepCacheStats | None:
    """Reset the cache state (if the pipeline did not) and return the stats of the call that just ended."""
    hook = _root_hook(transformer)
    if hook is None:
        return None
    hook.reset_state(transformer)
    return hook.run.tracker.last


def get_step_cache_stats(transformer: torch.nn.Module) -> StepCacheStats | None:
    """Stats of the last finished call on ``transformer`` (None before any, or when the cache is off)."""
    hook = _root_hook(transformer)
    return None if hook is None else hook.run.tracker.last
