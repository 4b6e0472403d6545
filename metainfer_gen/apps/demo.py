"""``metainfer-gen demo``: serve the Gradio demo (text-to-video, image-to-video, LLM) on this machine.

    metainfer-gen demo                          # embedded models, http://127.0.0.1:7860
    metainfer-gen demo --model DIR --llm-model CKPT --port 8000
    metainfer-gen demo --host 0.0.0.0           # reachable from the network (or --share for a gradio link)

Models load once, before the server starts, and are shared by every browser session.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

from metainfer_gen.apps.demo_limits import DemoLimits, list_loras
from metainfer_gen.apps.video_args import add_video_model_arguments, apply_model_options, load_options

DEFAULT_PORT = 7860


def add_demo_parser(subparsers) -> None:
    """Register the ``demo`` subcommand on the CLI's subparsers."""
    defaults = DemoLimits()
    p = subparsers.add_parser("demo", help="serve the Gradio demo (text-to-video, image-to-video, LLM) in a browser",
                              description="Load the models once and serve a Gradio page with one tab per loaded "
                                          "model. Binds 127.0.0.1 unless --host or --share says otherwise. Needs "
                                          "the demo extra: pip install 'metainfer-gen[demo]'.")
    p.add_argument("--model", default=None, help="video pipeline folder or hub id (default: the embedded model)")
    p.add_argument("--i2v-model", default=None,
                   help="separate image-to-video pipeline (default: image-to-video on --model's weights when the "
                        "model can do it; otherwise the tab is hidden)")
    p.add_argument("--llm-model", default=None,
                   help="LLM checkpoint folder or hub id (default: the embedded LLM; its tab is hidden when it is "
                        "not built)")
    p.add_argument("--no-llm", action="store_true", help="do not load an LLM (no LLM tab)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})")
    p.add_argument("--share", action="store_true", help="also ask gradio for a temporary public link")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    add_video_model_arguments(p)
    p.add_argument("--lora-dir", default=None,
                   help="folder of LoRA files (.safetensors, .bin) the page offers by name (default: the demo LoRAs "
                        "shipped for the embedded model when --model is not given, else no LoRA control)")
    p.add_argument("--max-frames", type=int, default=defaults.max_frames,
                   help=f"most frames per clip (default {defaults.max_frames})")
    p.add_argument("--max-size", type=int, default=defaults.max_size,
                   help=f"largest height/width in pixels (default {defaults.max_size})")
    p.add_argument("--max-steps", type=int, default=defaults.max_steps,
                   help=f"most denoising steps (default {defaults.max_steps})")
    p.add_argument("--max-prompt-chars", type=int, default=defaults.max_prompt_chars,
                   help=f"longest prompt in characters (default {defaults.max_prompt_chars})")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                   help=f"most tokens per LLM completion (default {defaults.max_new_tokens})")
    p.set_defaults(func=cmd_demo)


def limits_from_args(args: argparse.Namespace) -> DemoLimits:
    """The :class:`DemoLimits` the flags ask for (ValueError for a value below 1)."""
    return DemoLimits(max_frames=args.max_frames, max_size=args.max_size, max_steps=args.max_steps,
                      max_prompt_chars=args.max_prompt_chars, max_new_tokens=args.max_new_tokens)


def require_gradio() -> None:
    """Refuse to start without gradio, before minutes of model loading (gradio itself imports later, lazily).

    Raises:
        ValueError: gradio is not installed; the message names the extra that installs it.
    """
    if find_spec("gradio") is None:
        raise ValueError("the demo needs gradio, and gradio is not installed: pip install 'metainfer-gen[demo]' "
                         "(no model was loaded)")


def make_temp_root() -> Path:
    """A private temporary folder for uploads (gradio's cache) and clips, removed when the process exits.

    Sets ``GRADIO_TEMP_DIR`` so that gradio writes every uploaded file inside it; call before importing gradio.
    """
    root = Path(tempfile.mkdtemp(prefix="metainfer-demo-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["GRADIO_TEMP_DIR"] = str(root / "uploads")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the demo reports nothing to anyone
    return root


def load_backend(args: argparse.Namespace, output_dir: Path):
    """Load the models the flags name into a :class:`~metainfer_gen.apps.demo_backend.DemoBackend`.

    A model the user named that fails to load raises; the image-to-video and embedded-LLM tabs are left out
    with a note when their model cannot be had.
    """
    from metainfer_gen import pipelines
    from metainfer_gen.apps.demo_backend import DemoBackend

    options = load_options(args)
    notes: list[str] = []
    lora_dir = args.lora_dir
    if lora_dir is None and args.model is None:
        from metainfer_gen.pipelines.loading import default_lora_dir

        lora_dir = default_lora_dir()  # trained for the embedded model only
    if lora_dir is not None and not list_loras(lora_dir):  # a missing folder raises here, before loading
        notes.append(f"No LoRA control: {lora_dir} holds no .safetensors or .bin file")
    t2v = pipelines.TextToVideoPipeline.from_pretrained(args.model, device=args.device, **options)
    apply_model_options(t2v, args)
    if args.i2v_model:
        i2v = pipelines.ImageToVideoPipeline.from_pretrained(args.i2v_model, device=args.device, **options)
        apply_model_options(i2v, args)
    else:
        try:
            i2v = pipelines.ImageToVideoPipeline.from_pipe(t2v)  # same weights, no second load
        except ValueError as exc:
            i2v = None
            notes.append(f"Image-to-video is not shown: {exc} (give --i2v-model)")
    for pipe in (t2v, i2v):
        if pipe is not None:
            pipe.set_progress_bar_config(disable=True)  # the page shows progress; keep the server log readable
    llm = None
    if not args.no_llm:
        try:
            llm = pipelines.TextGenerationPipeline.from_pretrained(args.llm_model, device=args.device,
                                                                   torch_dtype=options["torch_dtype"], warmup=True)
        except Exception as exc:  # noqa: BLE001 - the embedded LLM may be missing or half-built; never fatal
            if args.llm_model:
                raise
            notes.append(f"The LLM tab is not shown: {type(exc).__name__}: {exc}")
    return DemoBackend(t2v=t2v, i2v=i2v, llm=llm, output_dir=output_dir, limits=limits_from_args(args), notes=notes,
                       lora_dir=lora_dir)


def cmd_demo(args: argparse.Namespace) -> int:
    """Load the models, build the page and serve it until interrupted.

    Raises:
        ValueError: gradio is missing (checked before anything loads), a limit below 1, a model that fails to load.
    """
    require_gradio()
    limits = limits_from_args(args)  # bad limits fail before minutes of loading
    root = make_temp_root()
    try:
        from metainfer_gen.apps.gradio_app import build_app, launch_app
    except ImportError as exc:
        raise ValueError(f"the demo needs gradio: pip install 'metainfer-gen[demo]' ({exc})") from None
    backend = load_backend(args, root / "clips")
    for note in backend.notes:
        print(f"note: {note}", file=sys.stderr)
    app = build_app(backend)
    print("warming up the models (one smallest call each)", flush=True)
    backend.warm_up()
    # SIGTERM (a service manager, `kill`) exits through SystemExit so that atexit removes the temporary folder.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"metainfer-gen demo on http://{args.host}:{args.port} (uploads and clips under {root})", flush=True)
    try:
        launch_app(app, host=args.host, port=args.port, share=args.share, max_upload_mb=limits.max_upload_mb)
    finally:
        backend.close()
    return 0
