"""LoRA adapters on a diffusers video pipeline, through diffusers' ``load_lora_weights`` and peft.

``LoraSet`` is what ``pipe.load_lora`` / ``set_lora_weights`` / ``disable_lora`` / ``enable_lora`` /
``fuse_lora`` / ``unfuse_lora`` / ``unload_lora`` / ``list_loras`` of our pipelines call. What it adds to diffusers:

* every common file layout, partial LoRAs and unknown keys (``lora_keys.normalise_lora``), with a report of what
  was covered and what was skipped; a LoRA that matches nothing is refused (it was made for another model);
* NaN/Inf refused before the model is touched;
* an exact unfuse: fusing keeps a copy of the base weights it changes and unfusing writes them back, so any
  number of fuse/unfuse cycles leaves the base bit-identical (peft's unmerge subtracts the delta again, which
  drifts by rounding on every cycle: about 1 ulp per cycle in fp32, far more in bf16);
* a state stamp on each transformer (:func:`lora_state`) that the step caches read, so cached or calibrated
  state never outlives an adapter change.

Adapters go into ``pipe.transformer`` (for Wan 2.2's two experts, only the high-noise one; see the note in
``load``). Swapping adapters or weights between calls never reloads the base model.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from metainfer_gen.video.lora_keys import non_finite_keys, normalise_lora

logger = logging.getLogger(__name__)

LORA_STATE_ATTR = "metainfer_lora_state"
TARGET = "transformer"
_DIR_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors", "pytorch_lora_weights.bin",
              "adapter_model.bin")


@dataclass(slots=True)
class LoraReport:
    """What loading one LoRA did.

    Attributes:
        adapter_name: the name it is known by. source: the file (or "<state dict>").
        num_keys: tensors in the file. modules: diffusers names of the model's modules it adapts.
        skipped: ``{key: reason}`` of every tensor not used (unknown module, missing pair, wrong shape...).
    """

    adapter_name: str
    source: str
    num_keys: int
    modules: list[str]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def summary(self) -> str:
        """One line, plus the skipped keys (at most 10 named)."""
        text = f"LoRA {self.adapter_name!r} from {self.source}: {len(self.modules)} modules adapted"
        if self.skipped:
            shown = "; ".join(f"{k} ({r})" for k, r in list(self.skipped.items())[:10])
            more = f"; and {self.num_skipped - 10} more" if self.num_skipped > 10 else ""
            text += f", {self.num_skipped} of {self.num_keys} keys skipped: {shown}{more}"
        return text


def read_lora_file(source: str | Path) -> tuple[dict[str, torch.Tensor], float | None]:
    """Tensors of a LoRA file or folder, and the alpha its metadata states (None: alpha = rank).

    Reads ``.safetensors`` (diffusers' ``lora_adapter_metadata`` honoured), ``.bin``/``.pt``/``.pth``
    (``torch.load(weights_only=True)``), or a folder holding ``pytorch_lora_weights.*`` (diffusers) or
    ``adapter_model.*`` with ``adapter_config.json`` (peft: ``lora_alpha``; ``rank_pattern``/``alpha_pattern``
    are not read).
    Raises:
        FileNotFoundError: no such file, or a folder without LoRA weights.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        found = next((path / n for n in _DIR_FILES if (path / n).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"LoRA folder {path} holds none of {', '.join(_DIR_FILES)}")
        tensors, alpha = read_lora_file(found)
        config = path / "adapter_config.json"
        if alpha is None and config.is_file():
            alpha = json.loads(config.read_text()).get("lora_alpha")
        return tensors, alpha
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file {path} does not exist")
    if path.suffix != ".safetensors":
        return torch.load(path, map_location="cpu", weights_only=True), None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    alpha = metadata.get(f"{TARGET}.lora_alpha", metadata.get("lora_alpha"))
    return tensors, alpha


def lora_state(model: torch.nn.Module) -> Any:
    """Stamp of the adapters active on ``model`` (names, weights, enabled, fused); None without adapters."""
    return getattr(model, LORA_STATE_ATTR, None)


def lora_active(model: torch.nn.Module) -> bool:
    """True when adapters change ``model``'s output: fused, or enabled with a weight other than 0."""
    state = lora_state(model)
    return state is not None and (state[2] or (state[1] and any(w != 0 for _, w in state[0])))


class LoraSet:
    """The LoRA adapters of one diffusers pipeline (shared by our pipelines made with ``from_pipe``).

    Args:
        pipe: a diffusers pipeline with diffusers' LoRA loader (``load_lora_weights``), e.g. ``WanPipeline``.
    Raises:
        TypeError: the pipeline has no LoRA support in diffusers.
    """

    def __init__(self, pipe) -> None:
        if not hasattr(pipe, "load_lora_weights"):
            raise TypeError(f"{type(pipe).__name__} has no diffusers LoRA loader (load_lora_weights)")
        self.pipe = pipe
        self.weights: dict[str, float] = {}
        self.reports: dict[str, LoraReport] = {}
        self.enabled = True
        self._fused: dict[str, torch.Tensor] | None = None  # base tensors changed by fuse, keyed by parameter name

    @property
    def model(self) -> torch.nn.Module:
        return getattr(self.pipe, TARGET)

    @property
    def is_fused(self) -> bool:
        return self._fused is not None

    def load(self, source: str | Path | dict[str, torch.Tensor], adapter_name: str | None = None,
             weight: float = 1.0) -> LoraReport:
        """Load a LoRA as a new adapter, active with ``weight``.

        Args:
            source: a LoRA file or folder (see :func:`read_lora_file`) or a ``{name: tensor}`` dict, in any layout
                ``lora_keys.normalise_lora`` knows.
            adapter_name: default the file's stem (or ``"lora"``), made unique with a number.
            weight: scale of its contribution (0 contributes nothing; negative subtracts).
        Returns:
            The :class:`LoraReport`; skipped keys are also logged as a warning.
        Raises:
            ValueError: NaN/Inf in the LoRA, no key matching the model (another architecture), a name already
                loaded, a non-finite weight, or the adapters are fused (unfuse first). The model is untouched.
            FileNotFoundError: see :func:`read_lora_file`.
        """
        self._refuse_if_fused("load a LoRA")
        _check_weight(weight)
        if isinstance(source, dict):
            state_dict, alpha, label = dict(source), None, "<state dict>"
        else:
            (state_dict, alpha), label = read_lora_file(source), str(source)
        name = adapter_name or self._unique(Path(label).stem if label != "<state dict>" else "lora")
        if name in self.weights:
            raise ValueError(f"an adapter named {name!r} is already loaded; unload_lora({name!r}) first or pick "
                             "another adapter_name")
        bad = non_finite_keys(state_dict)
        if bad:
            raise ValueError(f"LoRA {label} refused: {len(bad)} tensors hold NaN or Inf ({', '.join(bad[:5])}); "
                             "the model was not changed")
        converted, modules, skipped = normalise_lora(state_dict, self.model, default_alpha=alpha)
        if not modules:
            examples = ", ".join(list(state_dict)[:3])
            raise ValueError(f"LoRA {label} refused: none of its {len(state_dict)} keys matches a layer of "
                             f"{type(self.model).__name__} (e.g. {examples}); it was made for another model")
        dtype = next(self.model.parameters()).dtype
        with warnings.catch_warnings():  # peft warns on every adapter after the first; several are the point here
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            self.pipe.load_lora_weights({k: v.to(dtype) for k, v in converted.items()}, adapter_name=name)
        report = LoraReport(name, label, len(state_dict), modules, skipped)
        if skipped:
            logger.warning(report.summary())
        self.reports[name] = report
        self.weights[name] = float(weight)
        self._apply()
        return report

    def use(self, specs: list[tuple[str, float]]) -> list[LoraReport]:
        """Make exactly these ``(file, weight)`` LoRAs active, loading each file once (the CLI and batch path).

        Adapters loaded earlier by this method and not listed drop to weight 0 (inactive: no cost per call) and
        stay loaded for a later job. Returns the reports of the listed LoRAs, in order. Errors as :meth:`load`.
        """
        by_source = {report.source: name for name, report in self.reports.items()}
        names = []
        for source, weight in specs:
            name = by_source.get(str(source))
            if name is None:
                name = self.load(source, weight=weight).adapter_name
                by_source[str(source)] = name
            names.append(name)
        if self.weights:
            wanted = dict(zip(names, (w for _, w in specs)))
            self.set_weights({n: wanted.get(n, 0.0) for n in self.weights})
        return [self.reports[n] for n in names]

    def set_weights(self, weights: dict[str, float]) -> None:
        """Change the weights of loaded adapters (others keep theirs); takes effect on the next call.

        Raises:
            ValueError: an unknown name, a non-finite weight, or the adapters are fused.
        """
        self._refuse_if_fused("change LoRA weights")
        for name, weight in weights.items():
            self._known(name)
            _check_weight(weight)
        self.weights.update({name: float(w) for name, w in weights.items()})
        self._apply()

    def disable(self) -> None:
        """Compute as the base model (adapters stay loaded). Raises ValueError while fused."""
        self._refuse_if_fused("disable LoRAs")
        self.pipe.disable_lora()
        self.enabled = False
        self._stamp()

    def enable(self) -> None:
        """Undo :meth:`disable`."""
        self.pipe.enable_lora()
        self.enabled = True
        self._stamp()

    def fuse(self) -> None:
        """Merge the active adapters (at their weights) into the base weights: no LoRA cost per call.

        Keeps a CPU copy of every base tensor it changes (the adapted layers' weights and biases) so that
        :meth:`unfuse` restores them exactly. Raises ValueError when already fused, disabled, or empty.
        """
        self._refuse_if_fused("fuse again")
        active = [name for name, weight in self.weights.items() if weight != 0]
        if not active or not self.enabled:
            raise ValueError("nothing to fuse: load a LoRA with a weight other than 0 (and enable_lora) first")
        from peft.tuners.tuners_utils import BaseTunerLayer

        backup = {}
        for name, module in self.model.named_modules():
            if isinstance(module, BaseTunerLayer):
                for pname, param in module.get_base_layer().named_parameters(recurse=False):
                    backup[f"{name}.{pname}"] = param.detach().to("cpu", copy=True)
        self.pipe.fuse_lora(components=[TARGET], lora_scale=1.0, adapter_names=active)
        self._fused = backup
        self._stamp()

    def unfuse(self) -> None:
        """Separate the adapters from the base weights again; the base is restored bit for bit. No-op unfused."""
        if self._fused is None:
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.pipe.unfuse_lora(components=[TARGET])
        with torch.no_grad():
            for name, module in self.model.named_modules():
                if isinstance(module, BaseTunerLayer):
                    for pname, param in module.get_base_layer().named_parameters(recurse=False):
                        param.copy_(self._fused[f"{name}.{pname}"])
        self._fused = None
        self._stamp()

    def unload(self, adapter_name: str | None = None) -> None:
        """Remove one adapter (or, with no name, all of them and their peft layers). Raises ValueError if fused
        or the name is unknown."""
        self._refuse_if_fused("unload a LoRA")
        if adapter_name is None:
            self.pipe.unload_lora_weights()
            self.weights.clear()
            self.reports.clear()
            self.enabled = True
        else:
            self._known(adapter_name)
            self.pipe.delete_adapters(adapter_name)
            del self.weights[adapter_name], self.reports[adapter_name]
            self._apply()
        self._stamp()

    def info(self) -> list[dict[str, Any]]:
        """One dict per adapter, in load order: name, weight, source, modules, skipped (count), enabled, fused."""
        return [{"name": n, "weight": w, "source": self.reports[n].source, "modules": len(self.reports[n].modules),
                 "skipped": self.reports[n].num_skipped, "enabled": self.enabled, "fused": self.is_fused}
                for n, w in self.weights.items()]

    # ----------------------------------------------------------------------------------------------- helpers
    def _apply(self) -> None:
        active = {n: w for n, w in self.weights.items() if w != 0} or self.weights  # weight 0: not computed
        if active:
            self.pipe.set_adapters(list(active), list(active.values()))
            if not self.enabled:
                self.pipe.disable_lora()  # set_adapters re-enables the layers
        self._stamp()

    def _stamp(self) -> None:
        state = (tuple(self.weights.items()), self.enabled, self.is_fused) if self.weights else None
        setattr(self.model, LORA_STATE_ATTR, state)

    def _known(self, name: str) -> None:
        if name not in self.weights:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {list(self.weights) or 'none'}")

    def _refuse_if_fused(self, what: str) -> None:
        if self._fused is not None:
            raise ValueError(f"cannot {what} while the LoRAs are fused; call unfuse_lora() first")

    def _unique(self, stem: str) -> str:
        name, number = stem, 2
        while name in self.weights:
            name, number = f"{stem}_{number}", number + 1
        return name


def _check_weight(weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not torch.isfinite(torch.tensor(weight)):
        raise ValueError(f"a LoRA weight must be a finite number (e.g. 0.8); got {weight!r}")
