"""The pairing hook of CFG-parallel denoising (see :mod:`metainfer_gen.video.cfg_parallel`): on each rank it
computes that rank's call of every (cond, uncond) pair and exchanges the predictions with one all-gather."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks.hooks import ModelHook
from diffusers.utils.torch_utils import unwrap_module

from metainfer_gen.video.cache.blocks import HIDDEN_ARG, BlockIO

CFG_PARALLEL_HOOK = "metainfer_cfg_parallel"


@dataclass(slots=True)
class _Pair:
    """The open pair of one transformer: what its first call left for the second."""

    handle: Any
    record: Any  # the call's cfg_parallel.CfgParallelRecord
    pending: torch.Tensor | None = None  # rank 0: its computed cond; rank 1: the empty tensor it returned
    timestep: Any = None
    shape: tuple[int, ...] | None = None


def _sample(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.sample if hasattr(output, "sample") else output[0]


def transformer_io(module) -> tuple[BlockIO, bool]:
    """(argument reader of ``module``'s forward, its ``return_dict`` default): for hooks that pair whole calls."""
    signature = inspect.signature(type(unwrap_module(module)).forward).parameters
    return_dict_default = True
    if "return_dict" in signature and signature["return_dict"].default is not inspect.Parameter.empty:
        return_dict_default = signature["return_dict"].default
    return BlockIO(tuple(signature)[1:], None, None), return_dict_default


def wrap_sample(sample: torch.Tensor, io: BlockIO, return_dict_default: bool, args: tuple, kwargs: dict):
    """``sample`` in the form the call asked for: a tuple with ``return_dict=False``, else diffusers' output."""
    return_dict = io.argument("return_dict", args, kwargs)
    if not (return_dict_default if return_dict is None else return_dict):
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


class CfgParallelHook(ModelHook):
    """On a transformer, for one pipeline call: computes this rank's call of each pair and exchanges predictions.

    Works on any transformer whose ``forward`` takes ``hidden_states`` and ``timestep`` and returns a tensor, a
    tuple (``return_dict=False``) or an output with ``.sample``. Shapes: ``hidden_states`` (B, C_in, F, H, W), the
    prediction (B, C_out, F, H, W) in the latents' dtype; C_out may differ from C_in (Wan 2.1 I2V reads 36
    channels and predicts 16). The exchange moves ``2 x B*C_out*F*H*W`` elements per step (one all-gather).

    Raises (from the forward):
        RuntimeError: the second call of a pair is at another timestep or latent shape than the first, or the
            prediction's dtype differs from the latents'. CollectiveTimeout: the peer rank did not reach the
            exchange within the collectives' timeout.
    """

    def __init__(self, pair: _Pair):
        super().__init__()
        self.pair = pair
        self.io: BlockIO | None = None
        self.return_dict_default = True

    def initialize_hook(self, module):
        self.io, self.return_dict_default = transformer_io(module)
        return module

    def new_forward(self, module, *args, **kwargs):
        pair = self.pair
        hidden = self.io.argument(HIDDEN_ARG, args, kwargs)
        timestep = self.io.argument("timestep", args, kwargs)
        first = pair.pending is None
        computes = (pair.handle.rank == 0) == first  # rank 0 computes the first call (cond), rank 1 the second
        if first:
            pair.timestep, pair.shape = timestep, tuple(hidden.shape)
        else:
            self._check_pair(hidden, timestep)
        output = self.fn_ref.original_forward(*args, **kwargs) if computes else None
        if not computes:
            pair.record.num_skipped_calls += 1
        if first:
            pair.pending = _sample(output) if computes else hidden.new_empty(0)
            return output if computes else self._wrap(pair.pending, args, kwargs)
        mine = _sample(output) if computes else pair.pending
        cond, uncond = self._exchange(mine)
        pending, pair.pending, pair.timestep = pair.pending, None, None
        if pair.handle.rank == 0:
            return self._wrap(uncond, args, kwargs)
        if pending.dtype != cond.dtype:
            raise RuntimeError(f"the transformer predicts {cond.dtype} from {pending.dtype} latents; CFG-parallel "
                               "fills the first call's output in the latents' dtype (cast the model and latents alike)")
        pending.resize_(cond.shape).copy_(cond)  # the tensor the pipeline holds from the first call
        return output

    def _check_pair(self, hidden: torch.Tensor, timestep) -> None:
        pair = self.pair
        same_step = timestep is pair.timestep or (
            isinstance(timestep, torch.Tensor) and isinstance(pair.timestep, torch.Tensor)
            and timestep.shape == pair.timestep.shape and torch.equal(timestep, pair.timestep))
        if not same_step or tuple(hidden.shape) != pair.shape:
            raise RuntimeError("CFG-parallel pairs the two transformer calls of a step, but this call's timestep or "
                               f"latent shape {tuple(hidden.shape)} differs from the first call's {pair.shape}: the "
                               "pipeline does not call cond then uncond at one timestep; disable_cfg_parallel()")

    def _exchange(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from metainfer_gen.collectives import all_gather

        mine = mine.contiguous()
        both = torch.empty((2, *mine.shape), dtype=mine.dtype, device=mine.device)
        start = time.perf_counter()
        all_gather(both, mine, group=self.pair.handle, site="CfgParallelHook.exchange")
        record = self.pair.record
        record.exchange_seconds += time.perf_counter() - start
        record.num_exchanges += 1
        return both[0], both[1]

    def _wrap(self, sample: torch.Tensor, args: tuple, kwargs: dict):
        return wrap_sample(sample, self.io, self.return_dict_default, args, kwargs)
