"""The embedded Wan VAE's decode: diffusers' one latent frame a call against several a call, one table from one run.

    OMP_NUM_THREADS=2 python benchmarks/vae_decode.py | tee benchmarks/results/vae_decode.txt

Rows per clip length and dtype, interleaved round by round (the median of ``--repeats`` rounds counts), each on the
same random latent of the embedded model's shape (48 channels, 16x16 for 64x64 px):

* ``plain``: diffusers' decode as shipped (no kernels of ours).
* ``per frame``: our VAE kernels (oneDNN ``conv3d``, ``channel_rms_norm``, ``upsample_nearest``), diffusers' loop of
  one latent frame a call (``FuseKernelsConfig(vae_decode_chunks=False)``): the baseline of the ratio column.
* ``chunked``: the same kernels with the decoder on several latent frames a call
  (:mod:`metainfer_gen.video.fuse.wan_vae_decode`).

``max diff`` is each row's max abs difference from the ``per frame`` clip (pixels in [-1, 1]).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from table import print_table, run_footer, run_header  # noqa: E402


def _vae(config):
    from metainfer_gen.pipelines.text_to_video import TextToVideoPipeline
    from metainfer_gen.video.fuse import fuse_kernels

    vae = TextToVideoPipeline.from_pretrained().vae
    if config is not None:
        fuse_kernels(vae, config)
    return vae


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", default="17,81", help="comma-separated clip lengths (1 + 4 k)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from metainfer_gen.video.fuse import FuseKernelsConfig

    print(run_header())
    started = time.time()
    rows_vae = {"plain": _vae(None), "per frame": _vae(FuseKernelsConfig(vae_decode_chunks=False)),
                "chunked": _vae(FuseKernelsConfig())}
    table = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for vae in rows_vae.values():
            vae.to(dtype)
        for frames in (int(f) for f in args.frames.split(",")):
            z = torch.randn(1, 48, (frames - 1) // 4 + 1, 16, 16, generator=torch.Generator().manual_seed(0))
            z = z.to(dtype)
            times = {name: [] for name in rows_vae}
            clips = {}
            with torch.inference_mode():
                for name, vae in rows_vae.items():  # warm-up, and each row's clip
                    clips[name] = vae.decode(z, return_dict=False)[0].float()
                for _ in range(args.repeats):
                    for name, vae in rows_vae.items():
                        start = time.perf_counter()
                        vae.decode(z, return_dict=False)
                        times[name].append(time.perf_counter() - start)
            base = statistics.median(times["per frame"])
            for name in rows_vae:
                seconds = statistics.median(times[name])
                diff = (clips[name] - clips["per frame"]).abs().max().item()
                table.append([f"{frames}", dtype_name, name, f"{seconds:.3f}", f"{base / seconds:.2f}x", f"{diff:.1e}"])
            print(f"# {frames} frames {dtype_name} done", flush=True)
    print_table(["frames", "dtype", "row", "s / decode", "vs per frame", "max diff"], table)
    print(run_footer(time.time() - started))


if __name__ == "__main__":
    main()
