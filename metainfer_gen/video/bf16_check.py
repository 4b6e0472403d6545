"""bf16 per video component, each only where its own quality check against float32 passes.

A video pipeline's components react differently to bf16: the VAE's decode keeps its pixels 57-62 dB from float32
on the embedded model and runs about 1.5x faster on a CPU with native bf16, while a transformer's error feeds back
through every denoising step. So each component is cast on its own: :func:`try_bf16` measures the component in
float32 on a fixed random probe, casts it, measures again, and keeps bf16 only when the two agree to
``min_db``; otherwise the float32 weights are put back bit for bit (from a copy taken before the cast). The probe is
seeded, so the same model on the same machine decides the same way every time.

Probes: the VAE decodes one random latent of the call's size (PSNR of the [0, 1] pixels, threshold
:data:`VAE_MIN_DB`); a Wan-style transformer runs one forward on random latents, prompt embedding and a mid
timestep (signal-to-error ratio of its output, threshold :data:`TRANSFORMER_MIN_DB`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

VAE_MIN_DB = 40.0  # decoded pixels against float32's; the embedded model's VAE reads 57-62 dB
TRANSFORMER_MIN_DB = 30.0  # one forward's output against float32's (signal-to-error ratio)
_PROBE_SEED = 1234


@dataclass(frozen=True, slots=True)
class Bf16Decision:
    """Whether a component runs in bf16, with the figure that decided it.

    Attributes:
        component: "vae", "transformer", ...; enabled: True when the component now runs in bf16.
        db: the check's agreement with float32 in dB (None when no check ran); min_db: the threshold.
        reason: why it stays in float32 ("" when enabled).
    """

    component: str
    enabled: bool
    db: float | None
    min_db: float
    reason: str = ""

    def to_dict(self) -> dict:
        return {"component": self.component, "enabled": self.enabled, "db": self.db, "min_db": self.min_db,
                "reason": self.reason}


def agreement_db(reference: torch.Tensor, other: torch.Tensor, peak: float | None = None) -> float:
    """``10 log10(peak^2 / MSE)`` (PSNR, when ``peak`` is given) or the signal-to-error ratio ``10 log10(mean(ref^2)
    / MSE)``; infinite for identical tensors."""
    reference, other = reference.double(), other.double()
    mse = float(torch.mean((reference - other) ** 2))
    if mse == 0.0:
        return math.inf
    signal = peak**2 if peak is not None else float(torch.mean(reference**2))
    return 10.0 * math.log10(max(signal, 1e-30) / mse)


def try_bf16(component: str, module: torch.nn.Module, probe: Callable[[torch.nn.Module], torch.Tensor],
             min_db: float, peak: float | None = None) -> Bf16Decision:
    """Cast ``module`` to bf16 in place if its ``probe`` output stays within ``min_db`` of float32's.

    Args:
        component: its name in the decision. module: a float32 module. probe: ``module -> output`` on fixed inputs,
            run under ``inference_mode`` (inputs must follow the module's dtype). min_db: the threshold.
        peak: the output's peak for PSNR (1.0 for pixels in [0, 1]); None: signal-to-error ratio.
    Returns:
        The decision; on a refusal the module is float32 again, bit for bit.
    """
    dtype = run_dtype(module)
    if dtype != torch.float32:
        return Bf16Decision(component, dtype == torch.bfloat16, None, min_db,
                            "" if dtype == torch.bfloat16 else f"loaded in {dtype}, not float32")
    backup = float32_backup(module)
    with torch.inference_mode():
        reference = probe(module).float()
    to_bf16(module, backup)  # outside inference mode: the weights must stay normal tensors
    with torch.inference_mode():
        db = agreement_db(reference, probe(module).float(), peak)
    if db >= min_db:
        return Bf16Decision(component, True, db, min_db)
    restore_float32(module, backup)
    return Bf16Decision(component, False, db, min_db, f"bf16 reads {db:.1f} dB from float32, below {min_db:.0f} dB")


def to_bf16(module: torch.nn.Module, backup: dict[str, torch.Tensor]) -> None:
    """Cast ``module`` to bf16 except its ``_keep_in_fp32_modules`` (diffusers' list: Wan keeps its rotary table,
    time embedder, modulation table and norms in float32, as ``from_pretrained(torch_dtype=...)`` would), whose
    float32 values come back from ``backup``."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    torch.nn.Module.to(module, torch.bfloat16)  # diffusers' own .to() warns about the modules put back below
    if not keep:
        return
    with torch.no_grad():  # diffusers' rule: a tensor whose dotted name has a part in the list
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if keep & set(name.split(".")) and tensor.is_floating_point():
                original = backup.get(name)
                tensor.data = original.clone() if original is not None else tensor.data.float()


def run_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype holding most of ``module``'s weights (its inputs' dtype; a few modules may stay in float32)."""
    sizes: dict[torch.dtype, int] = {}
    for parameter in module.parameters():
        sizes[parameter.dtype] = sizes.get(parameter.dtype, 0) + parameter.numel()
    return max(sizes, key=sizes.get)


def float32_backup(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s state (for :func:`restore_float32`)."""
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def restore_float32(module: torch.nn.Module, backup: dict[str, torch.Tensor]) -> None:
    """Put ``module`` back in float32 with the exact values of ``backup`` (a bf16 round trip would lose them)."""
    module.to(torch.float32)
    module.load_state_dict(backup)


def vae_probe(vae: torch.nn.Module, num_latent_frames: int, latent_height: int, latent_width: int):
    """``vae -> pixels``: decode one seeded random latent (1, z_dim, frames, height, width), pixels in [0, 1]."""
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    z_dim = getattr(vae.config, "z_dim", None) or vae.config.latent_channels
    latent = torch.randn(1, z_dim, num_latent_frames, latent_height, latent_width, generator=generator)

    def probe(module):
        parameter = next(module.parameters())
        pixels = module.decode(latent.to(parameter.device, run_dtype(module))).sample
        return ((pixels.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    return probe


def transformer_probe(transformer: torch.nn.Module, num_latent_frames: int, latent_height: int, latent_width: int,
                      sequence_length: int = 16):
    """``transformer -> output``: one forward of a Wan-style transformer on seeded random latents, prompt
    embedding (and image embedding where the model reads one) at timestep 500."""
    config = transformer.config
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    latents = torch.randn(1, config.in_channels, num_latent_frames, latent_height, latent_width, generator=generator)
    text = torch.randn(1, sequence_length, config.text_dim, generator=generator)
    image = None
    if getattr(config, "image_dim", None):
        image = torch.randn(1, 257, config.image_dim, generator=generator)

    def probe(module):
        parameter = next(module.parameters())
        cast = {"device": parameter.device, "dtype": run_dtype(module)}
        kwargs = {} if image is None else {"encoder_hidden_states_image": image.to(**cast)}
        return module(hidden_states=latents.to(**cast), timestep=torch.tensor([500], device=parameter.device),
                      encoder_hidden_states=text.to(**cast), return_dict=False, **kwargs)[0]
    return probe
