"""The draft depth for this model on this machine: measured by `dyno tune`, else estimated.

Deeper drafts pay only while the acceptance at that position beats its verify cost, and that
cost depends on the machine (on the CPU backend Tv(k) grows much faster with k than on Metal),
so the best depth is stored per model and machine, and per draft vocabulary (a smaller one makes
each draft step cheaper, which can pay for a deeper draft).
"""

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx

from .cost_model import speedup_bound
from ..config import MAX_DRAFT_DEPTH
from ..heads.find import dyno_cache_dir
from ..loader import LoadedModel

# Acceptance at draft position i when nothing is measured yet: a prior, position 1 about 0.8
# and each further position about 0.75 of the previous (real heads: 0.93/0.86/0.75 at depth 3
# on Qwen3.8-27B, 0.87/0.72/0.63 on stock MLX per MTPLX's reports).
PRIOR_FIRST, PRIOR_DECAY = 0.8, 0.75


def prior_rates(n: int = MAX_DRAFT_DEPTH) -> List[float]:
    """The prior's acceptance at draft positions 1..n."""
    return [PRIOR_FIRST * PRIOR_DECAY**i for i in range(n)]

ESTIMATE_PROMPT = ('import os\nimport sys\n\n\ndef list_files(root, suffix=".py"):\n'
                   '    """Return the paths under root that end with suffix, sorted."""\n')


def tune_file() -> Path:
    return dyno_cache_dir() / "tune.json"


def machine_key(lm: LoadedModel, draft_vocab: Optional[int] = None) -> str:
    """Model folder + backend + CPU architecture + draft vocabulary (N tokens, or the whole one):
    what makes a stored depth valid."""
    return f"{lm.path.resolve()}|{mx.default_device()}|{platform.machine()}|draft_vocab={draft_vocab or 'full'}"


def stored(lm: LoadedModel, draft_vocab: Optional[int] = None) -> Optional[dict]:
    """The entry for this model, machine and draft vocabulary; else one stored before entries named
    the vocabulary (measured with the whole one: still a measured depth, until `dyno tune` again)."""
    try:
        table = json.loads(tune_file().read_text())
    except (OSError, ValueError):
        return None
    legacy = machine_key(lm).rsplit("|", 1)[0]
    return table.get(machine_key(lm, draft_vocab)) or table.get(legacy)


def store(lm: LoadedModel, depth: int, details: dict, draft_vocab: Optional[int] = None) -> None:
    """Record the best depth atomically (write a temp file, then rename)."""
    path = tune_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[machine_key(lm, draft_vocab)] = {"depth": depth, "draft_vocab": draft_vocab, **details}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune.")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)


def expected_tokens_per_round(acceptance: Sequence[float], k: int) -> float:
    """GenerationStats.tokens_per_round projected from acceptance rates, not counted: at depth k
    every round drafts positions 1..k, so 1 + accepted / rounds = 1 + the sum of acceptance_by_position
    over positions 1..k (the rates `acceptance` gives)."""
    return 1.0 + sum(acceptance[:k])


# Estimated speedups this close are one as far as a timing of a few seconds can tell.
SAME_WITHIN = 0.05


def best_by_cost(costs: dict, acceptance: Sequence[float]) -> int:
    """The depth maximising E(k) / (Tv(k)/T1 + k*Td/T1), or the shallowest within SAME_WITHIN of it:
    where the curve is flat, a shallower depth loses least if acceptance is lower than estimated."""
    score = {k: speedup_bound(expected_tokens_per_round(acceptance, k), costs["T1"], tv, costs["Td"], k)
             for k, tv in costs["Tv"].items()}
    top = max(score.values())
    return min(k for k, v in score.items() if v >= (1 - SAME_WITHIN) * top)


def measured_acceptance(lm: LoadedModel, prompt: Sequence[int], depth: int, tokens: int = 64,
                        draft_vocab: Optional[int] = None, drafter=None) -> Optional[list]:
    """Acceptance by position (GenerationStats') of one short greedy run at `depth` (None when too few
    rounds to say): the head's own acceptance instead of the prior. `drafter`: as engine.generate's."""
    from ..config import SamplingParams, SpecConfig
    from ..engine import generate
    from ..stats import GenerationStats

    stats = GenerationStats()
    spec = SpecConfig("mtp", depth, draft_vocab=draft_vocab)
    for event in generate(lm, list(prompt), SamplingParams(max_tokens=tokens), spec, drafter=drafter):
        stats.add(event)
    return stats.acceptance_by_position() if stats.rounds >= 8 else None
