"""The checkpoints ``serve_llm.py`` serves: the embedded LLM as shipped, and llm_throughput.py's random-large
DeepSeek-V3 widened to DeepSeek's 576-wide MLA latent so vLLM's CPU build can run it too.

vLLM's CPU MLA takes only kv_lora_rank 512 + qk_rope_head_dim 64 (and block size 16), and its DeepSeek-V3 loader
needs ``topk_method`` / ``scoring_func`` in config.json, which transformers 5.x does not write. A server streams
text, so the random checkpoint gets a word-level tokenizer over its whole vocabulary (token i <-> word ``w<i>``):
every generated token decodes to non-empty text, so one streamed chunk is one token on both servers.
"""

from __future__ import annotations

import json
from pathlib import Path

from llm_throughput import LARGE  # noqa: E402  (benchmarks/ is on the path when a script here runs)

MLA_576 = dict(kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V3's latent: 512 + 64 = 576 wide
VLLM_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # what DeepSeek's own config.json says
QUICK_SHAPES = dict(hidden_size=128, num_hidden_layers=2, vocab_size=512)


def build_random_large(out: Path, quick: bool = False, seed: int = 0) -> Path:
    """Save a random DeepSeek-V3 (``LARGE`` with the 576-wide latent; smaller layers when ``quick``) with a
    word-level tokenizer to ``out``; returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = {**LARGE, **MLA_576, **(QUICK_SHAPES if quick else {})}
    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v3", bos_token_id=None, eos_token_id=None, **shapes)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **VLLM_ROUTER}, indent=2))
    save_word_tokenizer(out, shapes["vocab_size"])
    return out


def random_large_pipeline(workdir: str | Path, num_prompts: int, prompt_lens: str, output_len: int, dtype,
                          **engine_options):
    """The warmed-up pipeline over the random checkpoint under ``workdir`` (built on first use) that
    ``llm_profile.py``, ``llm_batches.py`` and ``llm_decode_step.py`` time: batch ``num_prompts``, context for the
    longest prompt of ``prompt_lens`` ("lo,hi") plus ``output_len``, other EngineConfig fields from
    ``engine_options``; returns ``(pipe, lo, hi)``."""
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    path = Path(workdir) / "random-large"
    if not (path / "config.json").exists():
        build_random_large(path)
    lo, hi = (int(v) for v in prompt_lens.split(","))
    pipe = TextGenerationPipeline.from_pretrained(str(path), warmup=True, max_num_seqs=num_prompts,
                                                  max_model_len=max(1024, hi + output_len), torch_dtype=dtype,
                                                  **engine_options)
    return pipe, lo, hi


def add_batch_args(parser, prompt_lens: str = "64,512", output_len: int = 32, dtype: str | None = None) -> None:
    """The options of the offline-batch scripts (``llm_profile.py``, ``llm_roofline.py``, ``llm_batches.py``):
    ``--workdir``, ``--num-prompts``, ``--prompt-lens``, ``--output-len``, ``--dtype`` (None: the engine's
    default); the defaults are serve_llm.py's C=64 batch."""
    parser.add_argument("--workdir", default="/tmp/llm_profile", help="where the random checkpoint is saved")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts per batch (default 64)")
    parser.add_argument("--prompt-lens", default=prompt_lens,
                        help=f"prompt lengths lo,hi in tokens (default {prompt_lens}; the prefill-heavy row is "
                             f"512,1024 with --output-len 4)")
    parser.add_argument("--output-len", type=int, default=output_len,
                        help=f"greedy tokens per prompt (default {output_len})")
    parser.add_argument("--dtype", default=dtype,
                        help=f"float32 or bfloat16 (default {dtype or 'the engine default'})")


def random_large_batches(args, count: int):
    """The warmed-up pipeline of :func:`random_large_pipeline` for ``args`` (:func:`add_batch_args`), greedy
    ``ignore_eos`` sampling of ``args.output_len`` tokens, and ``count`` batches of ``args.num_prompts`` prompts
    (seeds 1 .. count: no batch shares a prefix with another); returns ``(pipe, params, batches)``."""
    from metainfer_gen.llm.sequence import SamplingParams

    pipe, lo, hi = random_large_pipeline(args.workdir, args.num_prompts, args.prompt_lens, args.output_len,
                                         args.dtype)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    batches = [random_prompts(args.num_prompts, 1000, lo, hi, seed) for seed in range(1, count + 1)]
    return pipe, params, batches


def save_word_tokenizer(out: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer mapping id i to the word ``w<i>`` (whitespace-split), saved in the transformers
    layout both venvs read (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0", "model_max_length": 1 << 20}, indent=2))


def random_prompts(num: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``num`` prompts of random token ids in [3, vocab), lengths uniform in [lo, hi] (seeded; as
    ``vllm bench serve --dataset random`` with token ids sent as they are, no retokenisation)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]
