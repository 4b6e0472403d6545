"""Find a diffusers transformer's blocks generically and describe each block family's input/output contract.

Blocks are the ``torch.nn.ModuleList`` children whose name is one of :data:`BLOCK_LIST_NAMES`, in definition
order (HunyuanVideo: ``transformer_blocks`` then ``single_transformer_blocks``), as diffusers' FirstBlockCache
finds them. Which output holds the image tokens and which the text tokens comes from diffusers'
``TransformerBlockRegistry`` when the block class is registered (Wan, HunyuanVideo, CogVideoX, LTX-Video...),
else from the usual layout: a tensor, or a ``(hidden_states, encoder_hidden_states)`` tuple.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

# Names of block lists, shared by the step cache, the TaylorSeer baseline and the block counter.
BLOCK_LIST_NAMES = ("blocks", "transformer_blocks", "single_transformer_blocks", "layers",
                    "temporal_transformer_blocks", "visual_transformer_blocks")
HIDDEN_ARG = "hidden_states"
ENCODER_ARG = "encoder_hidden_states"


def find_blocks(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``[(qualified name, block), ...]`` in execution order.

    Raises:
        ValueError: the model has no block list (not a diffusers-style transformer).
    """
    blocks = [(f"{name}.{index}", block)
              for name, child in transformer.named_children()
              if name in BLOCK_LIST_NAMES and isinstance(child, torch.nn.ModuleList)
              for index, block in enumerate(child)]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no ModuleList named one of {BLOCK_LIST_NAMES}: "
                         "the step cache needs a diffusers-style transformer")
    return blocks


@dataclass(frozen=True, slots=True)
class BlockIO:
    """Input/output contract of one block class.

    Attributes:
        parameters: names of ``forward``'s parameters after ``self`` (to read positional arguments).
        hidden_index: index of the image-token output in a tuple output; None when the output is one tensor.
        encoder_index: index of the text-token output in a tuple output; None when the block returns none.
    """

    parameters: tuple[str, ...]
    hidden_index: int | None
    encoder_index: int | None

    @classmethod
    def of(cls, block: torch.nn.Module) -> "BlockIO":
        parameters = tuple(inspect.signature(type(block).forward).parameters)[1:]
        try:
            from diffusers.hooks._helpers import TransformerBlockRegistry

            meta = TransformerBlockRegistry.get(type(block))
            return cls(parameters, meta.return_hidden_states_index, meta.return_encoder_hidden_states_index)
        except (ImportError, ValueError):
            return cls(parameters, 0, 1 if ENCODER_ARG in parameters else None)

    def argument(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The value passed for parameter ``name`` (None when absent)."""
        if name in kwargs:
            return kwargs[name]
        index = self.parameters.index(name) if name in self.parameters else len(args)
        return args[index] if index < len(args) else None

    def inputs(self, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, encoder_hidden_states or None) passed to the block."""
        encoder = self.argument(ENCODER_ARG, args, kwargs) if self.encoder_index is not None else None
        return self.argument(HIDDEN_ARG, args, kwargs), encoder

    def outputs(self, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, encoder_hidden_states or None) returned by the block."""
        if isinstance(output, torch.Tensor):
            return output, None
        encoder = output[self.encoder_index] if self.encoder_index is not None else None
        return output[self.hidden_index or 0], encoder

    def pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None, like: Any = None) -> Any:
        """Build an output with the block's layout from its parts (``like``: a real output, for its length)."""
        if isinstance(like, torch.Tensor) or (like is None and self.encoder_index is None):
            return hidden
        size = len(like) if like is not None else max(self.hidden_index or 0, self.encoder_index) + 1
        parts: list[Any] = list(like) if like is not None else [None] * size
        parts[self.hidden_index or 0] = hidden
        if self.encoder_index is not None:
            parts[self.encoder_index] = encoder
        return tuple(parts)


def first_linear(block: torch.nn.Module) -> torch.nn.Module | None:
    """The first ``nn.Linear`` inside the block's first attention module (else the block's first Linear).

    Its forward calls count block evaluations: hooks on the block or its attention still fire when a cache
    returns early, but a Linear inside only runs when the block really computes.
    """
    linears = [(name, m) for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, module in linears:
        if "attn" in name:
            return module
    return linears[0][1] if linears else None
