"""Resumable training state shared by the demo-model training scripts (video and LLM).

A run keeps ``state.pt`` (model + optimiser + step) in its work directory and rewrites it atomically every few
minutes, so a killed run resumes where it stopped. Batches are drawn from a generator seeded with
``seed + step``, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch


def learning_rate(peak: float, step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine decay to ``peak / 10`` at ``total_steps``."""
    warm = min(1.0, (step + 1) / warmup_steps)
    decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps))
    return peak * warm * decay


class ResumableRun:
    """Step counter, log and atomic checkpoints for one training run in ``work_dir``."""

    def __init__(self, work_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.optimizer = optimizer
        self.step = 0
        self.elapsed_s = 0.0
        self._start = time.monotonic()
        self._last_save = time.monotonic()
        path = self.work_dir / "state.pt"
        if path.exists():
            state = torch.load(path, map_location="cpu", weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            self.step = state["step"]
            self.elapsed_s = state["elapsed_s"]
            print(f"resumed {path} at step {self.step} ({self.elapsed_s / 60:.1f} min trained)", flush=True)

    @property
    def total_seconds(self) -> float:
        return self.elapsed_s + time.monotonic() - self._start

    def set_learning_rate(self, peak: float, total_steps: int, warmup_steps: int) -> float:
        lr = learning_rate(peak, self.step, total_steps, warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_step(self, loss: torch.Tensor, max_grad_norm: float = 1.0) -> None:
        """Backward ``loss``, clip the gradient norm, step the optimiser, count the step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.optimizer.step()
        self.step += 1

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed * 1_000_003 + self.step)

    def log(self, **values: float) -> None:
        record = {"step": self.step, "minutes": round(self.total_seconds / 60, 2), **values}
        with open(self.work_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    def maybe_save(self, every_s: float = 120.0, force: bool = False) -> None:
        if not force and time.monotonic() - self._last_save < every_s:
            return
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "elapsed_s": self.total_seconds,
        }
        tmp = self.work_dir / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.work_dir / "state.pt")
        self._last_save = time.monotonic()
