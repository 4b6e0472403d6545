"""Copy the trained LLM into the package as the embedded default (bf16 safetensors + tokenizer).

    python -m demo_models.llm.build --checkpoint build/demo_llm/final

Writes ``metainfer_gen/assets/demo_llm/``. Weights are stored in bfloat16 (half the bytes; the engine upcasts to
float32 on the CPU); the MoE router stays float32 as transformers keeps it. ``metainfer_gen.json`` beside them
records the context the model was trained at (``configs.CONTEXT`` tokens; ``max_position_embeddings`` is larger),
so that ``TextGenerationPipeline`` warns when a call goes past it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from demo_models import ASSETS
from demo_models.llm import configs

MAX_BYTES = 8 * 2**20


def build(checkpoint: Path, out_dir: Path) -> int:
    """Returns the bytes written. Raises FileNotFoundError (no checkpoint) or RuntimeError (over budget)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint; run demo_models.llm.train first")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    from metainfer_gen.pipelines.loading import SETTINGS_FILE
    from metainfer_gen.pipelines.text_generation import TRAINED_CONTEXT_KEY

    (tmp / SETTINGS_FILE).write_text(json.dumps({TRAINED_CONTEXT_KEY: configs.CONTEXT}, indent=1) + "\n")
    size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    if size > MAX_BYTES:
        raise RuntimeError(f"embedded LLM would take {size / 2**20:.1f} MiB, over the {MAX_BYTES / 2**20:.0f} MiB "
                           f"budget")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="build/demo_llm/final", help="output folder of the training run")
    parser.add_argument("--out-dir", default=str(ASSETS / "demo_llm"),
                        help="where to write the embedded model (default: inside the package)")
    args = parser.parse_args(argv)
    size = build(Path(args.checkpoint), Path(args.out_dir))
    print(f"wrote {args.out_dir} ({size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
