"""``metainfer-gen doctor``: capabilities, versions, and the path each registered op would take here."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch

from metainfer_gen.apps import doctor
from metainfer_gen.apps.cli import main
from tests.kernels.conftest import has_cpp_compiler

OPS = ("rms_norm", "fused_add_rms_norm", "rope", "adaln_modulate", "gated_residual", "store_kv_cache",
       "fp8_act_quant", "fp8_weight_dequant", "fp8_block_gemm", "indexer_topk", "sparse_mla", "paged_mla_decode",
       "moe_experts", "conv3d", "channel_rms_norm", "upsample_nearest", "timestep_embedding", "linear",
       "block_attention")
# Ops whose fastest implementation runs on a CPU-only machine too: plain torch or oneDNN (built into the CPU wheel),
# and C++ kernels built with the machine's C++ compiler (doctor's example inputs follow the suite's float32 pin).
TORCH_FASTEST = ("conv3d", "channel_rms_norm", "upsample_nearest", "timestep_embedding")
CPP_FASTEST = ("moe_experts", "block_attention")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("METAINFER_STRICT_FAST_PATH", raising=False)


def test_doctor_prints_machine_versions_and_every_op(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "device kind" in out and "c++ compiler" in out
    for package in ("torch", "triton", "diffusers", "transformers"):
        assert f"  {package} " in out
    assert torch.__version__ in out
    for op in OPS:
        assert op in out
    assert "model glm_moe_dsa   attention: MLA + DSA: indexer (interleaved rope)" in out
    assert "model deepseek_v4   attention: sliding-window K=V rows + compressed entries" in out
    if not torch.cuda.is_available():
        assert "refused triton: CPU-only machine" in out
        assert "rms_norm             runs compiled" in out  # example inputs are large enough to compile
        assert "store_kv_cache       runs torch" in out
        compiler = has_cpp_compiler()
        # The C++ kernels build with the machine's compiler; without one the torch paths run, paths not taken.
        assert f"moe_experts          runs {'cpp' if compiler else 'grouped'}" in out
        assert f"block_attention      runs {'bmm-fused' if compiler else 'bmm-blocks'}" in out
        assert "conv3d               runs onednn" in out
        assert "channel_rms_norm     runs sumsq" in out
        assert "timestep_embedding   runs unique" in out
        fastest = len(TORCH_FASTEST) + (len(CPP_FASTEST) if compiler else 0)
        assert f"{fastest} of {len(OPS)} ops run their fastest path here" in out


def test_strict_exits_nonzero_when_a_fast_path_is_refused(capsys):
    code = main(["doctor", "--strict"])
    refused = "fallback" in capsys.readouterr().out
    assert code == (1 if refused else 0)
    if not torch.cuda.is_available():
        assert code == 1


def test_strict_exits_zero_when_every_op_runs_its_fastest_path(monkeypatch):
    report = doctor.collect()
    for op in report["ops"]:
        op["refusals"], op["path"] = [], op["fastest"]
    monkeypatch.setattr(doctor, "collect", lambda device=None, dtype=None, model=None: report)
    out = io.StringIO()
    args = argparse.Namespace(strict=True, json=False, device=None, dtype=None)
    assert doctor.cmd_doctor(args, out=out) == 0
    assert f"{len(OPS)} of {len(OPS)} ops run their fastest path here" in out.getvalue()


def test_json_report_is_machine_readable(capsys):
    assert main(["doctor", "--json", "--dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {o["op"] for o in report["ops"]} >= set(OPS)
    assert report["example"]["dtype"] == "bfloat16"
    assert report["versions"]["torch"] == torch.__version__
    assert report["triton"]["mode"] in ("compile", "interpret", "unavailable")


def test_render_reports_missing_peer_access_on_a_multi_gpu_machine():
    report = doctor.collect()
    report["machine"].update(device_kind="cuda", devices=[
        {"index": i, "name": "GPU", "compute_capability": [8, 9]} for i in range(3)],
        missing_peer_pairs=[[0, 2], [2, 0]])
    out = io.StringIO()
    doctor.render(report, out)
    assert "peer access      missing for [[0, 2], [2, 0]]" in out.getvalue()
    assert "gpu 2            GPU (compute capability 8.9)" in out.getvalue()


def test_each_family_names_its_attention_path_and_what_it_refuses(tmp_path, capsys):
    """Every family's attention path; DeepSeek-V4's refused features with the reasons the engine audits; with
    ``--model`` the same for one checkpoint's config (GLM-5's shared-top-k layers counted) and how its weights load
    (a V4 FP8 checkpoint: dequantised, V4 having no FP8 layers), read without weights."""
    import re

    from metainfer_gen.llm.models.families import FAMILIES

    v4 = FAMILIES["deepseek_v4"].refuses
    glm = {"model_type": "glm_moe_dsa", "num_hidden_layers": 4, "indexer_types": ["full", "shared", "shared", "full"]}
    (tmp_path / "glm").mkdir()
    (tmp_path / "glm" / "config.json").write_text(json.dumps(glm))
    (tmp_path / "v4.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 3,
                                                  "quantization_config": {"quant_method": "fp8",
                                                                          "weight_block_size": [128, 128]}}))
    assert main(["doctor", "--model", str(tmp_path / "glm")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model deepseek_v4   attention: sliding-window K=V rows \+ compressed entries \(CSA: the "
                     r"indexer's top-k .*\n {22}refuses prefix caching: " + re.escape(v4["prefix_caching"]) + r"\n"
                     r" {22}refuses compiled decode steps \(they run eager\): " + re.escape(v4["compiled_decode"]),
                     out)
    assert re.search(r"model glm_moe_dsa   attention: MLA \+ DSA: indexer \(interleaved rope\).*\n  model", out)
    assert (f"llm checkpoint     {tmp_path / 'glm'}\n  attention        glm_moe_dsa: MLA + DSA: indexer (interleaved "
            f"rope)") in out and "(2 of 4 layers share top-k)\n  weights          " in out
    assert main(["doctor", "--json", "--model", str(tmp_path / "v4.json")]) == 0
    ckpt = json.loads(capsys.readouterr().out)["llm"]["checkpoint"]
    assert ckpt["attention"] == "deepseek_v4: " + FAMILIES["deepseek_v4"].attention and ckpt["refuses"] == v4
    # an FP8 checkpoint of a family without FP8 layers: dequantised at load, and why
    assert ckpt["quantization"] == "fp8" and ckpt["weights"]["name"].startswith("dequantised from fp8 at load to ")
    assert FAMILIES["deepseek_v4"].no_fp8_layers in ckpt["weights"]["reason"]
    assert main(["doctor", "--model", str(tmp_path / "missing")]) == 2
    assert "no config at" in capsys.readouterr().err
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["doctor", "--model", str(tmp_path / "llama.json")]) == 2
    assert "model_type 'llama' is not supported by the engine" in capsys.readouterr().err


def test_unknown_dtype_is_an_error():
    with pytest.raises(SystemExit):
        main(["doctor", "--dtype", "int8"])
    with pytest.raises(ValueError, match="dtype must be"):
        doctor.collect(dtype="int8")


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_probe_says_whether_a_bf16_vae_pays(monkeypatch, native):
    from metainfer_gen import platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"} if native else {"avx512f"}))
    caps = platform._probe()
    assert caps.bf16 is native
    assert caps.cpu_matrix == ("avx512_bf16" if native else "")
    hint = [n for n in caps.notes if "--vae-dtype bfloat16" in n]
    assert len(hint) == (1 if native else 0)
    assert any("emulated" in n for n in caps.notes) is not native


def test_the_llm_section_names_the_matmul_path_and_the_fp32_fast_path_not_taken(monkeypatch):
    from metainfer_gen import platform

    monkeypatch.delenv(platform.DTYPE_ENV, raising=False)
    amx = platform.Capabilities(device_kind=platform.DeviceKind.CPU, bf16=True, cpu_matrix="amx_bf16",
                                cpu_capability="AVX512", cxx_compiler="/usr/bin/g++")
    with platform.override_capabilities(amx):
        report = doctor.collect()  # the example inputs default to the engine's run dtype: bf16 here
        out = io.StringIO()
        doctor.render(report, out)
    text = out.getvalue()
    assert report["llm"]["default_dtype"] == "bfloat16" and report["example"]["dtype"] == "bfloat16"
    assert "[fast    ] bfloat16  matmuls run oneDNN AMX-BF16" in text
    assert "[fallback] float32   matmuls run AVX-512 fp32" in text and "3-8x faster" in text
    assert "fp8 checkpoints  dequantised at load" in text
    assert "decode steps     compiled, one graph per batch size" in text
    assert next(o for o in report["ops"] if o["op"] == "linear")["path"] == "bucketed"
    plain = platform.Capabilities(device_kind=platform.DeviceKind.CPU, cpu_capability="AVX2")
    with platform.override_capabilities(plain):
        report = doctor.collect()
    assert report["llm"]["default_dtype"] == "float32" and report["example"]["dtype"] == "float32"
    assert report["llm"]["matmul"]["float32"] == {"path": "AVX2 fp32", "refused": None}
    assert "emulated" in report["llm"]["matmul"]["bfloat16"]["path"]
    assert report["llm"]["decode_step"]["path"] == "eager" and "g++" in report["llm"]["decode_step"]["reason"]
