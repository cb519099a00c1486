"""The playground with an image in the prompt, in headless Chromium: an uploaded image in the chat, a
pasted one in the Compare race; each answer is Dyno's `--speculative off` greedy answer for the same
image and text, drawn with highlighted drafts, and the charts, rejected drafts, replay and export work.

The model is the tiny Qwen3.5-VL checkpoint made to agree with its head (playground_models.alphabet_vl_model):
its answers depend on the image, and its drafts are mostly accepted, some refused. One server and one
browser for the module (conftest.py's fixtures, with this `model_dir`).
"""

import hashlib
import json
import re

import pytest

from helpers import vision_models
from helpers.browser import chat_box, set_number, stats_text, wait_for_stats
from helpers.serving import detokenize
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token

pytestmark = pytest.mark.browser
QUESTION = "What is this?"
N = 48  # the served default (conftest.py): the race's max tokens too
SHOWN = "[...document.querySelectorAll('SEL .tok:not(.tok-rejected)')].map(e => e.textContent).join('')"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (pip install 'dyno-mlx[vision]')")
    from helpers import playground_models

    return playground_models.alphabet_vl_model(tmp_path_factory.mktemp("alphabet-vl"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    out = {}
    for seed in (1, 2):
        out[seed] = folder / f"picture-{seed}.png"
        out[seed].write_bytes(vision_models.png(64, 96, seed=seed))
    return out


@pytest.fixture(scope="module")
def plain(served, images):
    """Dyno's `--speculative off` greedy answer to QUESTION about each image (on the engine thread)."""
    from dyno_ui.runtime.request import IMAGE_PLACEHOLDER
    from speculative.loader.vision import images_for

    served, _ = served
    lm = served.lm

    def answer(path):
        messages = [{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}]
        prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt, vision = images_for(lm, prompt, [path.read_bytes()])
        events = generate(lm, prompt, SamplingParams(max_tokens=N), SpecConfig("off"), vision=vision)
        return detokenize(lm, [e.id for e in events if isinstance(e, Token)])

    out = {seed: served.worker.call(lambda p=path: answer(p)).result(120) for seed, path in images.items()}
    assert out[1] != out[2] and all(len(a) == N for a in out.values())  # the image decides the answer
    return out


def shown(page, selector: str) -> str:
    return page.evaluate(SHOWN.replace("SEL", selector))


def test_an_uploaded_image_is_shown_and_answered_as_plain_decoding_does(page, images, plain, shots):
    set_number(page, "chat-temperature", 0)
    page.locator("#chat-input input[type=file]").set_input_files(str(images[2]))
    page.locator("#chat-input img").wait_for()  # the upload's thumbnail in the box
    chat_box(page).fill(QUESTION)
    page.locator("#send").click()
    line = wait_for_stats(page, r"finished: (length|stop)")
    accepted, drafted = map(int, re.search(r"(\d+)/(\d+) drafts accepted", line).groups())
    assert 0 < accepted < drafted, line  # drafts kept, and some refused
    assert shown(page, "#answer") == plain[2]
    assert page.locator("#answer .tok-draft").count() > 0
    assert page.locator("#chatbot img").count() == 1 and QUESTION in page.locator("#chatbot").inner_text()
    for plot in ("plot-rounds", "plot-positions", "plot-histogram"):
        assert page.locator(f"#{plot} .js-plotly-plot .bars").count() > 0, plot
    page.locator("#show-rejected input").check()
    page.locator("#answer .tok-rejected").first.wait_for()
    assert shown(page, "#answer") == plain[2]  # struck-through drafts beside the answer, not in it
    page.screenshot(path=str(shots / "image-chat.png"), full_page=True)


def test_replay_export_and_regenerate_of_the_image_answer(page, images, plain):
    page.locator("#replay-box").get_by_text("Replay the rounds in slow motion").click()
    page.locator("#replay-next").click()
    page.wait_for_function("document.querySelector('#replay .replay-head')?.dataset.round === '2'")
    page.locator("#export-chat").click()
    page.wait_for_function("document.querySelectorAll('#export-files a').length >= 2")
    hrefs = page.locator("#export-files a").evaluate_all("els => els.map(e => e.href)")
    data = json.loads(page.request.get(next(h for h in hrefs if h.split("?")[0].endswith(".json"))).body())
    assert data["trace"]["text"] == plain[2] and data["prompt"] == QUESTION
    digest = hashlib.sha256(images[2].read_bytes()).hexdigest()
    assert [(i["name"], i["sha256"], i["grid"]) for i in data["images"]] == [(images[2].name, digest, [1, 12, 8])]
    exported = page.request.get(next(h for h in hrefs if h.split("?")[0].endswith(".html"))).text()
    assert f"{images[2].name} (sha256 {digest[:12]}" in exported
    # Regenerate answers from the conversation, which keeps the image.
    before = stats_text(page)
    page.locator("#regenerate").click()
    page.wait_for_function("b => { const t = document.querySelector('#stats')?.innerText || '';"
                           " return t !== b && t.includes('finished'); }", arg=before)
    assert shown(page, "#answer") == plain[2] and page.locator("#chatbot img").count() == 1


def test_a_pasted_image_races_identically_with_and_without_drafts(page, images, plain):
    page.get_by_role("tab", name="Compare").click()
    box = page.locator("#compare-prompt textarea")
    box.fill(QUESTION)
    png = list(images[1].read_bytes())
    box.evaluate("""(el, bytes) => { const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array(bytes)], 'pasted.png', {type: 'image/png'}));
        el.dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true})); }""", png)
    page.locator("#compare-prompt img").wait_for()
    set_number(page, "compare-repeats", 1)
    page.locator("#compare-run").click()
    summary = wait_for_stats(page, r"identical output|outputs differ", "#compare-summary")
    assert "identical output" in summary, summary
    assert shown(page, "#compare-plain") == plain[1] == shown(page, "#compare-mtp")
    assert page.locator("#compare-mtp .tok-draft").count() > 0
    assert page.locator("#plot-race .js-plotly-plot").count() == 1
