"""``TextGenerationPipeline``: prompts in, completions out, served by the paged-KV engine.

    from metainfer_gen import pipelines
    llm = pipelines.TextGenerationPipeline.from_pretrained()          # embedded default LLM
    out = llm(["The pass key is 12345. What is the pass key? The pass key is"], max_new_tokens=8, temperature=0)
    out[0].text, out[0].token_ids, out[0].finish_reason, out[0].ttft

Call arguments use Hugging Face ``generate``'s names (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``);
``temperature=0`` is greedy.

A model folder may say how long a context it was trained at (``trained_context`` in its ``metainfer_gen.json``;
the embedded LLMs were trained at 512 tokens but accept ``max_position_embeddings`` = 2,048). A call whose prompt
plus ``max_new_tokens`` goes past it still runs, with one ``UserWarning`` per call naming both lengths: the output
past the trained length is unreliable. A checkpoint without that file gets no warning.
"""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

from metainfer_gen.llm.config import EngineConfig
from metainfer_gen.pipelines.call_lock import call_lock

DEFAULT_LLM_DIR = "demo_llm"
TRAINED_CONTEXT_KEY = "trained_context"  # in the model folder's metainfer_gen.json, tokens


def default_llm_dir() -> Path:
    """Folder of the embedded default LLM (a DeepSeek-V3-architecture checkpoint) inside the installed package.

    Raises:
        FileNotFoundError: the package was installed without its assets.
    """
    path = Path(str(resources.files("metainfer_gen.assets"))) / DEFAULT_LLM_DIR
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the embedded default LLM is missing at {path}; reinstall metainfer-gen, or build "
                                f"it with `python -m demo_models.llm.build`")
    return path


def trained_context(path: str | Path) -> int | None:
    """The context length, in tokens, a model folder says it was trained at (``trained_context`` in its
    ``metainfer_gen.json``); None when the folder has no such file or entry (checkpoints from elsewhere).

    Raises:
        ValueError: the file is not JSON, or the entry is not a positive integer.
    """
    from metainfer_gen.pipelines.loading import SETTINGS_FILE, model_settings

    value = model_settings(path).get(TRAINED_CONTEXT_KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{Path(path) / SETTINGS_FILE}: {TRAINED_CONTEXT_KEY} must be a positive number of tokens "
                         f"(the context the model was trained at); got {value!r}: fix it or remove the entry")
    return value


class TextGenerationPipeline:
    """Wraps an :class:`~metainfer_gen.llm.engine.LLMEngine`; ``pipe.engine`` is the engine itself.

    Args:
        engine: the engine that serves the calls.
        trained_context: tokens the model was trained at, or None (unknown: no warning); a call past it warns.
    """

    def __init__(self, engine, trained_context: int | None = None):
        self.engine = engine
        self.trained_context = trained_context

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path | None = None, *, device: str | None = None,
                        torch_dtype=None, warmup: bool = False, **engine_kwargs) -> "TextGenerationPipeline":
        """Load the embedded LLM (no argument), a checkpoint directory, or a hub id.

        Args:
            pretrained_model_name_or_path: None, a directory with config.json + safetensors (+ tokenizer), or a
                hub id.
            device: "cpu", "cuda", ...; default CUDA when available.
            torch_dtype: torch.float32 / torch.bfloat16 / torch.float16 or its name; default bfloat16 where the
                hardware has native bf16 (a GPU, a CPU with AMX-BF16 or AVX512-BF16), float32 elsewhere
                (:func:`metainfer_gen.platform.native_dtype`).
            warmup: run :meth:`~metainfer_gen.llm.engine.LLMEngine.warmup` after loading (seconds at start-up,
                so that no later call waits for a compile; the CLI and the server do).
            engine_kwargs: :class:`~metainfer_gen.llm.config.EngineConfig` fields (``block_size``,
                ``max_num_seqs``, ``enable_prefix_caching``, ...).
        Raises:
            FileNotFoundError: no such checkpoint. ValueError: unsupported model or bad settings.
        """
        from metainfer_gen.llm.engine import LLMEngine
        from metainfer_gen.llm.loader import resolve_checkpoint

        dtype = str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else None
        config = EngineConfig(device=device, dtype=dtype, **engine_kwargs)
        path = resolve_checkpoint(pretrained_model_name_or_path or default_llm_dir())
        trained = trained_context(path)  # a bad settings file fails before the weights load
        engine = LLMEngine.from_pretrained(path, config)
        if warmup:
            engine.warmup()
        return cls(engine, trained_context=trained)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def __call__(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: tuple[int, ...] = (),
                 ignore_eos: bool = False, **sampling):
        """Complete each prompt.

        Args:
            prompts: a string, or a list of strings / token-id lists.
            max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos: see
                :class:`~metainfer_gen.llm.sequence.SamplingParams`.
            sampling: its further fields: ``min_tokens``, ``presence_penalty``, ``frequency_penalty``,
                ``repetition_penalty``, ``logprobs`` (then each output's ``logprobs`` holds one
                ``TokenLogprobs`` per generated token).
        Returns:
            One :class:`~metainfer_gen.llm.outputs.RequestOutput` (for a string) or a list of them, in order, with
            ``text``, ``token_ids``, ``finish_reason`` ("stop", "length" or "error" with ``error``), ``ttft`` and
            ``mean_token_latency`` in seconds.
        Raises:
            ValueError: bad sampling settings or an empty prompt (before any work). TypeError: an unknown keyword.
        Warns:
            UserWarning: once per call, when a prompt plus ``max_new_tokens`` goes past :attr:`trained_context`.
        """
        from metainfer_gen.llm.sequence import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos, **sampling)
        single = isinstance(prompts, str)
        batch = [prompts] if single else list(prompts)
        if self.trained_context is not None:
            batch = [self.engine.encode(p) for p in batch]  # token ids run exactly as the text would
            self._warn_past_trained_context(batch, max_new_tokens)
        with call_lock(self.engine):  # one call at a time per engine, whichever thread calls
            outputs = self.engine.generate(batch, params)
        return outputs[0] if single else outputs

    def _warn_past_trained_context(self, batch: list[list[int]], max_new_tokens: int) -> None:
        """One warning for the prompts whose prompt + new tokens (capped by the engine's ``max_model_len``) pass
        the trained length; prompts the engine will refuse anyway (no room to generate) are left out."""
        trained, limit = self.trained_context, self.engine.max_model_len
        past = [(min(len(ids) + max_new_tokens, limit), i, len(ids)) for i, ids in enumerate(batch)
                if len(ids) < limit and min(len(ids) + max_new_tokens, limit) > trained]
        if not past:
            return
        total, i, num_tokens = max(past, key=lambda item: item[0])  # the first of the longest
        which = f"{len(past)} of {len(batch)} prompts go past the trained length; the longest, " \
            if len(past) > 1 else ""
        warnings.warn(f"{which}prompt {i} ({num_tokens} tokens) + max_new_tokens={max_new_tokens} reaches {total} "
                      f"tokens, past the {trained} tokens this model was trained at (it accepts up to {limit}, but "
                      f"its output past {trained} tokens is unreliable); keep prompt + max_new_tokens within "
                      f"{trained} tokens", UserWarning, stacklevel=3)
