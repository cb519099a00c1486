"""The Gated DeltaNet kernel branch of the verify pass: `kernel_path` says what mlx-lm's own dispatch
does for every shape, and the batched commit replays every row in one call, bit for bit what one
replay per row gives, or not at all when every row kept every token."""

import random
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta

from speculative.rollback import commit_rows
from speculative.loader import load_checkpoint
from speculative.target import kernel_path

ROOT = Path(__file__).resolve().parents[2]


def dispatch_cases():
    """(B, T, Hk, Hv, Dk, Dv, training): one row and batches, a plain step and verify rows (k + 1 for
    k = 1, 3, 7), head dims on and off the kernel's multiple of 32."""
    for dk in (8, 16, 32, 48, 64, 96, 128, 256):
        for b, t in ((1, 1), (1, 4), (3, 2), (4, 8)):
            yield b, t, 2, 4 if dk % 64 else 2, dk, 16 if b == 1 else 32, False
    yield 1, 4, 2, 4, 128, 128, True  # training: mlx-lm's module asks for the ops


def took_kernel(kernel, b, t, hk, hv, dk, dv, training) -> bool:
    """Run mlx-lm's gated_delta_update as its GatedDeltaNet calls it (nothing is evaluated); did it call
    the kernel?"""
    before = len(kernel.calls)
    q = mx.zeros((b, t, hk, dk))
    v, a = mx.zeros((b, t, hv, dv)), mx.zeros((b, t, hv))
    gated_delta.gated_delta_update(q, q, v, a, a, mx.zeros(hv), mx.ones(hv), mx.zeros((b, hv, dv, dk)),
                                   use_kernel=not training)
    return len(kernel.calls) > before


def layer_like(dk: int, training: bool):
    """What kernel_path reads of a GatedDeltaNet module."""
    return SimpleNamespace(head_k_dim=dk, training=training)


def test_kernel_path_is_where_mlx_lm_sends_each_shape_on_metal(metal_kernel):
    cases = list(dispatch_cases())
    got = {c: kernel_path(layer_like(c[4], c[6])) for c in cases}
    want = {c: took_kernel(metal_kernel, *c) for c in cases}
    assert got == want
    assert set(want.values()) == {True, False}  # both branches were reached


class Recording:
    """The device's own kernel, its calls counted."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, *args, **kw):
        self.calls.append(args[1].shape)
        return self.kernel(*args, **kw)


@pytest.mark.gpu
def test_kernel_path_is_where_mlx_lm_sends_each_shape_on_this_device(monkeypatch):
    """No emulation: on the CPU (or CUDA) neither takes the kernel; on a Mac's GPU both do at Dk >= 32."""
    kernel = Recording(gated_delta.gated_delta_kernel)
    monkeypatch.setattr(gated_delta, "gated_delta_kernel", kernel)
    for c in dispatch_cases():
        assert kernel_path(layer_like(c[4], c[6])) == took_kernel(kernel, *c), c


@pytest.fixture(scope="module")
def dyno_tiny():
    """The bundled model: head dim 64, so on Metal its Gated DeltaNet layers take the kernel."""
    return load_checkpoint(ROOT / "assets" / "dyno-tiny")


def verified(lm, B: int, T: int, seed: int = 0):
    """A verify pass of T tokens on B rows after a prefix of 5 (so the state before it is no zero):
    its Gated DeltaNet tapes."""
    rng = random.Random(seed)
    cache = lm.target.make_cache()
    vocab = lm.target.args.vocab_size
    lm.target.hidden(mx.array([[rng.randrange(vocab) for _ in range(5)] for _ in range(B)]), cache)
    _, _, tapes = lm.target.verify(mx.array([[rng.randrange(vocab) for _ in range(T)] for _ in range(B)]), cache)
    mx.eval([(t.cache[0], t.cache[1]) for t in tapes])
    return tapes


def per_row(tape, consumed):
    """The reference: each row's conv window, and its state replayed alone over its own kept steps."""
    window = tape.cache[0].shape[1]
    conv = mx.concatenate([tape.conv_input[i : i + 1, n : n + window] for i, n in enumerate(consumed)])
    states = []
    for i, n in enumerate(consumed):
        if n == 0:
            states.append(tape.state_before[i : i + 1])
        elif tape.replay is None:
            states.append(tape.states[n - 1][i : i + 1])
        else:
            q, k, v, a, b = (x[i : i + 1, :n] for x in tape.replay[:5])
            layer = tape.replay.layer
            states.append(gated_delta.gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias,
                                                         tape.state_before[i : i + 1])[1])
    return conv, mx.concatenate(states)


def commits(B: int, T: int):
    """Accept counts to commit (tokens kept per row, 1..T as a batched round keeps): random ones, one
    row keeping all beside rows that did not, all rows alike, and every row keeping every token."""
    rng = random.Random(1)
    draws = [[rng.randint(1, T) for _ in range(B)] for _ in range(6)]
    return draws + [[T] + [1] * (B - 1), [2] * B, [T] * B]


def check_commits(tapes, T, kernel, same):
    """commit_rows against per_row for every draw in `commits`, with `same` (exact or close); with a
    `kernel` (the recorder), one call per layer where a row rejected something, none where none did."""
    B = tapes[0].conv_input.shape[0]
    for consumed in commits(B, T):
        for tape in tapes:
            after = tape.cache[0], tape.cache[1]  # the pass's end, as verify left it
            want_conv, want_state = per_row(tape, consumed)
            calls = len(kernel.calls) if kernel else 0
            commit_rows(tape, consumed)
            assert same(tape.cache[0], want_conv) and same(tape.cache[1], want_state), consumed
            if kernel:
                assert len(kernel.calls) - calls == (0 if consumed == [T] * B else 1), consumed
            if consumed == [T] * B:  # nothing replayed, nothing replaced
                assert tape.cache[0] is after[0] and tape.cache[1] is after[1]
            tape.cache[0], tape.cache[1] = after


def test_the_batched_commit_is_one_call_equal_to_a_replay_per_row(dyno_tiny, metal_kernel):
    B, T = 3, 4  # as the test on the device's branch below: the kernels MLX compiles for a shape are shared
    tapes = verified(dyno_tiny, B, T)
    assert tapes and all(t.replay is not None for t in tapes)  # the kernel branch
    check_commits(tapes, T, metal_kernel, lambda x, y: x.dtype == y.dtype and mx.array_equal(x, y).item())


@pytest.mark.gpu
def test_the_batched_commit_matches_a_replay_per_row_on_this_device(dyno_tiny, monkeypatch):
    """On the device's own branch (the kernel on a Mac's GPU), up to rounding."""
    kernel = None
    if kernel_path(dyno_tiny.target.body.layers[0].linear_attn):
        kernel = Recording(gated_delta.gated_delta_kernel)
        monkeypatch.setattr(gated_delta, "gated_delta_kernel", kernel)
    check_commits(verified(dyno_tiny, 3, 4), 4, kernel, lambda x, y: mx.allclose(x, y, rtol=1e-4, atol=1e-5).item())


@pytest.mark.gpu
def test_the_verify_pass_scores_as_the_model_does_on_this_device(dyno_tiny):
    """Its logits against mlx-lm's own forward over the same tokens, up to rounding (bf16 logits)."""
    tokens = mx.array([[5, 17, 101, 42, 7, 9, 300, 2]])
    want = dyno_tiny.model(tokens, cache=dyno_tiny.target.make_cache())
    got, _, _ = dyno_tiny.target.verify(tokens, dyno_tiny.target.make_cache())
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=0.1).item()
