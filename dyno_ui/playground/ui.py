"""The Gradio playground: Chat, Compare and Models tabs, mounted on the server's FastAPI app.

Layout and wiring only: callbacks call Sessions (jobs on the engine thread), and render.py and
charts.py turn Traces into HTML and figures.
"""

import html
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import List, Optional

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from speculative.attention_kernels import deepest_vector_depth, on_metal  # noqa: E402
from speculative.config import COPY_SOURCES, MAX_DRAFT_DEPTH  # noqa: E402
from speculative.errors import DynoError  # noqa: E402

from . import charts, export, races, render, replay  # noqa: E402
from ..runtime.keys import key_matches  # noqa: E402
from ..runtime.request import IMAGE_PLACEHOLDER  # noqa: E402
from ..runtime.served import ServedModel  # noqa: E402
from ..paths import ASSETS  # noqa: E402
from .sessions import CHART_S, Sessions  # noqa: E402
from .trace import Trace  # noqa: E402

CSS = ASSETS / "dyno.css"
UI_PATH = "/ui"
MAX_REPEATS = 5  # a race's runs: enough for a median, short enough for a demo
REPLAY_MAX_S = 6.0  # a slow race is replayed faster, to last at most this long
# Prompts the bundled dyno-tiny handles: it was trained on the standard library's source and on chat
# turns asking for one of its functions or classes (tools/tiny_data.py), so code in, code out.
EXAMPLES = [
    "Write the Python function `join` from the `posixpath` module.",
    "Implement `read_lines` in Python.",
    "Show me a Python class named `Stack`.",
    'def read_lines(path):\n    """Return the lines of the file at path."""',
]
BUNDLED_NOTE = ("The bundled model, dyno-tiny (5M parameters, trained on the Python standard library), continues "
                "Python code; it is no assistant, so try the examples under the chat box. Real Qwen3.5 / 3.6 / 3.8 "
                "models load from the Models tab.")


def depth_info(lm, metal: Optional[bool] = None) -> Optional[str]:
    """On Metal, where deeper drafts leave the vector attention kernel for the loaded model; else None."""
    if lm is None or lm.head is None or not (on_metal() if metal is None else metal):
        return None
    deepest = deepest_vector_depth(lm.text_config)
    if deepest >= MAX_DRAFT_DEPTH:
        return None
    return f"above {deepest}, a verify leaves Metal's vector attention kernel for this model (docs/performance.md)"


def theme() -> gr.themes.Base:
    """Gradio's default theme in Dyno's colours, with system fonts (nothing fetched from the web)."""
    return gr.themes.Default(primary_hue="emerald", neutral_hue="slate",
                             font=["system-ui", "-apple-system", "Segoe UI", "sans-serif"],
                             font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "monospace"])


LOGIN_MESSAGE = ("This server asks for its API key (--api-key): sign in with any user name and the key as "
                 "the password.")


def _key_login(api_key: str):
    """Gradio's login check with --api-key: any user name, the server's key as the password. Gradio
    then refuses its page config and every route that runs a callback (queue, call, run, upload)
    to a caller without the session cookie the login sets."""
    return lambda username, password: key_matches(api_key, password)


def _signed_key(s: Sessions, request: Optional[gr.Request]) -> Optional[str]:
    """The server's key for a signed-in page (Gradio names the user only once its login has passed
    the key check), else None: model management checks it once more, as a swap stops every client."""
    return s.api_key if getattr(request, "username", None) is not None else None


def _fail(e: DynoError):
    raise gr.Error(e.message)


def _session(request: Optional[gr.Request]) -> Optional[str]:
    return getattr(request, "session_hash", None)


# The chat and compare boxes: text, and images uploaded, dropped or pasted (Gradio's paste handler
# turns a pasted image into an upload). Long pasted text stays text, not a .txt file.
IMAGE_BOX = dict(sources=["upload"], file_types=["image"], file_count="multiple", submit_btn=False,
                 max_plain_text_length=10**7)


def _display(history: List[dict]) -> List[dict]:
    """Chatbot messages for the history: a user's images before their text (as the prompt has them),
    reasoning as a collapsible "Thinking" message."""
    out = []
    for m in history:
        if m.get("reasoning"):
            out.append({"role": "assistant", "content": m["reasoning"], "metadata": {"title": "Thinking"}})
        images = [{"path": f, "alt_text": Path(f).name} for f in m.get("images", ())]
        content = images + ([m["content"]] if m["content"] else []) if images else m["content"]
        out.append({"role": m["role"], "content": content})
    return out


def _with_placeholders(text: str, images) -> str:
    """A message's text for the chat template: one placeholder per image, before the text (as the CLI puts them)."""
    return IMAGE_PLACEHOLDER * len(images) + text


def _template(history: List[dict], system: str) -> List[dict]:
    msgs = [{"role": "system", "content": system}] if system.strip() else []
    return msgs + [{"role": m["role"], "content": _with_placeholders(m["content"], m.get("images", ()))}
                   for m in history]


def _images(history: List[dict]) -> List[str]:
    """Every image file of the conversation, in prompt order."""
    return [f for m in history for f in m.get("images", ())]


def _box(value: Optional[dict]) -> tuple:
    """(text, image files) of a MultimodalTextbox value ({"text": ..., "files": [paths]})."""
    value = value or {}
    return value.get("text") or "", list(value.get("files") or ())


def _image_meta(files: List[str], images) -> List[dict]:
    """What an export records of the prompt's images: file name, sha256 of the bytes, patch grid."""
    if images is None:
        return []
    return [{"name": Path(f).name, "sha256": d, "grid": list(g)}
            for f, d, g in zip(files, images.digests, images.grids)]


def build(served: ServedModel, api_key: Optional[str] = None) -> gr.Blocks:
    """The playground's Blocks for `served` (whose worker is started); `api_key` guards model loading
    (the login in `mount` guards the rest)."""
    s = Sessions(served, api_key)
    d = s.defaults()
    with gr.Blocks(title="Dyno playground", analytics_enabled=False) as ui:
        gr.HTML('<div class="dyno-header"><h1>Dyno</h1><span>exact MTP speculative decoding on MLX</span></div>')
        gr.Markdown(BUNDLED_NOTE, elem_id="bundled-note", elem_classes="dyno-note")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat = _chat_tab(s, d)
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                _compare_tab(s, d, chat)
            with gr.Tab("Models", id="models", elem_id="tab-models"):
                models = _models_tab(s, chat)
        ui.load(s.describe, None, models["current"])
        ui.load(models["list"], None, models["table"])  # its own event: the table may wait for the engine
    return ui


def _sampling_controls(d, prefix: str) -> dict:
    c = {}
    c["temperature"] = gr.Slider(0, 2, value=d.temperature, step=0.05, label="temperature",
                                 elem_id=f"{prefix}-temperature")
    c["top_p"] = gr.Slider(0.01, 1, value=d.top_p, step=0.01, label="top-p")
    c["top_k"] = gr.Slider(0, 200, value=d.top_k, step=1, label="top-k (0: off)")
    c["min_p"] = gr.Slider(0, 1, value=d.min_p, step=0.01, label="min-p")
    c["max_tokens"] = gr.Slider(1, 4096, value=d.max_tokens, step=1, label="max tokens",
                                elem_id=f"{prefix}-max-tokens")
    c["seed"] = gr.Number(value=-1, precision=0, label="seed (-1: random)", elem_id=f"{prefix}-seed")
    return c


SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed")
PLOTS = ("rounds", "positions", "depth", "histogram")  # the chat tab's charts (charts.answer_figures' order)


def _chat_tab(s: Sessions, d) -> dict:
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(height=360, buttons=["copy", "copy_all"], elem_id="chatbot",
                                 label="Conversation", feedback_options=None)
            with gr.Row():
                # lines=1 is what makes Enter submit (Shift+Enter adds a line); max_lines lets the box grow.
                message = gr.MultimodalTextbox(placeholder="Message (Enter sends, Shift+Enter adds a line); "
                                               "add, drop or paste images", show_label=False, scale=5, lines=1,
                                               max_lines=12, elem_id="chat-input", **IMAGE_BOX)
                send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            examples = gr.Examples([[{"text": e, "files": []}] for e in EXAMPLES], inputs=[message],
                                   label="Examples (what the bundled dyno-tiny is good at)", elem_id="chat-examples")
            with gr.Row():
                stop = gr.Button("Stop", variant="stop", elem_id="stop-button", size="sm")
                regen = gr.Button("Regenerate", elem_id="regenerate", size="sm")
                clear = gr.Button("Clear", elem_id="clear", size="sm")
            gr.HTML(render.legend_html())
            answer = gr.HTML(render.answer_html(None, placeholder="The last answer appears here, token by token."),
                             elem_id="answer")
            stats = gr.HTML(render.stats_line(None), elem_id="stats")
            with gr.Row():
                export_button = gr.Button("Export answer (HTML + JSON)", elem_id="export-chat", size="sm")
            files = gr.File(label="Exported answer", file_count="multiple", elem_id="export-files",
                            interactive=False, visible=False)
            with gr.Accordion("Replay the rounds in slow motion", open=False, elem_id="replay-box"):
                replay_view = gr.HTML(replay.replay_html(None, 0), elem_id="replay")
                with gr.Row():
                    r_start = gr.Button("◀◀ Start", elem_id="replay-start", size="sm")
                    r_back = gr.Button("◀ Back", elem_id="replay-back", size="sm")
                    r_step = gr.Button("Step ▶", elem_id="replay-step", size="sm")
                    r_next = gr.Button("Next round ▶▶", elem_id="replay-next", size="sm")
                    r_play = gr.Button("▶ Play", elem_id="replay-play", size="sm", variant="primary")
                    r_pause = gr.Button("Pause", elem_id="replay-pause", size="sm")
                speed = gr.Slider(0.5, 10, value=2, step=0.5, label="replay speed (steps per second)",
                                  elem_id="replay-speed")
        with gr.Column(scale=2, min_width=280):
            system = gr.Textbox(label="System prompt", lines=2, elem_id="system")
            thinking = gr.Checkbox(label="Thinking (for templates that support it)", value=False)
            mode = gr.Radio(["auto", "mtp", "off"], value="auto", label="Speculative decoding", elem_id="mode")
            depth = gr.Slider(1, MAX_DRAFT_DEPTH, value=s.served.worker.spec.draft_depth, step=1,
                              label="draft depth", info=depth_info(s.served.worker.lm), elem_id="depth")
            # A request's own "copies" for this page's answers; it starts at the server's --copies.
            copies = gr.Radio(list(COPY_SOURCES), value=s.served.worker.spec.copies, elem_id="copies",
                              label="Drafts copied from the context", info="on: beside the head's drafts; "
                              "off: the head alone; only: copies alone. The output is the same either way.")
            show_rejected = gr.Checkbox(label="show rejected drafts (struck through before their correction)",
                                        value=False, elem_id="show-rejected")
            details = gr.Checkbox(label="details: p, q and acceptance chance of each draft on hover (costs one "
                                  "more device-to-host copy per round)", value=False, elem_id="details")
            with gr.Accordion("Sampling (from the model's generation_config)", open=True):
                sampling = _sampling_controls(d, "chat")
    with gr.Row(elem_classes="dyno-charts"):
        plots = [gr.Plot(figure, elem_id=f"plot-{name}", show_label=False)
                 for name, figure in zip(PLOTS, charts.answer_figures(None))]
    history = gr.State([])
    frame = gr.State(0)
    settings = [system, thinking, mode, copies, depth, details, show_rejected] + [sampling[k] for k in SAMPLING]
    outputs = [chatbot, history, answer, stats] + plots

    def prepare(history, system, thinking, mode, copies, depth, details, values) -> tuple:
        """The reply's job: (model, prompt ids, its images, params, spec, copies, export metadata); a bad
        setting or image, or an image for a model without a tower, is a one-line gr.Error."""
        lm = s.lm  # one model for the whole reply
        files = _images(history)
        try:
            prompt, images = s.with_images(s.chat_prompt(_template(history, system), thinking, lm), files, lm)
            params = s.params(*values, prompt_len=len(prompt), lm=lm)
            spec = s.spec(mode, depth, lm, details)
            copies = s.copies(copies)
        except DynoError as e:
            _fail(e)
        meta = {"model": lm.name, "prompt": history[-1]["content"], "images": _image_meta(files, images),
                "settings": {"speculative": mode, "copies": copies, "draft depth": int(depth),
                             "details": bool(details), **{k: v for k, v in zip(SAMPLING, values)}}}
        return lm, prompt, images, params, spec, copies, meta

    def run(history, job, rejected, request: Optional[gr.Request]):
        """Stream the assistant's reply to the last user message of `history` (`job`: prepare's)."""
        lm, prompt, images, params, spec, copies, meta = job
        charted = 0.0
        trace = Trace(time.perf_counter())
        for trace in s.stream(prompt, params, spec, _session(request), lm, images, copies):
            reply = {"role": "assistant", "content": trace.text(), "reasoning": trace.text("reasoning")}
            now = time.perf_counter()
            shown = history + [reply]
            slow = [gr.skip()] * (2 + len(plots))  # text and charts a few times a second; the stats line every frame
            if trace.finished:
                s.keep(_session(request), "chat", (trace, meta))
            if now - charted >= CHART_S or trace.finished:
                charted = now
                slow = [_display(shown), render.answer_html(trace, rejected=rejected), *charts.answer_figures(trace)]
            yield [slow[0], shown if trace.finished else gr.skip(), slow[1], render.stats_line(trace)] + slow[2:]

    # Explicit parameters, no *args: Gradio injects gr.Request only into named parameters, and Stop
    # finds the running job by the request's session.
    def submit(box, history, system, thinking, mode, copies, depth, details, rejected, temperature, top_p, top_k,
               min_p, max_tokens, seed, request: gr.Request):
        text, files = _box(box)
        if not text.strip() and not files:
            raise gr.Error("Type a message or add an image first")
        history = history + [{"role": "user", "content": text, **({"images": files} if files else {})}]
        values = (temperature, top_p, top_k, min_p, max_tokens, seed)
        # Checked before the box is emptied: a refused message keeps its text and images there.
        job = prepare(history, system, thinking, mode, copies, depth, details, values)
        yield [gr.skip()] * len(outputs) + [{"text": "", "files": []}]
        for shown in run(history, job, rejected, request):
            yield shown + [gr.skip()]

    def regenerate(history, system, thinking, mode, copies, depth, details, rejected, temperature, top_p, top_k,
                   min_p, max_tokens, seed, request: gr.Request):
        while history and history[-1]["role"] == "assistant":
            history = history[:-1]
        if not history:
            raise gr.Error("Nothing to regenerate")
        values = (temperature, top_p, top_k, min_p, max_tokens, seed)
        yield from run(history, prepare(history, system, thinking, mode, copies, depth, details, values), rejected,
                       request)

    # Progress, and a refusal's "Error" mark, on the answer alone: the box stays usable, its image kept.
    for trigger in (send.click, message.submit):
        trigger(submit, [message, history] + settings, outputs + [message], concurrency_limit=None,
                show_progress_on=[answer])
    regen.click(regenerate, [history] + settings, outputs, concurrency_limit=None, show_progress_on=[answer])
    def stop_job(request: gr.Request):
        s.stop(_session(request))

    stop.click(stop_job, None, None, queue=False)

    def last_trace(request: Optional[gr.Request]) -> Optional[Trace]:
        kept = s.last(_session(request), "chat")
        return kept[0] if kept else None

    def rerender(rejected, request: gr.Request):
        trace = last_trace(request)
        return render.answer_html(trace, rejected=rejected) if trace else gr.skip()

    show_rejected.change(rerender, [show_rejected], [answer], queue=False)
    examples.dataset.click(lambda: True, None, show_rejected, queue=False)  # the demo examples show them

    def export_answer(request: gr.Request):
        kept = s.last(_session(request), "chat")
        if kept is None:
            raise gr.Error("Nothing to export yet: finish an answer first")
        return gr.File(value=_write_export("dyno-answer", export.answer_html_file(*kept),
                                           export.answer_json(*kept)), visible=True)

    export_button.click(export_answer, None, files)

    def show_frame(f, request: gr.Request):
        trace = last_trace(request)
        f = max(0, min(f, replay.frames(trace) - 1))
        return replay.replay_html(trace, f), f

    # Named functions: Gradio injects gr.Request by annotation, which a lambda cannot carry.
    def start(request: gr.Request):
        return show_frame(0, request)

    def back(f, request: gr.Request):
        return show_frame(f - 1, request)

    def step(f, request: gr.Request):
        return show_frame(f + 1, request)

    def next_round(f, request: gr.Request):
        return show_frame((f // len(replay.PHASES) + 1) * len(replay.PHASES), request)

    for button, fn in ((r_start, start), (r_back, back), (r_step, step), (r_next, next_round)):
        button.click(fn, None if fn is start else [frame], [replay_view, frame], queue=False)

    def play(f, rate, request: gr.Request):
        trace = last_trace(request)
        last = replay.frames(trace) - 1
        if last < 0:
            yield replay.replay_html(None, 0), 0
            return
        f = 0 if f >= last else f
        while True:
            yield replay.replay_html(trace, f), f
            if f >= last:
                return
            time.sleep(1.0 / max(float(rate), 0.1))
            f += 1

    playing = r_play.click(play, [frame, speed], [replay_view, frame], concurrency_limit=None)
    r_pause.click(None, None, None, cancels=[playing], queue=False)
    clear.click(lambda: ([], [], render.answer_html(None), render.stats_line(None), *charts.answer_figures(None)),
                None, outputs, queue=False)
    return {"depth": depth, **sampling}


def _write_export(stem: str, page: str, data: str) -> List[str]:
    """The two export files in a fresh temporary folder (Gradio serves files from the temp dir)."""
    folder = Path(tempfile.mkdtemp(prefix="dyno-export-"))
    paths = [folder / f"{stem}.html", folder / f"{stem}.json"]
    paths[0].write_text(page, encoding="utf-8")
    paths[1].write_text(data, encoding="utf-8")
    return [str(p) for p in paths]


def _compare_tab(s: Sessions, d, chat: dict) -> None:
    gr.Markdown("One prompt, decoded with MTP drafts and without (or with drafts copied from the context beside "
                "the head's and with the head's alone), one after the other on the same model and sampling, "
                "repeated to show the median speedup; then the median run replayed side by side on a shared timeline.")
    with gr.Row():
        prompt = gr.MultimodalTextbox(label="Prompt (text, and images added, dropped or pasted)", lines=2, scale=4,
                                      elem_id="compare-prompt", value={"text": EXAMPLES[0], "files": []}, **IMAGE_BOX)
        with gr.Column(scale=1, min_width=200):
            depth = gr.Slider(1, MAX_DRAFT_DEPTH, value=s.served.worker.spec.draft_depth, step=1,
                              label="draft depth (starts at auto's choice)", info=depth_info(s.served.worker.lm),
                              elem_id="compare-depth")
            repeats = gr.Slider(1, MAX_REPEATS, value=3, step=1, label="runs (median speedup)",
                                elem_id="compare-repeats")
            pairing = gr.Radio(list(races.PAIRINGS), value=races.DEFAULT, label="race", elem_id="compare-pairing")
            go = gr.Button("Race", variant="primary", elem_id="compare-run")
    with gr.Accordion("Sampling", open=False):
        sampling = _sampling_controls(d, "compare")
        sampling["temperature"].value = 0.0  # a race at temperature 0 can check the outputs are identical
    summary = gr.HTML(render.stats_line(None), elem_id="compare-summary")
    note = gr.HTML("", elem_id="compare-note")
    with gr.Row(equal_height=True):
        with gr.Column():
            left_label = gr.HTML(_race_label(races.DEFAULT, 0), elem_id="compare-mtp-label")
            left = gr.HTML(render.answer_html(None), elem_id="compare-mtp")
        with gr.Column():
            right_label = gr.HTML(_race_label(races.DEFAULT, 1), elem_id="compare-plain-label")
            right = gr.HTML(render.answer_html(None), elem_id="compare-plain")
    race = gr.Plot(charts.race_figure(None, None), elem_id="plot-race", show_label=False)
    export_button = gr.Button("Export race (HTML + JSON)", elem_id="export-race", size="sm")
    files = gr.File(label="Exported race", file_count="multiple", elem_id="export-race-files", interactive=False,
                    visible=False)

    def relabel(name):
        return _race_label(name, 0), _race_label(name, 1)

    pairing.change(relabel, [pairing], [left_label, right_label], queue=False)

    def compare(box, depth, runs_wanted, race_name, temperature, top_p, top_k, min_p, max_tokens, seed,
                request: gr.Request):
        values = (temperature, top_p, top_k, min_p, max_tokens, seed)
        text, files = _box(box)
        if not text.strip() and not files:
            raise gr.Error("Type a prompt or add an image first")
        if not 1 <= int(runs_wanted) <= MAX_REPEATS:
            raise gr.Error(f"runs must be from 1 to {MAX_REPEATS}, got {runs_wanted}")
        lm = s.lm  # one model for every run
        if lm.head is None:
            raise gr.Error(f"{lm.name} has no MTP head: nothing to compare")
        try:
            ids, images = s.with_images(s.chat_prompt([{"role": "user", "content": _with_placeholders(text, files)}],
                                                      False, lm), files, lm)
            params = s.params(*values, prompt_len=len(ids), lm=lm)
            sides = races.pairing(race_name)
        except DynoError as e:
            _fail(e)
        names = races.names(sides)
        auto_depth = s.served.worker.spec.draft_depth
        pairs = []
        for n in range(1, int(runs_wanted) + 1):
            runs = []
            for side in sides:
                spec = s.spec(side.mode, depth, lm)
                for trace in s.stream(ids, params, spec, _session(request), lm, images, side.copies):
                    status = (f'<div class="dyno-stats">run {n} of {int(runs_wanted)}, {html.escape(side.label)}: '
                              f'{len(trace.token_ids)} tokens…</div>')
                    yield status, gr.skip(), gr.skip(), gr.skip(), gr.skip()
                if trace.finish_reason == "cancelled" or trace.error:
                    yield render.stats_line(trace), gr.skip(), gr.skip(), gr.skip(), gr.skip()
                    return
                runs.append(trace)
            pairs.append(tuple(runs))
        # The replay: the median run's two generations from their first token, on one clock.
        speedups = render.race_speedups(pairs)
        order = sorted(range(len(pairs)), key=lambda i: speedups[i] if i < len(speedups) else 0.0)
        spec, plain = pairs[order[len(order) // 2]]
        result = render.race_summary(pairs, params.greedy, s.decode, int(depth), auto_depth, names)
        why = ""
        median = statistics.median(speedups) if speedups else None
        if median is not None and median < 1 and spec.tokens_per_round and sides[1].mode == "off":
            # (timed over the ids as text: a round's cost does not depend on what the image rows hold)
            why = _cost_note(s, lm, ids, int(depth), spec.tokens_per_round, median)
        meta = {"model": lm.name, "prompt": text, "images": _image_meta(files, images), "settings": {
            "race": race_name, "draft depth": int(depth), "auto depth": auto_depth, "runs": len(pairs),
            **{k: v for k, v in zip(SAMPLING, values)}}}
        s.keep(_session(request), "race", (spec, plain, result + why, meta,
                                           {side.key: [p[i] for p in pairs] for i, side in enumerate(sides)},
                                           speedups, names))
        length = max(t.token_times[-1] - t.token_times[0] for t in (spec, plain) if t.token_times) if spec.token_times else 0
        scale = max(1.0, length / REPLAY_MAX_S)
        start = time.perf_counter()
        while True:
            at = (time.perf_counter() - start) * scale
            frames = [render.answer_html(t, until=t.token_times[0] + at if t.token_times else None)
                      for t in (spec, plain)]
            done = at >= length
            yield (result if done else f'<div class="dyno-stats">replaying the median race: {at:.2f} s</div>',
                   why if done else gr.skip(), *frames,
                   charts.race_figure(spec, plain, until=None if done else at, names=names))
            if done:
                return
            time.sleep(CHART_S / 2)

    go.click(compare, [prompt, depth, repeats, pairing] + [sampling[k] for k in SAMPLING],
             [summary, note, left, right, race],
             concurrency_limit=None)

    def export_race(request: gr.Request):
        kept = s.last(_session(request), "race")
        if kept is None:
            raise gr.Error("Nothing to export yet: finish a race first")
        spec, plain, result, meta, runs, speedups, names = kept
        return gr.File(value=_write_export("dyno-race", export.race_html_file(spec, plain, result, meta, names),
                                           export.race_json(runs, meta, speedups)), visible=True)

    export_button.click(export_race, None, files)


def _race_label(race_name: str, side: int) -> str:
    """A race column's heading: its side's name, in the colour the summary and the chart give it."""
    try:
        label = races.pairing(race_name)[side].label
    except DynoError as e:
        _fail(e)
    return f'<div class="race-label {("race-mtp", "race-plain")[side]}">{html.escape(label)}</div>'


def _cost_note(s: Sessions, lm, ids: List[int], depth: int, tokens_per_round: float, measured: float) -> str:
    """One line on why drafting loses here, from a quick cost-model timing on the engine thread."""
    from speculative.measure.cost_model import cost_model

    try:
        costs = s.on_engine(lambda: cost_model(lm, ids, [depth], reps=5, burst=1), timeout=60)
    except Exception as e:  # the race stands without the explanation
        return f'<div class="dyno-race-note">Drafting lost here; the cost model could not time it ({html.escape(str(e))}).</div>'
    return f'<div class="dyno-race-note">{html.escape(render.cost_note(lm.name, costs, depth, tokens_per_round, measured))}</div>'


def _models_tab(s: Sessions, chat: dict) -> dict:
    current = gr.Markdown(elem_id="current-model")
    with gr.Row():
        folder = gr.Textbox(label="Model folder or Hugging Face repo id (or pick one below)", scale=4,
                            elem_id="model-folder")
        refresh = gr.Button("Scan", scale=1)
    table = gr.Dataframe(headers=["model", "type", "MTP head"], interactive=False, elem_id="models-table",
                         wrap=True)
    with gr.Row():
        # auto: the head follows the trunk (stored precision; 8-bit with a quantized trunk on Metal/CUDA)
        bits = gr.Radio(["auto", "16", "8", "4"], value="auto", label="MTP head precision (bits)",
                        elem_id="head-bits", scale=2)
        load = gr.Button("Load model", variant="primary", elem_id="load-model", scale=1)
        fetch = gr.Button("Fetch head", elem_id="fetch-head", scale=1)
    status = gr.Markdown(elem_id="models-status")

    # The last listing, shown to every page that opens; Scan and Fetch read the disk (and maybe the
    # Hub, for heads) again. Head checks run on the engine thread, so a page load should not repeat them.
    listed: dict = {}

    def rows(extra: Optional[str] = None) -> List[tuple]:
        listed["rows"] = s.local_models([extra] if extra else [])
        return listed["rows"]

    def first_rows() -> List[tuple]:
        return listed.get("rows") or rows()

    def scan(extra):
        return rows(extra), s.describe()

    def wait(future, progress, what: str, notes: List[str]):
        s_start = time.perf_counter()
        while not future.done():
            elapsed = time.perf_counter() - s_start
            progress(min(0.95, elapsed / (elapsed + 5)), desc=notes[-1] if notes else what)
            time.sleep(0.2)
        return future.result()

    def do_load(path, bits, request: gr.Request, progress=gr.Progress()):
        if not path:
            raise gr.Error("Type a model folder or a Hugging Face repo id, or pick one")
        notes: List[str] = []
        progress(0, desc="queued behind running generations")
        try:
            lm = wait(s.load(path, notes.append, bits, key=_signed_key(s, request)), progress, f"loading {path}", notes)
        except DynoError as e:
            _fail(e)
        d = s.defaults()
        return (f"Loaded {lm.name}.", s.describe(), d.temperature, d.top_p, d.top_k, d.min_p,
                s.served.worker.spec.draft_depth)

    def do_fetch(path, bits, request: gr.Request, progress=gr.Progress()):
        if not path:
            raise gr.Error("Type a model folder or a Hugging Face repo id, or pick one")
        try:
            notes: List[str] = []
            target, base, memory = wait(s.fetch_head(path, notes.append, bits, key=_signed_key(s, request)), progress,
                                        f"fetching the head for {path}", notes)
        except DynoError as e:
            _fail(e)
        msg = f"{target} carries its own head." if base is None else f"Head of {base} cached in `{target}`."
        return msg + (f" In memory: {memory}." if memory else ""), rows(path)

    refresh.click(scan, [folder], [table, current])
    def pick(evt: gr.SelectData):
        return evt.row_value[0] if evt.row_value else gr.skip()

    table.select(pick, None, folder)
    load.click(do_load, [folder, bits], [status, current, chat["temperature"], chat["top_p"], chat["top_k"],
                                  chat["min_p"], chat["depth"]])
    fetch.click(do_fetch, [folder, bits], [status, table])
    return {"current": current, "table": table, "list": first_rows}


def mount(app: FastAPI, served: ServedModel, path: str = UI_PATH, api_key: Optional[str] = None) -> FastAPI:
    """Mount the playground on `app` at `path` (the server's routes stay as they are); with `api_key`
    its login page asks for the key before anything runs."""
    login = dict(auth=_key_login(api_key), auth_message=LOGIN_MESSAGE) if api_key else {}
    return gr.mount_gradio_app(app, build(served, api_key), path=path, theme=theme(), css_paths=[CSS],
                               head=f"<script>{render.CARD_JS}</script>", footer_links=["api"], ssr_mode=False,
                               **login)
