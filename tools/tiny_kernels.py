"""Training-only CPU kernels for the Gated DeltaNet layers, exact up to float rounding.

transformers' reference torch path is correct but, on a CPU, two of its ops dominate a training step:
the depthwise `conv1d` backward and the batched `linalg.solve_triangular` (both run one small
LAPACK/oneDNN call per channel or per matrix). These replacements compute the same functions:
- causal depthwise conv as K shifted multiply-adds;
- the unit-lower-triangular solve as a product-form inverse, (I + N)^-1 = prod_k (I + (-N)^(2^k)), exact
  because the strictly lower N is nilpotent (N^64 = 0 for 64-row chunks).
They are swapped in only inside `training_kernels()`; evaluation, golden logits and export use the
untouched reference implementation. `check_against_reference()` asserts agreement before training.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref


def causal_conv1d_shift(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Same as `causal_conv1d_fn`: x [B, C, T], weight [C, K] -> silu(causal depthwise conv)."""
    _, _, seq_len = hidden_states.shape
    k = weight.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (k - 1, 0))
    out = sum(x[:, :, i : i + seq_len] * weight[:, i : i + 1] for i in range(k))
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype)


def _unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 for strictly lower N [..., C, C] by repeated squaring of -N."""
    c = strict_lower.shape[-1]
    inv = torch.eye(c, dtype=strict_lower.dtype) - strict_lower
    power = -strict_lower
    for _ in range(max(0, (c - 1).bit_length() - 1)):
        power = power @ power
        inv = inv + inv @ power
    return inv


def chunk_gated_delta_rule_fast(
    query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs,
):
    """transformers' `torch_chunk_gated_delta_rule` with the triangular solve replaced (see module doc)."""
    with torch.autocast("cpu", enabled=False):  # the recurrence stays fp32, as the reference intends
        return _chunk_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel)


def _chunk_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    initial_dtype = query.dtype
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query = ref.l2norm(query, dim=-1, eps=1e-6)
        key = ref.l2norm(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5

    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    num_chunks = (sequence_length + pad_size) // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)

    inv = _unit_lower_inverse(ut_system.tril(-1))  # solve_triangular(..., unitriangular=True) ignores the diagonal
    new_values, k_cumdecay = inv @ v_beta, inv @ decayed_k_beta

    state = torch.zeros(batch_size, num_v_heads, k_head_dim, v_head_dim) if initial_state is None else initial_state.to(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    outs = []
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(batch_size, num_v_heads, -1, v_head_dim)[:, :, :sequence_length]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)


@contextlib.contextmanager
def training_kernels():
    """Swap the fast kernels into modeling_qwen3_5 for the duration of the block, then restore."""
    saved = ref.causal_conv1d_fn, ref.torch_chunk_gated_delta_rule
    ref.causal_conv1d_fn, ref.torch_chunk_gated_delta_rule = causal_conv1d_shift, chunk_gated_delta_rule_fast
    try:
        yield
    finally:
        ref.causal_conv1d_fn, ref.torch_chunk_gated_delta_rule = saved


def check_against_reference(seed: int = 0) -> float:
    """Max abs difference (outputs and input grads) between fast and reference kernels on random data."""
    gen = torch.Generator().manual_seed(seed)
    B, T, Hk, Hv, D = 2, 100, 2, 4, 32
    q, k = (torch.randn(B, T, Hk, D, generator=gen) for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=gen)
    g = -torch.rand(B, T, Hv, generator=gen)
    beta = torch.rand(B, T, Hv, generator=gen)
    x = torch.randn(B, 24, T, generator=gen)
    w = torch.randn(24, 4, generator=gen)
    worst = 0.0
    for fast, slow, args in (
        (chunk_gated_delta_rule_fast, ref.torch_chunk_gated_delta_rule, (q, k, v, g, beta)),
        (causal_conv1d_shift, ref.causal_conv1d_fn, (x, w)),
    ):
        outs = []
        for fn in (fast, slow):
            leaves = [a.clone().requires_grad_(True) for a in args]
            kw = {"use_qk_l2norm_in_kernel": True} if fn in (chunk_gated_delta_rule_fast, ref.torch_chunk_gated_delta_rule) else {"activation": "silu"}
            y = fn(*leaves, **kw)
            y = y[0] if isinstance(y, tuple) else y
            y.square().sum().backward()
            outs.append([y.detach()] + [a.grad for a in leaves])
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(*outs)))
    return worst
