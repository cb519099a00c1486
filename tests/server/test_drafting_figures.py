"""Every answer says what drafting did: one `drafting` object with the same keys on every API, read by
the official clients from whole and streamed answers, its `tokens_sha256` the hash of the token ids
mlx-lm's plain greedy decoding gives; and `draft: false` answers with the same tokens and nothing
drafted, serial and batched, alone and beside other requests (docs/server.md, "Drafting figures")."""

import contextlib
import hashlib
import io
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dyno_ui.options import ServeOptions
from dyno_ui.paths import BUNDLED_MODEL
from helpers.reference import plain_greedy_prefix, template_tokens
from helpers.serving import MODEL_ID, running_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

N = 12
TEXT = "def parse(line):\n    "
MESSAGES = [{"role": "user", "content": "Write a function that parses a line of CSV."}]
KEYS = {"mode", "draft_tokens", "accepted_tokens", "rejected_tokens", "drafted_per_position",
        "accepted_per_position", "by_source", "rounds", "rounds_by_depth", "tokens_per_round", "prompt_tokens",
        "cached_prompt_tokens", "prefill_s", "decode_tokens_per_s", "generated_tokens", "tokens_sha256"}
APIS = ["chat", "completions", "responses", "messages"]
GREEDY = {"temperature": 0}  # the bundled model's generation_config samples
SEEDED = {"temperature": 0.9, "seed": 11}  # chat and completions take a seed
CASES = [pytest.param(api, stream, sampling, id=f"{api}-{'stream' if stream else 'whole'}-{name}")
         for api in APIS for stream in (False, True)
         for name, sampling in ([("greedy", GREEDY), ("seeded", SEEDED)] if api in ("chat", "completions")
                                else [("greedy", GREEDY)])]


def sha256_of(tokens) -> str:
    """The hash as docs/server.md defines it: token ids as 4-byte little-endian unsigned integers."""
    return hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens)).hexdigest()


def extra(obj) -> dict:
    """What the official clients keep of fields their types do not declare."""
    return obj.model_extra or {}


def send(server, api: str, stream: bool, n: int = N, messages=MESSAGES, text: str = TEXT, **body):
    """One request through the official client: `messages` on the chat APIs, `text` on completions."""
    client = server.client
    if api == "chat":
        return client.chat.completions.create(model=MODEL_ID, max_tokens=n, messages=messages, stream=stream,
                                              stream_options={"include_usage": True} if stream else None,
                                              extra_body=body)
    if api == "completions":
        return client.completions.create(model=MODEL_ID, max_tokens=n, prompt=text, stream=stream, extra_body=body)
    if api == "responses":
        return client.responses.create(model=MODEL_ID, max_output_tokens=n, input=messages[0]["content"],
                                       stream=stream, extra_body=body)
    return server.anthropic().messages.create(model=MODEL_ID, max_tokens=n, messages=messages, stream=stream,
                                              extra_body=body)


def ask(server, api: str, stream: bool, **body) -> dict:
    """One request (send's); its drafting figures, checked to come on the whole answer, or on the
    stream's last chunk or event and on no other."""
    reply = send(server, api, stream, **body)
    if not stream:
        return extra(reply)["drafting"]
    parts = list(reply)
    if api == "responses":  # every event carrying the Response: created, in_progress, then completed
        parts = [e.response for e in parts if hasattr(e, "response")]
    carrying = [i for i, part in enumerate(parts) if extra(part).get("drafting") is not None]
    last = len(parts) - (2 if api == "messages" else 1)  # Anthropic's: message_delta, before message_stop
    assert carrying == [last], (api, carrying, len(parts))
    return extra(parts[last])["drafting"]


@pytest.fixture(scope="module")
def serial():
    with running_server(BUNDLED_MODEL, spec=SpecConfig("mtp", 3)) as server:
        yield server


@pytest.fixture(scope="module")
def batched():
    with running_server(BUNDLED_MODEL, spec=SpecConfig("mtp", 3), decode_concurrency=4,
                        drafting_batch=True) as server:
        yield server


def test_every_api_carries_the_same_figures_whole_and_streamed(serial):
    lm = serial.served.lm
    chat_prompt = lm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompts = {"chat": chat_prompt, "responses": chat_prompt, "completions": lm.tokenizer.encode(TEXT),
               # an Anthropic request without `thinking` is answered without it
               "messages": template_tokens(lm, MESSAGES, thinking=False)}
    for api in APIS:
        want = plain_greedy_prefix(lm, list(prompts[api]), N)
        for stream in (False, True):
            figures = ask(serial, api, stream, **GREEDY, **({"draft": True} if stream else {}))  # true: as unset
            assert set(figures) == KEYS, (api, stream)
            assert figures["tokens_sha256"] == sha256_of(want), (api, stream)
            assert figures["generated_tokens"] == len(want)
            assert figures["prompt_tokens"] == len(prompts[api])
            assert 0 <= figures["cached_prompt_tokens"] < figures["prompt_tokens"]
            assert figures["mode"] == "mtp" and figures["draft_tokens"] > 0, (api, stream)
            assert figures["draft_tokens"] == figures["accepted_tokens"] + figures["rejected_tokens"]
            assert sum(figures["drafted_per_position"]) == figures["draft_tokens"]
            assert sum(figures["accepted_per_position"]) == figures["accepted_tokens"]
            assert figures["by_source"] == {"mtp": {"draft_tokens": figures["draft_tokens"],
                                                    "accepted_tokens": figures["accepted_tokens"]}}
            assert figures["rounds_by_depth"] == {"3": figures["rounds"]}  # a pinned depth of 3
            assert figures["tokens_per_round"] == pytest.approx(1 + figures["accepted_tokens"] / figures["rounds"])
            assert figures["prefill_s"] > 0 and figures["decode_tokens_per_s"] > 0


def assert_off(figures: dict) -> None:
    assert figures["mode"] == "off" and figures["draft_tokens"] == figures["rounds"] == 0
    assert figures["by_source"] == {} and figures["rounds_by_depth"] == {}


def decoding_beside(server, started: threading.Semaphore, prompt: str) -> dict:
    """A longer greedy request that says when its first token has come (its row decodes), then runs on."""
    chunks = server.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3 * N, temperature=0,
                                              stream=True)
    parts = iter(chunks)
    next(parts)
    started.release()
    return extra(list(parts)[-1])["drafting"]


@pytest.mark.parametrize("api,stream,sampling", CASES)
def test_draft_false_gives_the_same_tokens(serial, batched, api, stream, sampling):
    """Drafting on (serial), then off: served alone, alone in a batch, and in a batch beside two drafting
    requests already decoding (its row pinned at depth 0 while theirs draft)."""
    on = ask(serial, api, stream, **sampling)
    assert on["mode"] == "mtp" and on["draft_tokens"] > 0
    offs = [ask(serial, api, stream, draft=False, **sampling), ask(batched, api, stream, draft=False, **sampling)]
    before = batched.stats()["batch"]["rounds_by_width"].get("3", 0)
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(decoding_beside, batched, started, prompt) for prompt in ("import os\n", "class A:\n")]
        for _ in others:
            assert started.acquire(timeout=60)
        offs.append(ask(batched, api, stream, draft=False, **sampling))
        assert all(f.result()["mode"] == "mtp" for f in others)
    assert batched.stats()["batch"]["rounds_by_width"].get("3", 0) > before  # the three rows in some round
    for off in offs:
        assert_off(off)
        assert off["tokens_sha256"] == on["tokens_sha256"]


def test_draft_must_be_a_boolean(serial):
    reply = serial.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": MESSAGES, "draft": "no"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "draft"
    reply = serial.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 4, "messages": MESSAGES, "draft": 0})
    assert reply.status_code == 400 and reply.json()["type"] == "error"


def test_the_server_md_example_reads_the_figures():
    """docs/server.md's example, run as written but for the address."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = page[page.index("## Drafting figures"):page.index("## Memory")]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    options = ServeOptions(api_key="my-key", served_model_names=("qwen-local",))
    out = io.StringIO()
    with running_server(BUNDLED_MODEL, spec=SpecConfig("mtp", 3), options=options) as server:
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("http://127.0.0.1:8080", server.url), "docs/server.md", "exec"), {})
    accepted, sha, by_depth, mode = out.getvalue().splitlines()
    assert int(accepted) >= 0 and re.fullmatch(r"[0-9a-f]{64}", sha) and by_depth.startswith("{'3': ")
    assert mode == "mtp"


# A prompt that holds what the answer repeats: the bundled model re-emits the function it was given, so
# copies draft on every API (the chat APIs' template around it included).
FUNCTION = ('def parse(line, sep=","):\n    """Split one line of CSV into its fields."""\n    fields = []\n'
            "    for part in line.split(sep):\n        fields.append(part.strip())\n    return fields\n")
COPYING = {"messages": [{"role": "user", "content": f"Implement `parse` in Python.\n\n{FUNCTION}\n{FUNCTION[:40]}"}],
           "text": FUNCTION + "\n\n" + FUNCTION[:60], "n": 48}


@pytest.mark.parametrize("api", APIS)
def test_copies_field_picks_the_draft_sources_with_the_same_tokens(serial, batched, api):
    """`copies` on every API over a server whose own --copies is off: "on" copies beside the head,
    "off" drafts with the head alone, "only" with copies alone; greedy tokens the same every way, served
    alone and in the drafting batch (whose rows each keep their request's sources)."""
    for server in (serial, batched):
        by = {copies: ask(server, api, False, copies=copies, **GREEDY, **COPYING) for copies in ("on", "off", "only")}
        assert set(by["off"]["by_source"]) == {"mtp"}, (api, by["off"])  # no copied tokens
        assert set(by["only"]["by_source"]) == {"copy"}, (api, by["only"])
        assert set(by["on"]["by_source"]) == {"mtp", "copy"}, (api, by["on"])
        assert by["only"]["by_source"]["copy"]["accepted_tokens"] > 0
        for figures in by.values():
            assert figures["mode"] == "mtp"
            assert sum(s["draft_tokens"] for s in figures["by_source"].values()) == figures["draft_tokens"]
            assert sum(s["accepted_tokens"] for s in figures["by_source"].values()) == figures["accepted_tokens"]
        assert len({f["tokens_sha256"] for f in by.values()}) == 1, (api, by)
        assert by["off"]["generated_tokens"] == COPYING["n"]
    unset = ask(serial, api, True, **GREEDY, **COPYING)  # absent (and streamed): the server's, off
    assert set(unset["by_source"]) == {"mtp"} and unset["tokens_sha256"] == by["on"]["tokens_sha256"]


HOSTILE = [1, 0.5, "ON", "", "sometimes", ["on"], {"on": True}, True]


def test_a_bad_copies_value_is_a_one_line_400_and_serving_goes_on(serial):
    """Each API refuses what is not "on", "off", "only" or null, in its own envelope, naming the field;
    the server then answers a good request on each API as before."""
    import anthropic
    import openai

    want = {api: ask(serial, api, False, **GREEDY) for api in APIS}
    for api in APIS:
        for value in HOSTILE:
            with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as refused:
                send(serial, api, False, copies=value)
            err = refused.value
            message = err.body["message"] if api != "messages" else err.body["error"]["message"]
            assert err.status_code == 400 and message.startswith("copies: ") and "\n" not in message, (api, value)
            if api != "messages":
                assert err.body["param"] == "copies"
        assert ask(serial, api, False, copies=None, **GREEDY)["tokens_sha256"] == want[api]["tokens_sha256"]
        assert ask(serial, api, False, copies="off", **GREEDY)["tokens_sha256"] == want[api]["tokens_sha256"]
