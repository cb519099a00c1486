"""The reference every exactness test holds Dyno against: mlx-lm's own plain decoding."""

import mlx.core as mx
from mlx_lm.generate import generate_step


def plain_greedy(lm, prompt, n, prefill_step=2048, stop_at_eos=True):
    """mlx-lm's own greedy decoding (cut after EOS): the reference speculative runs must equal."""
    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, prefill_step_size=prefill_step):
        out.append(int(t))
        if stop_at_eos and out[-1] in lm.eos_token_ids:
            break
    return out


_runs = {}  # (id(lm), prompt, prefill step) -> (lm, its longest plain greedy run, EOS not cut)


def plain_greedy_prefix(lm, prompt, n, prefill_step=2048, stop_at_eos=True):
    """plain_greedy from one run per model, prompt and prefill step: a greedy token never depends on
    how many follow, so a shorter reference is the longest run's first n tokens (then cut after EOS)."""
    key = (id(lm), tuple(prompt), prefill_step)
    tokens = _runs.get(key, (lm, []))[1]  # the entry holds lm, so its id is never another model's
    if len(tokens) < n:
        tokens = plain_greedy(lm, prompt, n, prefill_step, stop_at_eos=False)
        _runs[key] = (lm, tokens)
    out = tokens[:n]
    if stop_at_eos:
        ends = [i for i, t in enumerate(out) if t in lm.eos_token_ids]
        out = out[: ends[0] + 1] if ends else out
    return out


def template_tokens(lm, messages, tools=None, thinking=False):
    """The chat template's prompt token ids, with the generation prompt."""
    return lm.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            enable_thinking=thinking)


def plain_constrained(lm, prompt, constraint, n, logit_bias=None):
    """mlx-lm's generate_step, greedy, with the constraint's processor (and bias): the reference tokens."""
    from speculative.config import SamplingParams
    from speculative.round.processors import processors_for

    params = SamplingParams(max_tokens=n, constraint=constraint, logit_bias=logit_bias)
    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, logits_processors=processors_for(params)):
        out.append(int(t))
        if out[-1] in lm.eos_token_ids:
            break
    return out
