"""`dyno bench` and `dyno tune`: paired speed measurements and the stored best depth."""

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from speculative.errors import DynoError

from speculative.measure.suites import SUITES, encode
from speculative.stats import CONTEXT_BANDS, GenerationStats

from ..options import ModelOptions
from ..paths import default_model
from .common import DRAFT_VOCAB_HELP, MODEL_HELP, draft_vocab, notify


def add_commands(sub) -> None:
    b = sub.add_parser("bench", help="measure Dyno against plain mlx-lm, side by side",
                       description="Paired, alternating runs: plain mlx-lm, Dyno off, Dyno mtp at each depth.")
    b.add_argument("--model", help=MODEL_HELP)
    b.add_argument("--suite", default="code", choices=[*SUITES, "all"])
    b.add_argument("--mtp-head-bits", metavar="{16,8,4}",
                   help="precision the MTP head is kept at "
                        "(default: follow the trunk; docs/heads.md, Head memory)")
    b.add_argument("--mtp-head", metavar="DIR", help="the MTP head to draft with (a head folder, a checkpoint with its "
                   "head embedded, or a repo id; default: the model's own, found as `dyno generate` finds it)")
    b.add_argument("--depths", default="1,2,3,4", help="comma-separated draft depths; `auto` adds the depth --draft-depth auto picks (default: %(default)s)")
    b.add_argument("--temp", type=float, nargs="+", default=[0.0], metavar="T", help="temperatures (default: 0)")
    b.add_argument("--top-p", type=float, default=0.95, help="top-p when T > 0 (default: %(default)s)")
    b.add_argument("--top-k", type=int, default=20, help="top-k when T > 0 (default: %(default)s)")
    b.add_argument("--max-tokens", type=int, default=200)
    b.add_argument("--pairs", type=int, default=5, help="measured cycles per prompt (default: %(default)s)")
    b.add_argument("--draft-vocab", type=draft_vocab, default=ModelOptions.draft_vocab, metavar="N|auto|full", help=DRAFT_VOCAB_HELP)
    b.add_argument("--concurrency", metavar="N,N,...",
                   help="instead: the suite's prompts as N concurrent rows (e.g. 1,2,4,8): Dyno batched drafting "
                        "against Dyno batched plain, mlx-lm's BatchGenerator and serial drafting")
    b.add_argument("--copies", default="off,on", metavar="SOURCES",
                   help="comma-separated draft sources to run at each depth: off (the head alone, setting mtp@k), "
                        "on (copies from the context beside it, mtp@k+copies), only (copies alone, copies@k) "
                        "(default: %(default)s)")
    b.add_argument("--tasks", metavar="FILE.jsonl",
                   help="instead of --suite: prompts from a JSONL file of {\"prompt\": ..., \"answer\": ...} "
                        "(tools/edit_tasks.py writes one from the standard library's sources)")
    b.add_argument("--draft-depth", default="auto", metavar="N|auto",
                   help="with --concurrency: the batched depth, pinned, or chosen each round by cost (default: auto)")
    b.add_argument("--json", "--out", dest="json", metavar="FILE", help="write the JSON record here")
    b.add_argument("--plot", metavar="FILE", help="write a Plotly chart (FILE.html, and FILE.png if kaleido works)")
    b.set_defaults(func=cmd_bench)
    t = sub.add_parser("tune", help="measure the best draft depth for a model on this machine and store it",
                       description="A short paired benchmark; `--draft-depth auto` (the default) then uses its result.")
    t.add_argument("--model", help=MODEL_HELP)
    t.add_argument("--max-tokens", type=int, default=120)
    t.add_argument("--pairs", type=int, default=3)
    t.add_argument("--draft-vocab", type=draft_vocab, default=ModelOptions.draft_vocab, metavar="N|auto|full", help=DRAFT_VOCAB_HELP)
    t.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from speculative import load_model
    from speculative.measure.bench import TUNE_DEPTHS, tune_depths, tune_prompts
    from speculative.config import SpecConfig
    from speculative.measure.batch_cost import measure_batch_costs
    from speculative.measure.tuning import store, tune_file

    # The depth is measured here (none settled at load) and stored for this draft vocabulary.
    lm, spec = load_model(args.model or default_model(), mode="mtp", draft_depth=SpecConfig.draft_depth,
                          draft_vocab=args.draft_vocab, notify=notify)
    vocab = spec.draft_vocab
    depths = list(TUNE_DEPTHS)
    prompts = tune_prompts(lm.tokenizer)
    best, speedup, results = tune_depths(lm, prompts, args.max_tokens, args.pairs, vocab)
    acceptance = GenerationStats()  # the deepest setting's rounds, pooled: the batched policy's prior
    for res in results:
        s = res["settings"][f"mtp@{max(depths)}"]
        acceptance.merge(GenerationStats.from_counts(s["rounds"], s["accepted_per_position"], s["drafted_per_position"]))
    costs = measure_batch_costs(lm, prompts[0], reps=7, draft_vocab=vocab)
    store(lm, best, {"source": "measured", "speedup": speedup, "acceptance": acceptance.acceptance_by_position(),
                     "batch_costs": costs.as_json()}, vocab)
    for k in depths:
        print(f"depth {k}: {speedup[k]:.2f}x vs plain mlx-lm" + ("  <- best" if k == best else ""))
    widths = " ".join(f"{b} rows: {round(costs.round(b, 0) * 1e3, 1)}-{round(costs.round(b, costs.max_depth) * 1e3, 1)}ms"
                      for b in sorted(costs.verify))
    print(f"batched round (depth 0-{costs.max_depth}): {widths}")
    print(f"stored depth {best} for {lm.repo_id or lm.path} in {tune_file()}")
    return 0


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _machine() -> dict:
    import mlx.core as mx
    import mlx_lm

    from speculative.measure.blas import detect

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "backend": str(mx.default_device()),
            "blas": detect().as_json()}


def _print_blas(record) -> None:
    """The BLAS line of a table's header, and what a reference BLAS means for the figures (Linux)."""
    from speculative.measure.blas import Blas, compute_bound_note

    blas = Blas(**record["machine"]["blas"])
    print(blas.line())
    if note := compute_bound_note(blas):
        print(note)


def cmd_bench(args) -> int:
    if args.concurrency:
        return cmd_concurrent(args)
    from speculative.measure.bench import paired_benchmark
    from speculative.measure.cost_model import cost_model, speedup_bound
    from speculative.config import COPY_SOURCES, MAX_DRAFT_DEPTH, SamplingParams, SpecConfig
    from speculative import load_model

    names = [d.strip() for d in args.depths.split(",")]
    try:
        depths = sorted({int(d) for d in names if d != "auto"})
    except ValueError:
        raise DynoError(f"--depths must be comma-separated integers or auto, got {args.depths!r}") from None
    if any(not 1 <= k <= MAX_DRAFT_DEPTH for k in depths):
        raise DynoError(f"--depths must be between 1 and {MAX_DRAFT_DEPTH}, got {args.depths!r}")
    if args.pairs < 1:
        raise DynoError(f"--pairs must be at least 1, got {args.pairs}")
    copies = [c.strip() for c in args.copies.split(",")]
    if not copies or any(c not in COPY_SOURCES for c in copies):
        raise DynoError(f"--copies must be comma-separated sources from {', '.join(COPY_SOURCES)}, got {args.copies!r}")
    SpecConfig("mtp", draft_vocab=args.draft_vocab)  # checked before anything loads
    items = read_tasks(args.tasks) if args.tasks else None
    lm, spec = load_model(args.model or default_model(), mode="mtp", head_bits=args.mtp_head_bits, notify=notify,
                          mtp_head=args.mtp_head,
                          draft_depth="auto" if "auto" in names else SpecConfig.draft_depth, draft_vocab=args.draft_vocab)
    vocab = spec.draft_vocab  # auto: the N it picks for this model (None: full)
    auto = spec.draft_depth if "auto" in names else None
    suites = ["tasks"] if items else list(SUITES) if args.suite == "all" else [args.suite]
    record = {"machine": _machine(), "model": lm.repo_id or str(lm.path), "quantization": lm.config.get("quantization"),
              "commit": _git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "settings": {"depths": depths, "auto_depth": auto, "temps": args.temp, "max_tokens": args.max_tokens, "pairs": args.pairs,
                           "top_p": args.top_p, "top_k": args.top_k, "draft_vocab": args.draft_vocab,
                           "draft_vocab_tokens": vocab, "copies": copies, "tasks": args.tasks},
              "results": []}
    record["mtp_head"] = lm.head_memory.as_json()
    cost_depths = sorted(set(depths) | ({auto} if auto else set()))
    for suite in suites:
        for item in items if suite == "tasks" else SUITES[suite]:
            prompt = encode(lm.tokenizer, item)
            for temp in args.temp:
                params = SamplingParams(temperature=temp, top_p=args.top_p if temp else 1.0,
                                        top_k=args.top_k if temp else 0, max_tokens=args.max_tokens, seed=0)
                print(f"[{suite}] T={temp} {item['prompt'][:40]!r}...", file=sys.stderr, flush=True)
                res = paired_benchmark(lm, prompt, params, depths, pairs=args.pairs, auto_depth=auto,
                                       draft_vocab=vocab, copies=copies)
                # Measured right after its pairs: this machine's speed drifts by tens of percent over
                # minutes, so a bound from another moment would misstate the efficiency.
                res["cost_model"] = cost_model(lm, prompt, cost_depths, draft_vocab=vocab)
                record["results"].append({"suite": suite, "prompt": item["prompt"], "temperature": temp, **res})
    record["cost_model"] = _median_costs([r["cost_model"] for r in record["results"]])
    _add_bounds(record, speedup_bound)
    _print_table(record)
    print(lm.head_memory.line())
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        _plot(record, args.plot)
    return 0


def read_tasks(path: str) -> list:
    """A JSONL task file's items ({"prompt": ..., "answer": ...} per line; the answer is not read here),
    or a one-line error."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise DynoError(f"--tasks: cannot read {path}: {e.strerror}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DynoError(f"--tasks: {path} line {n} is not JSON: {e.msg}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise DynoError(f"--tasks: {path} line {n} has no \"prompt\" string")
        items.append(item)
    if not items:
        raise DynoError(f"--tasks: {path} holds no tasks")
    return items


def _median_costs(models: list) -> dict:
    import statistics

    return {"T1": statistics.median(m["T1"] for m in models), "Td": statistics.median(m["Td"] for m in models),
            "Tv": {k: statistics.median(m["Tv"][k] for m in models) for k in models[0]["Tv"]}}


def _add_bounds(record, bound) -> None:
    """Per result and depth: the cost-model bound (from that result's cost model) and the engine efficiency."""
    for res in record["results"]:
        costs = res["cost_model"]
        t1, td = costs["T1"], costs["Td"]
        for s in res["settings"].values():
            k = s["depth"]
            if k and s["tokens_per_round"] and s.get("copies", "off") == "off":  # (a copy verifies deeper than k)
                s["bound"] = bound(s["tokens_per_round"], t1, costs["Tv"][k], td, k)
                s["efficiency"] = s["ratio"]["median"] / s["bound"]


def _aggregate(record):
    """Median over prompts of each (suite, temperature, setting)."""
    import statistics

    rows = {}
    for res in record["results"]:
        for name, s in res["settings"].items():
            key = (res["suite"], res["temperature"], name)
            rows.setdefault(key, []).append(s)
    out = []
    for (suite, temp, name), ss in rows.items():
        med = lambda f: statistics.median([f(s) for s in ss if f(s) is not None]) if any(f(s) is not None for s in ss) else None
        pooled = _pooled(ss)
        out.append({"suite": suite, "temperature": temp, "setting": name,
                    "ratio": med(lambda s: s["ratio"]["median"]),
                    "ratio_min": min(s["ratio"]["min"] for s in ss), "ratio_max": max(s["ratio"]["max"] for s in ss),
                    "tps": med(lambda s: s["decode_tps"]["median"]), "tpr": pooled.tokens_per_round,
                    "bound": med(lambda s: s.get("bound")), "efficiency": med(lambda s: s.get("efficiency")),
                    "identical": all(s["identical"] is not False for s in ss) if ss[0]["identical"] is not None else None,
                    "acceptance": pooled.acceptance_by_position(), "by_source": _pooled_by_source(ss),
                    "parked_rounds": pooled.parked_rounds, "by_context": _pooled_by_context(ss)})
    return out


def _pooled_by_context(ss) -> dict:
    """Per context band that ran a round, every prompt's rounds pooled: rounds, parked rounds,
    tokens per round and acceptance by position."""
    out = {}
    for band, _ in CONTEXT_BANDS:
        total = GenerationStats()
        for c in [c for s in ss if (c := s.get("by_context", {}).get(band))]:
            total.merge(GenerationStats.from_json(c))
        if total.rounds or total.parked_rounds:
            out[band] = {"rounds": total.rounds, "parked": total.parked_rounds, "tpr": total.tokens_per_round,
                         "acceptance": total.acceptance_by_position()}
    return out


def _pooled_by_source(ss) -> dict:
    """Per draft source, every prompt's rounds pooled: tokens per round and acceptance by position."""
    out = {}
    for source in sorted({src for s in ss for src in s.get("by_source", {})}):
        total = _pooled([c for s in ss if (c := s.get("by_source", {}).get(source))])
        out[source] = {"rounds": total.rounds, "tpr": total.tokens_per_round,
                       "acceptance": total.acceptance_by_position()}
    return out


def _pooled(ss):
    """Every prompt's rounds in one GenerationStats: tokens per round and acceptance by position over
    all of them, so a prompt that ended early weighs by its rounds."""
    total = GenerationStats()
    for s in ss:
        total.merge(GenerationStats.from_counts(s["rounds"], s["accepted_per_position"], s["drafted_per_position"],
                                                s.get("parked_rounds", 0)))
    return total


def _print_table(record) -> None:
    rows = _aggregate(record)
    fmt = lambda v, f: "-" if v is None else format(v, f)
    _print_blas(record)
    print(f"{'suite':10} {'T':>4} {'setting':13} {'tok/s':>7} {'vs mlx-lm':>18} {'tok/round':>9} "
          f"{'bound':>6} {'eff':>5} {'same':>5}  acceptance by position")
    for r in rows:
        rng = f"{fmt(r['ratio'], '.2f')}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
        print(f"{r['suite']:10} {r['temperature']:>4} {r['setting']:13} {fmt(r['tps'], '.1f'):>7} {rng:>18} "
              f"{fmt(r['tpr'], '.2f'):>9} {fmt(r['bound'], '.2f'):>6} {fmt(r['efficiency'], '.2f'):>5} {same:>5}  {acc}")
        if len(r["by_source"]) > 1 or "copy" in r["by_source"]:  # accepted per round by source and position
            for source, c in r["by_source"].items():
                acc = " ".join(f"{a:.2f}" for a in c["acceptance"])
                print(f"{'':10} {'':>4} {'  ' + source:13} {c['rounds']:>7} rounds {'':>11}{fmt(c['tpr'], '.2f'):>9} "
                      f"{'':>6} {'':>5} {'':>5}  {acc}")
        if r["parked_rounds"] or set(r["by_context"]) - {"under_2k"}:  # by the context the rounds ran at
            for band, c in r["by_context"].items():
                acc = " ".join(f"{a:.2f}" for a in c["acceptance"])
                parked = f"{c['parked']} parked" if c["parked"] else ""
                print(f"{'':10} {'':>4} {'  ' + band:13} {c['rounds']:>7} rounds {parked:>11}{fmt(c['tpr'], '.2f'):>9} "
                      f"{'':>6} {'':>5} {'':>5}  {acc}")
    if not any(r["parked_rounds"] or set(r["by_context"]) - {"under_2k"} for r in rows):
        print("by context: every round under 2k tokens of context, none parked (--json: by_context)")
    c = record["cost_model"]
    tv = " ".join(f"Tv({k})={v * 1e3:.1f}ms" for k, v in c["Tv"].items())
    print(f"cost model: T1={c['T1'] * 1e3:.1f}ms {tv} Td={c['Td'] * 1e3:.2f}ms")
    plain = [r["plain"]["decode_tps"]["median"] for r in record["results"]]
    print(f"plain mlx-lm decode: {sorted(plain)[len(plain) // 2]:.1f} tok/s (median over prompts)")


def _plot(record, path: str) -> None:
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise DynoError("--plot needs plotly: pip install plotly kaleido") from None
    rows = [r for r in _aggregate(record) if r["setting"].startswith("mtp@") and "+" not in r["setting"]]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("speedup vs plain mlx-lm", "tokens per round"))
    palette = ["#2e9e6b", "#d9822b", "#3b6fd4", "#a23bd4", "#6b7280", "#c0392b", "#16a085", "#8e6c2b"]
    for i, (suite, temp) in enumerate(sorted({(r["suite"], r["temperature"]) for r in rows})):
        sel = [r for r in rows if (r["suite"], r["temperature"]) == (suite, temp)]
        ks = [int(r["setting"].split("@")[1]) for r in sel]
        name, color = f"{suite} T={temp}", palette[i % len(palette)]
        line = dict(legendgroup=name, mode="lines+markers", line=dict(color=color))
        fig.add_trace(go.Scatter(x=ks, y=[r["ratio"] for r in sel], name=name, **line), 1, 1)
        fig.add_trace(go.Scatter(x=ks, y=[r["bound"] for r in sel], name=f"{name}: cost-model bound",
                                 legendgroup=name, mode="lines", line=dict(color=color, dash="dot")), 1, 1)
        fig.add_trace(go.Scatter(x=ks, y=[r["tpr"] for r in sel], name=name, showlegend=False, **line), 1, 2)
    fig.add_hline(y=1.0, line=dict(color="#888", width=1), row=1, col=1)
    fig.update_xaxes(title_text="draft depth", dtick=1)
    fig.update_layout(title=f"Dyno on {Path(record['model']).name} ({record['machine']['backend']})", width=1000, height=420)
    base = path[:-5] if path.endswith((".html", ".png")) else path
    fig.write_html(base + ".html", include_plotlyjs=True)
    try:
        fig.write_image(base + ".png")
        print(f"wrote {base}.html and {base}.png", file=sys.stderr)
    except Exception as e:  # kaleido missing or unable to start: the HTML still stands
        print(f"wrote {base}.html (no PNG: {str(e).splitlines()[0] if str(e) else type(e).__name__})", file=sys.stderr)


def cmd_concurrent(args) -> int:
    """`dyno bench --concurrency 1,2,4,8`: the suite's prompts as N rows at once, four settings, paired."""
    from speculative import load_model
    from speculative.config import SamplingParams, SpecConfig
    from speculative.measure.batch_bench import concurrent_benchmark
    from speculative.depth import batched_policy, single_depth

    try:
        widths = [int(n) for n in args.concurrency.split(",")]
    except ValueError:
        raise DynoError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if any(n < 1 for n in widths) or args.pairs < 1:
        raise DynoError("--concurrency and --pairs must be at least 1")
    if args.draft_depth != "auto" and not args.draft_depth.isdigit():
        raise DynoError(f"--draft-depth must be a number or auto, got {args.draft_depth!r}")
    lm, spec = load_model(args.model or default_model(), mode="mtp", head_bits=args.mtp_head_bits, notify=notify,
                          draft_depth=SpecConfig.draft_depth, draft_vocab=args.draft_vocab)
    vocab = spec.draft_vocab
    serial_depth = single_depth(lm, args.draft_depth, vocab)
    policy = batched_policy(lm, args.draft_depth, vocab)
    pool = [item for suite in (SUITES if args.suite == "all" else [args.suite]) for item in SUITES[suite]]
    params = SamplingParams(temperature=args.temp[0], top_p=args.top_p if args.temp[0] else 1.0,
                            top_k=args.top_k if args.temp[0] else 0, max_tokens=args.max_tokens, seed=0)
    record = {"machine": _machine(), "model": lm.repo_id or str(lm.path), "quantization": lm.config.get("quantization"),
              "commit": _git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "settings": {"concurrency": widths, "suite": args.suite, "temperature": args.temp[0],
                           "max_tokens": args.max_tokens, "pairs": args.pairs, "draft_depth": args.draft_depth,
                           "serial_depth": serial_depth, "draft_vocab_tokens": vocab},
              "batch_costs": policy.costs.as_json() if policy.costs else None, "results": []}
    for n in widths:
        prompts = [encode(lm.tokenizer, pool[i % len(pool)]) for i in range(n)]
        print(f"[{n} concurrent] ...", file=sys.stderr, flush=True)
        res = concurrent_benchmark(lm, prompts, params, policy, serial_depth, pairs=args.pairs, draft_vocab=vocab)
        record["results"].append({"concurrency": n, "settings": res})
    record["acceptance"] = policy.acceptance()
    _print_concurrent(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _print_concurrent(record) -> None:
    _print_blas(record)
    print(f"{'clients':>7} {'setting':14} {'tok/s':>7} {'vs plain':>17} {'vs mlx-lm':>17} {'latency':>8} "
          f"{'TTFT':>7} {'same':>5}  depths (rounds)")
    for res in record["results"]:
        for name, s in res["settings"].items():
            ratio = lambda r: f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"  # noqa: E731
            same = {True: "yes", False: "NO", None: "-"}[s["identical"]]
            depths = " ".join(f"{k}:{n}" for k, n in s["depths"].items()) or "-"
            print(f"{res['concurrency']:>7} {name:14} {s['tokens_per_s']['median']:>7.1f} {ratio(s['vs_plain']):>17} "
                  f"{ratio(s['vs_mlx_lm']):>17} {s['latency_s']:>7.2f}s {s['ttft_s']:>6.3f}s {same:>5}  {depths}")
        best = max(res["settings"]["dyno plain"]["tokens_per_s"]["median"], res["settings"]["dyno serial"]["tokens_per_s"]["median"])
        print(f"{'':>7} drafting / best of (serial, plain): "
              f"{res['settings']['dyno drafting']['tokens_per_s']['median'] / best:.2f}x")
