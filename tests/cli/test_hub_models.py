"""Models named by their Hugging Face repo id: downloaded through huggingface_hub from a real HTTP server
speaking the Hub's protocol, then taken from the local cache offline; the errors for a missing, gated,
uncached or non-Qwen repository; the name typed is the name served."""

import json
import os

import pytest

from dyno_ui.cli import main
from dyno_ui.paths import ASSETS
from helpers import run
from helpers.fake_hub import FakeHub
from helpers.reference import plain_greedy
from helpers.serving import running_server
from speculative.loader import load_checkpoint
from speculative.heads.find import MAKE_ONE

REPO = "mlx-community/dyno-tiny-mlx"
PROMPT = "def fib(n):\n"
N = 24


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The bundled MLX conversion under its repo id, its original (whose head Dyno fetches), a gated
    repository and a llama one."""
    llama = tmp_path_factory.mktemp("llama")
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes(b"\0" * 1024)
    with FakeHub() as h:
        h.add(REPO, ASSETS / "dyno-tiny-mlx")
        h.add("dyno-project/dyno-tiny", ASSETS / "dyno-tiny")
        h.add("org/gated", ASSETS / "dyno-tiny-mlx")
        h.gated.add("org/gated")
        h.add("org/llama", llama)
        yield h


@pytest.fixture(scope="module")
def reference():
    """mlx-lm's greedy tokens for the bundled conversion, loaded from its folder."""
    lm = load_checkpoint(ASSETS / "dyno-tiny-mlx", mode="off")
    return plain_greedy(lm, lm.tokenizer.encode(PROMPT), N)


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf" / "hub"


@pytest.fixture
def in_process(monkeypatch, hub, cache, tmp_path):
    """This process pointed at the fake Hub and an empty cache, online (huggingface_hub reads its
    settings at import, so they are set on its constants)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path / "dyno"))
    hub.requests.clear()

    def offline():
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    return offline


def generate(*extra):
    # Greedy (the card's generation_config samples), a set depth and the whole vocabulary: nothing to time or rank.
    return ["generate", "--model", REPO, "--prompt", PROMPT, "--max-tokens", str(N), "--temp", "0", "--draft-depth", "2",
            "--draft-vocab", "full", "--json", *extra]


def test_generate_downloads_a_repo_id_then_runs_offline_from_the_cache(hub, reference, cache, tmp_path,
                                                                      in_process, capsys):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DYNO_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), DYNO_CACHE=str(tmp_path / "dyno"),
               HF_HUB_DISABLE_TELEMETRY="1", TQDM_POSITION="-1")  # progress bars without a terminal
    r = run.dyno(*generate(), env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == reference
    assert json.loads(r.stdout)["speculative"]["mode"] == "mtp"  # the head came from the card's base_model
    assert (f"dyno: downloading {REPO} from the Hugging Face Hub into {cache}. "
            f"Set HF_HUB_OFFLINE=1 to prevent downloads.") in r.stderr.splitlines()
    assert "Fetching 8 files: 100%" in r.stderr  # huggingface_hub's progress bar
    fetched = {p for m, repo, p, _ in hub.requests if repo == REPO and m == "GET"}
    assert fetched == {"revision/main", f"tree/{hub.repos[REPO][1]}", "config.json", "model.safetensors",
                       "model.safetensors.index.json", "README.md", "chat_template.jinja", "generation_config.json",
                       "tokenizer.json", "tokenizer_config.json"}

    # The second run: offline, from the cache this one filled (in-process: same files, no Hub).
    hub.requests.clear()
    in_process()
    assert main(generate()) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == reference and "downloading" not in err
    assert hub.requests == []


@pytest.mark.parametrize("repo, message", [
    ("org/missing", "model not found: org/missing is no local folder and no model repository on the Hugging Face "
                    "Hub (a private one needs `hf auth login` or HF_TOKEN)"),
    ("org/gated", "org/gated is a gated repository: accept its conditions at {url}/org/gated, then log in "
                  "(`hf auth login` or HF_TOKEN)"),
    ("org/llama", "org/llama is a llama model; MTP drafting needs a Qwen3.5/3.6/3.8 model (model_type qwen3_5 or "
                  "qwen3_5_moe)"),
])
def test_a_repo_that_cannot_be_used_is_one_line_and_status_2(hub, in_process, capsys, repo, message):
    rc = main(["generate", "--model", repo, "--prompt", "x", "--speculative", "mtp"])
    assert (rc, capsys.readouterr().err.splitlines()) == (2, [f"dyno: error: {message.format(url=hub.url)}"])
    assert not any(p.endswith(".safetensors") for _, r, p, _ in hub.requests if r == repo)  # refused before the weights


@pytest.mark.parametrize("cached", [(), ("config.json", "README.md")], ids=["nothing", "card-and-config"])
def test_offline_and_not_cached(hub, in_process, capsys, cache, cached):
    """Nothing cached, or only what looking for a head fetches one by one: no model to load offline."""
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / hub.repos[REPO][1]
    for name in cached:
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes((ASSETS / "dyno-tiny-mlx" / name).read_bytes())
        (snapshot.parent.parent / "refs").mkdir(exist_ok=True)
        (snapshot.parent.parent / "refs" / "main").write_text(hub.repos[REPO][1])
    in_process()
    assert main(generate()) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dyno: error: {REPO} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 prevents downloading it; "
        f"unset HF_HUB_OFFLINE to download it, or pass a local folder"]
    assert hub.requests == []


def test_head_pull_and_models_take_a_repo_id(hub, in_process, capsys, tmp_path):
    """`dyno head pull ORG/NAME` fetches only the head (the model's weights stay on the Hub); `dyno models ORG/NAME`
    lists from the cache only, so a repo not downloaded is one line."""
    assert main(["head", "pull", REPO]) == 0
    head = tmp_path / "dyno" / "mtp" / "dyno-project--dyno-tiny"
    assert capsys.readouterr().out.startswith(f"MTP head of dyno-project/dyno-tiny: {head} (")
    assert not any(p == "model.safetensors" for _, r, p, _ in hub.requests if r == REPO)
    assert main(["models", REPO]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dyno: error: {REPO} is not in the local Hugging Face cache; `dyno generate --model {REPO}` downloads it"]


def test_an_unreachable_hub_is_one_line():
    """What huggingface_hub raises when the Hub cannot be reached (its retries take 20 s, so not run here)."""
    import httpx
    from huggingface_hub.errors import LocalEntryNotFoundError

    from speculative.loader.source import hub_error

    try:
        try:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        except httpx.ConnectError as cause:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub") from cause
    except LocalEntryNotFoundError as e:
        assert hub_error(REPO, e).message == (
            f"cannot reach the Hugging Face Hub to download {REPO} ([Errno 111] Connection refused); check the "
            f"connection, or set HF_HUB_OFFLINE=1 to use only the local cache")


def test_the_name_typed_is_the_name_served(hub, in_process, tiny_dir, monkeypatch):
    """The playground's Models tab loads a repo id; /v1/models then lists it by that id."""
    from dyno_ui.playground.sessions import Sessions

    monkeypatch.delitem(hub.repos, "dyno-project/dyno-tiny")  # no head: nothing to rank or time at load

    with running_server(tiny_dir()) as server:
        notes = []
        lm = Sessions(server.served).load(REPO, notes.append).result(60)
        assert (lm.name, lm.repo_id, server.served.id) == (REPO, REPO, REPO)
        assert notes[0].startswith(f"dyno: downloading {REPO} from the Hugging Face Hub")
        assert notes[-1].startswith(f"dyno: decoding without drafts: no MTP head for {REPO}: it has no mtp.* tensors; ")
        assert notes[-1].endswith("pass --mtp-base ORG/NAME (the original checkpoint)" + MAKE_ONE)
        assert [m["id"] for m in server.get("/v1/models").json()["data"]] == [REPO]


def test_what_is_a_path_and_what_a_repo_id(tmp_path, monkeypatch):
    from speculative.loader.source import cache_repo_id, is_repo_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert [is_repo_id(s) for s in ("mlx-community/Qwen3.6-27B-4bit", "org/local", "./org/name", "a/b/c", "~/x",
                                    "/abs/path", "dyno-tiny")] == [True, False, False, False, False, False, False]
    snapshot = tmp_path / "hub" / "models--mlx-community--Qwen3.6-27B-4bit" / "snapshots" / "abc123"
    assert (cache_repo_id(snapshot), cache_repo_id(tmp_path / "org" / "local")) == ("mlx-community/Qwen3.6-27B-4bit", None)
