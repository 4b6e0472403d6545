"""Clips per hour against plain diffusers at the model's own settings: one table from one (resumable) run.

    OMP_NUM_THREADS=2 python benchmarks/video_throughput.py                       # the full run (see docs)
    python benchmarks/video_throughput.py --model DIR --num-prompts 1 --num-frames 5 --size 32 --steps 2 \\
        --rows diffusers,ours,preset_fastest --results /tmp/vt.jsonl              # smoke run on a tiny model

Text-to-video and image-to-video on the embedded model at its own settings (its default steps and guidance, 17
frames 64x64), held-out demo prompts (never trained on), seed = prompt index. Rows (``video_rows.ROWS``): plain
diffusers (``WanPipeline`` / ``WanImageToVideoPipeline`` on the same weights, float32); ours with nothing enabled;
each acceleration added in turn (fused kernels, embed memo, prompt-embedding cache, bf16 VAE, CFG batching, step
cache ``auto``, the step LoRA fused at its 4 unguided steps); then each preset (``enable_acceleration``). Rows run
interleaved:
for each prompt every row renders in turn (``--repeats`` rounds, the fastest counting), after one untimed warm-up
call per row. A clip's seconds are the pipeline call plus its MP4 export (``VideoOutput.save``'s writer, the same on
every row); clips per hour = 3600 / that. PSNR (mean, worst clip) against plain diffusers' clip of the same prompt
and seed; adherence = clips whose colour and direction the project's reader (``read_clip``) reads as prompted, and
the same count by the independent reader (``frame_reader.py``). Shares: each piece's part of the clip (text
encoder, transformer calls, VAE encode + decode, set-up = the rest of the call, export).

Resumable: every finished (task, row, prompt) is appended to ``--results`` (JSON lines) at once; a rerun skips what
is there and prints the table from the whole file (``--fresh`` starts over). Plain diffusers' clips, the PSNR
reference, are kept beside it (``<results>.clips/``) and re-rendered untimed when missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_reader import follows  # noqa: E402
from rounds import clip_psnr  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402
from video_rows import BASELINE, PRESET_ROWS, ROWS, make_row  # noqa: E402

TASKS = {"t2v": "text-to-video", "i2v": "image-to-video"}
RESULTS = Path(__file__).resolve().parent / "results" / "video_throughput.jsonl"
WARMUP_SEED = 10_000
PIECE_COLUMNS = (("text_encoder",), ("transformer",), ("vae_encode", "vae_decode"), ("setup",), ("export",))


def load_records(path: Path) -> list[dict]:
    """The records already in ``path`` (none when it does not exist); a torn last line is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def items_for(num_prompts: int, size: int, num_frames: int):
    """(prompt, first frame, combo, fitted PIL image) per held-out prompt."""
    from step_cache import prompts_and_images

    from metainfer_gen.video.images import fit_image, load_image

    return [(p, f, c, fit_image(load_image(f), size, size)) for p, f, c in prompts_and_images(num_prompts, size,
                                                                                               num_frames)]


def model_call(model: str | None, args) -> dict:
    """The model's own settings (its ``metainfer_gen.json``), with the run's overrides."""
    from metainfer_gen import pipelines

    pipe = pipelines.TextToVideoPipeline.from_pretrained(model, device="cpu", embed_memo=False)
    call = {name: pipe.default(name) for name in ("num_frames", "height", "width", "num_inference_steps",
                                                  "guidance_scale")}
    if "max_sequence_length" in pipe.settings:
        call["max_sequence_length"] = pipe.settings["max_sequence_length"]
    for name, value in (("num_frames", args.num_frames), ("height", args.size), ("width", args.size),
                        ("num_inference_steps", args.steps), ("guidance_scale", args.guidance_scale)):
        if value is not None:
            call[name] = value
    preset_call = {k: call[k] for k in ("num_frames", "height", "width")}
    preset_call.update({k: v for k, v in (("num_inference_steps", args.steps), ("guidance_scale",
                                                                              args.guidance_scale)) if v is not None})
    return {"call": call, "preset_call": preset_call}


def run(args) -> None:
    from metainfer_gen.video.export import save_video

    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    clips = Path(str(results) + ".clips")
    clips.mkdir(exist_ok=True)
    done = {(r["task"], r["row"], r["index"]) for r in load_records(results) if r.get("kind") == "clip"}
    calls = model_call(args.model, args)
    items = items_for(args.num_prompts, calls["call"]["height"], calls["call"]["num_frames"])
    rows = [r for r in ROWS if r in args.rows]
    fps = 8.0
    with tempfile.TemporaryDirectory() as scratch, results.open("a") as out:
        for short in args.tasks:
            task, renders = TASKS[short], {}

            def row(name):  # loaded on first need, warmed up once
                if name not in renders:
                    render, note = make_row(name, args.model, task, calls["call"], calls["preset_call"])
                    if render is not None:
                        render(items[0], WARMUP_SEED)
                    renders[name] = render
                    out.write(json.dumps({"kind": "row", "task": short, "row": name, "note": note}) + "\n")
                    out.flush()
                return renders[name]

            for index, item in enumerate(items):
                pending = [r for r in rows if (short, r, index) not in done]
                if not pending:
                    continue
                reference_file = clips / f"{short}_{index}.npy"
                best: dict[str, tuple] = {}
                for _ in range(args.repeats):
                    for name in pending:
                        render = row(name)
                        if render is None:
                            continue
                        start = time.perf_counter()
                        frames, pieces = render(item, index)
                        seconds = time.perf_counter() - start
                        exported = time.perf_counter()
                        save_video(frames, Path(scratch) / "clip.mp4", fps=fps)
                        pieces = {k: v for k, v in pieces.items() if k != "setup"}
                        pieces["setup"] = max(0.0, seconds - sum(pieces.values()))
                        pieces["export"] = time.perf_counter() - exported
                        total = seconds + pieces["export"]
                        if name not in best or total < best[name][0]:
                            best[name] = (total, frames, pieces)
                if BASELINE in best:
                    np.save(reference_file, best[BASELINE][1])
                if not reference_file.exists():  # resumed after the baseline finished: render it again, untimed
                    np.save(reference_file, row(BASELINE)(item, index)[0])
                reference = np.load(reference_file)
                for name, (total, frames, pieces) in best.items():
                    record = {"kind": "clip", "task": short, "row": name, "index": index, "seconds": total,
                              "pieces": pieces, "psnr": None if name == BASELINE else clip_psnr(frames, reference),
                              "project": bool(_project_reads(frames, item[2])),
                              "independent": follows(frames, item[2][0], item[2][2])}
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                print(f"{short} prompt {index + 1}/{len(items)} done ({len(best)} rows)", file=sys.stderr,
                      flush=True)


def _project_reads(frames, combo) -> bool:
    from demo_models.video.evaluate import read_clip

    reading = read_clip(frames)
    return reading.colour == combo[0] and reading.direction == combo[2]


def summarise(records: list[dict], tasks: list[str], rows: list[str]) -> list[list[str]]:
    """The table's rows: one per (task, row) with clips in ``records``, in run order."""
    table = []
    for short in tasks:
        clips = [r for r in records if r.get("kind") == "clip" and r["task"] == short]
        base = [r["seconds"] for r in clips if r["row"] == BASELINE]
        base_mean = float(np.mean(base)) if base else None
        for name in rows:
            mine = sorted((r for r in clips if r["row"] == name), key=lambda r: r["index"])
            if not mine:
                continue
            seconds = float(np.mean([r["seconds"] for r in mine]))
            psnrs = [r["psnr"] for r in mine if r["psnr"] is not None]
            shares = [sum(float(np.mean([r["pieces"].get(k, 0.0) for r in mine])) for k in keys) / seconds
                      for keys in PIECE_COLUMNS]
            n = len(mine)
            table.append([short, name, f"{seconds:.3f}", f"{3600 / seconds:.0f}",
                          "-" if base_mean is None else f"{base_mean / seconds:.2f}x",
                          f"{np.mean(psnrs):.1f} / {np.min(psnrs):.1f}" if psnrs else "-",
                          f"{sum(r['project'] for r in mine)}/{n}", f"{sum(r['independent'] for r in mine)}/{n}",
                          " / ".join(f"{100 * s:.0f}" for s in shares)])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--tasks", default="t2v,i2v", help="comma-separated t2v, i2v (default both)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows (default all: {','.join(ROWS)})")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per task (default 8)")
    parser.add_argument("--num-frames", type=int, default=None, help="frames (default: the model's)")
    parser.add_argument("--size", type=int, default=None, help="height and width (default: the model's)")
    parser.add_argument("--steps", type=int, default=None, help="steps of every row, presets included (default: "
                                                                "the model's; the presets' and step LoRA's own)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="guidance (default: the model's)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per prompt, the fastest counting (default 1)")
    parser.add_argument("--results", default=str(RESULTS), help=f"JSON-lines results file (default {RESULTS})")
    parser.add_argument("--fresh", action="store_true", help="discard the results file and start over")
    args = parser.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [t for t in args.tasks if t not in TASKS] + [r for r in args.rows if r not in ROWS]
    if unknown or args.repeats < 1 or args.num_prompts < 1:
        parser.error(f"unknown task or row {unknown}, or --repeats / --num-prompts below 1")
    if BASELINE not in args.rows:
        parser.error(f"the {BASELINE!r} row is every ratio's baseline: keep it in --rows")
    if args.fresh:
        Path(args.results).unlink(missing_ok=True)
    started = time.perf_counter()
    print(run_header(), flush=True)
    run(args)
    records = load_records(Path(args.results))
    print_table(["task", "row", "s / clip", "clips / h", "vs diffusers", "PSNR mean / worst", "adherence (ours)",
                 "adherence (independent)", "% text enc / transformer / VAE / set-up / export"],
                summarise(records, args.tasks, args.rows))
    notes = {(r["task"], r["row"]): r["note"] for r in records if r.get("kind") == "row" and r["row"] in PRESET_ROWS}
    for (task, name), note in notes.items():
        print(f"\n{task} {name}:\n{note}")
    print(run_footer(time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
