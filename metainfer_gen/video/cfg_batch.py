"""CFG batching: the conditional and unconditional transformer passes of each step as one forward of twice the batch.

    pipe = pipelines.TextToVideoPipeline.from_pretrained()
    pipe.enable_cfg_batch()                 # on in every acceleration preset
    out = pipe("a red circle moving right", guidance_scale=4.0, seed=0)
    out.stats.extra["cfg_batch"]            # path, reason, steps batched

How. Diffusers' Wan pipelines call the transformer twice per step, ``cond`` then ``uncond``, on the same latents
and timestep, and read the first prediction only after the second call (the order CFG-parallel relies on too, see
:mod:`metainfer_gen.video.cfg_parallel`). A hook on each transformer, registered for one pipeline call (outside
any step cache), returns an empty tensor at the first call and keeps its arguments; at the second it runs one
forward on both calls' inputs joined along the batch (latents and timestep twice, the prompt and the negative
prompt's embeddings), fills the first call's tensor in place with the conditional half and returns the other. Older
pipelines batched their branches the same way (``torch.cat([latents] * 2)``); here the pipeline's loop is kept.

Why. A forward of the embedded model is mostly fixed per-op cost on the CPU (GEMMs of 320 x 128): two
branches in one batch took 47 ms against 54 ms for two calls (AMD EPYC Zen 4, AVX512-BF16, 2 threads). Batched
GEMM rows round differently, so the clip is equal to the unbatched one within GEMM rounding, not bit for bit.

Our step cache inside sees one call per step with both branches in its batch (the second call's cache context), so
both branches are computed or reused together. The public baseline caches (diffusers', cache-dit's) keep a state
per call of the pair, so a call with one of them runs its two calls as before (the record says why). Every pair is
checked: the two calls must share the latents' shape and the timestep, or the call raises instead of mixing steps;
arguments that differ in any other way than a tensor of the batch's leading size run the two calls one by one
(``num_unpaired``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook

from metainfer_gen.video.cache.blocks import HIDDEN_ARG
from metainfer_gen.video.cfg_parallel import PAIRED_CALL_PIPELINES
from metainfer_gen.video.cfg_parallel_hook import _sample, transformer_io, wrap_sample

__all__ = ["AUDIT_OP", "CFG_BATCH_HOOK", "CfgBatchHook", "CfgBatchRecord", "cfg_batch_hooks", "plan_cfg_batch"]

AUDIT_OP = "cfg_batch"
CFG_BATCH_HOOK = "metainfer_cfg_batch"
BATCHED, SEQUENTIAL, SINGLE_BRANCH = "batched", "sequential", "single_branch"


@dataclass(slots=True)
class CfgBatchRecord:
    """What one pipeline call did about CFG batching (``out.stats.extra["cfg_batch"]``, and the audit).

    Attributes:
        path: "batched", "sequential" (two calls per step) or "single_branch" (guidance off).
        reason: why this path. num_batched_steps: steps whose two calls ran as one forward.
        num_unpaired: steps whose calls differed beyond the batch and ran one by one.
    """

    path: str
    reason: str
    num_batched_steps: int = 0
    num_unpaired: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_cfg_batch(pipeline: Any, guidance_scale: float | None, context_parallel: bool = False,
                   baseline_cache: str | None = None) -> CfgBatchRecord:
    """Decide whether the coming call batches its CFG branches, and why (no device work).

    Args:
        pipeline: the diffusers pipeline about to be called. guidance_scale: the call's guidance weight (the Wan
            pipelines run the unconditional pass when it is > 1). context_parallel: the call splits its tokens over
            ranks (batching is not combined with it). baseline_cache: the name of a public baseline step cache on
            the transformer (diffusers' or cache-dit's), which keeps a state per call of the pair: not batched.
    """
    if guidance_scale is None or guidance_scale <= 1:
        return CfgBatchRecord(SINGLE_BRANCH, f"guidance_scale={guidance_scale} <= 1: one transformer pass per step")
    name = type(pipeline).__name__
    if name not in PAIRED_CALL_PIPELINES:
        return CfgBatchRecord(SEQUENTIAL, f"{name} is not known to call the transformer once per CFG branch "
                                          f"(supported: {', '.join(sorted(PAIRED_CALL_PIPELINES))})")
    if context_parallel:
        return CfgBatchRecord(SEQUENTIAL, "context parallelism is on: its hooks split one branch's tokens")
    if baseline_cache is not None:
        return CfgBatchRecord(SEQUENTIAL, f"the {baseline_cache} baseline cache keeps its state per call of the "
                                          "(cond, uncond) pair; ours decides batched branches together")
    return CfgBatchRecord(BATCHED, f"guidance_scale={guidance_scale} > 1: cond and uncond in one forward per step")


class CfgBatchHook(ModelHook):
    """On a transformer, for one pipeline call: runs each (cond, uncond) pair of calls as one forward.

    Shapes: ``hidden_states`` (B, C_in, F, H, W) in both calls; the forward runs on 2B rows and each call gets
    its (B, C_out, F, H, W) half, in the latents' dtype.

    Raises (from the forward):
        RuntimeError: the second call of a pair is at another timestep or latent shape than the first, or the
            model predicts another dtype than the latents' (the first call's tensor is filled in that dtype).
    """

    def __init__(self, record: CfgBatchRecord):
        super().__init__()
        self.record = record
        self.pending: tuple[tuple, dict, torch.Tensor] | None = None  # the first call's args, kwargs, tensor
        self.io = None
        self.return_dict_default = True

    def initialize_hook(self, module):
        self.io, self.return_dict_default = transformer_io(module)
        return module

    def new_forward(self, module, *args, **kwargs):
        hidden = self.io.argument(HIDDEN_ARG, args, kwargs)
        if self.pending is None:
            placeholder = hidden.new_empty(0)
            self.pending = (args, kwargs, placeholder)
            return wrap_sample(placeholder, self.io, self.return_dict_default, args, kwargs)
        first_args, first_kwargs, placeholder = self.pending
        self.pending = None
        self._check_pair(first_args, first_kwargs, hidden, args, kwargs)
        joined = _join((first_args, first_kwargs), (args, kwargs), hidden.shape[0])
        forward = self.fn_ref.original_forward
        if joined is None:
            self.record.num_unpaired += 1
            cond = _sample(forward(*first_args, **first_kwargs))
            output = forward(*args, **kwargs)
        else:
            both = _sample(forward(*joined[0], **joined[1]))
            cond, uncond = both[:hidden.shape[0]], both[hidden.shape[0]:]
            self.record.num_batched_steps += 1
            output = wrap_sample(uncond, self.io, self.return_dict_default, args, kwargs)
        if cond.dtype != placeholder.dtype:
            raise RuntimeError(f"the transformer predicts {cond.dtype} from {placeholder.dtype} latents; CFG batching "
                               "fills the first call's output in the latents' dtype (cast the model and latents alike)")
        placeholder.resize_(cond.shape).copy_(cond)  # the tensor the pipeline holds from the first call
        return output

    def _check_pair(self, first_args, first_kwargs, hidden, args, kwargs) -> None:
        first_hidden = self.io.argument(HIDDEN_ARG, first_args, first_kwargs)
        first_t, t = (self.io.argument("timestep", a, k) for a, k in ((first_args, first_kwargs), (args, kwargs)))
        same_step = t is first_t or (isinstance(t, torch.Tensor) and isinstance(first_t, torch.Tensor)
                                     and t.shape == first_t.shape and torch.equal(t, first_t))
        if not same_step or first_hidden.shape != hidden.shape:
            raise RuntimeError("CFG batching pairs the two transformer calls of a step, but this call's timestep or "
                               f"latent shape {tuple(hidden.shape)} differs from the first call's "
                               f"{tuple(first_hidden.shape)}: the pipeline does not call cond then uncond at one "
                               "timestep; disable_cfg_batch()")


def _join(first: tuple[tuple, dict], second: tuple[tuple, dict], batch: int):
    """(args, kwargs) of one forward over both calls: tensors of leading size ``batch`` concatenated along it,
    everything else equal in both and passed once; None when the calls differ otherwise."""
    (args_a, kwargs_a), (args_b, kwargs_b) = first, second
    if len(args_a) != len(args_b) or kwargs_a.keys() != kwargs_b.keys():
        return None
    args = tuple(_join_value(a, b, batch) for a, b in zip(args_a, args_b))
    kwargs = {key: _join_value(kwargs_a[key], kwargs_b[key], batch) for key in kwargs_a}
    if any(value is _DIFFERENT for value in (*args, *kwargs.values())):
        return None
    return args, kwargs


_DIFFERENT = object()


def _join_value(a: Any, b: Any, batch: int) -> Any:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.ndim == 0 or a.shape[0] != batch:
            return a if a is b else _DIFFERENT
        return torch.cat((a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _DIFFERENT
    try:
        return a if a is b or a == b else _DIFFERENT
    except Exception:  # a comparison that is not a plain bool (containers of tensors): not provably equal
        return _DIFFERENT


@contextmanager
def cfg_batch_hooks(transformers: list[torch.nn.Module], record: CfgBatchRecord,
                    site: str = "pipeline") -> Iterator[CfgBatchRecord]:
    """Around one pipeline call: audit the path (op ``cfg_batch``), attach the hooks when batching, detach after.

    Raises:
        RuntimeError: the call ended with a pair half done (an odd number of transformer calls in a step).
    """
    from metainfer_gen.kernels.audit_log import Refusal, record as audit_record

    batched = record.path == BATCHED
    audit_record(AUDIT_OP, site, record.path, () if batched else (Refusal(AUDIT_OP, record.reason),))
    if not batched:
        yield record
        return
    hooks = []
    try:
        for transformer in transformers:
            registry = HookRegistry.check_if_exists_or_initialize(transformer)
            if registry.get_hook(CFG_BATCH_HOOK) is not None:
                raise RuntimeError("CFG batching is already attached to this transformer (a call in progress)")
            hooks.append(CfgBatchHook(record))
            registry.register_hook(hooks[-1], CFG_BATCH_HOOK)
        yield record
        if any(hook.pending is not None for hook in hooks):
            raise RuntimeError("the pipeline made an odd number of transformer calls: CFG batching needs a cond and "
                               "an uncond call per step")
    finally:
        for transformer, _ in zip(transformers, hooks):
            transformer._diffusers_hook.remove_hook(CFG_BATCH_HOOK, recurse=False)
