"""Running a real Dyno server in-process for tests: uvicorn on a free 127.0.0.1 port, in a thread."""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dyno_ui.options import ServeOptions
from dyno_ui.runtime.served import ServedModel
from dyno_ui.server.run import listen
from dyno_ui.server.app import create_app
from dyno_ui.runtime.worker import EngineWorker
from speculative.config import SpecConfig
from speculative.loader import load_checkpoint

MODEL_ID = "tiny"


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    served: ServedModel

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def anthropic(self, api_key: str = "unused"):
        """The official Anthropic client, pointed at this server (it adds /v1/messages itself)."""
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0, timeout=120)

    def get(self, path: str, **kw):
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw):
        return httpx.post(self.url + path, timeout=120, **kw)

    def stats(self) -> dict:
        return self.get("/stats").json()

    def metrics(self) -> dict:
        """Every sample of /metrics as {name{labels}: value}, parsed by prometheus_client."""
        text = self.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@contextmanager
def running_server(model_dir, spec: SpecConfig = SpecConfig(), decode_concurrency: int = 1,
                   options: ServeOptions = ServeOptions(), drafting_batch: bool = False, worker_kw=None,
                   load_kw=None, **app_kw):
    """A started server for the checkpoint in `model_dir`, with `options`' key, origins, model names and
    reasoning budget; stopped (thread joined) on exit. Batched (decode_concurrency > 1) it decodes without
    drafts unless `drafting_batch`; `worker_kw` go to the EngineWorker (max_queue, max_batch_memory),
    `load_kw` to load_checkpoint (mtp_head, ...)."""
    mode = "off" if decode_concurrency > 1 and not drafting_batch else spec.mode
    worker = EngineWorker(lambda: (load_checkpoint(model_dir, mode=mode, **(load_kw or {})), spec),
                          decode_concurrency=decode_concurrency, **(worker_kw or {}))
    lm = worker.start()
    served = ServedModel(id=MODEL_ID, lm=lm, worker=worker, default_max_tokens=64, created=0,
                         names=options.served_model_names, reasoning_budget=options.reasoning_budget)
    with serving_in_thread(create_app(served, options=options, **app_kw)) as url:
        yield Running(url, served)


@contextmanager
def serving_in_thread(app, lifespan: str = "off", start_timeout: float = 30):
    """uvicorn serving `app` on a free 127.0.0.1 port in a thread; yields the base URL. On exit the
    server stops and then the app's engine worker (thread joined, worker closed)."""
    served = app.state.served
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        served.worker.close(15)
        sock.close()
        assert not thread.is_alive() and not served.worker.alive()


def detokenize(lm, tokens) -> str:
    """Text of token ids the way the server builds it: mlx-lm's streaming detokenizer, EOS left out."""
    detok = lm.tokenizer.detokenizer
    for t in tokens:
        if t not in lm.eos_token_ids:
            detok.add_token(t)
    detok.finalize()
    return detok.text


def split_think(text, thinking=False):
    """(content, reasoning) of a decoded answer, by plain string search: the reference for the server."""
    content, reasoning = [], []
    while text:
        tag = "</think>" if thinking else "<think>"
        part, found, text = text.partition(tag)
        (reasoning if thinking else content).append(part)
        thinking = thinking != bool(found)
    return "".join(content), "".join(reasoning)


def drafted(server, before):
    """Drafts accepted since the /stats snapshot `before`."""
    return server.stats()["speculative"]["accepted_tokens"] - before["speculative"]["accepted_tokens"]
