"""Fixtures of the browser tests: `python app.py`'s app on a free port in this process, Chromium, a page.

Module-scoped: each browser test module starts its own server and browser.
"""

import os
import shutil
from pathlib import Path

import pytest

from helpers.browser import ARGS, CHROMIUM, new_page

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chromium():
    """Missing Chromium fails the module (CI must never pass without the browser tests); a developer
    without it opts out by name."""
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if os.environ.get("DYNO_SKIP_BROWSER") == "1":
        pytest.skip("DYNO_SKIP_BROWSER=1")
    pytest.fail(f"the playground tests need Debian's Chromium at {CHROMIUM} (apt-get install chromium); "
                f"set DYNO_SKIP_BROWSER=1 to skip them", pytrace=False)


# Refreshing the README's screenshots (DYNO_SCREENSHOTS): the playground as `python app.py` starts it
# from the repository root, with the bundled model named by its relative path (no machine's folders
# in the pictures) and the depth `auto` picks; the tests' assertions are the same either way.
SCREENSHOT_RUN = bool(os.environ.get("DYNO_SCREENSHOTS"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dyno_ui import paths

    if (paths.BUNDLED_MODEL / "config.json").exists():
        if not SCREENSHOT_RUN:
            yield paths.BUNDLED_MODEL
            return
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(ROOT)
            mp.setattr(paths, "BUNDLED_MODEL", paths.BUNDLED_MODEL.relative_to(ROOT))
            yield paths.BUNDLED_MODEL
        return
    from helpers import playground_models

    yield playground_models.alphabet_model(tmp_path_factory.mktemp("alphabet"))


@pytest.fixture(scope="module")
def served(model_dir):
    """(ServedModel, URL) of `python app.py`'s app (API + playground in front) on a free port, in this process."""
    from helpers.serving import serving_in_thread

    from dyno_ui.options import ServeOptions
    from dyno_ui.runtime.served import ServedModel
    from dyno_ui.server.run import make_app
    from dyno_ui.runtime.worker import EngineWorker
    from speculative.config import SpecConfig
    from speculative.loader import load_checkpoint

    # Batched drafting, as `python app.py` serves by default (the depth pinned here, measured there).
    width = ServeOptions().width
    if SCREENSHOT_RUN:  # as `python app.py` loads it: draft vocabulary and depth settled by `auto`
        from speculative import load_model

        worker = EngineWorker(lambda: load_model(model_dir), decode_concurrency=width)
    else:
        worker = EngineWorker(lambda: (load_checkpoint(model_dir), SpecConfig("auto", 3)), decode_concurrency=width)
    lm = worker.start()
    served = ServedModel(id=lm.path.name, lm=lm, worker=worker, default_max_tokens=48, created=0)
    with serving_in_thread(make_app(served, ui_front=True), lifespan="on", start_timeout=60) as url:
        yield served, url


@pytest.fixture(scope="module")
def url(served):
    return served[1]


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("screenshots")
    yield folder
    print(f"\nplayground screenshots: {folder}")
    if os.environ.get("DYNO_SCREENSHOTS"):  # e.g. DYNO_SCREENSHOTS=assets/screenshots to refresh the README's
        dest = ROOT / os.environ["DYNO_SCREENSHOTS"]
        dest.mkdir(parents=True, exist_ok=True)
        for png in folder.glob("*.png"):
            shutil.copy(png, dest / png.name)


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, url):
    page = new_page(browser)
    page.goto(url + "/")  # redirected to /ui/
    page.locator("#chat-input textarea").wait_for()
    yield page
    page.context.close()  # before the server stops (the browser outlives it): no page left connected


