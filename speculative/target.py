"""The trunk adapter: an mlx-lm Qwen3.5 model seen as (tokens, cache) -> (logits, hidden).

`hidden` is the trunk's post-final-norm state (what goes into lm_head), which is what the MTP
head consumes. `verify` runs the same layers but records, for every Gated DeltaNet layer, what
rollback needs (see cache.GDNTape); mlx-lm's own forward keeps only the final recurrent state.
"""

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, gather_last_axis, scaled_dot_product_attention
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from .attention_kernels import on_metal
from .rollback import GDNTape, Replay


def kernel_path(layer) -> bool:
    """True when mlx-lm's gated_delta_update would take its Metal kernel for `layer` (only the final
    state comes out). mlx-lm exposes no predicate, so this is its dispatch rule as of 0.32.2; a test
    holds it to where mlx-lm's own update goes for each shape (tests/engine/test_gdn_kernel.py)."""
    return not layer.training and on_metal() and layer.head_k_dim >= 32 and layer.head_k_dim % 32 == 0


def _recurrence_with_states(q, k, v, a, b, layer, state):
    """The gated delta rule over T steps, also returning the state after every step.

    Portable path: the same compiled step mlx-lm's `gated_delta_ops` loops over, so outputs
    are identical to its forward; the per-step states come for free.
    """
    from mlx_lm.models.gated_delta import _gated_delta_step_ops  # pinned mlx-lm minor

    beta = mx.sigmoid(b)
    g = compute_g(layer.A_log, a, layer.dt_bias)
    if (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


def _gdn_inputs(layer, x: mx.array, mask, conv_state: mx.array):
    """mlx-lm's GatedDeltaNet.__call__ up to the recurrence, op for op: (q, k, v, a, b, z, conv_input)."""
    B, S, _ = x.shape
    qkv = layer.in_proj_qkv(x)
    z = layer.in_proj_z(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    b = layer.in_proj_b(x)
    a = layer.in_proj_a(x)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+S, C]
    conv_out = nn.silu(layer.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    return q, k, v, a, b, z, conv_input


def _gdn_output(layer, out: mx.array, z: mx.array) -> mx.array:
    B, S = out.shape[:2]
    out = layer.out_proj(layer.norm(out, z).reshape(B, S, -1))
    if getattr(layer, "sharding_group", None) is not None:  # tensor parallel: sum the ranks' heads, as mlx-lm
        out = mx.distributed.all_sum(out, group=layer.sharding_group)
    return out


def linear_layer(layer, h: mx.array, conv_state: mx.array, state: mx.array):
    """A whole Gated DeltaNet decoder layer on the portable path, as a pure function of its inputs
    (so that it compiles): (h after the layer, conv input rows, the state after every step)."""
    gdn = layer.linear_attn
    q, k, v, a, b, z, conv_input = _gdn_inputs(gdn, layer.input_layernorm(h), None, conv_state)
    out, states = _recurrence_with_states(q, k, v, a, b, gdn, state)
    h = h + _gdn_output(gdn, out, z)
    return (h + layer.mlp(layer.post_attention_layernorm(h)), conv_input, *states)


def compilelinear_layer(layer) -> Callable:
    """Decoder layer `layer` (Gated DeltaNet) as one mx.compile'd call of (h, conv window, state)."""
    # inputs=layer.state: the compiled function follows the weights if they are replaced.
    return mx.compile(partial(linear_layer, layer), inputs=layer.state)


# Random inputs the first-use probe tries besides the caller's own: the caller's may be degenerate
# (the cost model verifies one token repeated, so the first layer sees identical rows).
PROBE_INPUTS = 3


def _like(x: mx.array, key: mx.array) -> mx.array:
    """Random values shaped like `x`: its per-feature mean plus noise of its standard deviation
    (unit where `x` is constant), so that every row differs but the scale is a real activation's."""
    xf = x.astype(mx.float32)
    mean = mx.mean(xf, axis=tuple(range(x.ndim - 1)), keepdims=True)  # per feature (last axis)
    std = mx.std(xf)
    std = mx.where(std > 0, std, 1.0)
    return (mean + std * mx.random.normal(x.shape, key=key)).astype(x.dtype)


def _same_outputs(layer, compiled: Callable, inputs: tuple, plain_out=None) -> List[mx.array]:
    """Scalar bools, one per output (and one for their count): compiled == plain ops on `inputs`."""
    got = compiled(*inputs)
    want = linear_layer(layer, *inputs) if plain_out is None else plain_out
    return [mx.array_equal(x, y) for x, y in zip(got, want)] + [mx.array(len(got) == len(want))]


def _probe(layer, compiled: Callable, inputs: tuple, plain_out) -> bool:
    """Is `compiled` bit-identical to the plain ops on the caller's `inputs` (whose plain outputs
    are `plain_out`) and on PROBE_INPUTS random inputs like them? One host sync."""
    same = _same_outputs(layer, compiled, inputs, plain_out)
    key = mx.random.key(0)  # fixed: the probe is reproducible and leaves the global RNG alone
    for _ in range(PROBE_INPUTS):
        key, *subs = mx.random.split(key, len(inputs) + 1)
        same += _same_outputs(layer, compiled, tuple(_like(x, k) for x, k in zip(inputs, subs)))
    return mx.all(mx.stack(same)).item()


def _initial_state(layer, cache, B: int, dtype):
    """The layer's (conv window, recurrent state), zeros before its first token."""
    conv = cache[0]
    if conv is None:
        conv = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=dtype)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), mx.float32)
    return conv, state


def _gdn_forward(layer, x: mx.array, mask, cache) -> Tuple[mx.array, GDNTape]:
    """mlx-lm's GatedDeltaNet.__call__, op for op, keeping a rollback tape (masks, Metal kernel)."""
    conv_state, state_before = _initial_state(layer, cache, x.shape[0], x.dtype)
    q, k, v, a, b, z, conv_input = _gdn_inputs(layer, x, mask, conv_state)
    if kernel_path(layer):
        # Fast kernel keeps only the final state: record the step inputs and replay on commit.
        out, final = gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, state_before)
        tape = GDNTape(cache, conv_input, state_before, None, Replay(q, k, v, a, b, layer))
    else:
        out, states = _recurrence_with_states(q, k, v, a, b, layer, state_before)
        final = states[-1]
        tape = GDNTape(cache, conv_input, state_before, states, None)
    _advance(layer, cache, conv_input, final)
    return _gdn_output(layer, out, z), tape


def _advance(layer, cache, conv_input: mx.array, final: mx.array) -> None:
    """Leave the layer's cache after every token of the pass: the last K-1 conv rows, the final state."""
    cache[0] = conv_input[:, -(layer.conv_kernel_size - 1) :, :]
    cache[1] = final
    cache.advance(conv_input.shape[1] - (layer.conv_kernel_size - 1))


def _from_previous_stage(body, h: mx.array) -> mx.array:
    """Pipeline parallel, as mlx-lm's Qwen3_5TextModel: the last rank runs the first layers; every
    other rank starts from the output of the rank above it. One process: `h` itself."""
    if body.pipeline_rank < body.pipeline_size - 1:
        h = mx.distributed.recv_like(h, body.pipeline_rank + 1)
    return h


def _to_next_stage(body, h: mx.array) -> mx.array:
    """Hand this stage's output down the pipeline; rank 0's (the last layers') reaches every rank,
    so every rank has the final hidden state (and the MTP head can run on each)."""
    if body.pipeline_rank != 0:
        h = mx.distributed.send(h, (body.pipeline_rank - 1) % body.pipeline_size)
    if body.pipeline_size > 1:
        h = mx.distributed.all_gather(h)[: h.shape[0]]
    return h


class MRoPE:
    """Where the full-attention rows of a prompt with images sit (Qwen3.5-VL's 3-axis M-RoPE).

    The prompt's rows take mlx-vlm's 3-axis positions [3, n]; every row at cache offset p >= n
    (the prompt's last generated tokens, drafts, verify rows) sits at p + delta on all three axes,
    so draft, verify, accept and rollback keep counting by the cache offset alone. Text-only
    requests have none (None): mlx-lm's own layers run, with its 1-D RoPE.
    """

    def __init__(self, rotary, prompt: mx.array, delta: int):
        self.rotary = rotary  # mlx-vlm's Qwen3_5RotaryEmbedding for the text's rotary dims (apply_rotary)
        self.prompt = prompt  # [3, n] int32
        self.delta = int(delta)  # rope_delta: max prompt position + 1 - n (negative for an image)

    def positions(self, start, length: int) -> mx.array:
        """[3, B, length] positions of the cache rows start .. start + length - 1; `start` an int (B = 1)
        or a batch cache's [B] offsets (mlx-lm's BatchKVCache, a row's offset its own position)."""
        n = self.prompt.shape[-1]
        idx = mx.array(start).reshape(-1, 1) + mx.arange(length)[None]  # [B, length]
        inside = mx.take(self.prompt, mx.minimum(idx, n - 1), axis=1)  # [3, B, length]
        return mx.where(idx < n, inside, idx + self.delta).astype(mx.int32)

    def beside(self, ropes: Sequence[Optional["MRoPE"]]) -> "MRoPE":
        """The positions of a batch whose rows' own are `ropes` (this one among them; None: a text row)."""
        return self if len(ropes) == 1 else RowsRoPE(ropes)

    def rotate(self, attn, queries: mx.array, keys: mx.array, offset) -> Tuple[mx.array, mx.array]:
        """Queries and keys [B, heads, L, D] of the cache rows from `offset` on, turned to their positions."""
        return self.rotary.apply_rotary(queries, keys, self.positions(offset, queries.shape[2]), unsqueeze_dim=1)

    def attention(self, attn, x: mx.array, mask, cache) -> mx.array:
        """mlx-lm's Qwen3-Next gated attention op for op, with M-RoPE at these positions for its RoPE."""
        B, L, _ = x.shape
        queries, gate = mx.split(attn.q_proj(x).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        keys, values = attn.k_proj(x), attn.v_proj(x)
        queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
        keys = attn.k_norm(keys.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.rotate(attn, queries, keys, cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))

    def layer(self, layer, x: mx.array, mask, cache) -> mx.array:
        """A full-attention decoder layer (trunk or MTP head) as mlx-lm's DecoderLayer, at these positions."""
        h = x + self.attention(layer.self_attn, layer.input_layernorm(x), mask, cache)
        return h + layer.mlp(layer.post_attention_layernorm(h))


class RowsRoPE(MRoPE):
    """A batch whose rows sit at their own positions: an image prompt's row at its M-RoPE positions, a
    text row at mlx-lm's 1-D RoPE, computed as mlx-lm computes it, so a text row beside an image row
    has the bits it has without one (both turns are computed for every row; each row keeps its own)."""

    def __init__(self, ropes: Sequence[Optional[MRoPE]]):
        image = next(r for r in ropes if r is not None)
        self.rotary = image.rotary
        width = max(r.prompt.shape[-1] for r in ropes if r is not None)
        self.prompt = mx.stack([mx.zeros((3, width), mx.int32) if r is None else  # [3, B, width]
                                mx.pad(r.prompt, [(0, 0), (0, width - r.prompt.shape[-1])]) for r in ropes], axis=1)
        self.lengths = mx.array([0 if r is None else r.prompt.shape[-1] for r in ropes])[:, None]  # [B, 1]
        self.deltas = mx.array([0 if r is None else r.delta for r in ropes])[:, None]
        self.images = mx.array([r is not None for r in ropes])[:, None, None, None]

    def positions(self, start, length: int) -> mx.array:
        idx = mx.array(start).reshape(-1, 1) + mx.arange(length)[None]  # [B, length]
        width = self.prompt.shape[-1]
        inside = mx.take_along_axis(self.prompt, mx.clip(idx, 0, width - 1)[None], axis=2)  # [3, B, length]
        return mx.where(idx < self.lengths, inside, idx + self.deltas).astype(mx.int32)

    def rotate(self, attn, queries: mx.array, keys: mx.array, offset) -> Tuple[mx.array, mx.array]:
        turned_q, turned_k = super().rotate(attn, queries, keys, offset)
        return (mx.where(self.images, turned_q, attn.rope(queries, offset=offset)),
                mx.where(self.images, turned_k, attn.rope(keys, offset=offset)))


class Target:
    """A loaded mlx-lm Qwen3.5-family model, exposed as the trunk the engine drafts against."""

    def __init__(self, model: nn.Module, compile_layers: bool = True,
                 compiler: Callable = compilelinear_layer):
        self.model = model
        self.text = model.language_model  # TextModel: .model (layers + norm), lm_head
        self.body = self.text.model
        self.args = self.text.args
        self.compile_layers = compile_layers  # False: the verify pass as plain ops throughout
        self.compiler = compiler  # decoder layer -> its compiled call (tests pass inexact ones)
        self._compiled: Dict[int, Any] = {}  # layer index -> compiled Gated DeltaNet decoder layer
        self._exact: Dict[tuple, bool] = {}  # (layer, input shape and dtypes) -> compiled is bit-identical

    def make_cache(self) -> List[Any]:
        return self.model.make_cache()

    def embed(self, tokens: mx.array) -> mx.array:
        return self.body.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.body.embed_tokens.as_linear(hidden)
        logits = self.text.lm_head(hidden)
        if getattr(self.text, "sharding_group", None) is not None:  # tensor parallel: a vocabulary slice per rank
            logits = gather_last_axis(logits, self.text.sharding_group)
        return logits

    def hidden(self, tokens: mx.array, cache, embeddings: Optional[mx.array] = None,
               rope: Optional[MRoPE] = None) -> mx.array:
        """Post-norm hidden states [B, T, H]; the same ops as mlx-lm's own forward.

        `embeddings` [B, T, H] replace the tokens' (an image's rows); with `rope` the full-attention
        layers take its M-RoPE positions (one process only: images are not split across ranks).
        """
        if rope is None:
            return self.body(tokens, cache, input_embeddings=embeddings)
        body = self.body
        h = embeddings if embeddings is not None else body.embed_tokens(tokens)
        fa_mask = create_attention_mask(h, cache[body.fa_idx])
        ssm_mask = create_ssm_mask(h, cache[body.ssm_idx])
        for layer, c in zip(body.pipeline_layers, cache):
            h = layer(h, mask=ssm_mask, cache=c) if layer.is_linear else rope.layer(layer, h, fa_mask, c)
        return body.norm(h)

    def positioned(self, rope: MRoPE) -> "PositionedTrunk":
        """The trunk as mlx-lm's generate_step calls a model, with `rope`'s positions."""
        return PositionedTrunk(self, rope)

    def verify(self, tokens: mx.array, cache, rope: Optional[MRoPE] = None) -> Tuple[mx.array, mx.array, List[GDNTape]]:
        """Forward [B, T] tokens keeping rollback tapes: (logits, hidden, tapes); `rope` as in `hidden`."""
        body = self.body
        h = body.embed_tokens(tokens)
        # A pipeline stage may hold no layer of a kind (mlx-lm sets its index to None then).
        fa_mask = create_attention_mask(h, cache[body.fa_idx]) if body.fa_idx is not None else None
        ssm_mask = create_ssm_mask(h, cache[body.ssm_idx]) if body.ssm_idx is not None else None
        h = _from_previous_stage(body, h)
        tapes = []
        for i, (layer, c) in enumerate(zip(body.pipeline_layers, cache)):
            if not layer.is_linear:
                h = layer(h, mask=fa_mask, cache=c) if rope is None else rope.layer(layer, h, fa_mask, c)
            elif self.compile_layers and ssm_mask is None and not kernel_path(layer.linear_attn):
                # The compiled layer takes no mask, and the Metal kernel path keeps replay tapes.
                h, tape = self._linear(i, layer, h, c)
                tapes.append(tape)
            else:
                r, tape = _gdn_forward(layer.linear_attn, layer.input_layernorm(h), ssm_mask, c)
                tapes.append(tape)
                h = h + r
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = body.norm(_to_next_stage(body, h))
        return self.lm_head(hidden), hidden, tapes

    def _linear(self, i: int, layer, h: mx.array, cache) -> Tuple[mx.array, GDNTape]:
        """Decoder layer i (Gated DeltaNet) in the verify pass, compiled where that is exact.

        One compiled call per layer instead of some sixty small ops, each with its Python cost.
        mx.compile fuses elementwise ops, which may round differently on some backend, and maybe
        only on some inputs: the first call for each input shape compares the compiled outputs with
        the plain ones bit for bit, on the caller's input and on random ones like it (the caller's
        may be degenerate), and where any differ the plain path is kept.
        """
        gdn = layer.linear_attn
        conv, state = _initial_state(gdn, cache, h.shape[0], h.dtype)
        key = (i, h.shape, h.dtype, state.dtype)
        if i not in self._compiled:
            self._compiled[i] = self.compiler(layer)
        if key not in self._exact:
            out = linear_layer(layer, h, conv, state)
            self._exact[key] = _probe(layer, self._compiled[i], (h, conv, state), out)
        elif self._exact[key]:
            out = self._compiled[i](h, conv, state)
        else:
            out = linear_layer(layer, h, conv, state)
        h, conv_input, states = out[0], out[1], list(out[2:])
        _advance(gdn, cache, conv_input, states[-1])
        return h, GDNTape(cache, conv_input, state, states, None)


class PositionedTrunk:
    """A Target at an image prompt's M-RoPE positions, called as an mlx-lm model (generate_step's)."""

    def __init__(self, target: Target, rope: MRoPE):
        self.target, self.rope = target, rope

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        """Logits [B, T, V] for `inputs` (or their `input_embeddings`), consuming them into `cache`."""
        return self.target.lm_head(self.target.hidden(inputs, cache, input_embeddings, self.rope))
