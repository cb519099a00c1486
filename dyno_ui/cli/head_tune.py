"""`dyno head tune`'s run: data, acceptance before, the tune with its progress bar (resumed from its
checkpoint), acceptance after, then the head folder with its card, written in one rename."""

import sys
from pathlib import Path

from .common import notify

EVAL_TOKENS = 128  # tokens each held-out prompt is continued for, before and after
PROMPT_TOKENS = 64  # tokens of a held-out prompt cut from a window or document


def tune(lm, args, settings, out: Path) -> int:
    """Tune lm's head as `settings` say and write it to `out`; Ctrl-C keeps a checkpoint the same
    command resumes from."""
    from tqdm import tqdm

    from speculative.measure import head_tune as tuning
    from speculative.measure.corpus import eval_prompts, read_corpus
    from speculative.measure.head_eval import acceptance
    from speculative.heads.health import HeadHealth
    from speculative.heads.mtp import build_head, write_head_folder

    corpus = read_corpus(args.data, lm.tokenizer)
    base, start = lm.head_source, _starting_weights(lm)
    state = tuning.state_dir(out)
    sig = tuning.signature(lm.path, lm.head_source, corpus, settings)
    if corpus.prompts:
        notify(f"dyno: the model continues the {len(corpus.prompts)} prompts of {args.data} "
               f"({settings.continue_tokens} tokens each, "
               f"{'greedy' if not settings.continue_temperature else f'temperature {settings.continue_temperature:g}'})")
    stream = tuning.stream_cached(state, sig, lambda: tuning.token_stream(lm, corpus, settings))
    from speculative.backend.memory import device_memory

    run = tuning.Tune(lm, stream, settings, state, sig, memory=device_memory())
    if args.eval_data:
        prompts = eval_prompts(read_corpus(args.eval_data, lm.tokenizer), args.eval_prompts, PROMPT_TOKENS)
    else:
        prompts = [list(map(int, w[:PROMPT_TOKENS])) for w in run.held[: args.eval_prompts]]
    if run.resume():
        notify(f"dyno: resuming the tune from step {run.step} of {settings.steps} ({state})")
    notify(f"dyno: tuning the MTP head from {lm.head_source}: {len(run.train)} windows of {settings.seq_len} tokens "
           f"({len(run.held)} held out), {run.batch} per step, {settings.steps} steps; checkpoints in {state}")
    before = acceptance(lm, prompts, settings.depth, max_tokens=EVAL_TOKENS)
    notify(f"dyno: before: {_line(before)}")

    if run.step < settings.steps:  # a tune whose steps are all done (a late failure before) needs no targets
        with tqdm(total=len(run.train), desc="trunk targets", unit="win", file=sys.stderr, leave=False) as bar:
            for done, _ in run.prepare(device_memory() // 8):
                bar.update(done - bar.n)
    bar = tqdm(total=settings.steps, initial=run.step, desc="tune", unit="step", file=sys.stderr)
    try:
        estimate = None
        for p in run.run():
            estimate = p.estimate or estimate
            bar.set_postfix_str(f"loss {p.loss:.4f}" + (
                f", held-out acceptance {'/'.join(f'{a:.2f}' for a in estimate)}" if estimate else ""))
            bar.update(1)
    except KeyboardInterrupt:
        run.settle()  # a stop inside a step goes back to its start
        run.checkpoint()  # the steps done so far are kept: the same command goes on from here
        bar.close()
        notify(f"dyno: tune stopped at step {run.step}; run the same command to resume ({state})")
        raise
    bar.close()
    try:
        weights = tuning.tuned_weights(run, start, f"dyno head tune of {lm.head_source}")
        lm.head = build_head(lm.target.args, weights, None, 16)
        lm.head_health = HeadHealth()
        after = acceptance(lm, prompts, settings.depth, max_tokens=EVAL_TOKENS)
        notify(f"dyno: after: {_line(after)}")
        info = {"model": str(lm.path), "base_head": base, "data": str(args.data),
                "data_sha256": corpus.sha256, "tokens": len(stream), "windows": len(run.train) + len(run.held),
                "batch": run.batch, "settings": sig["settings"],
                "eval_data": args.eval_data or "held-out windows of --data",
                "eval_prompts": len(prompts), "eval_tokens": EVAL_TOKENS,
                "before": before.as_dict(), "after": after.as_dict(), "log": run.log}
        write_head_folder(out, weights, lm.text_config, extra={"tune": {k: v for k, v in info.items() if k != "log"}},
                          files={"README.md": tuning.card(info), "tune_log.json": _json(run.log)})
    except BaseException:
        # The last step's checkpoint is the resume point on purpose: the same command writes the head
        # without training again.
        notify(f"dyno: the tuned head is kept in {state} (step {run.step}); run the same command to write it, "
               f"or delete that folder to start over")
        raise
    tuning.finish(state)
    print(f"MTP head written to {out}: {after.stats.tokens_per_round:.3f} tokens per round at depth "
          f"{settings.depth} (before {before.stats.tokens_per_round:.3f}); use it with --mtp-head {out}")
    return 0


def _starting_weights(lm):
    """The starting head's tensors as the module holds them (the tuned head keeps their dtypes)."""
    from mlx.utils import tree_flatten

    from speculative.heads.mtp import HeadWeights

    return HeadWeights(dict(tree_flatten(lm.head.parameters())), True, lm.head_source)


def _line(r) -> str:
    return (f"{r.stats.tokens_per_round or 1.0:.3f} tokens per round at depth {r.depth}, acceptance by position "
            + " ".join(f"{a:.3f}" for a in r.stats.acceptance_by_position()))


def _json(value) -> str:
    import json

    return json.dumps(value, indent=1) + "\n"
