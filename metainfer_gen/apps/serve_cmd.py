"""``metainfer-gen serve``: the OpenAI-compatible server: LLM (completions, chat, SSE streaming) and video
(``/v1/videos``), one app, one port, one ``/health`` and ``/metrics``.

    metainfer-gen serve                               # the embedded LLM and video model on http://127.0.0.1:8000/v1
    metainfer-gen serve --llm none --video DIR --video-workers 2 --data-dir jobs/   # video only
    metainfer-gen serve --llm CKPT --port 8001 --api-key SECRET --max-num-seqs 32
    metainfer-gen serve --host 0.0.0.0                # reachable from the network: set an API key too
    metainfer-gen serve --llm CKPT --tp 2             # 2 tensor-parallel ranks; rank 0 serves HTTP
    metainfer-gen serve --llm none --job-store postgresql://db/jobs --clips-dir /mnt/clips --video-workers 0
                                                      # an API-only node of a fleet (docs/fleet.md)
    metainfer-gen serve CKPT --tensor-parallel-size 2 --max-model-len 4096 --served-model-name ds  # vLLM's names

Needs the serve extra: ``pip install 'metainfer-gen[serve]'``. With ``--tp N`` this command starts ranks 1..N-1
itself (or runs under ``torchrun --nproc-per-node N``): every rank steps the engine, rank 0 serves
(``apps/tp_launch.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

from metainfer_gen.apps.arg_types import non_negative_int, port, positive_float, positive_int
from metainfer_gen.apps.llm_args import add_llm_engine_arguments, add_tp_argument, engine_options
from metainfer_gen.apps.video_serve_args import NONE, add_video_serve_arguments, video_serve_config

DEFAULT_PORT = 8000
API_KEY_ENV = "METAINFER_GEN_API_KEY"


def add_serve_parser(subparsers) -> None:
    """Register the ``serve`` subcommand on the CLI's subparsers."""
    from metainfer_gen.serve.admission import DEFAULT_HEALTH_STEP_TIMEOUT_S
    from metainfer_gen.serve.http_io import DEFAULT_MAX_BODY_BYTES

    p = subparsers.add_parser("serve", help="serve an LLM and a video model over OpenAI's API (completions, chat, "
                                            "streaming, /v1/videos)",
                              description="Load an LLM checkpoint (default: the embedded one) and serve OpenAI's "
                                          "/v1/completions and /v1/chat/completions with SSE streaming, plus "
                                          "/v1/models, /tokenize, /detokenize, /health and /metrics, and a "
                                          "video model (default: the embedded one) on /v1/videos. Binds "
                                          "127.0.0.1 unless --host says otherwise. Needs the serve extra: "
                                          "pip install 'metainfer-gen[serve]'.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="the LLM checkpoint directory or hub id, as `vllm serve MODEL` (same as --llm)")
    p.add_argument("--llm", default=None, help="checkpoint directory or hub id (default: the embedded LLM; 'none': "
                                               "no LLM routes)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=DEFAULT_PORT, help=f"port to bind, 0 = any free one "
                                                                   f"(default {DEFAULT_PORT})")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics (default: "
                        f"${API_KEY_ENV}, else no key)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="requests decoded together; more wait in the queue (default 64)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--served-model-name", default=None,
                   help="the 'model' name clients send (default: the checkpoint folder's name)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="tokens per engine step, prefill chunks and decodes together (default 2048)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the device's free memory (plus what the process holds) for weights, activations "
                        "and the KV cache, in (0, 1] (default: all of it on a GPU; on a CPU the weights plus a "
                        "quarter of the available RAM)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of shared prompt prefixes (default on; --no-enable-prefix-caching "
                        "turns it off)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="KV pool size in blocks (default: sized from free memory)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
                   help="the LLM's weights and activations (default bfloat16 where the hardware has it natively: a "
                        "GPU, a CPU with AMX-BF16 or AVX512-BF16; float32 elsewhere; `metainfer-gen doctor` "
                        "says which)")
    p.add_argument("--max-queued-requests", type=non_negative_int, default=None,
                   help="LLM requests that may wait behind the --max-num-seqs running ones; more get 429 with "
                        "Retry-After (default: unbounded)")
    p.add_argument("--max-queued-videos", type=non_negative_int, default=None,
                   help="video jobs that may wait in the queue; more get 429 with Retry-After (default: unbounded)")
    p.add_argument("--health-step-timeout", type=positive_float, default=DEFAULT_HEALTH_STEP_TIMEOUT_S,
                   help="/health answers 503 once the engine has not stepped for this many seconds while requests "
                        f"wait (default {DEFAULT_HEALTH_STEP_TIMEOUT_S:g})")
    add_llm_engine_arguments(p)
    add_video_serve_arguments(p)
    add_tp_argument(p)
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level (default info, with an access log)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from metainfer_gen.apps.tp_launch import enable_stack_dumps, tensor_parallel_pipeline
    from metainfer_gen.serve.server import (LLMServer, ServeConfig, bind_socket, pipeline_options,
                                            require_serve_dependencies)

    enable_stack_dumps()

    try:
        require_serve_dependencies()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.model is not None and args.llm is not None and args.model != args.llm:
        print(f"error: MODEL {args.model!r} and --llm {args.llm!r} disagree: give one of them", file=sys.stderr)
        return 2
    args.llm = args.llm if args.llm is not None else args.model
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        print(f"error: --gpu-memory-utilization must be in (0, 1]; got {args.gpu_memory_utilization}",
              file=sys.stderr)
        return 2
    args.dtype = None if args.dtype == "auto" else args.dtype
    names = ("max_model_len", "num_kv_blocks", "device", "dtype", "max_num_batched_tokens", "gpu_memory_utilization",
             "enable_prefix_caching")
    engine = {name: getattr(args, name) for name in names if getattr(args, name) is not None} | engine_options(args)
    if args.llm == NONE and args.tp > 1:
        print("error: --tp applies to the LLM and --llm none serves none: drop --tp or name an --llm", file=sys.stderr)
        return 2
    if args.tp > 1 and os.environ.get("RANK", "0") != "0":
        video = None  # a torchrun worker rank only steps the LLM engine: rank 0 serves (and renders) alone
    else:
        try:
            video = video_serve_config(args)
        except (FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.llm == NONE and video is None:
        print("error: --llm none and --video none leave nothing to serve", file=sys.stderr)
        return 2
    config = ServeConfig(llm=None if args.llm == NONE else args.llm, host=args.host, port=args.port,
                         api_key=args.api_key, max_num_seqs=args.max_num_seqs, max_body_bytes=args.max_body_bytes,
                         served_model_name=args.served_model_name, engine=engine, with_llm=args.llm != NONE,
                         video=video, admission={"max_queued_requests": args.max_queued_requests,
                                                 "max_queued_videos": args.max_queued_videos,
                                                 "health_step_timeout_s": args.health_step_timeout})
    try:
        bind_socket(args.host, args.port).close()  # a taken port fails now, not after the model loaded
        if video is not None and video.job_store is None:  # and so does a data folder another server holds
            from pathlib import Path

            from metainfer_gen.serve.video.service import lock_data_dir

            from metainfer_gen.serve.video.sqlite_store import STORE_NAME, SQLiteJobStore

            lock_data_dir(Path(video.data_dir).resolve()).close()
            SQLiteJobStore(Path(video.data_dir).resolve() / STORE_NAME).close()  # a corrupt file: named, exit 2
        elif video is not None:  # and a fleet store that is unreachable, too new, or needs the fleet extra
            from metainfer_gen.serve.video.stores import open_job_store

            open_job_store(video.job_store).close()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # DataDirInUse, JobStoreUnavailable, JobStoreCorrupt, SchemaTooNew
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not config.with_llm:
        LLMServer.run_forever(config, log_level=args.log_level)
        return 0
    print(f"loading {config.llm or 'the embedded LLM'} and warming up its step shapes (torch.compile, once per "
          "process: 1.5-3.5 minutes on 2 CPU cores, longer while another process compiles; the port opens after "
          "it)", flush=True)
    with tensor_parallel_pipeline(args.tp, config.llm, **pipeline_options(config)) as pipe:
        if pipe is not None:  # rank 0; the other ranks followed its steps until it stopped
            LLMServer.run_forever(config, log_level=args.log_level, pipe=pipe)
    return 0
