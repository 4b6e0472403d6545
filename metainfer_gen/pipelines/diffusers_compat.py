"""diffusers' own pipeline surface on the video pipelines: ``.to()``, ``.components``, the component attributes
(``pipe.vae``, ``pipe.scheduler``, ``pipe.transformer.config``, ``pipe.vae_scale_factor_spatial``...) and CPU
offload, so code written against a diffusers pipeline runs on ours unchanged."""

from __future__ import annotations

from typing import Any


class DiffusersCompatMixin:
    """Methods of :class:`~metainfer_gen.pipelines.video_base.VideoPipelineBase` (needs ``diffusers_pipeline``)."""

    def __getattr__(self, name: str) -> Any:
        """Attributes this object lacks come from the wrapped diffusers pipeline (components, config, helpers).

        Raises:
            AttributeError: neither object has ``name`` (private names are never forwarded).
        """
        wrapped = self.__dict__.get("diffusers_pipeline")
        if name.startswith("_") or wrapped is None:
            raise AttributeError(f"{type(self).__name__!s} object has no attribute {name!r}")
        try:
            return getattr(wrapped, name)
        except AttributeError:
            raise AttributeError(f"neither {type(self).__name__} nor its {type(wrapped).__name__} has an attribute "
                                 f"{name!r}") from None

    @property
    def components(self) -> dict[str, Any]:
        """The wrapped pipeline's modules by name, as diffusers' ``DiffusionPipeline.components`` (for
        ``OtherPipeline(**pipe.components)``)."""
        return self.diffusers_pipeline.components

    def to(self, *args, **kwargs):
        """Move or cast every component, as diffusers' ``pipe.to("cuda")``, ``pipe.to(torch.bfloat16)`` or
        ``pipe.to("cuda", torch.bfloat16)``. Accelerators (step cache, embed memo, LoRA, fused kernels) stay on.

        Returns:
            this pipeline (so ``pipe = pipe.to("cuda")`` works as in diffusers).
        """
        self.diffusers_pipeline.to(*args, **kwargs)
        return self

    def enable_model_cpu_offload(self, gpu_id: int | None = None, device: Any = None) -> None:
        """Keep each whole model (text encoder, transformer, VAE) on the CPU until its turn (diffusers' own
        ``enable_model_cpu_offload``, through accelerate hooks): peak device memory is the largest model, at the
        cost of one host-device copy per model per call. The step cache, embed memo and LoRA adapters keep
        working (their hooks sit inside the offload hooks).

        Raises:
            RuntimeError: no accelerator was found and ``device`` was not given (diffusers' own error).
        """
        self.diffusers_pipeline.enable_model_cpu_offload(gpu_id=gpu_id, device=device)

    def enable_sequential_cpu_offload(self, gpu_id: int | None = None, device: Any = None) -> None:
        """Keep every submodule on the CPU and copy it to the device only for its own forward (diffusers'
        ``enable_sequential_cpu_offload``): the smallest device memory, and much slower than model offload.

        Raises:
            ValueError: ``device`` is a CPU (there is nothing to offload to; accelerate's hooks also fail there).
        """
        import torch

        if device is not None and torch.device(device).type == "cpu":
            raise ValueError("sequential CPU offload moves weights from the CPU to an accelerator; this call named "
                             f"device={device!r}: leave it out on a GPU machine, or run without offload on a CPU")
        self.diffusers_pipeline.enable_sequential_cpu_offload(gpu_id=gpu_id, device=device)

    def remove_all_hooks(self) -> None:
        """Undo CPU offload (diffusers' ``remove_all_hooks``); the accelerators' own hooks stay."""
        self.diffusers_pipeline.remove_all_hooks()
