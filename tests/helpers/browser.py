"""Driving the playground in headless Chromium: the launch settings and small page helpers."""

import os

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def new_page(browser):
    """A page in a context of its own (its own cookies)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.set_default_timeout(int(os.environ.get("PW_TIMEOUT", 60_000)))
    return page


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def stats_text(page, selector="#stats") -> str:
    return page.locator(selector).inner_text()


def wait_for_stats(page, pattern: str, selector="#stats") -> str:
    """Wait until the stats line matches `pattern` (the stream's end is written there), return it."""
    page.wait_for_function(
        "([sel, pat]) => new RegExp(pat).test(document.querySelector(sel)?.innerText || '')",
        arg=[selector, pattern])
    return stats_text(page, selector)


def chat_box(page):
    return page.locator("#chat-input textarea")


def clear_chat(page) -> None:
    page.locator("#clear").click()
    page.wait_for_function("!(document.querySelector('#stats')?.innerText || '').includes('finished')")
    chat_box(page).fill("")
