"""Servers as subprocesses for ``serve_llm.py``: ours (``python -m metainfer_gen.apps.cli serve``) and
``vllm serve`` from another venv, each on a free loopback port, each waited for and stopped within bounded time.

A server runs in its own process group so stopping it also stops what it spawned (vLLM's engine-core and worker
processes): SIGTERM to the group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from metainfer_gen.host_allocator import without_ours

REPO = Path(__file__).resolve().parents[1]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_model(base_url: str, timeout_s: float, alive=lambda: True) -> str:
    """Poll ``{base_url}/models`` every half second until it answers 200; returns the first model's id.

    Raises:
        RuntimeError: ``alive()`` turned false, or ``timeout_s`` seconds passed.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while alive():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url} did not answer within {timeout_s:.0f} s")
        try:
            response = httpx.get(f"{base_url}/models", timeout=2.0)
            if response.status_code == 200:
                return response.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server process ended")


def thread_env(threads: int) -> dict[str, str]:
    """The environment of every process that computes: ``threads`` OpenMP / MKL threads."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def vllm_env(vllm_python: str, threads: int, preload: bool, kv_gib: int = 2) -> dict[str, str]:
    """vLLM CPU settings: ``threads`` unpinned OpenMP threads (``nobind``, as ours), a ``kv_gib`` KV pool, and
    with ``preload`` the LD_PRELOAD its CPU docs recommend (tcmalloc + the venv's Intel OpenMP).

    Raises:
        FileNotFoundError: ``preload`` and tcmalloc or libiomp5.so is missing (with the install line).
    """
    env = {**without_ours(thread_env(threads)), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    env.pop("LD_PRELOAD", None)
    if preload:
        iomp = sorted(Path(vllm_python).absolute().parents[1].glob("lib/libiomp5.so"))  # the venv, not its base
        if not TCMALLOC.exists() or not iomp:
            raise FileNotFoundError(f"LD_PRELOAD needs {TCMALLOC} (apt-get install libtcmalloc-minimal4) and the "
                                    f"venv's lib/libiomp5.so (intel-openmp, installed with vllm-cpu)")
        env["LD_PRELOAD"] = f"{TCMALLOC}:{iomp[0]}"
    return env


def ours_command(model: Path | None, port: int, max_num_seqs: int, max_model_len: int, dtype: str) -> list[str]:
    command = [sys.executable, "-m", "metainfer_gen.apps.cli", "serve", "--port", str(port), "--max-num-seqs",
               str(max_num_seqs), "--max-model-len", str(max_model_len), "--dtype", dtype, "--log-level", "warning",
               "--video", "none"]
    return command + ([] if model is None else ["--llm", str(model)])


def vllm_options(block_size: int | None, attention_backend: str | None) -> list[str]:
    """vLLM's block size and attention backend flags, where given (None: vLLM's own choice; on a CPU with AMX it
    takes its AMX_MLA backend, which needs a block size that is a multiple of 32 and defaults to 128, and which
    runs bfloat16 only; its reference CPU_MLA backend lists float32 and bfloat16 and forces block size 16)."""
    return ((["--block-size", str(block_size)] if block_size else [])
            + (["--attention-backend", attention_backend] if attention_backend else []))


def vllm_command(vllm_python: str, model: Path, port: int, max_num_seqs: int, max_model_len: int, dtype: str,
                 block_size: int | None = None, attention_backend: str | None = None) -> list[str]:
    # ``vllm serve`` itself fails in vllm-cpu (its CLI looks up the "vllm" distribution, which is "vllm-cpu");
    # the OpenAI server module takes the same flags.
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len), "--served-model-name", model.name,
            "--disable-log-stats", "--uvicorn-log-level", "warning", *vllm_options(block_size, attention_backend)]


@dataclass
class ServerProcess:
    """A started server: ``base_url`` (``http://127.0.0.1:PORT/v1``), ``model`` (its served name) and
    ``startup_s``. Use as a context manager, or call :meth:`stop`."""

    name: str
    process: subprocess.Popen
    base_url: str
    log_path: Path
    model: str = ""
    startup_s: float = 0.0

    @classmethod
    def start(cls, name: str, command: list[str], env: dict[str, str], port: int, log_path: Path,
              timeout_s: float) -> "ServerProcess":
        """Start ``command`` and wait until ``/v1/models`` answers.

        Raises:
            RuntimeError: the process exited first, or ``timeout_s`` passed (the log's tail in the message).
        """
        start = time.perf_counter()
        log = open(log_path, "w")
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        log.close()
        server = cls(name, process, f"http://127.0.0.1:{port}/v1", log_path)
        try:
            server.model = wait_for_model(server.base_url, timeout_s, alive=lambda: process.poll() is None)
        except RuntimeError as exc:
            server.stop()
            state = (f"exited with {process.returncode} before serving" if process.poll() is not None
                     else f"did not answer within {timeout_s:.0f} s")
            raise RuntimeError(f"{name} {state}:\n{server.log_tail()}") from exc
        except BaseException:
            server.stop()
            raise
        server.startup_s = time.perf_counter() - start
        return server

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` seconds; idempotent."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
        try:  # children (vLLM's engine core) may outlive the leader
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(5)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
