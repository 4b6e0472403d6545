"""Whether a call's negative prompt takes effect: it acts only through classifier-free guidance.

Diffusers' video pipelines encode the negative prompt only when they run the unconditional branch, i.e. when the
guidance weight is above 1 (Wan, CogVideoX, LTX: ``guidance_scale > 1``; HunyuanVideo, whose ``guidance_scale``
is an embedded distillation weight: ``true_cfg_scale > 1``). Below that the prompt is dropped without a word; here
the user is told, and the settings record what was used.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

# The call argument that turns classifier-free guidance on, where it is not guidance_scale.
_TRUE_CFG_ARG = "true_cfg_scale"


def _given(negative_prompt: Any) -> bool:
    """True for a non-empty string or a list holding one (None, "" and ["", ""] mean no negative prompt)."""
    if isinstance(negative_prompt, str):
        return bool(negative_prompt.strip())
    return isinstance(negative_prompt, (list, tuple)) and any(isinstance(p, str) and p.strip()
                                                              for p in negative_prompt)


def used_negative_prompt(diffusers_pipeline: Any, negative_prompt: Any, guidance_scale: float,
                         call_kwargs: dict[str, Any], stacklevel: int = 3) -> Any:
    """The negative prompt the call will really use: ``negative_prompt``, or None when guidance is off.

    Args:
        diffusers_pipeline: the wrapped pipeline (its signature tells which argument enables guidance).
        negative_prompt: as given (str, list of str or None). guidance_scale: the call's resolved weight.
        call_kwargs: the further diffusers arguments of the call (``true_cfg_scale`` for HunyuanVideo).
        stacklevel: of the warning; 3 points at the caller of the pipeline's ``__call__``.
    Returns:
        ``negative_prompt`` unchanged when it takes effect (or none was given); None, after a ``UserWarning``
        saying so, when it has no effect.
    """
    if not _given(negative_prompt):
        return negative_prompt
    name, weight = "guidance_scale", guidance_scale
    parameters = inspect.signature(diffusers_pipeline.__call__).parameters
    if _TRUE_CFG_ARG in parameters:
        default = parameters[_TRUE_CFG_ARG].default
        name, weight = _TRUE_CFG_ARG, call_kwargs.get(_TRUE_CFG_ARG, default)
    if weight is None or weight > 1:
        return negative_prompt
    warnings.warn(f"negative_prompt has no effect at {name}={weight} <= 1 (classifier-free guidance is off) and "
                  f"is ignored (recorded as None in the settings); raise {name} above 1 to use it",
                  UserWarning, stacklevel=stacklevel)
    return None
