"""The LLM engine: requests in, tokens out, with continuous batching over a paged, prefix-cached KV pool.

    engine = LLMEngine.from_pretrained("path/to/deepseek-v3-checkpoint", EngineConfig(block_size=16))
    outputs = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8, temperature=0))
    for delta in engine.stream(["Once upon a time"]):   # incremental RequestOutputs
        print(delta.new_token_ids)
Structure follows nano-vllm (``LLMEngine`` -> ``Scheduler`` + ``BlockManager`` -> ``ModelRunner``); request
checks and outputs follow vLLM. Correctness reference: transformers' ``generate`` on the same checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence as SequenceABC
from pathlib import Path

import torch

from metainfer_gen.kernels.gemm import record_matmul_path
from metainfer_gen.llm.block_manager import BlockManager
from metainfer_gen.llm.compiled_decode import choose_decode_path
from metainfer_gen.llm.config import EngineConfig
from metainfer_gen.llm.layers.linear import configure_gemms
from metainfer_gen.llm.model_refusals import prefix_caching_allowed, static_decode_allowed
from metainfer_gen.llm.model_runner import ModelRunner, kv_cache_bytes_per_block
from metainfer_gen.llm.outputs import RequestOutput
from metainfer_gen.llm.scheduler import Scheduler
from metainfer_gen.llm.sequence import SamplingParams, Sequence
from metainfer_gen.llm.step_recovery import run_step
from metainfer_gen.platform import default_device, native_dtype

Prompt = str | SequenceABC[int]


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool); other requests are unaffected."""


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        model: engine model (see :mod:`metainfer_gen.llm.models.deepseek_v3`).
        config: engine settings (already validated).
        max_model_len: resolved context length.
        tokenizer: a transformers tokenizer, or None (then prompts must be token ids).
        eos_token_ids: tokens that end a request.
    """

    def __init__(self, model, config: EngineConfig, *, max_model_len: int, tokenizer=None,
                 eos_token_ids: tuple[int, ...] = ()):
        config.check_model_len(max_model_len)
        self.model = model
        self.config = config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        configure_gemms(model)  # the platform's GEMM path per layer, chosen once (audited at llm.linear)
        self.matmul_path = record_matmul_path(self.device, self.dtype)
        self.weight_format = getattr(model, "weight_format", None)  # fp8 kept, dequantised at load, or dense
        self.cache_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        from metainfer_gen.llm.kv_sizing import size_kv_pool

        self.kv_sizing = size_kv_pool(model, config, max_model_len=max_model_len, dtype=self.dtype, device=self.device,
                                      bytes_per_block=kv_cache_bytes_per_block(model, config.block_size,
                                                                               self.cache_dtype))
        num_blocks, prefix = self.kv_sizing.num_blocks, prefix_caching_allowed(model, config.enable_prefix_caching)
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix)  # off where the model refuses it
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   max_model_len=max_model_len, eos_token_ids=eos_token_ids)
        self.decode_path = choose_decode_path(model, config, self.device)  # "compiled", "eager"; None on a GPU
        compiled = self.decode_path == "compiled"
        static = (bool(config.static_decode) or compiled) and static_decode_allowed(model)  # CUDA: opt-in
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size, dtype=self.cache_dtype,
                                  device=self.device, seed=config.seed, static_decode=static,
                                  cuda_graphs=static and self.device.type == "cuda" and not config.enforce_eager
                                  and config.tensor_parallel_size == 1, compiled_decode=compiled,
                                  compiled_prefill=compiled, max_num_seqs=config.max_num_seqs,
                                  max_model_len=max_model_len, eos_token_ids=eos_token_ids)
        self._requests: dict[str, Sequence] = {}
        self.compile_guard = contextlib.nullcontext  # every step runs in it: no_new_compiles once warmed up
        self.warmup_report = None  # what warmup() ran, once it has

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, config: EngineConfig | None = None) -> "LLMEngine":
        """Load a checkpoint directory (or hub id): config.json, safetensors, and the tokenizer when present.

        Raises:
            FileNotFoundError: no such checkpoint. ValueError: unsupported model type or bad settings.
        """
        from metainfer_gen.llm.loader import load_config, load_model, resolve_checkpoint

        config = config or EngineConfig()
        path = resolve_checkpoint(path_or_id)
        model_config = load_config(path, config)  # refuses settings the family cannot use yet, before any rank
        tp, device = _tensor_parallel(config)
        device = torch.device(config.device) if config.device else device
        dtype = getattr(torch, config.dtype) if config.dtype else native_dtype(device)
        max_len = config.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}")
        model = load_model(path, model_config, dtype=dtype, device=device, max_positions=max_len, tp=tp,
                           quantization=config.quantization)
        tokenizer = _load_tokenizer(path)
        eos = model_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        return cls(model, config, max_model_len=max_len, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos_ids)))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size

    # -- requests -------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens) or of a list of ids.

        Raises:
            ValueError: an empty or whitespace-only text, or a text prompt for a checkpoint without a tokenizer.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("empty prompt: give some text")
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass prompts as lists of token ids")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return [int(t) for t in prompt]

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id.

        Raises:
            ValueError: empty prompt, duplicate id, or token ids outside the vocabulary.
            RequestRejected: the prompt (plus at least one new token) exceeds ``max_model_len``, or the prompt plus
                ``max_new_tokens`` can never fit the KV pool.
        """
        params = params or SamplingParams()
        token_ids = self.encode(prompt)
        self._check_tokens(token_ids)
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(token_ids) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                                  f"max_model_len={self.max_model_len}; shorten it below {self.max_model_len} tokens")
        total = min(len(token_ids) + params.max_new_tokens, self.max_model_len)
        if total > self.kv_capacity_tokens:
            per_token = self.kv_sizing.bytes_per_block / self.config.block_size
            raise RequestRejected(f"prompt ({len(token_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                  f"needs {total} tokens of KV cache ({total * per_token / 2**20:.2f} MiB at "
                                  f"{per_token:.0f} bytes/token) but the pool holds {self.kv_capacity_tokens} "
                                  f"({self.block_manager.num_blocks} blocks of {self.config.block_size}; "
                                  f"{self.kv_sizing.describe()}); lower max_new_tokens or give the engine more "
                                  f"KV memory")
        seq = Sequence(token_ids, params, request_id=request_id or "")
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
            self.runner.release(seq)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- running --------------------------------------------------------------------------------------------
    def warmup(self):
        """Run the step shapes the scheduler can produce once (a full-budget prefill, decode batches up to
        ``max_num_seqs``) on scratch KV blocks, so their compiled paths are built now; later steps compile nothing
        new (:mod:`metainfer_gen.llm.warmup`). Leaves no request, cached prefix or counter behind.

        Returns:
            a :class:`~metainfer_gen.llm.warmup.WarmupReport`.
        Raises:
            RuntimeError: requests are open.
        """
        from metainfer_gen.kernels.common import no_new_compiles
        from metainfer_gen.llm.warmup import warm_up

        report = self.warmup_report = warm_up(self)
        self.compile_guard = no_new_compiles
        return report

    def step(self) -> list[RequestOutput]:
        """One scheduler step + forward: an output per request that got a token, or whose row failed (it alone)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        with self.compile_guard():  # a row that raises ends its request alone (llm/step_recovery.py)
            sampled, logprobs, errors = run_step(self.runner, out)
        finished = {s.seq_id for s in self.scheduler.update(out, sampled, time.perf_counter(), logprobs, errors)}
        outputs = []
        for item in out.scheduled:
            seq = item.seq
            if seq.seq_id not in sampled and seq.seq_id not in finished:  # (finished unsampled: its row failed)
                continue
            outputs.append(RequestOutput.from_sequence(seq, [sampled[seq.seq_id]] if seq.seq_id in sampled else [],
                                                       self._detokenize(seq) if seq.seq_id in finished else ""))
            if seq.seq_id in finished:
                self._requests.pop(seq.request_id, None)
                self.runner.release(seq)
        return outputs

    def stream(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Add ``prompts`` and yield each request's output every time it gains a token (refusals first)."""
        order, refused = self._add_all(prompts, params)
        yield from self._run(set(order), refused)

    def _run(self, ids: set[str], refused: list[RequestOutput]) -> Iterator[RequestOutput]:
        yield from refused
        while self.has_unfinished_requests:
            for output in self.step():
                if output.request_id in ids:
                    yield output

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order. A prompt that can never fit gets an output
        with ``finish_reason`` "error" and the reason, while the others run.

        Raises:
            ValueError: an empty prompt or bad ids (before any work), mismatched ``params`` list.
        """
        order, refused = self._add_all(prompts, params)
        final = {o.request_id: o for o in self._run(set(order), refused) if o.finished}
        return [final[i] for i in order]

    def _add_all(self, prompts, params) -> tuple[list[str], list[RequestOutput]]:
        """Check every prompt first (nothing is queued if one is malformed), then queue them in order."""
        if isinstance(prompts, str) or not isinstance(prompts, SequenceABC):
            raise TypeError("prompts must be a list of strings or of token-id lists")
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(
            prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        for i, ids in enumerate(encoded):
            try:
                self._check_tokens(ids)
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
        order, refused = [], []
        for ids, p in zip(encoded, params_list):
            try:
                order.append(self.add_request(ids, p))
            except RequestRejected as err:
                rid = f"refused-{len(order)}-{id(err)}"
                order.append(rid)
                refused.append(RequestOutput.refused(rid, ids, str(err)))
        return order, refused

    def _check_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got min {min(token_ids)}, "
                             f"max {max(token_ids)}")

    def _detokenize(self, seq: Sequence) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)


def _tensor_parallel(config: EngineConfig):
    """``(TensorParallel, default device)``: one process, or this rank's place after ``init_distributed``.

    Raises:
        ValueError: ``tensor_parallel_size`` does not divide the launched world size.
    """
    from metainfer_gen.llm.parallel import TensorParallel

    if config.tensor_parallel_size == 1:
        return TensorParallel.single(), torch.device(default_device())
    from metainfer_gen import collectives

    state = collectives.init_distributed(tensor_parallel_size=config.tensor_parallel_size)
    group = state.groups["tp"]
    return TensorParallel(rank=group.rank, size=group.size, group="tp"), state.device


def _load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when it ships none."""
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

