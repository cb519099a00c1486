"""Multi-turn prompt reuse, measured: scripted conversations against two real `dyno serve` processes.

    python tools/bench_multiturn.py [--model assets/dyno-tiny] [--turns 10] [--max-tokens 96]
                                    [--speculative auto] [--decode-concurrency 1] [--json out.json]

One server keeps its prompt cache (the default), the other has none (`--prompt-cache-bytes 0`).
Each turn goes to the first (the conversation as a client builds it from that server's answers),
then the same messages to the second: prompt tokens and reused tokens come from the first's
usage, time to first token from each server's own /metrics (arrival to first token, so HTTP and
text held back by the detokenizer are left out), and the two answers must be identical (greedy).
Conversations: a thinking chat whose client sends earlier answers back without their reasoning
(as Qwen templates drop it), a tool-using chat (a forced call, the tool's result, the answer),
and a regenerate/edit sequence. The system prompt is a stretch of a standard-library module, so
prompts pass 1,000 tokens from the first turn (each conversation its own stretch: none reuses another's).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
TTFT_SUM = "mlx:time_to_first_token_seconds_sum"
SOURCE = inspect.getsource(textwrap)


def system(n: int) -> dict:
    """Conversation n's system prompt: another stretch of the module, so no conversation reuses another's."""
    return {"role": "system", "content": "You maintain the module below. Answer with Python code that fits its "
                                         "style.\n\n" + SOURCE[600 * n : 600 * n + 3600]}


ASKS = ["Add a function that indents every line by four spaces.", "Now one that removes blank lines.",
        "Write a helper that counts the words in a paragraph.", "Make the wrap width a keyword argument.",
        "Add a docstring to the last function.", "Write a test for the indent helper.",
        "Rename the counting helper to word_count.", "Handle tabs in the indent helper.",
        "Add type hints to every new function.", "Summarize what you changed."]
TOOL = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the test suite of one module and report the result",
    "parameters": {"type": "object",
                   "properties": {"module": {"type": "string", "enum": ["textwrap", "shutil", "json"]}},
                   "required": ["module"], "additionalProperties": False}}}


class Server:
    """A `dyno serve` subprocess on a free port."""

    def __init__(self, args, *extra: str):
        cmd = [sys.executable, "-c", "import sys; from dyno_ui.cli import main; sys.exit(main())",
               "serve", "--model", args.model, "--port", "0", "--no-ui", "--max-tokens-default", str(args.max_tokens),
               "--speculative", args.speculative, "--decode-concurrency", str(args.decode_concurrency), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if m := re.search(r"at (http://\S+)/v1", line):
                self.url = m.group(1)
                break
        else:
            raise SystemExit(f"the server did not start: {' '.join(cmd)}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def ttft_sum(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == TTFT_SUM:
                    return s.value
        return 0.0

    def ask(self, messages: List[dict], **kw):
        """(reply, its time to first token as the server measured it)."""
        before = self.ttft_sum()
        reply = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0, **kw)
        return reply, self.ttft_sum() - before

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def answer(reply) -> dict:
    """What must match between the two servers: text, reasoning and calls (not their ids)."""
    m = reply.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return {"content": m.content, "reasoning": getattr(m, "reasoning_content", None), "calls": calls}


def assistant(reply) -> dict:
    """The answer as a client sends it back: content and tool calls, no reasoning."""
    m = reply.choices[0].message
    msg: Dict = {"role": "assistant", "content": m.content or ""}
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    return msg


def thinking_chat(turns: int):
    """(messages, request fields) per turn; `send` feeds each reply back."""
    messages = [system(0)]
    for i in range(turns):
        messages.append({"role": "user", "content": ASKS[i % len(ASKS)]})
        reply = yield "thinking", messages, {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
        messages.append(assistant(reply))


def tool_chat(turns: int):
    """A forced call, then the tool's result and an answer (tool_choice auto: tools offered on every request)."""
    messages = [system(1)]
    for i in range(turns):
        if i % 2 == 0:
            messages.append({"role": "user", "content": f"Run the tests of {['textwrap', 'shutil', 'json'][i % 3]}."})
            reply = yield "call", messages, {"tools": [TOOL], "tool_choice": "required"}
        else:
            call = messages[-1]["tool_calls"][0] if messages[-1].get("tool_calls") else {"id": "none"}
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{10 + i} passed, 0 failed"})
            reply = yield "answer", messages, {"tools": [TOOL], "tool_choice": "auto"}
        messages.append(assistant(reply))


def edit_chat(turns: int):
    """Three turns, the third regenerated, then its question edited, then more turns."""
    messages = [system(2)]
    for i in range(3):
        messages.append({"role": "user", "content": ASKS[i]})
        reply = yield "turn", messages, {}
        messages.append(assistant(reply))
    messages.pop()
    reply = yield "regenerate", messages, {}
    messages[-1] = {"role": "user", "content": ASKS[2].replace("counts the words", "counts the lines")}
    reply = yield "edit", messages, {}
    messages.append(assistant(reply))
    for i in range(3, max(turns - 2, 4)):
        messages.append({"role": "user", "content": ASKS[i]})
        reply = yield "turn", messages, {}
        messages.append(assistant(reply))


def play(script, warm: Server, cold: Server) -> List[dict]:
    rows, reply = [], None
    try:
        kind, messages, kw = next(script)
        while True:
            reply, warm_ttft = warm.ask(messages, **kw)
            cold_reply, cold_ttft = cold.ask(messages, **kw)
            usage = reply.usage
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            rows.append({"turn": len(rows) + 1, "kind": kind, "prompt_tokens": usage.prompt_tokens,
                         "reused_tokens": cached, "reused": cached / usage.prompt_tokens,
                         "ttft_reuse_ms": 1000 * warm_ttft, "ttft_cold_ms": 1000 * cold_ttft,
                         "ratio": cold_ttft / warm_ttft if warm_ttft else None,
                         "identical": answer(reply) == answer(cold_reply)})
            kind, messages, kw = script.send(reply)
    except StopIteration:
        return rows


def table(name: str, rows: List[dict]) -> str:
    out = [f"\n{name}", "| turn | request | prompt tokens | reused | TTFT reuse | TTFT cold | cold/reuse | identical |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['turn']} | {r['kind']} | {r['prompt_tokens']} | {r['reused_tokens']} ({r['reused']:.0%}) "
                   f"| {r['ttft_reuse_ms']:.1f} ms | {r['ttft_cold_ms']:.1f} ms | {r['ratio']:.1f}x "
                   f"| {'yes' if r['identical'] else 'NO'} |")
    late = [r for r in rows if r["turn"] >= 3 and r["prompt_tokens"] > 1000]
    if late:
        out.append(f"turns 3+ over 1,000 tokens: reused {min(r['reused'] for r in late):.0%} at least, "
                   f"TTFT {statistics.median(r['ratio'] for r in late):.1f}x better (median, "
                   f"min {min(r['ratio'] for r in late):.1f}x)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--speculative", default="auto")
    ap.add_argument("--decode-concurrency", type=int, default=1)
    ap.add_argument("--json", help="write every row to this file")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warm, cold = Server(args), Server(args, "--prompt-cache-bytes", "0")
    try:
        for server in (warm, cold):  # warm-up: first calls compile and allocate
            server.ask([{"role": "user", "content": "Hello."}], max_tokens=8)
        results = {}
        for name, script in (("thinking chat", thinking_chat(args.turns)), ("tool chat", tool_chat(args.turns)),
                             ("regenerate/edit", edit_chat(args.turns))):
            results[name] = play(script, warm, cold)
            print(table(name, results[name]), flush=True)
    finally:
        warm.stop()
        cold.stop()
    if args.json:
        import platform

        import mlx.core as mx
        from importlib.metadata import version

        machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": version("mlx"),
                   "mlx_lm": version("mlx-lm"), "backend": "metal" if mx.metal.is_available() else "cpu",
                   "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                            capture_output=True).stdout.strip()}
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main()
