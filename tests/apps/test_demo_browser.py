"""End to end in a real browser: ``metainfer-gen demo`` in a subprocess on a free loopback port, driven by headless
Chromium through Selenium (Debian's ``chromium`` and ``chromium-driver`` packages; ``.ci/run`` installs them).

One server (tiny Wan model, tiny LLM) serves every test in this module; each test types into the page, clicks
Generate and reads what a person would see: a video element with a playable MP4 of the right duration, and the
stats text. Screenshots go to the test's temporary folder. The browser helpers live in
``demo_models.demo_browser``, which also makes the README's screenshots on the embedded models.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

from selenium.webdriver.common.by import By  # noqa: E402

from demo_models.demo_browser import (find_browser, generate, open_page, open_tab,  # noqa: E402
                                             start_demo, stop_demo, set_number, text_of, type_into, wait_until)

FPS = 8.0  # the tiny model has no settings file: clips are written at VideoOutput's default
START_TIMEOUT_S = 240  # imports and model loads on a busy 2-core machine
CALL_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server(tiny_wan_dir, text_checkpoint, tmp_path_factory):
    """The demo in a subprocess: (url, process, temp root it announced, log); stopped with SIGTERM afterwards."""
    if find_browser() is None:
        pytest.skip("no browser: install Debian's chromium and chromium-driver packages (chromedriver on PATH)")
    log = tmp_path_factory.mktemp("demo_server") / "server.log"
    url, process = start_demo(["--model", str(tiny_wan_dir), "--llm-model", str(text_checkpoint[2]),
                               "--device", "cpu", "--max-frames", "9", "--max-size", "64", "--max-steps", "4",
                               "--max-new-tokens", "16"], log, timeout=START_TIMEOUT_S)
    match = re.search(r"uploads and clips under (\S+)\)", log.read_text())
    yield url, process, Path(match.group(1)) if match else None, log
    stop_demo(process)


@pytest.fixture(scope="module")
def page(server):
    """A headless Chromium at the demo's page, with every tab's controls rendered."""
    driver = open_page(server[0])
    try:
        yield driver
    finally:
        driver.quit()


def generate_clip(driver, prefix: str, num_frames: int) -> dict:
    set_number(driver, f"{prefix}-frames", num_frames)
    video = generate(driver, prefix, CALL_TIMEOUT_S)
    assert video["error"] is None and video["src"].endswith(".mp4")
    assert video["duration"] == pytest.approx(num_frames / FPS, abs=0.05)
    return video


def test_text_to_video_in_the_browser(page, tmp_path):
    page.find_element(By.ID, "t2v-generate").click()  # empty prompt: refused with a message, no clip
    toast = wait_until(lambda: [text for text in (t.text for t in page.find_elements(  # read once: a toast fades
        By.CSS_SELECTOR, "[data-testid=toast-body]")) if "prompt is empty" in text], 60, "the empty-prompt message")
    assert "type what the clip should show" in toast[0]
    assert not page.find_elements(By.CSS_SELECTOR, "#t2v-video video")

    type_into(page, "t2v-prompt", "a red circle moving right")
    video = generate_clip(page, "t2v", num_frames=5)
    assert (video["width"], video["height"]) == (64, 64)
    stats = text_of(page, "t2v-stats")
    assert "for 5 frames at 64x64, 4 steps" in stats and "step cache auto" in stats
    assert text_of(page, "t2v-audit").startswith("fast-path audit")
    page.save_screenshot(str(tmp_path / "demo_t2v.png"))
    assert (tmp_path / "demo_t2v.png").stat().st_size > 10_000


def test_image_to_video_with_an_rgba_upload_in_the_browser(page, tmp_path):
    rng = np.random.default_rng(0)
    upload = tmp_path / "reference.png"
    Image.fromarray(rng.integers(0, 256, (90, 130, 4), dtype=np.uint8), "RGBA").save(upload)
    open_tab(page, "Image to video")
    wait_until(lambda: page.find_element(By.ID, "i2v-generate").is_displayed(), 30, "the image tab")
    page.find_element(By.CSS_SELECTOR, "#i2v-image input[type=file]").send_keys(str(upload))
    wait_until(lambda: page.find_elements(By.CSS_SELECTOR, "#i2v-image img"), 60, "the uploaded image preview")
    type_into(page, "i2v-prompt", "the square moves up")
    generate_clip(page, "i2v", num_frames=9)
    assert text_of(page, "i2v-image-info") == "reference image 130x90 RGBA, centre-cropped and resized to 64x64"
    assert "for 9 frames at 64x64" in text_of(page, "i2v-stats")
    page.save_screenshot(str(tmp_path / "demo_i2v.png"))


def test_llm_tab_in_the_browser(page, tmp_path):
    open_tab(page, "LLM")
    wait_until(lambda: page.find_element(By.ID, "llm-generate").is_displayed(), 30, "the LLM tab")
    type_into(page, "llm-prompt", "the quick brown fox")
    set_number(page, "llm-max-new-tokens", 6)
    page.find_element(By.ID, "llm-generate").click()
    stats = wait_until(lambda: text_of(page, "llm-stats"), CALL_TIMEOUT_S, "the LLM stats")
    assert stats.startswith("6 tokens, TTFT ") and "tokens/s" in stats
    page.save_screenshot(str(tmp_path / "demo_llm.png"))


def test_uploads_and_clips_stay_in_the_demo_temp_folder_and_go_with_the_server(server, page):
    _, process, root, log = server
    assert root is not None, f"the server did not announce its temp folder: {log.read_text()[-2000:]}"
    files = [p for p in root.rglob("*") if p.is_file()]
    if not files:
        pytest.skip("run with the other browser tests: nothing was uploaded or rendered yet")
    assert any(p.suffix == ".mp4" for p in files)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert not root.exists(), "the demo left its temporary folder behind"
