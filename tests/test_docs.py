"""The README and docs/ held against the project: the module map in docs/how-it-works.md against the
tree, every relative link and #anchor against the files and headings it names, every command synopsis
against the parser, and every command line of the README's ```bash blocks run as written (long-running
ones started, asked once, stopped)."""

import argparse
import json
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.run import ROOT, dyno, dyno_server

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAP_PAGE = DOCS / "how-it-works.md"
PACKAGES = ("speculative", "dyno_ui")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
README_ADDRESS = "http://127.0.0.1:8080"  # what the README's examples call; replaced by the real address


def without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code spans blanked out (their contents are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "``", text)


# --- the module map ------------------------------------------------------------------------------------

def section(text: str, title: str) -> str:
    """The text under the heading `title` (any level) up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+)\s+{re.escape(title)}\s*$", text, re.M)
    assert match, f"no heading {title!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}}\s", re.M).search(text, match.end())
    return text[match.end(): end.start() if end else len(text)]


def mapped_modules() -> list:
    """The modules the map lists: one list item per module, opening with its path in backticks."""
    return re.findall(r"^\s*[-*]\s+`([\w./]+\.py)`", section(MAP_PAGE.read_text(), "Module map"), re.M)


def package_modules() -> set:
    """Every .py module under the packages, subpackages included; __init__.py files are left out of the
    map (the map says so: a package's docstring describes it)."""
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def test_every_module_in_the_map_exists():
    listed = mapped_modules()
    assert listed, f"no module entries under 'Module map' in {MAP_PAGE}"
    missing = [m for m in listed if not (ROOT / m).is_file()]
    assert not missing, f"{MAP_PAGE.name} lists modules that do not exist: {missing}"
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"{MAP_PAGE.name} lists these modules more than once: {twice}"


def test_every_module_is_in_the_map():
    unlisted = sorted(package_modules() - set(mapped_modules()))
    assert not unlisted, f"modules missing from the module map in {MAP_PAGE.name}: {unlisted}"


# --- links and anchors ---------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but - and _ dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set:
    """Every #anchor a page's headings make, duplicates numbered as GitHub numbers them."""
    seen, out = {}, set()
    for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", page.read_text()), re.M):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list:
    """The page's relative link targets (images included), as written."""
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_code(page.read_text()))
    return [t for t in targets if not re.match(r"^[a-zA-Z][\w+.-]*:|^//", t)]


def test_pages_exist():
    assert README.is_file() and MAP_PAGE.is_file()
    assert len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slug_rules():
    assert slug("Serve an API: `dyno serve`") == "serve-an-api-dyno-serve"
    assert slug("Where a round's time goes") == "where-a-rounds-time-goes"
    assert slug("GPU: one NVIDIA H200 (CUDA)") == "gpu-one-nvidia-h200-cuda"
    assert slug("dyno_ui and speculative/") == "dyno_ui-and-speculative"


# --- synopses: every flag they show is one the command takes -------------------------------------------

def synopses():
    """(page, command words, flags) for each usage block line (untagged fences) naming dyno or app.py."""
    found = []
    for page in PAGES:
        for kind, body in FENCE.findall(page.read_text()):
            if kind:
                continue
            for entry in re.split(r"\n(?=\S)", body.strip()):  # continuation lines are indented
                words = entry.split()
                if not words or not (words[0] == "dyno" or words[:2] == ["python", "app.py"]):
                    continue
                command = []
                for word in words:
                    if word.startswith(("[", "-")) or word.isupper() or word == "#" or "/" in word:
                        break  # a flag, a placeholder, a comment, or an argument (a path or a repo id)
                    command.append(word)
                found.append((page.relative_to(ROOT).as_posix(), tuple(command),
                              sorted(set(re.findall(r"(--[a-z][\w-]*)", entry)))))
    return found


def dyno_help(words) -> str:
    """The help text of a `dyno` subcommand, from the CLI's own parser (no subprocess)."""
    from dyno_ui import cli

    parser = cli.build_parser()
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser.format_help()


def test_synopses_exist():
    commands = {c for _, c, _ in synopses()}
    assert {("dyno", "generate"), ("dyno", "serve"), ("python", "app.py")} <= commands, commands


@pytest.mark.parametrize("page,command,flags", synopses(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_synopsis_flags_are_accepted(page, command, flags):
    if command[0] == "dyno":
        text = dyno_help(command[1:])
    else:
        assert command == ("python", "app.py"), command
        text = subprocess.run([sys.executable, "app.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120).stdout
    known = set(re.findall(r"--[a-z][\w-]*", text))
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{page}: `{' '.join(command)}` does not take {unknown}"


# --- the README's command lines, run -------------------------------------------------------------------

SETUP = ("python3 -m venv ", ".venv/bin/pip install ", ".venv/bin/python -m pytest")  # what .ci/run runs


def readme_commands():
    """Every command of the README's ```bash blocks, split at `&&`, as (kind, words): kind is dyno, app,
    curl, setup (the install steps and the test suite itself, which CI runs) or unknown."""
    out = []
    for kind, body in FENCE.findall(README.read_text()):
        if kind != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            for part in (p.strip() for p in line.split("&&")):
                if not part or part.startswith("#"):
                    continue
                words = shlex.split(part)
                if words[0] in ("dyno", ".venv/bin/dyno"):
                    out.append(("dyno", words[1:]))
                elif words[0] in ("python", ".venv/bin/python") and words[1:2] == ["app.py"]:
                    out.append(("app", words[2:]))
                elif words[0] == "curl":
                    out.append(("curl", words[1:]))
                elif part.startswith(SETUP):
                    out.append(("setup", words))
                else:
                    out.append(("unknown", words))
    return out


COMMANDS = readme_commands()
ONE_SHOT = [w for k, w in COMMANDS if k == "dyno" and w[0] != "serve"]
SERVE = [w for k, w in COMMANDS if k == "dyno" and w[0] == "serve"]
APP = [w for k, w in COMMANDS if k == "app"]
CURL = [w for k, w in COMMANDS if k == "curl"]
line_id = lambda words: " ".join(words)[:60]  # noqa: E731


def test_every_readme_command_is_run_here():
    unknown = [" ".join(w) for k, w in COMMANDS if k == "unknown"]
    assert not unknown, f"README commands this file does not run: {unknown}"
    assert [w[0] for w in ONE_SHOT].count("generate") >= 2 and SERVE and APP and CURL
    assert len(SERVE) == 1, "the README's curl examples call its one `dyno serve`"


def readme_json_keys() -> dict:
    """The keys the README's `--json` bullet lists: {"": top-level keys, "speculative": ..., "timing": ...}."""
    bullet = re.search(r"^- `--json` prints one object:(.*?)(?=^- |^#)", README.read_text(), re.M | re.S).group(1)
    nested = {name: set(re.findall(r"`(\w+)`", inner)) for name, inner in re.findall(r"`(\w+)` \{([^}]*)\}", bullet)}
    top = re.sub(r"\{[^}]*\}|\([^)]*\)", "", bullet.split("How drafts are counted")[0])
    return {"": set(re.findall(r"`(\w+)`", top)), **nested}


def check_generate(args, r):
    assert r.stdout.strip()
    assert re.match(r"MTP: \d+ tokens in \d+ rounds \([\d.]+ per round\), \d+/\d+ drafts accepted( \(\d+/\d+ copied, in \d+ rounds\))?$",
                    r.stderr.strip().splitlines()[-1]), r.stderr
    limit = int(args[args.index("--max-tokens") + 1]) if "--max-tokens" in args else None
    if "--json" in args:
        out = json.loads(r.stdout)
        assert {"text", "tokens", "provenance", "finish_reason", "speculative", "timing"} <= set(out)
        assert {"mode", "draft_depth", "rounds", "draft_tokens", "accepted_tokens", "accepted_per_position",
                "draft_vocab"} <= set(out["speculative"])
        assert {"prefill_s", "decode_s", "decode_tokens_per_s"} <= set(out["timing"])
        assert len(out["tokens"]) == len(out["provenance"]) and set(out["provenance"]) <= {"draft", "model"}
        assert out["provenance"].count("draft") == out["speculative"]["accepted_tokens"]
        listed = readme_json_keys()  # the README lists exactly what the command prints
        assert listed == {"": set(out), "speculative": set(out["speculative"]), "timing": set(out["timing"])}, listed
        spec = out["speculative"]
        if spec["rounds"]:
            assert spec["tokens_per_round"] == pytest.approx(1 + spec["accepted_tokens"] / spec["rounds"])
        if limit:
            assert len(out["tokens"]) <= limit


@pytest.mark.e2e
@pytest.mark.parametrize("args", ONE_SHOT, ids=line_id)
def test_readme_command(args):
    r = dyno(*args, timeout=120)
    assert r.returncode == 0, r.stderr
    if args[0] == "generate":
        check_generate(args, r)
    elif args[0] == "models":
        lines = r.stdout.splitlines()
        assert lines[0].split() == ["MODEL", "TYPE", "MTP", "HEAD"], r.stdout
        assert any("dyno-tiny" in line and line.endswith("in checkpoint") for line in lines[1:]), r.stdout
    elif args[:2] == ["head", "list"]:
        assert r.stdout.startswith(("no cached MTP heads in ", "BASE MODEL")), r.stdout
    else:
        pytest.fail(f"no expectation for README command `dyno {' '.join(args)}`")


class Started:
    """A long-running command's stdout, line by line, read on a thread so that its pipe never fills."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.seen = proc, queue.Queue(), []
        threading.Thread(target=lambda: [self.lines.put(line.rstrip("\n")) for line in proc.stdout],
                         daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.seen
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            self.seen.append(line)
            if m := re.match(pattern, line):
                return m

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def curl(words, base: str) -> httpx.Response:
    """One README curl line sent as curl sends it (URL, -H headers, -d body: a POST), at `base`."""
    url, headers, body = None, {}, None
    rest = iter(words)
    for word in rest:
        if word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            body = next(rest)
        else:
            assert url is None and word.startswith(README_ADDRESS), word
            url = base + word[len(README_ADDRESS):]
    if body is None:
        return httpx.get(url, headers=headers, timeout=60)
    return httpx.post(url, headers=headers, content=body, timeout=120)


def readme_figures() -> dict:
    """The drafting figures the README shows for its chat request: its one ```json block."""
    (block,) = [body for kind, body in FENCE.findall(README.read_text()) if kind == "json"]
    figures = json.loads(block)
    assert figures["draft_tokens"] == figures["accepted_tokens"] + figures["rejected_tokens"]
    return figures


@pytest.mark.e2e
@pytest.mark.parametrize("args", SERVE, ids=line_id)
def test_readme_serve_and_its_curl_examples(args):
    """The README's `dyno serve` line (on a free port: `--port 0`), its URL line awaited, then each of the
    README's curl lines sent to it."""
    server = Started(dyno_server(*args[1:], "--port", "0"))
    try:
        base = server.wait_for(r"dyno: serving dyno-tiny at (http://\S+)/v1 \(batched MTP drafting of up to 8 "
                               r"requests, depth 0-\d chosen each round by measured cost\)$", timeout=120).group(1)
        server.wait_for(rf"dyno: playground at {re.escape(base)}/ui/$", timeout=30)
        for words in CURL:
            r = curl(words, base)
            assert r.status_code == 200, r.text
            body = r.json()
            if r.request.url.path == "/v1/chat/completions":
                assert body["object"] == "chat.completion" and body["model"] == "dyno-tiny"
                assert set(body["drafting"]) == set(readme_figures()) and body["drafting"]["mode"] == "mtp"
                assert body["drafting"]["generated_tokens"] == body["usage"]["completion_tokens"]
                assert isinstance(body["choices"][0]["message"]["content"], str)
                assert body["usage"]["completion_tokens"] <= json.loads(words[words.index("-d") + 1])["max_tokens"]
            elif r.request.url.path == "/stats":
                assert {"mode", "rounds", "accepted_tokens"} <= set(body["speculative"])
            else:
                pytest.fail(f"no expectation for README curl {r.request.url.path}")
    finally:
        server.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("args", APP, ids=line_id)
def test_readme_playground(args):
    """`python app.py` as the README runs it (on a free port): the API line first, the page to open last."""
    proc = subprocess.Popen([sys.executable, "app.py", *args, "--port", "0"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    app = Started(proc)
    try:
        api = app.wait_for(r"dyno: serving dyno-tiny at (http://\S+/v1) ").group(1)
        page = app.wait_for(r"\* Running on local URL:\s+(http://\S+)$").group(1)
        r = httpx.get(page, follow_redirects=True, timeout=60)
        assert r.status_code == 200 and "<html" in r.text.lower()
        assert httpx.get(api + "/models", timeout=30).json()["data"][0]["id"] == "dyno-tiny"
    finally:
        app.stop()
