"""Held-out evaluation of dyno-tiny: losses, the acceptance proxy and a greedy speculative simulation."""

from __future__ import annotations

import math

import torch

from tiny_model import TinyMTPModel, losses


@torch.no_grad()
def heldout_losses(model: TinyMTPModel, windows: torch.Tensor, batch: int = 8, head_depth: int = 2) -> dict:
    """Mean trunk/head CE and the teacher-forced acceptance proxy over eval windows [N, L + 1 + depth]."""
    model.eval()
    sums: dict[str, float] = {}
    for i in range(0, len(windows), batch):
        out = losses(model, windows[i : i + batch], head_depth)
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + v.item() * len(windows[i : i + batch])
    model.train()
    return {k: v / len(windows) for k, v in sums.items()}


@torch.no_grad()
def greedy_continuations(model: TinyMTPModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Trunk-only greedy decoding with transformers' cache (what plain decoding outputs)."""
    model.eval()
    out = model.lm.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            attention_mask=torch.ones_like(prompts), pad_token_id=0, eos_token_id=None)
    model.train()
    return out


@torch.no_grad()
def speculative_simulation(model: TinyMTPModel, seqs: torch.Tensor, prompt_len: int, depth: int = 3) -> dict:
    """Greedy draft/verify rounds replayed on the trunk's own greedy continuations.

    For every row p the head drafts a chain d1..d_depth exactly as an engine would (row p fed t_{p+1} and
    h_p at position p, then its own argmax and post-norm hidden). A round that starts after committing
    t_n uses the chain of row p = n - 1; drafts are kept while they equal the greedy tokens t_{n+1}, ...
    Returns, for each depth 1..depth, the engine's two figures (speculative.stats.GenerationStats):
    tokens per round = 1 + accepted drafts / rounds, and acceptance by position = accepted there /
    rounds that drafted it (here every round, as every simulated round drafts all k).
    """
    model.eval()
    logits, hidden = model.trunk(seqs[:, :-1])
    chains, _ = model.head_chain(hidden, [seqs[:, 1:]] * depth, greedy_tail=True)
    drafts = torch.stack([c.argmax(-1) for c in chains], dim=-1)  # [B, T-1, depth]: drafts for t_{p+2..}
    # The greedy reference is the trunk's full-pass argmax (equals the continuation up to float ties).
    greedy = torch.cat([seqs[:, :1], logits.argmax(-1)], dim=1)
    model.train()
    result = {"reference_mismatch": (greedy[:, prompt_len + 1 :] != seqs[:, prompt_len + 1 :]).float().mean().item()}
    total = seqs.shape[1]
    for k in range(1, depth + 1):
        accepted, rounds = [0] * k, 0
        for b in range(seqs.shape[0]):
            n = prompt_len  # t_n is the first token sampled from the prefill
            while n + k < total:
                a = 0
                while a < k and drafts[b, n - 1, a] == greedy[b, n + 1 + a]:
                    a += 1
                for i in range(a):
                    accepted[i] += 1
                rounds += 1
                n += a + 1
        reached = [rounds] + accepted[:-1]  # position i is judged only if positions < i were all kept
        result[f"depth{k}"] = {
            "tokens_per_round": 1 + sum(accepted) / max(rounds, 1),
            "acceptance_by_position": [a / max(rounds, 1) for a in accepted],
            "conditional_acceptance_by_position": [a / max(r, 1) for a, r in zip(accepted, reached)],
            "rounds": rounds,
        }
    return result


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
