"""The playground as a teaching tool, in headless Chromium: rejected drafts, hover cards with p and q,
the slow-motion replay, the standalone export and the repeated race, checked against the engine's own
events for the same prompt (run on the engine thread, as the playground's jobs are)."""

import json
import math
import re

import pytest

from helpers.browser import chat_box, new_page, set_number, wait_for_stats
from helpers.drafts import rounds_with_tokens
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token

pytestmark = pytest.mark.browser
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def answer(page, served):
    """A greedy answer to the second example with details on, and the engine's events for it."""
    from dyno_ui.playground.sessions import Sessions
    from dyno_ui.playground.ui import EXAMPLES

    served, _ = served
    page.locator("#chat-examples").get_by_text(EXAMPLES[1], exact=True).click()
    page.wait_for_function("document.querySelector('#chat-input textarea').value.length > 0")
    set_number(page, "chat-temperature", 0)
    set_number(page, "chat-max-tokens", MAX_TOKENS)
    page.locator("#details input").check()
    page.locator("#send").click()
    wait_for_stats(page, r"finished: (length|stop)")
    lm = served.lm
    prompt = Sessions(served).chat_prompt([{"role": "user", "content": EXAMPLES[1]}], False, lm)
    spec = SpecConfig("mtp", served.worker.spec.draft_depth, details=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=0)
    return served.worker.call(lambda: list(generate(lm, prompt, params, spec))).result(120)


def rejected_ids(page, scope="#answer"):
    return [int(x) for x in page.locator(f"{scope} .tok-rejected").evaluate_all("els => els.map(e => e.dataset.id)")]


def test_examples_turn_on_rejected_drafts_which_match_the_engines_trace(page, answer):
    assert page.locator("#show-rejected input").is_checked()  # the demo examples switch them on
    expected = [d for r, toks in rounds_with_tokens(answer)
                if len(toks) == r.accepted + 1 and toks[-1].provenance.value == "correction"
                for d in r.drafts[r.accepted:]]
    assert expected, "the answer needs corrections to show rejected drafts"
    assert rejected_ids(page) == expected  # count and ids, in order
    page.locator("#show-rejected input").uncheck()
    page.wait_for_function("document.querySelectorAll('#answer .tok-rejected').length === 0")
    page.locator("#show-rejected input").check()
    page.wait_for_function(f"document.querySelectorAll('#answer .tok-rejected').length === {len(expected)}")


def test_hover_cards_give_round_position_and_the_engines_probabilities(page, answer, shots):
    tokens = [e for e in answer if isinstance(e, Token)]
    checked = 0
    for kind in ("draft", "correction", "bonus"):
        # Tokens with visible text (a lone newline has no box to hover).
        visible = page.locator(f"#answer .tok-{kind}").evaluate_all(
            "els => els.filter(e => e.textContent.trim()).map(e => e.dataset.i)")
        for i in map(int, visible[:3]):
            span = page.locator(f'#answer .tok[data-i="{i}"]')
            span.hover()
            card = page.locator("#dyno-card")
            card.wait_for(state="visible")
            text = card.inner_text()
            assert re.match(r"round \d+ · position \d+ of \d+ · ", text), text
            p = float(re.search(r"· p (\d\.\d{4})", text).group(1))
            assert abs(p - math.exp(tokens[i].logprobs.logprob)) <= 1e-4, (text, tokens[i])
            if kind == "draft":
                assert "was the model's argmax" in text
            checked += 1
    assert checked >= 4
    page.locator("#answer .tok-correction").first.hover()  # the README's picture: a card beside a correction
    page.screenshot(path=str(shots / "rejected-drafts.png"), full_page=True)


def test_replay_steps_through_every_round_of_the_answer(page, answer, shots):
    rounds = len(rounds_with_tokens(answer))
    page.locator("#replay-box").get_by_text("Replay the rounds in slow motion").click()
    page.locator("#replay-start").click()
    head = page.locator("#replay .replay-head")
    page.wait_for_function("document.querySelector('#replay .replay-head')?.dataset.round === '1'")
    phases = [head.get_attribute("data-phase")]
    for _ in range(3):
        before = phases[-1]
        page.locator("#replay-step").click()
        page.wait_for_function(f"document.querySelector('#replay .replay-head').dataset.phase !== '{before}'")
        phases.append(head.get_attribute("data-phase"))
    assert phases == ["draft", "verify", "rollback", "commit"]
    seen = [1]
    for n in range(2, rounds + 1):
        page.locator("#replay-next").click()
        page.wait_for_function(f"document.querySelector('#replay .replay-head').dataset.round === '{n}'")
        seen.append(int(head.get_attribute("data-round")))
    assert seen == list(range(1, rounds + 1))
    assert f"Round {rounds} of {rounds}" in head.inner_text()
    page.locator("#replay-start").focus()  # the keyboard drives it too
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#replay .replay-head').dataset.round === '1'")
    for _ in range(2):
        page.locator("#replay-next").click()
    page.locator("#replay-step").focus()
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#replay .replay-head').dataset.phase === 'verify'")
    page.locator("#replay").scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "replay.png"), full_page=True)
    set_number(page, "replay-speed", 10)  # Play runs on to the last round's commit by itself
    page.locator("#replay-play").click()
    page.wait_for_function(f"(h => h.dataset.round === '{rounds}' && h.dataset.phase === 'commit')"
                           "(document.querySelector('#replay .replay-head'))")


def test_exported_answer_opens_standalone_with_the_same_tokens(page, browser, answer, tmp_path, shots):
    page.locator("#export-chat").click()
    links = page.locator("#export-files a")
    page.wait_for_function("document.querySelectorAll('#export-files a').length >= 2")
    hrefs = {re.sub(r".*\.", "", h.split("?")[0]): h for h in links.evaluate_all("els => els.map(e => e.href)")}
    (tmp_path / "answer.html").write_bytes(page.request.get(hrefs["html"]).body())
    data = json.loads(page.request.get(hrefs["json"]).body())
    assert [t["id"] for t in data["trace"]["tokens"]] == [e.id for e in answer if isinstance(e, Token)]
    shown = "[...document.querySelectorAll('.dyno-answer .tok:not(.tok-rejected)')].map(e => e.textContent).join('')"
    live = page.evaluate(shown.replace(".dyno-answer", "#answer .dyno-answer"))
    offline = new_page(browser)
    fetched = []
    offline.route(re.compile(r"^https?://"), lambda route: (fetched.append(route.request.url), route.abort()))
    offline.goto((tmp_path / "answer.html").as_uri())
    assert offline.evaluate(shown) == live and live
    rejected = [d for r in data["trace"]["rounds"] for d in r["rejected"]]
    assert rejected_ids(offline, ".dyno-answer") == rejected == rejected_ids(page)
    offline.locator(".js-plotly-plot").first.wait_for()  # the charts drew with the inlined Plotly
    assert offline.locator(".js-plotly-plot").count() == 4 and fetched == []  # charts.answer_figures
    offline.screenshot(path=str(shots / "export.png"), full_page=True)
    offline.context.close()


def test_race_reports_the_median_over_its_runs_at_autos_depth(page, served, shots):
    page.get_by_role("tab", name="Compare").click()
    set_number(page, "compare-repeats", 3)
    page.locator("#compare-run").click()
    summary = wait_for_stats(page, r"identical output|outputs differ", "#compare-summary")
    assert re.search(r"\d+\.\d+× speedup \(median of 3 runs, spread \d+\.\d+–\d+\.\d+×\)", summary), summary
    depth = served[0].worker.spec.draft_depth
    assert f"depth {depth} (auto's choice)" in summary and "identical output in every run" in summary
    note = page.locator("#compare-note").inner_text()
    median = float(re.search(r"(\d+\.\d+)× speedup", summary).group(1))
    if median < 1:  # drafting lost on this machine: the cost model says why, in one line
        assert "the cost model" in note, note
    page.screenshot(path=str(shots / "race.png"), full_page=True)
    page.get_by_role("tab", name="Chat").click()
    chat_box(page).fill("")


def test_provenance_differs_in_more_than_hue_and_the_switches_take_the_keyboard(page):
    styles = page.evaluate("""[...document.querySelectorAll('.dyno-legend .tok')].map(e => {
        const s = getComputedStyle(e); return s.textDecorationLine + ' ' + s.textDecorationStyle; })""")
    kinds = [k for k in page.locator(".dyno-legend .tok").all_inner_texts()]
    assert len(kinds) == 6 and len(set(styles)) == 6, list(zip(kinds, styles))  # one line style per kind (copies too)
    box = page.locator("#show-rejected input")
    was = box.is_checked()
    box.focus()
    page.keyboard.press("Space")
    page.wait_for_function(f"document.querySelector('#show-rejected input').checked === {str(not was).lower()}")
    page.keyboard.press("Space")
