"""Rolling back the hybrid cache after verification.

Attention KV caches (trunk and head) trim through mlx-lm's cache protocol (is_trimmable, trim, size);
a batch cache whose rows keep different counts rolls each row's rejected slots into its left padding. Gated DeltaNet layers hold a conv window
(the last K-1 rows of the qkv input) and an fp32 recurrent state that cannot be trimmed; the
verify pass leaves a GDNTape per layer from which the state after any prefix is recovered
without a second trunk forward.
"""

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll
from mlx_lm.models.gated_delta import gated_delta_update


class Replay(NamedTuple):
    """A verify pass's step inputs for one GDN layer, kept where only its final state exists (the
    Metal kernel): the state after any prefix is recomputed from them on commit."""

    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    layer: Any  # the GatedDeltaNet module (A_log, dt_bias)


@dataclass
class GDNTape:
    """What one GDN layer saw during a verify pass."""

    cache: Any  # the layer's ArraysCache: [conv window, recurrent state]
    conv_input: mx.array  # [B, K-1+T, C]: window before verify, then the T new qkv rows
    state_before: mx.array  # [B, Hv, Dv, Dk] fp32
    states: Optional[List[mx.array]]  # state after each step (portable path)
    replay: Optional[Replay]  # when only the final state exists

    def commit(self, consumed: int) -> None:
        """Make the cache hold the state after the first `consumed` verify tokens."""
        steps = len(self._steps())
        if consumed == steps:  # every token kept: the pass already left this window and state (target._advance)
            return
        window = self.conv_input.shape[1] - steps
        # After consuming c tokens the window is rows [c, c + K-1) of conv_input.
        self.cache[0] = self.conv_input[:, consumed : consumed + window, :]
        if consumed == 0:  # none kept (a consumer that stopped before the pass's first token)
            self.cache[1] = self.state_before
        elif self.states is not None:
            self.cache[1] = self.states[consumed - 1]
        else:
            q, k, v, a, b, layer = self.replay
            c = consumed
            _, self.cache[1] = gated_delta_update(
                q[:, :c], k[:, :c], v[:, :c], a[:, :c], b[:, :c], layer.A_log, layer.dt_bias,
                self.state_before,
            )

    def _steps(self) -> Sequence:
        return self.states if self.states is not None else range(self.replay.q.shape[1])


def tape_row(tape: GDNTape, b: int, cache: Any) -> GDNTape:
    """Row b of a batch pass's tape, committing into `cache` (that row's own layer cache, extracted)."""
    def row(x: mx.array) -> mx.array:
        return x[b : b + 1]

    replay = None if tape.replay is None else Replay(*map(row, tape.replay[:5]), tape.replay.layer)
    states = None if tape.states is None else [row(s) for s in tape.states]
    return GDNTape(cache, row(tape.conv_input), row(tape.state_before), states, replay)


def replay_rows(replay: Replay, state_before: mx.array, end_state: mx.array, consumed: Sequence[int]) -> mx.array:
    """Row i's state after its first consumed[i] steps, all rows in one gated_delta_update call; a row
    that consumed every step keeps `end_state`, the pass's own final state.

    Steps past a row's count become identity steps: a = b = -inf makes the decay exp(-0) = 1 and the
    write strength sigmoid(-inf) = 0, so the state goes through unchanged (x * 1 + 0). mlx-lm's `mask`
    would too, but on Metal it takes another kernel than the verify pass where mlx-lm's packed one
    applies (Dk = 128), and the two sum alike only as far as simd_sum lowers to the packed one's tree.
    """
    q, k, v, a, b, layer = replay
    steps = q.shape[1]
    n = max((c for c in consumed if c < steps), default=0)  # no row needs the steps past it
    c = mx.array(consumed)
    keep = (mx.arange(n)[None] < c[:, None])[..., None]  # [B, n, 1]
    a, b = mx.where(keep, a[:, :n], -mx.inf), mx.where(keep, b[:, :n], -mx.inf)
    state = state_before
    if n:
        _, state = gated_delta_update(q[:, :n], k[:, :n], v[:, :n], a, b, layer.A_log, layer.dt_bias, state)
    return mx.where((c < steps)[:, None, None, None], state, end_state)


def snapshot(cache: List[Any]) -> list:
    """What `restore` needs to rewind `cache` to now: the size of attention caches (a batch cache's
    offsets are per row, its size is shared), references to the GDN arrays (MLX arrays are
    immutable, so references are a copy)."""
    return [(c.size(),) if c.is_trimmable() else (c[0], c[1]) for c in cache]


def restore(cache: List[Any], snap: list) -> None:
    """Rewind `cache` to the `snapshot` taken from it (attention caches only ever grew since)."""
    for c, s in zip(cache, snap):
        if c.is_trimmable():
            c.trim(c.size() - s[0])
        else:
            c[0], c[1] = s


def rollback(cache: List[Any], tapes: List[GDNTape], fed: int, consumed: Union[int, Sequence[int]]) -> None:
    """After a pass of `fed` tokens per row keep only the first `consumed` of them (per row when a
    list: row i its first consumed[i]) in every cache of `cache` and on every tape."""
    kept = [consumed] if isinstance(consumed, int) else list(consumed)
    if len(set(kept)) == 1:  # every row alike: mlx-lm's trim, and one commit per tape
        if kept[0] == fed:
            return  # everything the pass wrote is committed
        for c in cache:
            if c.is_trimmable():
                c.trim(fed - kept[0])
        for tape in tapes:
            tape.commit(kept[0])
        return
    for c in cache:
        if c.is_trimmable():
            trim_rows(c, fed, kept)
    for tape in tapes:
        commit_rows(tape, kept)


# Left padding every row of a batch cache shares is dropped once it reaches this many slots.
COMPACT_AT = 256


def trim_rows(cache: BatchKVCache, fed: int, kept: List[int]) -> None:
    """Of the last `fed` slots keep row i's first kept[i]: the slots it rejected are rolled right
    into its left padding (masked, never zeroed); its offset (RoPE position) drops by as many."""
    drop = [fed - k for k in kept]
    cache.trim(min(drop))  # the part every row drops
    extra = [d - min(drop) for d in drop]
    if not any(extra):  # every row dropped alike: its padding is as it was
        return
    # As BatchKVCache.finalize: roll each row by its own count.
    shift = mx.array(extra)
    cache.keys = dynamic_roll(cache.keys, shift[:, None], axis=2)
    cache.values = dynamic_roll(cache.values, shift[:, None], axis=2)
    cache.offset = cache.offset - shift
    cache.left_padding = cache.left_padding + shift
    if mx.min(cache.left_padding).item() >= COMPACT_AT:  # padding every row has: filter drops it
        cache.filter(mx.arange(cache.keys.shape[0]))


def commit_rows(tape: GDNTape, consumed: List[int]) -> None:
    """GDNTape.commit per row: row i's conv window and state after its first consumed[i] tokens."""
    if len(set(consumed)) == 1:  # (every row kept every token included: then nothing to do)
        tape.commit(consumed[0])
        return
    rows = mx.arange(len(consumed))
    c = mx.array(consumed)
    window = tape.cache[0].shape[1]  # K-1: the pass left its last rows there
    # After consuming c tokens the window is rows [c, c + K-1) of conv_input.
    tape.cache[0] = tape.conv_input[rows[:, None], c[:, None] + mx.arange(window)[None]]
    if tape.states is not None:
        states = mx.stack([tape.state_before] + tape.states, axis=1)  # [B, T+1, Hv, Dv, Dk]
        tape.cache[1] = states[rows, c]
    else:  # the Metal kernel kept only the final state: replay each row's kept steps, in one call
        tape.cache[1] = replay_rows(tape.replay, tape.state_before, tape.cache[1], consumed)
