"""Drive ``metainfer-gen demo`` in headless Chromium: what the browser tests use and the README's screenshots.

    python -m demo_models.demo_browser --out docs     # embedded models: docs/demo_{t2v,i2v,llm}.png

Needs Selenium (the ``dev`` extra) and Debian's ``chromium`` and ``chromium-driver`` packages (chromedriver on
PATH). The demo runs in a subprocess on a free loopback port; every step types into the page, clicks Generate and
waits for what a person would see (a video element that has decoded a frame, the stats text).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
# The embedded LLM's task (docs/demo_llm.md): recall a pass key hidden in text like its training corpus.
PASSKEY_PROMPT = ("Return the hyperbolic tangent of x. The pass key is 48213. Remember it. 48213 is the pass key. "
                  "Adapt given object to given protocol. What is the pass key? The pass key is")


def find_browser() -> tuple[str, str] | None:
    """(chromium binary, chromedriver) from PATH, or None."""
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, process: subprocess.Popen | None = None):
    """Poll ``condition`` every 0.5 s until it returns something truthy, and return that.

    Raises:
        TimeoutError: ``timeout`` seconds passed. RuntimeError: ``process`` (the demo server) exited meanwhile.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the demo server exited with {process.returncode} while waiting for {what}")
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_demo(demo_args: list[str], log: Path, timeout: float = 240) -> tuple[str, subprocess.Popen]:
    """Start ``metainfer-gen demo DEMO_ARGS --port <free>`` with its output in ``log``; return (url, process) once
    the page answers. Raises what :func:`wait_until` raises, after killing the process (the log's tail in the
    message)."""
    port = free_port()
    command = [sys.executable, "-m", "metainfer_gen.apps.cli", "demo", *demo_args, "--port", str(port)]
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)}
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
        wait_until(up, timeout, f"the demo to serve {url}", process)
    except BaseException as exc:
        process.kill()
        raise type(exc)(f"{exc}; server log:\n{log.read_text()[-4000:]}") from exc
    return url, process


def stop_demo(process: subprocess.Popen) -> None:
    """SIGTERM (the demo then removes its temp folder), SIGKILL after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def open_page(url: str, window: str = "1400,1100"):
    """A headless Chromium WebDriver at ``url`` once the text-to-video tab has rendered (caller quits it)."""
    from selenium.webdriver.common.by import By

    driver = new_driver(window)
    try:
        driver.get(url)
        wait_until(lambda: driver.find_elements(By.ID, "t2v-prompt"), 60, "the page to render")
    except BaseException:
        driver.quit()
        raise
    return driver


def new_driver(window: str = "1400,1100"):
    """A headless Chromium WebDriver on no page yet, autoplay allowed (caller quits it).

    Raises:
        RuntimeError: no chromium / chromedriver on PATH.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    if found is None:
        raise RuntimeError("no browser: install Debian's chromium and chromium-driver packages (chromedriver on PATH)")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={window}",
                     "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(found[1]), options=options)


def play_video_url(driver, src: str, timeout: float = 60) -> dict:
    """Open ``src`` (an MP4 served over HTTP, e.g. ``/v1/videos/{id}/content``) as the page itself, which Chromium
    shows in its own ``<video>`` element, and return that video's state (see :func:`playable_video`) once it has
    decoded a frame. (A ``data:`` page cannot load it: its opaque origin makes Chromium refuse the source.)

    Raises:
        TimeoutError: it never plays.
    """
    driver.get(src)
    return wait_until(lambda: playable_video(driver, None), timeout, f"the browser to play {src}")


def open_tab(driver, label: str) -> None:
    """Click the tab whose text is ``label``. Raises: LookupError: no such tab (the message lists them)."""
    from selenium.webdriver.common.by import By

    tabs = driver.find_elements(By.CSS_SELECTOR, "[role=tab]")
    chosen = [b for b in tabs if b.text.strip() == label]
    if not chosen:
        raise LookupError(f"no tab {label!r}; tabs: {[b.text for b in tabs]}")
    chosen[0].click()


def type_into(driver, elem_id: str, text: str) -> None:
    """Replace the text of the textbox with ``elem_id``."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea, #{elem_id} input")
    box.clear()
    box.send_keys(text)


def set_number(driver, elem_id: str, value: int) -> None:
    """A slider's number box: type the value and leave the box so the slider takes it."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]")
    driver.execute_script("arguments[0].select()", box)
    box.send_keys(str(value))
    box.send_keys("\t")


def text_of(driver, elem_id: str) -> str:
    """The value of the textbox with ``elem_id``."""
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea").get_attribute("value")


def playable_video(driver, elem_id: str | None) -> dict | None:
    """The source and timing of the video element inside ``elem_id`` (None: the page's first video) once it has
    decoded a frame (readyState >= 2), else None."""
    from selenium.webdriver.common.by import By

    videos = driver.find_elements(By.CSS_SELECTOR, f"#{elem_id} video" if elem_id else "video")
    if not videos:
        return None
    state = driver.execute_script(
        "const v = arguments[0]; return {src: v.currentSrc, ready: v.readyState, duration: v.duration, "
        "error: v.error && v.error.code, width: v.videoWidth, height: v.videoHeight};", videos[0])
    return state if state["ready"] >= 2 and state["src"] else None


def generate(driver, prefix: str, timeout: float = 180) -> dict:
    """Click ``<prefix>-generate`` and wait for ``<prefix>-video`` to play; the video's state (see playable_video)."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, f"{prefix}-generate").click()
    return wait_until(lambda: playable_video(driver, f"{prefix}-video"), timeout, f"the {prefix} video")


def show_frame(driver, elem_id: str, seconds: float) -> None:
    """Pause the video of ``elem_id`` at ``seconds`` and wait until that frame is shown (the first frame of a clip
    is its roughest, so a screenshot shows one from the middle)."""
    from selenium.webdriver.common.by import By

    video = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} video")
    driver.execute_script("const v = arguments[0]; v.pause(); v.dataset.seeked = ''; "
                          "v.addEventListener('seeked', () => { v.dataset.seeked = '1'; }, {once: true}); "
                          "v.currentTime = arguments[1];", video, seconds)
    wait_until(lambda: driver.execute_script("return arguments[0].dataset.seeked === '1';", video), 30,
               f"the {elem_id} video to show {seconds} s")


def main(argv: list[str] | None = None) -> None:
    """Screenshots of each tab of the demo on the embedded models, default settings (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for demo_t2v.png, demo_i2v.png, demo_llm.png")
    args = parser.parse_args(argv)
    from selenium.webdriver.common.by import By

    from PIL import Image

    from demo_models.video.data import ClipSpec, first_frame

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    url, process = start_demo(["--device", "cpu"], out / ".demo_server.log")
    driver = open_page(url)
    try:
        type_into(driver, "t2v-prompt", "a red circle moving right")
        generate(driver, "t2v")
        wait_until(lambda: text_of(driver, "t2v-stats"), 30, "the text-to-video stats")
        show_frame(driver, "t2v-video", 1.5)
        driver.save_screenshot(str(out / "demo_t2v.png"))

        open_tab(driver, "Image to video")
        wait_until(lambda: driver.find_element(By.ID, "i2v-generate").is_displayed(), 30, "the image tab")
        spec = ClipSpec(colour="green", shape="square", direction="up", x0=32, y0=44, speed=1.0, radius=9,
                        background=(0.05, 0.02, 0.12))
        reference = out / ".reference.png"
        Image.fromarray(first_frame(spec, 64)).save(reference)
        driver.find_element(By.CSS_SELECTOR, "#i2v-image input[type=file]").send_keys(str(reference.resolve()))
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#i2v-image img"), 60, "the uploaded image")
        type_into(driver, "i2v-prompt", "the green square moves up")
        generate(driver, "i2v")
        show_frame(driver, "i2v-video", 1.5)
        driver.save_screenshot(str(out / "demo_i2v.png"))

        open_tab(driver, "LLM")
        wait_until(lambda: driver.find_element(By.ID, "llm-generate").is_displayed(), 30, "the LLM tab")
        type_into(driver, "llm-prompt", PASSKEY_PROMPT)
        set_number(driver, "llm-max-new-tokens", 8)
        driver.find_element(By.ID, "llm-generate").click()
        wait_until(lambda: text_of(driver, "llm-stats"), 180, "the LLM stats")
        driver.save_screenshot(str(out / "demo_llm.png"))
        reference.unlink()
    finally:
        driver.quit()
        stop_demo(process)
    print(f"wrote {out}/demo_t2v.png, demo_i2v.png, demo_llm.png")


if __name__ == "__main__":
    main()
