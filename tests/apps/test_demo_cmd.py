"""``metainfer-gen demo`` without gradio: a clear error naming the demo extra, before any model loads."""

from __future__ import annotations

import importlib.util

from metainfer_gen.apps.cli import main


def test_demo_without_gradio_says_how_to_install_it_and_loads_no_model(monkeypatch, capsys, tmp_path):
    from metainfer_gen import pipelines
    from metainfer_gen.apps import demo

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):  # gradio looks absent (whether or not this machine has it)
        return None if name.split(".")[0] == "gradio" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(demo, "find_spec", find_spec, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    loaded = []

    def loader(cls, *args, **kwargs):
        loaded.append(cls.__name__)
        raise RuntimeError(f"{cls.__name__} was loaded before the gradio check")

    for cls in (pipelines.TextToVideoPipeline, pipelines.ImageToVideoPipeline, pipelines.TextGenerationPipeline):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(loader))
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "untouched"))  # restored even if the command sets it

    code = main(["demo", "--device", "cpu"])
    err = capsys.readouterr().err
    assert loaded == []
    assert code == 2
    assert "gradio is not installed" in err and "pip install 'metainfer-gen[demo]'" in err

