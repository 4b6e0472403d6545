"""Fixtures: tiny DeepSeek-V3 checkpoints (see ``tests/llm/checkpoints.py``)."""

from __future__ import annotations

import pytest

from tests.llm.checkpoints import CONFIGS, make_hf_model


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    """(transformers model, checkpoint directory) for each tiny config."""
    model = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    model = make_hf_model("moe")
    path = tmp_path_factory.mktemp("deepseek_moe_only")
    model.save_pretrained(path)
    return model, path
