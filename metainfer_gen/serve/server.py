"""Start the OpenAI-compatible server: load the LLM, build the app, run uvicorn (in the foreground, or in a thread).

    from metainfer_gen.serve.server import ServeConfig, LLMServer
    with LLMServer.start(ServeConfig(port=0)) as server:      # the embedded LLM on a free loopback port
        print(server.base_url)                                 # http://127.0.0.1:PORT/v1
    LLMServer.run_forever(ServeConfig(port=8000))              # what `metainfer-gen serve` does

The port is bound first (a taken port fails at once, before minutes of loading) but listens only once the model
is loaded, so no client ever reaches a half-started server.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from metainfer_gen.serve.app import AppSettings
from metainfer_gen.serve.http_io import DEFAULT_MAX_BODY_BYTES

INSTALL_HINT = "pip install 'metainfer-gen[serve]'"


def require_serve_dependencies() -> None:
    """Raises:
        ImportError: fastapi, uvicorn or prometheus-client is missing, naming them and ``INSTALL_HINT``.
    """
    missing = [name for name, module in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"),
                                         ("prometheus-client", "prometheus_client"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ImportError(f"the server needs {', '.join(missing)}: run {INSTALL_HINT}")


@dataclass(slots=True)
class ServeConfig:
    """How to serve.

    Args:
        llm: checkpoint directory or hub id; None serves the embedded demo LLM.
        host: interface to bind; the loopback default keeps the server private (give 0.0.0.0 to share it).
        port: TCP port; 0 picks a free one (see ``LLMServer.port``).
        api_key: when set, clients must send ``Authorization: Bearer <api_key>``.
        max_num_seqs: requests decoded at once (the batch); more wait in the queue.
        max_body_bytes: largest accepted request body (413 above).
        served_model_name: the ``model`` name clients use; default the checkpoint folder's name.
        engine: further :class:`~metainfer_gen.llm.config.EngineConfig` fields (``num_kv_blocks``,
            ``max_model_len``, ``device``, ``dtype``, ...).
        with_llm: False serves no LLM (``--llm none``).
        video: a :class:`~metainfer_gen.serve.video.service.VideoServeConfig` to serve ``/v1/videos`` too, or None.
        switch_interval_s: the process's GIL switch interval while serving (``sys.setswitchinterval``; None keeps
            Python's 5 ms). The engine thread releases the GIL in every torch op and then waits for the event loop
            to hand it back: a 64-request embedded-LLM batch took 0.80 s served at 5 ms and 0.70 s at 0.5 ms
            (0.3 s offline; benchmarks/serve_profile.py, docs/benchmarks_serving.md#serving).
        admission: further :class:`~metainfer_gen.serve.app.AppSettings` fields (``max_queued_requests``,
            ``max_queued_videos``, ``health_step_timeout_s``).
    Raises:
        ValueError: a port outside [0, 65535], or non-positive limits.
    """

    llm: str | Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_num_seqs: int = 64
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_name: str | None = None
    engine: dict = field(default_factory=dict)
    with_llm: bool = True
    video: object = None
    switch_interval_s: float | None = 0.0005
    admission: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_num_seqs < 1 or self.max_body_bytes < 1:
            raise ValueError(f"max_num_seqs and max_body_bytes must be >= 1; got {self.max_num_seqs}, "
                             f"{self.max_body_bytes}")


class LLMServer:
    """A loaded engine, its async front and app, and the uvicorn server running them."""

    def __init__(self, config: ServeConfig, front, app, model_name: str, sock: socket.socket, video=None):
        self.config = config
        self.video = video  # the VideoService, when /v1/videos is served
        self.front = front
        self.app = app
        self.model_name = model_name
        self._socket = sock
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, config: ServeConfig, pipe=None, *, engine_thread: bool = True) -> "LLMServer":
        """Bind the port, load the model (unless ``pipe``, a loaded and warmed-up
        :class:`~metainfer_gen.pipelines.TextGenerationPipeline`, is given), build the app, then listen (uvicorn
        accepts once it runs). ``engine_thread=False`` leaves the engine loop to the caller
        (:meth:`~metainfer_gen.serve.async_engine.AsyncLLMEngine.run_here`, as :meth:`run_forever` does).

        Raises:
            ImportError: the serve extra is missing. OSError: the address is taken or not this machine's.
            FileNotFoundError / ValueError: bad checkpoint or settings.
        """
        require_serve_dependencies()
        settings(config, "x")  # check the key and limits before loading
        sock = bind_socket(config.host, config.port)
        if config.switch_interval_s is not None:
            sys.setswitchinterval(config.switch_interval_s)
        try:
            server = cls._load(config, sock, pipe, engine_thread)
        except BaseException:
            sock.close()
            raise
        sock.listen(2048)  # connections queue from here on, even before uvicorn accepts
        return server

    @classmethod
    def _load(cls, config: ServeConfig, sock: socket.socket, pipe=None, engine_thread: bool = True) -> "LLMServer":
        from metainfer_gen.pipelines.text_generation import TextGenerationPipeline, default_llm_dir
        from metainfer_gen.serve.async_engine import AsyncLLMEngine
        from metainfer_gen.serve.metrics import ServerMetrics
        from metainfer_gen.serve.video.attach import serving_app
        from metainfer_gen.serve.video.service import VideoService

        front = metrics = video = None
        name = "none"
        if config.with_llm:
            path = Path(config.llm) if config.llm is not None else default_llm_dir()
            name = config.served_model_name or (path.name if path.exists() else str(config.llm))
            if pipe is None:
                pipe = TextGenerationPipeline.from_pretrained(config.llm, warmup=True, **pipeline_options(config))
            metrics = ServerMetrics(name)
            front = AsyncLLMEngine(pipe.engine, metrics, start_thread=engine_thread)
        try:
            video = VideoService.start(config.video) if config.video is not None else None
            app = serving_app(front, metrics, settings(config, name), video)
        except BaseException:
            for part in (front, video):
                if part is not None:
                    part.close()
            raise
        if video is not None:
            name = video.model_name if front is None else f"{name} + {video.model_name}"
        return cls(config, front, app, name, sock, video)

    def _uvicorn_server(self, log_level: str):
        import uvicorn

        return uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, access_log=log_level == "info",
                                             timeout_graceful_shutdown=2))

    @property
    def port(self) -> int:
        """The bound port (the one picked when the config said 0)."""
        return self._socket.getsockname()[1]

    @property
    def base_url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/v1"

    # -- running ----------------------------------------------------------------------------------------------
    @classmethod
    def run_forever(cls, config: ServeConfig, log_level: str = "info", pipe=None,
                    stop_when: Callable[[], bool] | None = None) -> None:
        """Load (or take ``pipe``), bind and serve until Ctrl-C / SIGTERM, or until ``stop_when()`` turns true
        (checked between engine steps and at least every half second), then close everything.

        The engine loop runs on this (the main) thread and uvicorn on a thread of its own: torch's OpenMP regions
        opened from a second thread ran about 2x slower (see
        :class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine`). SIGTERM is turned into the KeyboardInterrupt
        of Ctrl-C here, since uvicorn installs no signal handlers off the main thread."""
        import signal

        server = cls.load(config, pipe, engine_thread=False)
        uv = server._uvicorn = server._uvicorn_server(log_level)
        server._thread = threading.Thread(target=uv.run, kwargs={"sockets": [server._socket]}, name="uvicorn",
                                          daemon=True)
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        server._thread.start()
        report = None if server.front is None else getattr(server.front.engine, "warmup_report", None)
        if report is not None:
            eager = f"; decode steps run eager: {report.decode_refusal}" if report.decode_refusal else ""
            print(f"warmed up in {report.seconds:.0f} s: {len(report.prefill_tokens)} prefill and "
                  f"{len(report.decode_batches)} decode step shapes, {report.num_graphs_compiled} graphs compiled"
                  f"{eager}", flush=True)
        print(f"serving {server.model_name!r} on {server.base_url} (OpenAI API; /health, /metrics)", flush=True)
        try:
            def done() -> bool:
                return not server._thread.is_alive() or (stop_when is not None and stop_when())

            if server.front is not None:
                server.front.run_here(stop_when=done)
            while not done():  # no LLM (video only), or the engine loop ended first
                server._thread.join(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            server.close()

    @classmethod
    def start(cls, config: ServeConfig, timeout_s: float = 60.0, log_level: str = "warning") -> "LLMServer":
        """Load, then serve from a background thread; returns once the port answers.

        Raises:
            TimeoutError: uvicorn did not start within ``timeout_s`` seconds.
        """
        server = cls.load(config)
        server._uvicorn = server._uvicorn_server(log_level)
        server._thread = threading.Thread(target=server._uvicorn.run, kwargs={"sockets": [server._socket]},
                                          name="uvicorn", daemon=True)
        server._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server._uvicorn.started:
            if time.monotonic() > deadline or not server._thread.is_alive():
                server.close()
                raise TimeoutError(f"the server did not start within {timeout_s} s")
            time.sleep(0.02)
        return server

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop uvicorn (when started here) and the engine thread; idempotent."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout_s)
            self._uvicorn = None
        for part in (self.front, self.video):
            if part is not None:
                part.close()
        self._socket.close()

    def __enter__(self) -> "LLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def settings(config: ServeConfig, model_name: str) -> AppSettings:
    """The app's settings of ``config``. Raises ValueError for a bad key or limit."""
    return AppSettings(model_name, config.api_key, config.max_body_bytes, **config.admission)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pipeline_options(config: ServeConfig) -> dict:
    """``TextGenerationPipeline.from_pretrained`` keywords for ``config`` (``engine``'s ``dtype`` becomes
    ``torch_dtype``, the pipeline's name for it)."""
    options = dict(config.engine, max_num_seqs=config.max_num_seqs)
    if "dtype" in options:
        options["torch_dtype"] = options.pop("dtype")
    return options


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a colon), not yet listening.

    Raises:
        OSError: the port is taken, or ``host`` is not an address of this machine.
    """
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it
    # Nagle holds back the second write of every response (body after headers) for the client's 40 ms delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
