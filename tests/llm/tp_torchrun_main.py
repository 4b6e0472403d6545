"""Run under ``torchrun --nproc-per-node N``: a TP=N engine generates greedily; rank 0 writes the tokens as JSON.

    torchrun --nproc-per-node 2 tests/llm/tp_torchrun_main.py CHECKPOINT_DIR OUT.json PROMPTS_JSON MAX_NEW
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import torch

    from metainfer_gen import collectives
    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    path, out, prompts, max_new = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    world = int(os.environ["WORLD_SIZE"])
    engine = LLMEngine.from_pretrained(path, EngineConfig(tensor_parallel_size=world, block_size=4))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    record = collectives.last_audit()
    if collectives.get_state().rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens": [o.token_ids for o in outputs], "last_path": record.path,
                       "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}, f)
    collectives.shutdown_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
