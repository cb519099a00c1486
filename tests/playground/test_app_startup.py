"""`python app.py` as a user starts it: the URL it prints last is the playground's, and it opens."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
URL = re.compile(r"https?://\S+")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dyno_ui.paths import BUNDLED_MODEL

    if (BUNDLED_MODEL / "config.json").exists():
        return BUNDLED_MODEL
    from helpers import tiny_models

    return tiny_models.build(tmp_path_factory.mktemp("tiny") / "tiny", seed=1)


def _lines(stream, out: "queue.Queue[str]") -> None:
    for line in stream:
        out.put(line.rstrip("\n"))


def test_app_prints_the_playground_url_last_and_it_opens(model_dir):
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "app.py", "--model", str(model_dir), "--port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    printed = []
    try:
        deadline = time.monotonic() + 120
        while not printed or not printed[-1].startswith("* Running on local URL:"):
            assert proc.poll() is None and time.monotonic() < deadline, printed
            try:
                printed.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        api = URL.search(printed[0]).group(0)
        playground = URL.search(printed[-1]).group(0)
        assert api.endswith("/v1") and not playground.endswith("/v1"), printed
        page = httpx.get(playground, follow_redirects=True, timeout=60)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<html" in page.text.lower()
        models = httpx.get(api + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [model_dir.name]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    time.sleep(0.2)  # the reader thread drains what was printed after the playground line
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not [line for line in rest if URL.search(line)], rest  # the playground URL stays the last one


def test_dyno_serve_keeps_its_api_line_first_and_names_the_playground_last():
    from dyno_ui.server.run import startup_lines

    lines = startup_lines("dyno-tiny", "MTP drafting, depth 3", "http://127.0.0.1:8080", ui=True, ui_front=False)
    assert lines == ["dyno: serving dyno-tiny at http://127.0.0.1:8080/v1 (MTP drafting, depth 3)",
                     "dyno: playground at http://127.0.0.1:8080/ui/"]
    assert startup_lines("m", "plain decoding, no drafting", "http://h:1", ui=False, ui_front=False) == [
        "dyno: serving m at http://h:1/v1 (plain decoding, no drafting)"]
