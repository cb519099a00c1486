"""A prompt that shares a prefix with an earlier generation reuses its state; the output equals a cold run.

Extending the previous answer, parting from it inside (regenerate, an edit, a template that drops
the <think> text: resumed at a checkpoint), after a stop or a close, across drafting and plain
runs, after the store evicted to disk and a restart read it back.
"""

import mlx.core as mx
import numpy as np
import pytest

from dyno_ui.options import parse_size
from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.round.drafter import Drafts
from helpers.drafts import drafted as drafted_run
from speculative.events import Done, Round, Token
from speculative.prompt_cache.store import (
    PrefixCache, PrefixEntry, ShiftedKVCache, thin,
)
from speculative.prompt_cache.disk import DiskTier, model_keys, prompt_store

TURNS = ["def add(a, b):\n", "\n# now subtract\n", "\n# and multiply\n"]
SYSTEM, USER, EDITED = "# A module of small helpers.\n", "def mean(xs):\n    return", "def median(xs):\n    return"


def run(lm, prompt, mode, n, cache=None, boundaries=(), until=None, **kw):
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n, **kw), SpecConfig(mode, 3),
                           prefix_cache=cache, boundaries=boundaries, until=until))
    return [e.id for e in events if isinstance(e, Token)], events[-1]


@pytest.mark.parametrize("mode", ["mtp", "off"])
def test_turns_reuse_the_previous_turn_and_match_cold_runs(tiny_lm, mode):
    lm = tiny_lm("untied-mha")
    cache = PrefixCache()
    prompt, reusable = [], 0
    for i, text in enumerate(TURNS):
        prompt = prompt + lm.tokenizer.encode(text)
        tokens, done = run(lm, prompt, mode, 12 + 5 * i, cache)
        assert tokens == run(lm, prompt, mode, 12 + 5 * i)[0] == plain_greedy(lm, prompt, 12 + 5 * i)
        assert done.reused_prompt_tokens == reusable
        # Speculative entries leave out the last emitted token: it was never fed to the trunk.
        reusable = len(prompt) + len(tokens) - (1 if mode == "mtp" else 0)
        prompt = prompt + tokens


def test_penalties_count_the_reused_prefix(tiny_lm):
    lm = tiny_lm()
    cache = PrefixCache()
    first = lm.tokenizer.encode(TURNS[0])
    tokens, _ = run(lm, first, "off", 10, cache, repetition_penalty=1.5, presence_penalty=1.0)
    prompt = first + tokens + lm.tokenizer.encode(TURNS[1])
    warm, done = run(lm, prompt, "off", 30, cache, repetition_penalty=1.5, presence_penalty=1.0)
    assert done.reused_prompt_tokens == len(first) + 10
    assert warm == run(lm, prompt, "off", 30, repetition_penalty=1.5, presence_penalty=1.0)[0]


def chat(lm, *parts):
    """Token ids of text parts and the boundaries where parts 2.. start (as chat messages do)."""
    ids, starts = [], []
    for part in parts:
        starts.append(len(ids))
        ids += lm.tokenizer.encode(part)
    return ids, starts[1:]


@pytest.mark.parametrize("mode", ["mtp", "off"])
def test_regenerate_edit_and_a_re_rendered_answer_resume_at_checkpoints(tiny_lm, mode):
    lm = tiny_lm()
    cache = PrefixCache()
    prompt, marks = chat(lm, SYSTEM, USER)
    answer, _ = run(lm, prompt, mode, 8, cache, marks)
    # Regenerate: the same prompt; its last token must be fed again, so the end-of-prompt checkpoint serves.
    again, done = run(lm, prompt, mode, 8, cache, marks)
    assert again == answer == plain_greedy(lm, prompt, 8)
    assert done.reused_prompt_tokens == len(prompt) - 1
    assert len(cache.entries) == 1  # the new entry holds every state the old one offered: it replaced it
    # An edited last message parts at its start: the message boundary serves.
    edited, marks2 = chat(lm, SYSTEM, EDITED)
    tokens, done = run(lm, edited, mode, 8, cache, marks2)
    assert done.reused_prompt_tokens == marks2[0] and tokens == plain_greedy(lm, edited, 8)
    # The next turn renders the answer differently (a template dropping <think> text): the end of the prompt serves.
    follow, _ = chat(lm, SYSTEM, USER, " 0  # rendered again\n", TURNS[1])
    tokens, done = run(lm, follow, mode, 8, cache)
    assert done.reused_prompt_tokens == len(prompt) - 1 and tokens == plain_greedy(lm, follow, 8)


@pytest.mark.parametrize("mode", ["mtp", "off"])
def test_seeded_sampling_with_reuse_draws_the_same_tokens(tiny_lm, mode):
    lm = tiny_lm()
    cache = PrefixCache()
    kw = dict(temperature=0.9, top_p=0.95, seed=1234)
    prompt, marks = chat(lm, SYSTEM, USER)
    first, _ = run(lm, prompt, mode, 10, cache, marks, **kw)
    for follow in (prompt + first + lm.tokenizer.encode(TURNS[1]), chat(lm, SYSTEM, EDITED)[0]):
        warm, done = run(lm, follow, mode, 15, cache, **kw)
        assert done.reused_prompt_tokens > 0
        assert warm == run(lm, follow, mode, 15, **kw)[0]


@pytest.mark.parametrize("first_mode, then", [("off", "mtp"), ("mtp", "off")])
def test_an_entry_serves_drafting_and_plain_requests_alike(tiny_lm, first_mode, then):
    lm = tiny_lm()
    cache = PrefixCache()
    prompt = lm.tokenizer.encode(TURNS[0])
    tokens, _ = run(lm, prompt, first_mode, 10, cache)
    follow = prompt + tokens + lm.tokenizer.encode(TURNS[1])
    warm, done = run(lm, follow, then, 20, cache)
    assert done.reused_prompt_tokens == len(prompt) + 10 - (1 if first_mode == "mtp" else 0)
    assert warm == plain_greedy(lm, follow, 20)
    if first_mode == "off":  # the drafting run had no head rows for the prefix: its head cache starts there
        (entry,) = [e for e in cache.entries if len(e) > len(follow)]
        head = entry.head_cache[0]
        assert isinstance(head, ShiftedKVCache) and head.start == done.reused_prompt_tokens
    else:  # a plain run copies a drafting entry: the head rows stay for the next drafting request
        assert any(e.head_cache is not None for e in cache.entries)


@pytest.mark.parametrize("mode", ["mtp", "off"])
def test_a_stop_or_a_close_keeps_the_state_the_consumer_received(tiny_lm, mode):
    lm = tiny_lm()
    cache = PrefixCache()
    prompt = lm.tokenizer.encode(TURNS[0])
    seen = []
    tokens, done = run(lm, prompt, mode, 30, cache, until=lambda: "stop" if len(seen.append(1) or seen) == 7 else None)
    assert isinstance(done, Done) and done.finish_reason == "stop" and len(tokens) == 7
    events = generate(lm, prompt + tokens + lm.tokenizer.encode(TURNS[1]), SamplingParams(max_tokens=30),
                      SpecConfig(mode, 3), prefix_cache=cache)
    closed = [next(e.id for e in events if isinstance(e, Token)) for _ in range(5)]
    events.close()  # a client that went away
    follow = prompt + tokens + lm.tokenizer.encode(TURNS[1]) + closed + lm.tokenizer.encode(TURNS[2])
    warm, done = run(lm, follow, mode, 10, cache)
    drafted = 1 if mode == "mtp" else 0
    assert done.reused_prompt_tokens == len(follow) - len(lm.tokenizer.encode(TURNS[2])) - drafted
    assert warm == plain_greedy(lm, follow, 10)


class OracleDrafter:
    """Drafts the true continuation, so every round is fully accepted and stops land mid-round."""

    def __init__(self, reference):
        self.reference = reference

    def propose(self, rounds, budgets):
        (row,), (k,) = rounds.rows, budgets
        start = len(row.generated)
        return Drafts(mx.array([(self.reference + [0] * k)[start : start + k]]), [None], [k])


def assert_same_cache(got, want, what):
    """Attention KV: same offset and rows; Gated DeltaNet: same conv window and recurrent state."""
    if hasattr(want, "offset"):
        n = int(mx.array(want.offset).reshape(-1)[0])  # (a one-row batch cache's offset is an array)
        assert int(mx.array(got.offset).reshape(-1)[0]) == n, what
        pairs = [(got.keys[..., :n, :], want.keys[..., :n, :]), (got.values[..., :n, :], want.values[..., :n, :])]
    else:
        pairs = [(got[0], want[0]), (got[1], want[1])]
    for a, b in pairs:
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4, err_msg=what)


def take_tokens(steps, n, after_round=False):
    """The first n token ids of a OneRow.run stream, then close it (as a consumer that stops);
    `after_round`: also read the next Round event (a consumer that stops before its tokens)."""
    out = []
    while len(out) < n:
        e = next(steps)
        if isinstance(e, Token):
            out.append(e.id)
    if after_round:
        assert isinstance(next(steps), Round)
    steps.close()
    return out


@pytest.mark.parametrize("emitted, after_round", [(1, False), (2, False), (4, False), (5, False), (6, False),
                                                  (9, False), (1, True), (6, True)])
def test_settle_handles_a_stop_inside_a_round(tiny_lm, emitted, after_round):
    """Depth 4: tokens 2..6 come from one round; stopping after any of them leaves the trunk ahead."""
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(TURNS[0])
    reference = plain_greedy(lm, prompt, 20, stop_at_eos=False)
    first = drafted_run(lm, SamplingParams(max_tokens=20), 4, drafter=OracleDrafter(reference))
    got = take_tokens(first.run(prompt), emitted, after_round)
    assert got == reference[:emitted]
    entry = first.settle(emitted)
    assert entry.tokens == tuple(prompt + got[:-1])
    assert entry.trunk_cache[3].offset == len(entry.tokens)  # layer 3 is full attention
    assert entry.head_cache[0].offset == len(entry.tokens) - 1

    follow = prompt + got + lm.tokenizer.encode(TURNS[1])
    warm, cold = (drafted_run(lm, SamplingParams(max_tokens=25), 3) for _ in range(2))
    warm_steps, cold_steps = warm.run(follow, resume=entry.hand_over(head_layers=1)), cold.run(follow)
    assert next(warm_steps) == next(cold_steps)  # both prefilled: their caches must agree
    w, c = warm.batch, cold.batch
    for i, (w, c) in enumerate(zip(w.trunk_cache + w.head_cache, c.trunk_cache + c.head_cache)):
        assert_same_cache(w, c, f"layer {i}")
    tokens = [warm.generated[0]] + take_tokens(warm_steps, 24)
    assert tokens == plain_greedy(lm, follow, 25, stop_at_eos=False)


def test_checkpoints_are_thinned_towards_the_past():
    # The latest four at least MIN_GAP apart, then each gap at least the span kept so far, and the earliest.
    assert thin([5, 40, 100, 300, 500, 700, 850, 900, 930, 939, 940, 960, 990, 1000]) == [
        5, 300, 700, 900, 940, 960, 1000]
    assert len(thin(range(1, 20000))) < 20


def test_the_plan_cuts_at_boundaries_and_the_prompt_end():
    cache = PrefixCache(max_bytes=10**9)
    assert cache.plan(100, [30, 60]) == [30, 60, 99]  # no boundary near the end: the prompt end too
    assert cache.plan(100, [30, 95]) == [30, 95]  # the generation prompt's start stands for the end
    assert cache.plan(100, [30, 60], start=40) == [60, 99]
    assert PrefixCache(max_bytes=0).plan(100, [30]) == []  # no store: prefill uncut


def test_the_store_is_bounded_in_bytes_and_evicts_the_least_recently_used(tiny_lm):
    lm = tiny_lm()
    cache = PrefixCache(max_bytes=10**9)
    prompts = [lm.tokenizer.encode(f"x{i} = {i}\n") for i in range(4)]
    for p in prompts:
        run(lm, p, "off", 4, cache)
    assert len(cache.entries) == 4
    one = cache.nbytes // 4
    run(lm, prompts[0] + [32], "off", 1, cache)  # uses (and extends) the oldest entry
    cache.max_bytes = 3 * one
    cache.put(cache.entries.pop())  # re-applies the budget
    kept = {tuple(e.tokens[:len(prompts[0])]) for e in cache.entries}
    assert tuple(prompts[1]) not in kept and tuple(prompts[0]) in kept  # the least recently used went
    assert cache.nbytes <= cache.max_bytes


def test_sizes_parse():
    assert [parse_size(v) for v in ("8GB", "512MiB", "1.5g", "0", 1024, None)] == [
        8 * 10**9, 512 * 2**20, 1.5 * 10**9, 0, 1024, None]
    with pytest.raises(Exception, match="number of bytes"):
        parse_size("lots")


@pytest.mark.parametrize("mode", ["mtp", "off"])
def test_the_disk_tier_serves_after_a_restart(tiny_lm, tmp_path, mode):
    lm = tiny_lm()
    notices = []
    store = prompt_store(lm, max_bytes=0, folder=tmp_path, notify=notices.append)  # evicts to disk at once
    prompt, marks = chat(lm, SYSTEM, USER)
    tokens, _ = run(lm, prompt, mode, 9, store, marks)
    store.close()
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1 and not list(tmp_path.rglob(".tmp-*"))
    # "Restart": a new store over the same folder, memory empty; the file is read when a prompt can use it.
    restarted = prompt_store(lm, max_bytes=10**9, folder=tmp_path, notify=notices.append)
    follow = prompt + tokens + lm.tokenizer.encode(TURNS[1])
    warm, done = run(lm, follow, mode, 12, restarted)
    assert done.reused_prompt_tokens == len(prompt) + 9 - (1 if mode == "mtp" else 0)
    assert warm == plain_greedy(lm, follow, 12)
    edited = chat(lm, SYSTEM, EDITED)[0]  # a checkpoint from the file: the store kept the loaded entry
    warm, done = run(lm, edited, mode, 6, restarted)
    assert done.reused_prompt_tokens == marks[0] and warm == plain_greedy(lm, edited, 6)
    assert notices == []


def test_corrupt_foreign_and_over_budget_files_are_handled(tiny_lm, tmp_path):
    lm = tiny_lm()
    notices = []
    store = prompt_store(lm, max_bytes=0, folder=tmp_path, notify=notices.append)
    prompt = lm.tokenizer.encode(TURNS[0])
    run(lm, prompt, "mtp", 6, store)
    (good,) = store.disk.dir.glob("*.safetensors")
    (store.disk.dir / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    truncated = store.disk.dir / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    trunk, head = model_keys(lm)
    other = DiskTier(tmp_path, "f" * 64, head, lm.model.make_cache, notify=notices.append)
    other.save(store.disk.load(store.disk.index[good]))
    (moved,) = other.dir.glob("*.safetensors")
    moved.rename(store.disk.dir / "foreign.safetensors")  # another model's file in this model's folder
    fresh = prompt_store(lm, max_bytes=10**9, folder=tmp_path, notify=notices.append)
    tokens, done = run(lm, prompt + lm.tokenizer.encode(" x"), "mtp", 4, fresh)
    assert done.reused_prompt_tokens > 0
    # Damaged files are removed (they can never serve); another model's is left to it.
    folder = store.disk.dir
    assert len(notices) == 3 and all("\n" not in n for n in notices)
    assert {n.split(": ", 3)[2] for n in notices} == {
        f"removed {folder / 'broken.safetensors'}", f"removed {truncated}",
        f"ignoring {folder / 'foreign.safetensors'}"}
    assert not (store.disk.dir / "broken.safetensors").exists() and not truncated.exists()
    assert (store.disk.dir / "foreign.safetensors").exists()
    # A head made by another head is left out; the trunk state still serves, the head starts empty there.
    other_head = DiskTier(tmp_path, trunk, "0" * 64, lm.model.make_cache)
    entry = other_head.load(other_head.index[good])
    assert entry is not None and entry.head_cache is None
    # The disk budget: the least recently used files go.
    small = DiskTier(tmp_path, trunk, head, lm.model.make_cache, max_bytes=good.stat().st_size + 10)
    small.save(PrefixEntry(entry.tokens + (7,), entry.trunk_cache, checkpoints={}))
    assert len(small.index) == 1 and small.nbytes <= small.max_bytes
