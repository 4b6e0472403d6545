"""Loading refuses what it cannot load right (issue 31, class 6): checkpoints saved here with one tensor wrong each
(an fp8 weight without its scale or with a scale of the wrong shape, an integer-typed weight, too few or extra
experts, fused or one per expert) are refused with the tensor named, before any model storage is allocated."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from metainfer_gen.llm import weight_fill
from metainfer_gen.llm.loader import load_config, load_model
from tests.llm.checkpoints import make_hf_model, save_fp8_checkpoint

O_PROJ = "model.layers.0.self_attn.o_proj.weight"
EXPERTS = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_for_checks")
    save_fp8_checkpoint(make_hf_model("moe", intermediate_size=320), path)
    return path


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the loader gets as far as allocating the model's storage."""
    def allocated(*args, **kwargs):
        raise AssertionError("the model's storage was allocated before the checkpoint was refused")

    monkeypatch.setattr(weight_fill, "materialize", allocated)


def _variant(src, dst, edit):
    """A copy of checkpoint ``src`` in ``dst`` with ``edit(tensors)`` applied to its one shard."""
    dst.mkdir(exist_ok=True)
    for file in src.iterdir():
        shutil.copy(file, dst / file.name)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _load(path):
    return load_model(path, load_config(path), dtype=torch.float32, device=torch.device("cpu"), max_positions=64)


def test_an_fp8_weight_without_its_scale_is_refused_before_allocating(fp8_dir, tmp_path, no_allocation):
    path = _variant(fp8_dir, tmp_path, lambda t: t.pop(O_PROJ.removesuffix("weight") + "weight_scale_inv"))
    with pytest.raises(ValueError, match=rf"{O_PROJ} is stored in fp8 \(F8_E4M3\) but the checkpoint has no"):
        _load(path)


@pytest.mark.parametrize("shape", [(2, 1), (1, 2), (1,), (1, 1, 1)])
def test_a_scale_of_the_wrong_shape_is_refused(fp8_dir, tmp_path, no_allocation, shape):
    scale = O_PROJ.removesuffix("weight") + "weight_scale_inv"

    def edit(tensors):
        assert tuple(tensors[scale].shape) == (1, 1)  # o_proj is (64, 64): one 128x128 block
        tensors[scale] = torch.ones(shape)

    with pytest.raises(ValueError, match=rf"{scale} is F32 \({', '.join(map(str, shape))},?\), but the fp8 weight "
                                         rf"{O_PROJ} \(64, 64\) needs .* shape \(1, 1\)"):
        _load(_variant(fp8_dir, tmp_path, edit))


@pytest.mark.parametrize("dtype, name", [(torch.int8, "I8"), (torch.int32, "I32"), (torch.uint8, "U8"),
                                          (torch.bool, "BOOL")])
def test_an_integer_weight_is_refused(moe_checkpoint, tmp_path, no_allocation, dtype, name):
    _, src = moe_checkpoint
    path = _variant(src, tmp_path, lambda t: t.__setitem__(O_PROJ, t[O_PROJ].to(dtype)))
    with pytest.raises(ValueError, match=rf"{O_PROJ} is stored as {name}, not a float dtype"):
        _load(path)


def test_too_few_or_extra_experts_are_refused(moe_checkpoint, tmp_path, no_allocation):
    _, src = moe_checkpoint

    def extra(tensors):
        for part in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{EXPERTS}8.{part}.weight"] = tensors[f"{EXPERTS}7.{part}.weight"].clone()

    with pytest.raises(RuntimeError, match=rf"{EXPERTS}8\.\w+\.weight is expert 8, but config.json's "
                                           rf"n_routed_experts is 8"):
        _load(_variant(src, tmp_path / "extra", extra))

    def drop(tensors):
        for part in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"{EXPERTS}7.{part}.weight"]

    with pytest.raises(RuntimeError, match=rf"missing \[.*'{EXPERTS}7\.down_proj\.weight'"):
        _load(_variant(src, tmp_path / "fewer", drop))


@pytest.mark.parametrize("num_experts", [7, 9])
def test_fused_experts_of_the_wrong_count_are_refused(moe_checkpoint, tmp_path, no_allocation, num_experts):
    model, src = moe_checkpoint

    def fuse(tensors):
        for layer in range(1, model.config.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts."
            gate_up = [torch.cat([tensors.pop(f"{prefix}{e}.gate_proj.weight"),
                                  tensors.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(8)]
            down = [tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(8)]
            tensors[prefix + "gate_up_proj"] = torch.stack((gate_up * 2)[:num_experts])
            tensors[prefix + "down_proj"] = torch.stack((down * 2)[:num_experts])

    with pytest.raises(RuntimeError, match=rf"model.layers.1.mlp.experts.down_proj holds {num_experts} experts but "
                                           rf"config.json's n_routed_experts is 8"):
        _load(_variant(src, tmp_path, fuse))
