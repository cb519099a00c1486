"""Images through both APIs: OpenAI chat image_url parts and Responses input_image with data: URLs,
Anthropic base64 image blocks; each answer is the engine's plain greedy answer for the same image, and
every bad image is a 400 after which the next request is served."""

import base64

import pytest

from helpers import vision_models
from helpers.serving import MODEL_ID, detokenize, running_server, split_think
from dyno_ui.runtime.request import IMAGE_PLACEHOLDER
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.loader.vision import images_for

QUESTION = "What is this?"
N = 24


@pytest.fixture(scope="module")
def server(vl_dir):
    with running_server(vl_dir, SpecConfig("mtp", draft_depth=2)) as running:
        yield running


def data_url(png: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(png).decode()}"


def reference(lm, png: bytes, before=()):
    """The engine's plain greedy answer (content, reasoning) for the question about `png` (after the
    messages `before`), as the chat template renders it: a cold run, no prompt cache."""
    messages = list(before) + [{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}]
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt, vision = images_for(lm, prompt, [png])
    events = generate(lm, prompt, SamplingParams(max_tokens=N), SpecConfig("off"), vision=vision)
    return split_think(detokenize(lm, [e.id for e in events if isinstance(e, Token)]))


def openai_parts(png):
    return [{"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": QUESTION}]


def test_both_apis_answer_with_the_image_as_plain_decoding_does(server):
    one, two = vision_models.png(64, 96, seed=1), vision_models.png(64, 96, seed=2)
    want = {png: reference(server.served.lm, png) for png in (one, two)}
    assert want[one] != want[two]  # the image matters: same text, another answer
    client = server.client
    for png in (one, two):
        r = client.chat.completions.create(model=MODEL_ID, max_tokens=N, temperature=0,
                                           messages=[{"role": "user", "content": openai_parts(png)}])
        assert (r.choices[0].message.content, getattr(r.choices[0].message, "reasoning_content", None) or "") == want[png]
    stream = client.chat.completions.create(model=MODEL_ID, max_tokens=N, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": openai_parts(one)}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want[one][0]
    r = client.responses.create(model=MODEL_ID, max_output_tokens=N, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(two)}, {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == want[two][0]
    m = server.anthropic().messages.create(model=MODEL_ID, max_tokens=N, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(one).decode()}},
        {"type": "text", "text": QUESTION}]}])
    assert "".join(b.text for b in m.content if b.type == "text") == want[one][0]
    # (what follows a <think> differs: without `thinking` an Anthropic request closes it at once)


def cold(lm, messages, png):
    """The engine's plain greedy answer (content, reasoning) for `messages` (their one image `png`), cold."""
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt, vision = images_for(lm, prompt, [png])
    events = generate(lm, prompt, SamplingParams(max_tokens=N), SpecConfig("off"), vision=vision)
    return split_think(detokenize(lm, [e.id for e in events if isinstance(e, Token)]))


def test_the_prompt_cache_keys_an_image_by_its_pixels(server):
    """Two images with the same text each get their own cold answer (the placeholder ids they share
    are keyed by each image's pixels); the same image asked again, and a second turn on it, resume from
    its prefix and still answer as a cold run does."""
    lm, client = server.served.lm, server.client
    system = {"role": "system", "content": "You describe pictures."}

    def ask(messages):
        r = client.chat.completions.create(model=MODEL_ID, max_tokens=N, temperature=0, messages=[system] + messages)
        message = r.choices[0].message
        return (message.content, getattr(message, "reasoning_content", None) or ""), \
            r.usage.prompt_tokens_details.cached_tokens

    pngs = {seed: vision_models.png(64, 96, seed=seed) for seed in (1, 2)}
    first = [{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}]
    want = {seed: server.served.worker.call(lambda png=png: cold(lm, [system] + first, png)).result(120)
            for seed, png in pngs.items()}
    assert want[1][0] != want[2][0]  # the image decides the answer
    ask([{"role": "user", "content": QUESTION}])  # a text prompt with the same system message
    answers = {seed: ask([{"role": "user", "content": openai_parts(pngs[seed])}]) for seed in (1, 2)}
    assert {seed: a for seed, (a, _) in answers.items()} == want
    assert answers[1][1] == answers[2][1] > 0  # each reused the system message's prefix, no other image's
    again, cached = ask([{"role": "user", "content": openai_parts(pngs[1])}])
    assert again == want[1] and cached > answers[1][1]  # past its own image
    content = want[1][0]
    turn = [{"role": "assistant", "content": content}, {"role": "user", "content": "And its colours?"}]
    second, cached = ask([{"role": "user", "content": openai_parts(pngs[1])}] + turn)
    assert second == server.served.worker.call(lambda: cold(lm, [system] + first + turn, pngs[1])).result(120)
    assert cached > answers[1][1]


BAD = [
    (data_url(b"not an image"), "image 1 cannot be decoded"),
    (data_url(vision_models.png(32, 32), "text/plain"), "media type 'text/plain' is not an image"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "does not fetch image URLs (dyno serve --allow-image-urls)"),
]


@pytest.mark.parametrize("url, message", BAD)
def test_a_bad_image_is_a_400_and_the_next_request_is_served(server, url, message):
    r = server.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


def test_video_and_too_many_images_are_refused(server):
    r = server.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]})
    assert r.status_code == 400 and "video input is not supported" in r.text
    parts = [{"type": "image_url", "image_url": {"url": data_url(vision_models.png(32, 32))}}] * 9
    r = server.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and "9 images in one request, over the limit of 8" in r.text


def test_an_image_request_and_a_text_request_are_decoded_in_one_batch_each_as_alone(vl_dir):
    """Queued together (the engine thread held by a call meanwhile), an image request and a text
    request join one drafting batch (/stats counts rounds of width 2) and each gets its answer alone."""
    import threading
    import time

    png = vision_models.png(64, 96, seed=1)
    with running_server(vl_dir, SpecConfig("mtp", draft_depth=2), decode_concurrency=2, drafting_batch=True) as s:
        lm = s.served.lm
        text = [{"role": "user", "content": "Name three colours."}]
        want_text = s.served.worker.call(lambda: cold_text(lm, text)).result(120)
        answers = {}

        def ask(name, content):
            r = s.client.chat.completions.create(model=MODEL_ID, max_tokens=N, temperature=0,
                                                 messages=[{"role": "user", "content": content}])
            answers[name] = r.choices[0].message.content

        held = s.served.worker.call(lambda: time.sleep(1.0))  # both requests queue behind it
        threads = [threading.Thread(target=ask, args=a) for a in (("image", openai_parts(png)), ("text", text[0]["content"]))]
        for t in threads:
            t.start()
        held.result(30)
        for t in threads:
            t.join(120)
        assert answers == {"image": reference(lm, png)[0], "text": want_text[0]}
        assert s.stats()["batch"]["rounds_by_width"].get("2", 0) > 0


def cold_text(lm, messages):
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    events = generate(lm, prompt, SamplingParams(max_tokens=N), SpecConfig("off"))
    return split_think(detokenize(lm, [e.id for e in events if isinstance(e, Token)]))


def test_image_urls_are_fetched_only_when_allowed_and_within_the_byte_limit(server):
    import http.server
    import threading

    from dyno_ui.runtime.images import ImagePolicy
    from speculative.loader.vision import ImageLimits

    png = vision_models.png(64, 96, seed=1)

    class Png(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Png)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/image.png"
    body = {"model": MODEL_ID, "max_tokens": N, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}]}
    try:
        server.served.images = ImagePolicy(fetch_urls=True)
        r = server.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference(server.served.lm, png)[0]
        server.served.images = ImagePolicy(ImageLimits(max_bytes=len(png) - 1), fetch_urls=True)
        r = server.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and f"over the limit of {len(png) - 1} bytes" in r.text
    finally:
        server.served.images = ImagePolicy()
        httpd.shutdown()
