"""--api-key on the playground: its Gradio API (page config, queue, call, run) refuses a caller
without the login the key opens, and nothing is generated; signed in with the key, it works."""

import json

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError

from dyno_ui.options import ServeOptions
from dyno_ui.playground.ui import LOGIN_MESSAGE
from dyno_ui.runtime.served import ServedModel
from dyno_ui.runtime.worker import EngineWorker
from dyno_ui.server.run import make_app
from helpers.serving import serving_in_thread
from speculative.config import SpecConfig
from speculative.loader import load_checkpoint

pytestmark = pytest.mark.e2e

KEY = "sk-dyno-test"
# The prompt box's value (text and image files), depth, runs, then the sampling controls
RACE = [{"text": "def read_lines(path):", "files": []}, 2, 1, "MTP against plain decoding", 0.0, 1.0, 0, 0.0, 4, -1]


@pytest.fixture(scope="module")
def url(tiny_dir):
    model = tiny_dir()
    worker = EngineWorker(lambda: (load_checkpoint(model), SpecConfig("auto", 2)))
    lm = worker.start()
    served = ServedModel(id=lm.path.name, lm=lm, worker=worker, default_max_tokens=8, created=0)
    app = make_app(served, ui_front=True, options=ServeOptions(api_key=KEY))
    with serving_in_thread(app, lifespan="on", start_timeout=60) as url:
        yield url


def counters(url) -> tuple:
    stats = httpx.get(url + "/stats", timeout=30).json()
    return stats["requests"]["total"], stats["tokens"]["generated"]


def signed_in(url, password=KEY) -> httpx.Client:
    client = httpx.Client(base_url=url + "/ui", timeout=60)
    client.post("/login", data={"username": "anyone", "password": password})
    return client


def call(client: httpx.Client, endpoint: str, data: list) -> httpx.Response:
    """Gradio's documented REST call: POST the inputs, then read the event's stream to its end."""
    return client.post(f"/gradio_api/call/{endpoint}", json={"data": data})


def events(client: httpx.Client, endpoint: str, event_id: str) -> list:
    """The (event, data) pairs of a call's stream."""
    text = client.get(f"/gradio_api/call/{endpoint}/{event_id}").text
    pairs = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        pairs.append((lines["event"], json.loads(lines["data"])))
    return pairs


def refused(r: httpx.Response) -> bool:
    return r.status_code == 401 and r.json()["detail"]["error"] == "Not authenticated"


def test_without_the_key_the_playground_api_runs_nothing(url):
    before = counters(url)
    anonymous = httpx.Client(base_url=url + "/ui", timeout=60)
    wrong = signed_in(url, password="wrong")
    for client in (anonymous, wrong):
        for endpoint in ("compare", "submit", "regenerate", "do_load", "stop_job"):
            assert refused(call(client, endpoint, RACE)), endpoint
        join = {"data": RACE, "fn_index": 0, "session_hash": "x1", "event_data": None, "trigger_id": None}
        assert refused(client.post("/gradio_api/queue/join", json=join))
        assert refused(client.post("/gradio_api/run/compare", json={"data": RACE}))
        assert refused(client.get("/config"))  # the page's components and endpoints
        assert refused(client.get("/gradio_api/info"))
    assert wrong.post("/login", data={"username": "anyone", "password": "wrong"}).json() == {
        "detail": "Incorrect credentials."}
    with pytest.raises(AuthenticationError):
        Client(url + "/ui/", verbose=False)
    # The page itself is Gradio's login form, with the message that says what to type.
    assert refused(anonymous.get("/config")) and anonymous.get("/config").json()["detail"][
        "auth_message"] == LOGIN_MESSAGE
    assert counters(url) == before  # nothing was generated


def test_signed_in_with_the_key_the_race_runs(url):
    client = signed_in(url)
    before = counters(url)
    r = call(client, "compare", RACE)
    assert r.status_code == 200, r.text
    stream = events(client, "compare", r.json()["event_id"])
    assert stream[-1][0] == "complete", stream[-1]
    assert "identical output" in stream[-1][1][0]
    requests, generated = counters(url)
    assert requests == before[0] + 2 and generated > before[1]  # the MTP run and the plain one


def test_signed_in_pages_manage_models_without_typing_the_key_again(url, tiny_dir):
    client = signed_in(url)
    r = call(client, "do_fetch", [str(tiny_dir()), "auto"])
    stream = events(client, "do_fetch", r.json()["event_id"])
    assert stream[-1][0] == "complete", stream  # past the key check: the folder carries its own head
    assert stream[-1][1][0].startswith(f"{tiny_dir()} carries its own head.")


def test_a_rebound_host_or_a_plain_text_post_drives_nothing_even_signed_in(url):
    """A page can make the browser send the session cookie; the Host and the body's type still stop it."""
    client = signed_in(url)
    before = counters(url)
    port = url.rsplit(":", 1)[1]
    rebound = {"host": f"evil.example:{port}"}
    assert client.get("/", headers=rebound).status_code == 403
    assert client.post("/gradio_api/call/compare", json={"data": RACE}, headers=rebound).status_code == 403
    plain = client.post("/gradio_api/call/compare", content=json.dumps({"data": RACE}),
                        headers={"content-type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    assert client.get("/", headers={"host": f"localhost:{port}"}).status_code == 200
    assert counters(url) == before  # nothing was generated
