"""Aggregate throughput of `dyno serve` under N concurrent clients against mlx-lm's own server, paired
and alternating.

    python tools/serve_concurrency.py [--model assets/dyno-tiny] [--clients 1 2 4 8] [--pairs 5]
                                      [--max-tokens 128] [--concurrency 8] [--configs NAME ...] [--json FILE]

Configurations (--configs picks some): `default` (`dyno serve` as a user starts it), `serial`
(`--decode-concurrency 1`), `drafting` (`--decode-concurrency C`), `plain` (`--decode-concurrency C
--speculative off`) and `mlx-lm` (`python -m mlx_lm.server --decode-concurrency C`). Each is its own
process (Dyno's with no UI and no prompt cache, so every request prefills cold as in mlx-lm's, whose
cache is keyed per prompt and these prompts differ). Per client count and pair the configurations
run in turn, the order rotated each pair so none always goes first; a run sends N greedy completions at once (N different prompts)
and times from the first send to the last answer. Reported per configuration and N: the median of
the pairs' aggregate tokens per second (min-max), and whether every configuration gave every prompt
the same text.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "# Parse a CSV file and sum the second column\nimport csv\n",
    "def quicksort(items):\n",
    "def is_prime(n):\n",
    "# A tiny HTTP server\nfrom http.server import",
    "def merge(a, b):\n",
    "def read_config(path):\n",
]


CONFIGS = ("default", "serial", "drafting", "plain", "mlx-lm")


def configurations(names, concurrency: int) -> dict:
    """Each configuration's label and its `dyno serve` flags (None: mlx-lm's server)."""
    c = str(concurrency)
    every = {
        "default": ("dyno serve (default)", []),
        "serial": ("serial drafting (-c 1)", ["--decode-concurrency", "1"]),
        "drafting": (f"batched drafting (-c {c})", ["--decode-concurrency", c]),
        "plain": (f"batched plain (-c {c}, --speculative off)", ["--decode-concurrency", c, "--speculative", "off"]),
        "mlx-lm": (f"mlx-lm server (-c {c})", None),
    }
    return dict(every[n] for n in names)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, args, concurrency: int) -> tuple:
    """(process, (base URL, model id)) of a server on a free port, once it answers."""
    if args is None:  # mlx-lm's server: the same model and width, on the same device (its default)
        port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port),
               "--decode-concurrency", str(concurrency)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                httpx.get(url + "/v1/models", timeout=1).raise_for_status()
                return proc, (url, model)
            except httpx.HTTPError:
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
        raise RuntimeError(f"{cmd} did not start")
    cmd = [sys.executable, "-m", "dyno_ui", "serve", "--model", model, "--port", "0", "--no-ui",
           "--prompt-cache-bytes", "0", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if m := re.search(r"serving (\S+) at (http://\S+)/v1", line):
            return proc, (m.group(2), m.group(1))
    raise RuntimeError(f"{cmd} did not start")



def complete(server: tuple, prompt: str, max_tokens: int) -> tuple:
    url, model = server
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def wave(url: tuple, n: int, max_tokens: int) -> tuple:
    """(aggregate tokens per second, texts) of n completions sent at once."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    start_at = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    wall = time.perf_counter() - start_at
    return sum(t for _, t in answers) / wall, [a for a, _ in answers]


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args()
    configs = configurations(a.configs, a.concurrency)
    servers = {name: start(a.model, args, a.concurrency) for name, args in configs.items()}
    rates = {(name, n): [] for name in configs for n in a.clients}
    texts: dict = {}
    try:
        for name, (_, url) in servers.items():  # warm-up: compiled kernels, first allocations
            wave(url, max(a.clients), 16)
        for n in a.clients:
            for pair in range(a.pairs):
                names = list(configs)
                names = names[pair % len(names):] + names[: pair % len(names)]
                for name in names:
                    rate, out = wave(servers[name][1], n, a.max_tokens)
                    rates[name, n].append(rate)
                    texts.setdefault(n, {}).setdefault(name, out)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    same = all(len({tuple(t) for t in by_name.values()}) == 1 for by_name in texts.values())
    rows = []
    first = list(configs)[0]
    print(f"aggregate tok/s, {a.max_tokens}-token greedy completions, median of {a.pairs} pairs (min-max); "
          f"ratio: the median of each pair's {first} / the configuration")
    print("| clients | " + " | ".join(configs) + " |")
    print("|---|" + "---|" * len(configs))
    for n in a.clients:
        cells = []
        for name in configs:
            r = rates[name, n]
            ratio = statistics.median(x / y for x, y in zip(rates[first, n], r))
            cells.append(f"{statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f}), {ratio:.2f}x")
            rows.append({"config": name, "clients": n, "tok_s": r})
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(f"every configuration gave every prompt the same text: {same}")
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "commit": commit(), "rows": rows,
                                      "same_text": same}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
