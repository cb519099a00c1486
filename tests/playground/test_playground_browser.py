"""The playground in real headless Chromium (Debian's /usr/bin/chromium through Playwright; nothing
downloaded): chat with coloured drafts, charts and stats; Stop; the compare race; the Models tab.

Runs on the bundled dyno-tiny when it is there, else on a tiny checkpoint whose head agrees with
its trunk (tests/helpers/playground_models.py), so that drafts are really accepted either way.
The server, browser and page fixtures are in conftest.py.
"""

import re

import pytest

from helpers.browser import chat_box, clear_chat, new_page, set_number, stats_text, wait_for_stats

pytestmark = pytest.mark.browser


def test_with_a_key_the_page_asks_for_it_then_chats(browser, model_dir):
    """`--api-key`: Gradio's login form first (a wrong key stays on it), then the playground."""
    from dyno_ui.options import ServeOptions
    from dyno_ui.runtime.served import ServedModel
    from dyno_ui.runtime.worker import EngineWorker
    from dyno_ui.server.run import make_app
    from helpers.serving import serving_in_thread
    from speculative.config import SpecConfig
    from speculative.loader import load_checkpoint

    worker = EngineWorker(lambda: (load_checkpoint(model_dir), SpecConfig("auto", 3)))
    lm = worker.start()
    served = ServedModel(id=lm.path.name, lm=lm, worker=worker, default_max_tokens=8, created=0)
    app = make_app(served, ui_front=True, options=ServeOptions(api_key="sk-page"))
    with serving_in_thread(app, lifespan="on", start_timeout=60) as url:
        page = new_page(browser)
        page.goto(url + "/")

        def sign_in(key: str) -> None:
            page.get_by_label("username").fill("visitor")
            page.get_by_label("password").fill(key)
            page.get_by_role("button", name="Login").click()

        sign_in("wrong")
        page.get_by_text("Incorrect Credentials").wait_for()
        assert page.locator("#chat-input").count() == 0
        assert "API key" in page.locator(".auth").inner_text()  # the message says what to type
        sign_in("sk-page")
        chat_box(page).fill("def fibonacci(n):")
        page.locator("#send").click()
        assert "finished: length" in wait_for_stats(page, r"finished: (length|stop)")
        page.context.close()  # before the server stops: no page left connected to it


def test_chat_streams_coloured_drafts_charts_and_stats(page, shots):
    from dyno_ui.playground.ui import EXAMPLES

    page.locator("#chat-input textarea").fill(EXAMPLES[1])  # what a visitor clicks first
    page.locator("#send").click()
    line = wait_for_stats(page, r"finished: (length|stop)")
    accepted, drafted = map(int, re.search(r"(\d+)/(\d+) drafts accepted", line).groups())
    assert 0 < accepted <= drafted, line
    assert page.locator("#answer .tok-draft").count() > 0
    assert page.locator("#answer .tok").count() >= 2
    for plot in ("plot-rounds", "plot-positions", "plot-histogram"):
        assert page.locator(f"#{plot} .js-plotly-plot .bars").count() > 0, plot
    assert page.locator("#chatbot").inner_text().strip()
    page.screenshot(path=str(shots / "chat.png"), full_page=True)


def test_stop_mid_generation_then_generate_again(page):
    set_number(page, "chat-max-tokens", 4096)  # tens of seconds here: Stop lands mid-stream
    set_number(page, "chat-seed", 0)  # an answer that runs to max tokens (some seeds end in 40 tokens)
    page.locator("#chat-input textarea").fill("Keep going.")
    page.locator("#send").click()
    page.wait_for_function("document.querySelectorAll('#answer .tok').length > 8")
    page.locator("#stop-button").click()
    line = wait_for_stats(page, r"finished: cancelled")
    assert int(re.search(r"(\d+)\s*tokens", line).group(1)) < 4096
    set_number(page, "chat-max-tokens", 20)
    page.locator("#chat-input textarea").fill("Once more.")
    page.locator("#send").click()
    line = wait_for_stats(page, r"20\s*tokens.*finished: length")
    assert "drafts accepted" in line
    set_number(page, "chat-seed", -1)


def test_shift_enter_adds_a_line_and_sends_nothing(page):
    clear_chat(page)
    chat_box(page).press_sequentially("first line")
    chat_box(page).press("Shift+Enter")
    chat_box(page).press_sequentially("second line")
    page.wait_for_timeout(1500)  # time enough for a submit to have reached the server and the stats line
    assert chat_box(page).input_value() == "first line\nsecond line"
    assert "finished" not in stats_text(page) and "first line" not in page.locator("#chatbot").inner_text()
    chat_box(page).fill("")


def test_enter_sends_the_message(page):
    set_number(page, "chat-max-tokens", 20)
    clear_chat(page)
    chat_box(page).press_sequentially("def fibonacci(n):")
    chat_box(page).press("Enter")
    wait_for_stats(page, r"finished: (length|stop)")
    assert "def fibonacci(n):" in page.locator("#chatbot").inner_text()
    assert page.locator("#answer .tok").count() > 0
    assert chat_box(page).input_value() == ""  # sent, so the box is emptied


def test_examples_fill_the_chat_box_and_the_note_names_the_models_tab(page):
    from dyno_ui.playground.ui import EXAMPLES

    assert "Models tab" in page.locator("#bundled-note").inner_text()
    clear_chat(page)
    page.locator("#chat-examples").get_by_text(EXAMPLES[1], exact=True).click()
    page.wait_for_function("document.querySelector('#chat-input textarea').value.length > 0")
    assert chat_box(page).input_value() == EXAMPLES[1]
    chat_box(page).fill("")


def test_compare_race_is_identical_at_temperature_zero(page):
    from dyno_ui.playground.ui import EXAMPLES

    page.get_by_role("tab", name="Compare").click()
    assert page.locator("#compare-prompt textarea").input_value() == EXAMPLES[0]  # a prompt dyno-tiny handles
    page.locator("#compare-run").click()
    summary = wait_for_stats(page, r"identical output|outputs differ", "#compare-summary")
    assert "identical output" in summary, summary
    assert re.search(r"\d+\.\d+× speedup", summary), summary
    assert page.locator("#compare-mtp .tok-draft").count() > 0
    assert page.locator("#plot-race .js-plotly-plot").count() == 1


# A prompt whose answer repeats what it was given, so that the bundled model's drafts are copied from it.
FUNCTION = ('def parse(line, sep=","):\n    """Split one line of CSV into its fields."""\n    fields = []\n'
            "    for part in line.split(sep):\n        fields.append(part.strip())\n    return fields\n")
COPYING = f"Implement `parse` in Python.\n\n{FUNCTION}\n{FUNCTION[:40]}"
PLOT_DATA = "(id) => document.querySelector(`#${id} .js-plotly-plot`).data.map(t => ({name: t.name, y: t.y}))"


def plotted(page, plot: str) -> dict:
    """The traces a chart drew, by name: {name: y values} as Plotly holds them in the page."""
    return {t["name"]: t["y"] for t in page.evaluate(PLOT_DATA, f"plot-{plot}")}


def copied_answer(page, copies: str) -> tuple:
    """The greedy answer to COPYING with the page's copies toggle at `copies`: (stats line, answer text)."""
    page.get_by_role("tab", name="Chat").click()
    clear_chat(page)
    page.locator("#copies").get_by_label(copies, exact=True).check()
    set_number(page, "chat-temperature", 0)
    set_number(page, "chat-max-tokens", 48)
    chat_box(page).fill(COPYING)
    page.locator("#send").click()
    line = wait_for_stats(page, r"finished: (length|stop)")
    page.wait_for_function("document.querySelector('#plot-depth .js-plotly-plot')?.data?.length > 0")
    shown = page.locator("#answer .tok:not(.tok-rejected)").all_inner_texts()  # refused drafts are not the answer
    return line, "".join(shown)


def test_the_copies_toggle_colours_copies_and_the_charts_split_them_from_the_heads(page, shots):
    """Copies on: copied tokens coloured apart, the stats line counts them, the rounds chart's accepted
    bars and the acceptance chart split by source with the line's figures, and the depth chart has
    every round, the copied ones marked with their longer depths; off: none of it, the same text."""
    line, text = copied_answer(page, "on")
    copied, copies = map(int, re.search(r"(\d+)/(\d+) copies accepted", line).groups())
    accepted, drafted = map(int, re.search(r"(\d+)/(\d+) drafts accepted", line).groups())
    assert 0 < copied <= copies < drafted and copied < accepted, line
    assert page.locator("#answer .tok-copy").count() == copied  # each accepted copy is one token's span
    rounds = plotted(page, "rounds")
    assert sum(y or 0 for y in rounds["accepted: copies"]) == copied, rounds
    assert sum(y or 0 for y in rounds["accepted: head"]) == accepted - copied, rounds
    assert set(plotted(page, "positions")) == {"head", "copies"}
    depth = plotted(page, "depth")
    n_rounds = len(rounds["drafted"])  # (the rounds chart holds its last 100 rounds: this answer's all)
    assert len(depth["depth"]) == n_rounds and sum(depth["depth"]) == drafted, depth
    assert sum(depth["copied round"]) == copies and max(depth["copied round"]) > max(
        d for d, c in zip(depth["depth"], rounds["accepted: copies"]) if c is None), depth  # longer than the head's
    page.screenshot(path=str(shots / "copies.png"), full_page=True)
    line_off, text_off = copied_answer(page, "off")
    assert "copies accepted" not in line_off and page.locator("#answer .tok-copy").count() == 0
    assert "accepted: copies" not in plotted(page, "rounds") and set(plotted(page, "positions")) == {"head"}
    assert "copied round" not in plotted(page, "depth") and text_off == text
    clear_chat(page)


def test_compare_races_head_and_copies_against_the_head_alone(page):
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-pairing").get_by_label("head + copies against the head alone").check()
    page.locator("#compare-mtp-label").get_by_text("head + copies").wait_for()
    assert page.locator("#compare-plain-label").inner_text().strip() == "head only"
    page.locator("#compare-prompt textarea").fill(COPYING)
    set_number(page, "compare-repeats", 1)
    page.locator("#compare-run").click()
    # (the last race's summary stays until this one ends: its end is the first line naming these sides)
    summary = wait_for_stats(page, r"head \+ copies .*(identical output|outputs differ)", "#compare-summary")
    assert "identical output" in summary and re.search(r"\d+\.\d+× speedup", summary), summary
    assert re.search(r"head \+ copies [\d.]+ tok/s · head only [\d.]+ tok/s", summary), summary
    assert page.locator("#compare-mtp .tok-copy").count() > 0  # copies drafted on one side only
    assert page.locator("#compare-plain .tok-copy").count() == 0
    assert page.locator("#compare-plain .tok-draft").count() > 0  # the head drafts on both
    assert [t["name"] for t in page.evaluate(PLOT_DATA, "plot-race")] == ["head + copies", "head only"]
    page.locator("#compare-pairing").get_by_label("MTP against plain decoding").check()
    page.locator("#compare-mtp-label").get_by_text("MTP").wait_for()
    page.get_by_role("tab", name="Chat").click()


def table_text(page) -> str:
    return page.locator("#models-table").inner_text()


def test_models_tab_opens_listing_the_bundled_model_once(page):
    from dyno_ui.paths import BUNDLED_MODEL

    page.get_by_role("tab", name="Models").click()
    assert (BUNDLED_MODEL / "config.json").exists(), "the bundled model ships with the repository"
    page.wait_for_function("(document.querySelector('#models-table')?.innerText || '').includes('in checkpoint')")
    assert table_text(page).count(str(BUNDLED_MODEL)) == 1, table_text(page)


def test_models_tab_lists_and_loads(page, shots, model_dir):
    page.get_by_role("tab", name="Models").click()
    page.locator("#model-folder textarea, #model-folder input").first.fill(str(model_dir))
    page.get_by_role("button", name="Scan").click()
    page.wait_for_function("(document.querySelector('#models-table')?.innerText || '').includes('in checkpoint')")
    assert table_text(page).count(str(model_dir)) == 1, table_text(page)  # typed in, and maybe bundled: once
    page.locator("#head-bits").get_by_label("8", exact=True).check()
    page.locator("#load-model").click()
    # (a first load under auto times this model's batched rounds once: tens of seconds on 2 busy cores)
    page.locator("#models-status").get_by_text(f"Loaded {model_dir.name}").wait_for(timeout=180_000)
    current = page.locator("#current-model").inner_text()
    assert "MLX memory" in current and re.search(r"MTP head: [0-9.]+ [MG]B, 8-bit, from ", current), current
    page.screenshot(path=str(shots / "models.png"), full_page=True)


def test_an_image_for_a_model_without_a_tower_is_a_one_line_error(page, tmp_path):
    from helpers import vision_models

    page.get_by_role("tab", name="Chat").click()
    clear_chat(page)
    picture = tmp_path / "picture.png"
    picture.write_bytes(vision_models.png(32, 32))
    page.locator("#chat-input input[type=file]").set_input_files(str(picture))
    page.locator("#chat-input img").wait_for()
    chat_box(page).fill("What is this?")
    page.locator("#send").click()
    toast = page.get_by_test_id("toast-body").filter(has_text="use a vision-language conversion")
    toast.wait_for()
    message = toast.get_by_test_id("toast-text").inner_text().strip()
    assert re.fullmatch(r"\S+ has no (vision tower|image processor config)[^\n]*; use a vision-language "
                        r"conversion \(the original Qwen repo, or an mlx-vlm conversion\)", message), message
    assert page.locator("#chat-input img").count() == 1  # refused before sending: the box keeps the image
    assert "finished" not in stats_text(page)
    page.locator("#chat-input .thumbnail-item button, #chat-input button.delete-button").first.click()
    chat_box(page).fill("")
