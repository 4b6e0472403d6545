"""``TextGenerationPipeline``: prompts in, completions out, served by the paged-KV engine.

    from metainfer_gen import pipelines
    llm = pipelines.TextGenerationPipeline.from_pretrained()          # embedded default LLM
    out = llm(["The pass key is 12345. What is the pass key? The pass key is"], max_new_tokens=8, temperature=0)
    out[0].text, out[0].token_ids, out[0].finish_reason, out[0].ttft

Call arguments use Hugging Face ``generate``'s names (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``);
``temperature=0`` is greedy.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from metainfer_gen.llm.config import EngineConfig

DEFAULT_LLM_DIR = "demo_llm"


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


class TextGenerationPipeline:
    """Wraps an :class:`~metainfer_gen.llm.engine.LLMEngine`; ``pipe.engine`` is the engine itself."""

    def __init__(self, engine):
        self.engine = engine

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path | None = None, *, device: str | None = None,
                        torch_dtype=None, **engine_kwargs) -> "TextGenerationPipeline":
        """Load the embedded LLM (no argument), a checkpoint directory, or a hub id.

        Args:
            pretrained_model_name_or_path: None, a directory with config.json + safetensors (+ tokenizer), or a
                hub id.
            device: "cpu", "cuda", ...; default CUDA when available.
            torch_dtype: torch.float32 / torch.bfloat16 / torch.float16 or its name; default float32 on CPU,
                bfloat16 on CUDA.
            engine_kwargs: :class:`~metainfer_gen.llm.config.EngineConfig` fields (``block_size``,
                ``max_num_seqs``, ``enable_prefix_caching``, ...).
        Raises:
            FileNotFoundError: no such checkpoint. ValueError: unsupported model or bad settings.
        """
        from metainfer_gen.llm.engine import LLMEngine

        dtype = str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else None
        config = EngineConfig(device=device, dtype=dtype, **engine_kwargs)
        return cls(LLMEngine.from_pretrained(pretrained_model_name_or_path or default_llm_dir(), config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def __call__(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: tuple[int, ...] = (),
                 ignore_eos: bool = False):
        """Complete each prompt.

        Args:
            prompts: a string, or a list of strings / token-id lists.
            max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos: see
                :class:`~metainfer_gen.llm.sequence.SamplingParams`.
        Returns:
            One :class:`~metainfer_gen.llm.outputs.RequestOutput` (for a string) or a list of them, in order, with
            ``text``, ``token_ids``, ``finish_reason`` ("stop", "length" or "error" with ``error``), ``ttft`` and
            ``mean_token_latency`` in seconds.
        Raises:
            ValueError: bad sampling settings or an empty prompt (before any work).
        """
        from metainfer_gen.llm.sequence import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
        single = isinstance(prompts, str)
        outputs = self.engine.generate([prompts] if single else list(prompts), params)
        return outputs[0] if single else outputs
