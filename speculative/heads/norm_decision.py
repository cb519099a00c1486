"""Which of a head's norms still need the +1, decided against the model when provenance cannot say.

An MLX conversion that kept its head, or a drafter repo, may have shifted all, some or none of the
head's seven norms, and their trained values cannot tell: a gamma of 0.49 is as plausible stored
raw as shifted (a mean-below-0.5 test misread such gammas elsewhere and halved acceptance). The
model can tell. The trunk runs once over a fixed text; the head, with its norms read each possible
way, drafts the token after next at every position; the way whose draft distributions are closest
to the trunk's own (mean KL divergence) is the one kept. Ties keep the likelier way: all shifted,
then none.

The ways: the head's own norms (pre-fc and final) and its layer's norms, each stored shifted or
not. The q/k norms go with the layer norms: converters shift both by one suffix list (mlx-lm's
misses the head's own norms), and drafts barely depend on them over a short text (they set the
attention's temperature), so drafting cannot tell them apart: on the bundled model, reading the
q/k norms wrong moved the divergence by 0.08 to 0.24 nats either way, reading the head's or layer
norms wrong by 0.66 to 5.21 (`python tools/norm_readings.py`).
"""

from typing import Dict, Tuple

import mlx.core as mx

from .mtp import ALL_NORMS, NORM_RE, HeadWeights, MTPHead, shift_norms

# Code and prose: the texts the Qwen3.5 family (and the bundled model, trained on Python) predicts well.
CALIBRATION_TEXT = (
    "def read_config(path):\n"
    '    """Read a JSON config file and return it as a dict."""\n'
    "    with open(path) as f:\n"
    "        return json.load(f)\n\n\n"
    "def main():\n"
    '    config = read_config("config.json")\n'
    "    for key, value in config.items():\n"
    "        print(key, value)\n"
)
CALIBRATION_TOKENS = 64
# Groups shifted at load, likeliest first: none (stored shifted), all (stored raw), then the mixes.
CANDIDATES = [(), ALL_NORMS, ("top",), ("layer", "qk")]
GROUP_NAMES = {"top": "pre-fc and final norms", "layer": "layer norms", "qk": "q/k norms"}
CLOSE = 1.25  # a runner-up within this factor of the best divergence: too close to call


def _norms(weights: HeadWeights, groups) -> Dict[str, mx.array]:
    return {k: v for k, v in shift_norms(weights.tensors, groups).items() if NORM_RE.match(k)}


def decide_norms(target, tokenizer, head: MTPHead, weights: HeadWeights) -> Tuple[tuple, dict]:
    """(groups to shift, the decision for provenance); `head` is built from `weights` as stored and
    keeps the norms of the last candidate tried: load the chosen ones after."""
    ids = tokenizer.encode(CALIBRATION_TEXT)[:CALIBRATION_TOKENS]
    tokens = mx.array(ids)[None]
    hidden = target.hidden(tokens, target.make_cache())
    trunk = _log_softmax(target.lm_head(hidden[:, 1:]))  # the trunk's next token after t_{p+1}
    embeddings = target.embed(tokens[:, 1:])
    scores = []
    for groups in CANDIDATES:
        head.load_weights(list(_norms(weights, groups).items()), strict=False)
        drafts = _log_softmax(target.lm_head(head(embeddings, hidden[:, :-1], head.make_cache())))
        # row p drafts t_{p+2} from (t_{p+1}, h_p): KL(trunk || draft), averaged over the rows
        scores.append(mx.mean(mx.sum(mx.exp(trunk) * (trunk - drafts), axis=-1)))
        mx.eval(scores[-1])  # one candidate's [T, V] rows in memory at a time
    scores = [round(s, 4) for s in mx.stack(scores).tolist()]
    order = sorted(range(len(CANDIDATES)), key=lambda i: (scores[i], i))  # ties: the likelier first
    best, runner_up = order[0], order[1]
    return CANDIDATES[best], {
        "method": "calibration", "shifted_at_load": list(CANDIDATES[best]), "rows": len(ids) - 1,
        "divergence": scores[best], "runner_up": {"shifted_at_load": list(CANDIDATES[runner_up]),
                                                  "divergence": scores[runner_up]},
    }


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def describe(groups) -> str:
    """How the head's norms were found stored, in words."""
    if not groups:
        return "stored shifted (all seven)"
    if tuple(groups) == ALL_NORMS:
        return "stored zero-centred (all seven), shifted now"
    raw = " and ".join(GROUP_NAMES[g] for g in groups)
    return f"stored mixed: {raw} zero-centred (shifted now), the rest already shifted"


def notice(source: str, decision: dict) -> str:
    """The load notice naming the decision; it warns when the runner-up came close."""
    best, second = decision["divergence"], decision["runner_up"]["divergence"]
    line = (f"dyno: MTP head in {source}: norms {describe(decision['shifted_at_load'])}, decided by "
            f"drafting {decision['rows']} positions each way (divergence from the model {best:.2f} nats, "
            f"next best {second:.2f})")
    if second < best * CLOSE:
        line += "; too close to call: drafting may be poor, pass --mtp-head with a head folder to be sure"
    return line
