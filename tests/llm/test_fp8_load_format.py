"""Where FP8 weights stay FP8: dequantised once at load on the CPU (no FP8 GEMM), kept where asked or on an FP8 GPU."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from metainfer_gen import kernels, platform
from metainfer_gen.kernels.fp8_quant import dequantize_fp8_weight_reference
from metainfer_gen.llm import EngineConfig, LLMEngine
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.fp8 import AUDIT_OP, AUDIT_SITE, choose_weight_format, fp8_weights_stay
from metainfer_gen.llm.layers.linear import LinearBase
from metainfer_gen.llm.loader import load_config, load_model
from metainfer_gen.llm.parallel import TensorParallel
from metainfer_gen.platform import Capabilities, DeviceKind, override_capabilities
from tests.llm.checkpoints import make_hf_model, random_prompts, save_fp8_checkpoint

FP8 = torch.float8_e4m3fn
# intermediate_size 320: the dense MLP's gate/up (320, 64) and down (64, 320) have partial last tiles, and TP=2
# splits them at 160, inside a 128x128 scale block.
OVERRIDES = dict(intermediate_size=320)


def _gpu(cc: tuple[int, int], fp8: bool) -> Capabilities:
    return Capabilities(device_kind=DeviceKind.CUDA, device_names=("GPU",), compute_capabilities=(cc,), bf16=True,
                        fp8_e4m3=fp8, fp8_e5m2=fp8)


def _load(path, quantization=None, dtype=torch.float32, tp=None):
    return load_model(path, load_config(path), dtype=dtype, device=torch.device("cpu"), max_positions=128, tp=tp,
                      quantization=quantization)


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 checkpoint, a dense fp32 checkpoint holding exactly the fp8 checkpoint's dequantised values)."""
    fp8, dense = tmp_path_factory.mktemp("fp8_ckpt"), tmp_path_factory.mktemp("fp8_dequantised_ckpt")
    model = make_hf_model("moe", **OVERRIDES)
    save_fp8_checkpoint(model, fp8)
    tensors = load_file(fp8 / "model.safetensors")
    for name in [n for n, t in tensors.items() if t.dtype == FP8]:
        scale = tensors.pop(name.removesuffix("weight") + "weight_scale_inv")
        tensors[name] = dequantize_fp8_weight_reference(tensors[name], scale)
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config))
    return fp8, dense


@pytest.fixture()
def triton_compiles(monkeypatch):
    """Triton counts as compiling on a faked GPU, whether or not it is installed here."""
    monkeypatch.setattr(platform, "triton_installed", lambda: "3.0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_dequantises_and_says_why():
    stay, reason = fp8_weights_stay("cpu", torch.bfloat16)
    assert not stay
    assert reason.startswith("CPU: no FP8 GEMM") and "9-50x" in reason and reason.endswith("to bfloat16")


def test_sm90_keeps_fp8_sm80_does_not(triton_compiles, monkeypatch):
    with override_capabilities(_gpu((9, 0), True)):
        stay, reason = fp8_weights_stay(torch.device("cuda", 0))
        assert stay and "sm_90" in reason
        fmt = choose_weight_format(None, "fp8", "cuda", torch.bfloat16)
        assert fmt.fp8 and fmt.fp8_gemm and not fmt.dequantise and fmt.name == "fp8 (block-scaled, FP8 GEMM)"
        monkeypatch.setattr(platform, "triton_installed", lambda: None)
        stay, reason = fp8_weights_stay("cuda")
        assert not stay and "triton not installed" in reason
    with override_capabilities(_gpu((8, 0), False)):
        stay, reason = fp8_weights_stay("cuda", torch.float16)
        assert not stay and "sm_80: no FP8 matrix arithmetic" in reason and reason.endswith("to float16")
        assert choose_weight_format("fp8", None, "cuda", torch.bfloat16).fp8  # asked for: kept


def test_choose_weight_format():
    cpu = torch.device("cpu")
    fmt = choose_weight_format(None, "fp8", cpu, torch.bfloat16)
    assert not fmt.fp8 and fmt.dequantise and str(fmt) == "dequantised from fp8 at load to bfloat16"
    asked = choose_weight_format("fp8", "fp8", cpu, torch.bfloat16)
    assert asked.fp8 and not asked.fp8_gemm and "no FP8 GEMM" in asked.name and "requested" in asked.reason
    plain = choose_weight_format(None, None, cpu, torch.bfloat16)
    assert not plain.fp8 and not plain.dequantise and plain.name == "bfloat16"
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        choose_weight_format("int4", None, cpu, torch.bfloat16)


def test_a_model_without_fp8_layers_dequantises_even_on_an_fp8_gpu(triton_compiles):
    """DeepSeek-V4's case: the device has an FP8 GEMM but the model no FP8 layers; the audit names the refused path."""
    from metainfer_gen.llm.fp8 import record_weight_format

    with override_capabilities(_gpu((9, 0), True)):
        fmt = choose_weight_format(None, "fp8", "cuda", torch.bfloat16, model_refusal="no FP8 layers")
    assert fmt.dequantise and not fmt.fp8 and fmt.fp8_gemm and str(fmt) == "dequantised from fp8 at load to bfloat16"
    assert fmt.reason == "no FP8 layers, so FP8 weights are dequantised once at load to bfloat16"
    with kernels.audit() as report:
        record_weight_format(fmt)
    (entry,) = [e for e in report.entries if e.op == AUDIT_OP]
    assert entry.path == "dense" and entry.refusals[0].implementation == "fp8"
    with pytest.raises(ValueError, match="quantization='fp8': no FP8 layers; leave quantization unset"):
        choose_weight_format("fp8", None, "cpu", torch.bfloat16, model_refusal="no FP8 layers")


def test_fp8_checkpoint_on_cpu_loads_dense_in_the_run_dtype(checkpoints):
    fp8, dense = checkpoints
    with kernels.audit() as report:
        model = _load(fp8, dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) > 20 and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert not any(name.endswith("weight_scale_inv") for name, _ in model.named_buffers())
    assert model.weight_format.dequantise and str(model.weight_format) == "dequantised from fp8 at load to bfloat16"
    assert report.paths()[AUDIT_OP] == {"dense": 1}
    assert [e.site for e in report.entries if e.op == AUDIT_OP] == [AUDIT_SITE]
    # Exactly what a dense checkpoint of the dequantised values gives.
    ours, reference = _tensors(model), _tensors(_load(dense, dtype=torch.bfloat16))
    assert ours.keys() == reference.keys()
    assert all(ours[n].dtype == reference[n].dtype and torch.equal(ours[n], reference[n]) for n in reference)
    assert str(_load(dense, dtype=torch.bfloat16).weight_format) == "bfloat16"


def test_quantization_fp8_keeps_fp8_on_cpu(checkpoints):
    fp8, _ = checkpoints
    with kernels.audit() as report:
        model = _load(fp8, quantization="fp8", dtype=torch.bfloat16)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.dtype == FP8 and mlp.gate_proj.weight_scale_inv.shape == (3, 1)
    assert model.model.layers[1].mlp.experts["0"].up_proj.weight.dtype == FP8
    assert model.weight_format.fp8 and not model.weight_format.fp8_gemm
    (entry,) = [e for e in report.entries if e.op == AUDIT_OP]
    assert entry.path == "fp8" and entry.refusals[0].implementation == "dense"


def _prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(16))], 4)
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(torch.tensor(prompt), meta, engine.runner.kv_caches))


def test_dequantised_logits_match_the_fp8_path(checkpoints):
    fp8, dense = checkpoints
    prompt = random_prompts(1, 160, (29,))[0]
    dequantised = LLMEngine.from_pretrained(fp8, EngineConfig(block_size=4, dtype="float32"))
    kept = LLMEngine.from_pretrained(fp8, EngineConfig(block_size=4, dtype="float32", quantization="fp8"))
    reference = LLMEngine.from_pretrained(dense, EngineConfig(block_size=4, dtype="float32"))
    ours, theirs = _prefill_logits(dequantised, prompt), _prefill_logits(kept, prompt)
    torch.testing.assert_close(ours, _prefill_logits(reference, prompt), atol=0, rtol=0)
    # The fp8 path also rounds the activations to e4m3 in 1x128 groups: a few percent apart, no more.
    assert (ours - theirs).norm() / theirs.norm() < 0.05  # 0.022 measured
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_tp_slices_across_scale_blocks_dequantise_in_row_groups(checkpoints, monkeypatch):
    """TP=2 cuts gate/up at row 160 and down at column 160, inside scale blocks: fine when dequantising; one
    128-row group at a time (DEQUANT_BYTES tiny) gives the same values as the whole tensor."""
    from metainfer_gen.llm import weight_fill

    fp8, _ = checkpoints
    full = _tensors(_load(fp8))
    monkeypatch.setattr(weight_fill, "DEQUANT_BYTES", 1)
    assert all(torch.equal(t, full[n]) for n, t in _tensors(_load(fp8)).items())
    for rank in range(2):
        shards = _tensors(_load(fp8, tp=TensorParallel(rank, 2, group=None)))
        gate = shards["model.layers.0.mlp.gate_proj.weight"]
        assert gate.tp_shard.start == 160 * rank and gate.dtype == torch.float32
        for name, shard in shards.items():
            split = getattr(shard, "tp_shard", None)
            assert torch.equal(shard, split.take(full[name]) if split is not None else full[name]), name


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_weight_without_its_scale_is_refused(checkpoints, tmp_path, quantization):
    fp8, _ = checkpoints
    for file in fp8.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj.weight is stored in fp8 \(F8_E4M3\) but "
                                         r"the checkpoint has no model.layers.0.self_attn.o_proj.weight_scale_inv"):
        _load(tmp_path, quantization=quantization)
