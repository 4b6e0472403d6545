"""Rank bodies of the CFG-parallel tests (run by :func:`tests.collectives.harness.run_ranks`), and the calls they
make, shared with the single-process reference in ``test_cfg_parallel.py``."""

from __future__ import annotations

import os

import numpy as np

SMALL = {"num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 2}
T2V_CALL = {"prompt": "a red circle moving right", "guidance_scale": 5.0, "seed": 3, **SMALL}
I2V_CALL = {"prompt": "the square moves up", "guidance_scale": 4.0, "seed": 5, **SMALL}
OFF_CALL = {**T2V_CALL, "guidance_scale": 1.0}
CLI_ARGS = ["--device", "cpu", "--steps", "2", "--num-frames", "5", "--height", "32", "--width", "32",
            "--guidance-scale", "5", "--seed", "3"]


def reference_image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def load(cls_name: str, path: str):
    from metainfer_gen import pipelines

    pipe = getattr(pipelines, cls_name).from_pretrained(path, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe, call: dict, image=None) -> dict:
    """One call: the final latents (float32, from the pipeline's step callback), frames, stats and audit."""
    latents = []

    def capture(_pipe, _step, _t, tensors):
        latents.append(tensors["latents"].float().cpu().numpy().copy())
        return {}

    call = dict(call)
    prompt = call.pop("prompt")
    out = pipe(*((prompt,) if image is None else (image, prompt)), callback_on_step_end=capture, **call)
    paths = pipe.last_audit.paths()
    return {"latents": latents[-1], "frames": out.frames, "stats": out.stats.to_dict(), "seed": out.settings["seed"],
            "paths": {op: paths.get(op) for op in ("cfg_parallel", "all_gather")},
            "refusals": sorted(pipe.last_audit.refusals().get("cfg_parallel", ()))}


def cfg_parallel_cases(rank: int, world: int, args: dict) -> dict:
    """T2V with and without guidance, I2V, a call without a seed, a call whose prompt differs per rank, and the
    CLI's single clip with ``--cfg-parallel`` (rank 0 writes ``args["clip"]``)."""
    from metainfer_gen import collectives
    from metainfer_gen.apps.cli import main

    os.environ["METAINFER_COLLECTIVES_TIMEOUT"] = "600"  # a loaded machine may start one rank minutes late
    t2v = load("TextToVideoPipeline", args["t2v"])
    t2v.enable_cfg_parallel()
    i2v = load("ImageToVideoPipeline", args["i2v"])
    i2v.enable_cfg_parallel()
    out = {"t2v": render(t2v, T2V_CALL), "off": render(t2v, OFF_CALL),
           "i2v": render(i2v, I2V_CALL, reference_image()), "unseeded": render(t2v, {**T2V_CALL, "seed": None})}
    try:
        t2v(f"rank {rank} asks for something else", **SMALL)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    out["layout"] = {name: (g.rank, g.size) for name, g in collectives.get_state().groups.items()}
    out["cli"] = main(["render", T2V_CALL["prompt"], "-o", args["clip"], "--model", args["t2v"], "--cfg-parallel",
                       *CLI_ARGS])
    collectives.shutdown_distributed()
    return out
