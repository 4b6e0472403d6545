"""The acceleration presets of the video pipelines: what each one asks for, and the record of what it got.

``pipe.enable_acceleration(preset)`` (:mod:`metainfer_gen.pipelines.acceleration`) walks one preset's features in
a fixed order and, for each, either turns it on or records why not (the model lacks the module, the machine has no
native bf16, a quality check failed, it does not pay here). This module is the bookkeeping half: plain Python, no
device work, so it is tested on its own.

| preset | step cache | bf16 | step LoRA (the model's) | for |
|---|---|---|---|---|
| ``quality`` | ``quality`` | none | no | clips closest to the uncached float32 ones |
| ``balanced`` | ``quality=0.6`` | the VAE, where its check passes | no | speed at 30+ dB from plain diffusers |
| ``fastest`` | ``fast`` | VAE, transformer: each where its check passes (and pays, on a CPU) | fused | clips/hour |

Every preset also turns on the lossless helpers (the fused kernels, the condition-embedder memo, the prompt-
embedding cache, both CFG branches in one batch) and regional compilation of the transformer blocks where it pays (a
GPU; on the CPU it is refused with the measurement). The features stay usable one by one (``enable_step_cache``,
``enable_fused_kernels``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the order they are applied in (weights first, hooks outermost last)
FEATURES = ("step_lora", "bf16_transformer", "bf16_vae", "fused_kernels", "compile_blocks", "embed_memo",
            "prompt_cache", "cfg_batch", "step_cache")


@dataclass(frozen=True, slots=True)
class Preset:
    """What one preset asks for.

    Attributes:
        name: "quality", "balanced" or "fastest". step_cache: the ``enable_step_cache`` spec.
        bf16: components to try in bf16 ("vae", "transformer"), each kept only where its check passes.
        step_lora: fuse the model's step LoRA and render at its step count and guidance, when one is configured.
    """

    name: str
    step_cache: str
    bf16: tuple[str, ...] = ()
    step_lora: bool = False


PRESETS: dict[str, Preset] = {
    "quality": Preset("quality", step_cache="quality"),
    # ``quality``'s reuse cap with a budget between it (0.4) and ``auto`` (0.9). Measured on 8 training prompts
    # of the embedded model at its 20 guided steps, CFG batched (never on the benchmark's held-out prompts):
    # transformer calls per clip 9.4 / 10.0 (text / image to video) at budget 0.4, 9.0 / 9.2 at 0.6, 8.0 / 9.0 at
    # 0.9; worst clip 30.7 / 38.7, 32.5 / 31.3 and 26.8 / 30.7 dB against plain diffusers. ``auto`` loses a
    # text-to-video clip there (and lost an image-to-video one before CFG batching, 19.2 dB).
    "balanced": Preset("balanced", step_cache="quality=0.6", bf16=("vae",)),
    "fastest": Preset("fastest", step_cache="fast", bf16=("vae", "transformer"), step_lora=True),
}


def get_preset(name: Any) -> Preset:
    """The :class:`Preset` named ``name``.

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise ValueError(f"unknown acceleration preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(slots=True)
class AccelerationReport:
    """What ``enable_acceleration`` turned on, and why anything was refused (``out.stats.extra["acceleration"]``).

    Attributes:
        preset: the preset's name. enabled: feature -> a short note of what runs ("auto", "bf16 58.3 dB").
        refused: feature -> why it is off. call_defaults: call arguments the preset changed (the step LoRA's
            ``num_inference_steps`` and ``guidance_scale``); a value given in the call still wins.
    """

    preset: str
    enabled: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    call_defaults: dict[str, Any] = field(default_factory=dict)

    def on(self, feature: str, note: str = "on") -> None:
        """Record ``feature`` as enabled. Raises ValueError for a name outside :data:`FEATURES`."""
        self._check(feature)
        self.refused.pop(feature, None)
        self.enabled[feature] = note

    def refuse(self, feature: str, reason: str) -> None:
        """Record ``feature`` as refused, with ``reason``. Raises ValueError for an unknown feature or no reason."""
        self._check(feature)
        if not reason:
            raise ValueError(f"refusing {feature} needs a reason")
        self.enabled.pop(feature, None)
        self.refused[feature] = reason

    def is_on(self, feature: str) -> bool:
        return feature in self.enabled

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "enabled": dict(self.enabled), "refused": dict(self.refused),
                "call_defaults": dict(self.call_defaults)}

    def summary(self) -> str:
        """Lines for a log or ``--audit``: one per feature, on or refused with the reason."""
        lines = [f"acceleration preset {self.preset!r}:"]
        for feature in FEATURES:
            if feature in self.enabled:
                lines.append(f"  on       {feature}: {self.enabled[feature]}")
            elif feature in self.refused:
                lines.append(f"  refused  {feature}: {self.refused[feature]}")
        if self.call_defaults:
            lines.append(f"  call defaults: {self.call_defaults}")
        return "\n".join(lines)

    @staticmethod
    def _check(feature: str) -> None:
        if feature not in FEATURES:
            raise ValueError(f"unknown acceleration feature {feature!r}; known: {', '.join(FEATURES)}")
