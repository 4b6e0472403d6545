"""Load diffusers video pipelines: the embedded default, a local directory or a hub id, for a given task.

Any pipeline ``diffusers.DiffusionPipeline.from_pretrained`` can load works. A checkpoint saved for one task is
converted to the other only where the same weights serve both (Wan 2.2 TI2V-style models with
``expand_timesteps=True``, such as the embedded default); otherwise the error says which class to use.
"""

from __future__ import annotations

import inspect
import json
from importlib import resources
from pathlib import Path
from typing import Any

from metainfer_gen.platform import default_device, default_dtype, is_hub_id, looks_like_path

TEXT_TO_VIDEO = "text-to-video"
IMAGE_TO_VIDEO = "image-to-video"
DEFAULT_MODEL_DIR = "demo_wan"
DEFAULT_LORA_DIR = "loras"  # LoRAs trained for the embedded model (style_navy, steps_4_8)
SETTINGS_FILE = "metainfer_gen.json"


def default_model_path() -> Path:
    """Folder of the embedded default model (a diffusers Wan pipeline) inside the installed package."""
    path = Path(str(resources.files("metainfer_gen.assets"))) / DEFAULT_MODEL_DIR
    if not (path / "model_index.json").exists():
        raise FileNotFoundError(
            f"the embedded default model is missing at {path}; reinstall metainfer-gen, or build it with "
            "`python -m demo_models.video.build`"
        )
    return path


def default_lora_dir() -> Path | None:
    """Folder of the demo LoRAs trained for the embedded model (None when the package ships none)."""
    path = Path(str(resources.files("metainfer_gen.assets"))) / DEFAULT_LORA_DIR
    return path if any(path.glob("*.safetensors")) else None


def model_settings(path: str | Path | None) -> dict[str, Any]:
    """Default call settings a model folder ships in ``metainfer_gen.json`` (empty when absent)."""
    if path is None or not (Path(path) / SETTINGS_FILE).exists():
        return {}
    return json.loads((Path(path) / SETTINGS_FILE).read_text())


def accepts_image(pipe) -> bool:
    return "image" in inspect.signature(pipe.__call__).parameters


def _wan_components(pipe) -> dict[str, Any]:
    names = ("tokenizer", "text_encoder", "vae", "transformer", "scheduler", "transformer_2")
    return {name: getattr(pipe, name, None) for name in names}


def _wan_to_i2v(pipe):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(**_wan_components(pipe), image_encoder=None, image_processor=None,
                                   boundary_ratio=pipe.config.get("boundary_ratio"), expand_timesteps=True)


def _wan_to_t2v(pipe):
    from diffusers import WanPipeline

    return WanPipeline(**_wan_components(pipe), boundary_ratio=pipe.config.get("boundary_ratio"),
                       expand_timesteps=True)


def _shared_weights_wan(pipe) -> bool:
    """True for Wan pipelines whose transformer takes text-only and image-conditioned input alike."""
    transformer = getattr(pipe, "transformer", None)
    return bool(pipe.config.get("expand_timesteps")) and transformer is not None and \
        transformer.config.image_dim is None


# (source class name, wanted task) -> converter, for checkpoints whose weights serve both tasks.
_CONVERTERS = {
    ("WanPipeline", IMAGE_TO_VIDEO): _wan_to_i2v,
    ("WanImageToVideoPipeline", TEXT_TO_VIDEO): _wan_to_t2v,
}


def for_task(pipe, task: str):
    """Return ``pipe`` or a view of its components that performs ``task``.

    Raises:
        ValueError: the checkpoint cannot do ``task``.
    """
    if (task == IMAGE_TO_VIDEO) == accepts_image(pipe):
        return pipe
    convert = _CONVERTERS.get((type(pipe).__name__, task))
    if convert is not None and _shared_weights_wan(pipe):
        return convert(pipe)
    other = "ImageToVideoPipeline" if task == TEXT_TO_VIDEO else "TextToVideoPipeline"
    raise ValueError(
        f"{type(pipe).__name__} is not a {task} checkpoint; load it with pipelines.{other}, or pass a {task} "
        "checkpoint directory or hub id"
    )


def resolve_model_source(path: str | Path | None) -> str | Path:
    """The model to load: the embedded default for None, a local pipeline folder as a Path, or a hub id
    (``org/name``, exactly one slash, as the LLM loader reads them) as given. Checks nothing on the network, so
    ``serve`` and ``render`` call it before any model loads.

    Raises:
        FileNotFoundError: a folder without ``model_index.json``, or a source that is neither an existing folder
            nor a hub id (``./x``, ``/x``, a bare name such as ``default``), with what to pass instead.
    """
    source = default_model_path() if path is None else path
    local = Path(source).expanduser()
    if local.exists():
        if not (local / "model_index.json").exists():
            raise FileNotFoundError(f"{local} holds no model_index.json: it is not a diffusers pipeline folder")
        return local
    if looks_like_path(source):
        raise FileNotFoundError(f"model path {source} does not exist")
    if not is_hub_id(source):
        raise FileNotFoundError(f"model {str(source)!r} is neither an existing pipeline folder nor a hub id "
                                f"(org/name): pass a folder saved by save_pretrained, or leave the model out for "
                                f"the embedded default")
    return source


def load_diffusers_pipeline(path: str | Path | None, task: str, torch_dtype=None, device: str | None = None,
                            vae_dtype=None, **kwargs):
    """Load and place a pipeline for ``task``.

    Args:
        path: None for the embedded default, else a local directory or hub id.
        torch_dtype: e.g. ``torch.bfloat16``; default float32 on CPU, bfloat16 on CUDA. A dict per component
            (``{"vae": torch.bfloat16, "default": torch.float32}``) is diffusers' own form and passes through.
        vae_dtype: the VAE's dtype when it should differ from the rest (sets the ``"vae"`` entry of that dict).
            ``torch.bfloat16`` on a CPU with native bf16 (AVX512-BF16 or AMX; ``metainfer-gen doctor`` says) makes
            the VAE's decode, which a step cache does not shorten, about 1.5x faster (0.19 s against 0.30 s for the
            embedded model's default clip, 2 cores with AVX512-BF16), its pixels 57-62 dB from float32's
            (``benchmarks/step_cache.py --vae-dtype`` prints both).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available.
        kwargs: passed to ``DiffusionPipeline.from_pretrained``.
    Returns:
        (diffusers pipeline, resolved local path or hub id, settings dict).
    Raises:
        FileNotFoundError: see :func:`resolve_model_source`. ValueError: the checkpoint cannot do ``task``.
    """
    import torch
    from diffusers import DiffusionPipeline

    device = device or default_device()
    torch_dtype = torch_dtype or default_dtype(device)
    if vae_dtype is not None:
        torch_dtype = {**(torch_dtype if isinstance(torch_dtype, dict) else {"default": torch_dtype}),
                       "vae": vae_dtype}
    source = resolve_model_source(path)
    pipe = DiffusionPipeline.from_pretrained(str(source), dtype=torch_dtype, **kwargs)
    pipe = for_task(pipe, task)
    pipe.to(device)
    settings = model_settings(source if Path(str(source)).exists() else None)
    return pipe, source, settings
