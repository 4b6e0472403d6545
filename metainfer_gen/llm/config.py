"""Engine settings (vLLM's ``EngineArgs`` names where one exists), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """How the engine batches and how much KV cache it keeps.

    Args:
        block_size: tokens per KV block (page size).
        max_num_seqs: sequences running at once (decode batch size).
        max_num_batched_tokens: tokens per step, prefill chunks and decodes together.
        max_model_len: context length; None takes the model's ``max_position_embeddings``.
        enable_chunked_prefill: split long prompts across steps; when off, ``max_num_batched_tokens`` must be at
            least ``max_model_len`` so every prompt fits one step.
        enable_prefix_caching: reuse the KV of full blocks shared with earlier requests.
        num_kv_blocks: size of the block pool (explicit override); None sizes it from memory, capped at what
            ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
        kv_cache_memory_gib: memory for the KV cache when ``num_kv_blocks`` is None (explicit override); None
            measures instead: one prefill of the largest chunk is profiled and the KV pool gets
            ``memory_budget_gib`` minus weights, that peak and the margin.
        memory_budget_gib: memory the engine may use in all (weights + activations + KV); None takes the device's
            free memory plus what the process already holds on CUDA, and the weights plus a quarter of the
            available RAM on the CPU.
        gpu_memory_utilization: vLLM's name: the share of the device's free memory (plus what this process
            already holds) the engine takes for weights, activations and KV when ``memory_budget_gib`` is None, in
            (0, 1]; None: all of it on a GPU, the weights plus a quarter of the available RAM on the CPU.
        kv_memory_margin: fraction of the budget left unallocated when sizing from measurement (allocator
            fragmentation, memory the profile cannot see).
        dtype: weights and activations, "float32", "bfloat16" or "float16"; None takes
            :func:`metainfer_gen.platform.native_dtype`: bfloat16 on a GPU and on a CPU with AMX-BF16 or
            AVX512-BF16, float32 on a CPU that would emulate bf16.
        device: "cpu", "cuda", "cuda:N"; None picks CUDA when available.
        seed: seed of the sampler for requests without their own seed.
        tensor_parallel_size: ranks splitting the model (heads, intermediate columns, experts, vocabulary); above 1
            the engine runs under torchrun with this many processes, each calling the same engine methods.
        quantization: None, or "fp8": linear weights in float8_e4m3fn with 128x128 block scales (a bf16/fp32
            checkpoint is quantised on load; a DeepSeek FP8 checkpoint keeps its blocks), on any device, see
            ``llm/fp8.py``. With None, a checkpoint whose config declares ``quant_method: "fp8"`` stays fp8 on a GPU
            with an FP8 GEMM and is dequantised once at load to ``dtype`` elsewhere (the CPU); the loaded model's
            ``weight_format`` says which.
        kv_cache_dtype: "auto" (the run dtype) or "fp8" (float8_e4m3fn latent cache, scale 1, half the bytes of
            bf16; values are cast on store and read back in the run dtype).
        static_decode: run decode-only steps on preallocated buffers padded to a batch-size ladder (1, 2, 4, ...,
            ``max_num_seqs``), see ``llm/static_decode.py``; None (the default): off until the CUDA-graph path has
            run on a GPU (captured MoE decode runs every expert on every row, E/k times the routed FLOPs).
        enforce_eager: never capture CUDA graphs (vLLM's name); static decode steps then run eagerly. Graphs are
            captured only on CUDA, with ``static_decode`` on and ``tensor_parallel_size`` 1.
    Raises:
        ValueError: a field out of range, with the fix in the message.
    """

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    memory_budget_gib: float | None = None
    kv_memory_margin: float = 0.05
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    device: str | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    static_decode: bool | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1; got {value!r}")
        for name in ("kv_cache_memory_gib", "memory_budget_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be None or > 0; got {value!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be None or in (0, 1]; got {self.gpu_memory_utilization!r}")
        if not 0 <= self.kv_memory_margin < 0.5:
            raise ValueError(f"kv_memory_margin must be in [0, 0.5); got {self.kv_memory_margin!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES} or None; got {self.dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8'; got {self.quantization!r}")
        if self.static_decode not in (None, True, False):
            raise ValueError(f"static_decode must be None, True or False; got {self.static_decode!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False; got {self.enforce_eager!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8'; got {self.kv_cache_dtype!r}")

    def check_model_len(self, max_model_len: int) -> None:
        """Checks that need the resolved context length.

        Raises:
            ValueError: chunked prefill off and a whole prompt of ``max_model_len`` tokens would not fit a step.
        """
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len={max_model_len} with "
                f"chunked prefill off, so a long prompt could never be scheduled; raise max_num_batched_tokens, "
                f"lower max_model_len, or set enable_chunked_prefill=True")
