"""What a seed costs in acceptance: tokens per round of seeded requests (drafts coupled by position,
plain mlx-lm's text) against unseeded ones (the lossless min(1, p/q) rule), paired on the same prompts.

    python tools/seeded_acceptance.py [--model PATH] [--depth 3] [--runs 8] [--tokens 96]

Counts, not times: the figures do not depend on the machine's load.
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyno_ui.paths import BUNDLED_MODEL  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.engine import generate  # noqa: E402
from speculative.events import Round  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.measure.suites import SUITES, encode  # noqa: E402


def per_round(lm, prompts, temperature, depth, runs, tokens, seeded):
    """Tokens per round over every prompt and run (run r: seed r, or the engine's key from random.seed(r))."""
    rounds = emitted = 0
    for prompt in prompts:
        for r in range(runs):
            random.seed(r)
            params = SamplingParams(temperature=temperature, max_tokens=tokens, seed=r if seeded else None)
            for e in generate(lm, prompt, params, SpecConfig(mode="mtp", draft_depth=depth)):
                if isinstance(e, Round):
                    rounds += 1
                    emitted += e.accepted + 1
    return emitted / rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    args = ap.parse_args()
    lm = load_checkpoint(args.model, mode="mtp")
    prompts = [encode(lm.tokenizer, item) for suite in SUITES.values() for item in suite]
    print(f"| temperature | unseeded (lossless rule) | seeded (coupled) | seeded / unseeded |")
    print("|---|---|---|---|")
    for t in (float(x) for x in args.temperatures.split(",")):
        free = per_round(lm, prompts, t, args.depth, args.runs, args.tokens, seeded=False)
        coupled = per_round(lm, prompts, t, args.depth, args.runs, args.tokens, seeded=True)
        print(f"| {t} | {free:.2f} | {coupled:.2f} | {coupled / free:.3f} |", flush=True)


if __name__ == "__main__":
    main()
