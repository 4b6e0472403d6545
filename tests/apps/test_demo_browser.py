"""End to end in a real browser: ``metainfer-gen demo`` in a subprocess on a free loopback port, driven by headless
Chromium through Selenium (Debian's ``chromium`` and ``chromium-driver`` packages; ``.ci/run`` installs them).

One server (tiny Wan model, tiny LLM) serves every test in this module; each test types into the page, clicks
Generate and reads what a person would see: a video element with a playable MP4 of the right duration, and the
stats text. Screenshots go to the test's temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

from selenium.webdriver.common.by import By  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FPS = 8.0  # the tiny model has no settings file: clips are written at VideoOutput's default
START_TIMEOUT_S = 240  # imports and model loads on a busy 2-core machine
CALL_TIMEOUT_S = 180


def find_browser() -> tuple[str, str] | None:
    """(chromium binary, chromedriver) from PATH, or None."""
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, server=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if server is not None and server.poll() is not None:
            pytest.fail(f"the demo server exited with {server.returncode} while waiting for {what}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def server(tiny_wan_dir, text_checkpoint, tmp_path_factory):
    """The demo in a subprocess: (url, process, temp root it announced); stopped with SIGTERM afterwards."""
    if find_browser() is None:
        pytest.skip("no browser: install Debian's chromium and chromium-driver packages (chromedriver on PATH)")
    port = free_port()
    log = tmp_path_factory.mktemp("demo_server") / "server.log"
    command = [sys.executable, "-m", "metainfer_gen.apps.cli", "demo", "--model", str(tiny_wan_dir),
               "--llm-model", str(text_checkpoint[2]), "--device", "cpu", "--port", str(port),
               "--max-frames", "9", "--max-size", "64", "--max-steps", "4", "--max-new-tokens", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}/"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_until(up, START_TIMEOUT_S, f"the demo to serve {url}", server=process)
    except BaseException:
        process.kill()
        print(log.read_text()[-4000:])
        raise
    match = re.search(r"uploads and clips under (\S+)\)", log.read_text())
    yield url, process, Path(match.group(1)) if match else None, log
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def page(server):
    """A headless Chromium at the demo's page, with every tab's controls rendered."""
    binary, driver_path = find_browser()
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100",
                     "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(server[0])
        wait_until(lambda: driver.find_elements(By.ID, "t2v-prompt"), 60, "the page to render")
        yield driver
    finally:
        driver.quit()


def open_tab(driver, label: str) -> None:
    tab = [b for b in driver.find_elements(By.CSS_SELECTOR, "[role=tab]") if b.text.strip() == label]
    assert tab, f"no tab {label!r}; tabs: {[b.text for b in driver.find_elements(By.CSS_SELECTOR, '[role=tab]')]}"
    tab[0].click()


def type_into(driver, elem_id: str, text: str) -> None:
    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea, #{elem_id} input")
    box.clear()
    box.send_keys(text)


def set_number(driver, elem_id: str, value: int) -> None:
    """A slider's number box: type the value and leave the box so the slider takes it."""
    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]")
    driver.execute_script("arguments[0].select()", box)
    box.send_keys(str(value))
    box.send_keys("\t")


def text_of(driver, elem_id: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea").get_attribute("value")


def playable_video(driver, elem_id: str) -> dict | None:
    """The video element's source and timing once it has decoded a frame (readyState >= 2), else None."""
    videos = driver.find_elements(By.CSS_SELECTOR, f"#{elem_id} video")
    if not videos:
        return None
    state = driver.execute_script(
        "const v = arguments[0]; return {src: v.currentSrc, ready: v.readyState, duration: v.duration, "
        "error: v.error && v.error.code, width: v.videoWidth, height: v.videoHeight};", videos[0])
    return state if state["ready"] >= 2 and state["src"] else None


def generate_clip(driver, prefix: str, num_frames: int) -> dict:
    set_number(driver, f"{prefix}-frames", num_frames)
    driver.find_element(By.ID, f"{prefix}-generate").click()
    video = wait_until(lambda: playable_video(driver, f"{prefix}-video"), CALL_TIMEOUT_S, f"the {prefix} video")
    assert video["error"] is None and video["src"].endswith(".mp4")
    assert video["duration"] == pytest.approx(num_frames / FPS, abs=0.05)
    return video


def test_text_to_video_in_the_browser(page, tmp_path):
    page.find_element(By.ID, "t2v-generate").click()  # empty prompt: refused with a message, no clip
    toast = wait_until(lambda: [t.text for t in page.find_elements(By.CSS_SELECTOR, "[data-testid=toast-body]")
                                if "prompt is empty" in t.text], 60, "the empty-prompt message")
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
