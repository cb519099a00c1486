"""Batched drafting is exact per row: every row's greedy tokens are plain mlx-lm's for its own prompt
whatever joins or leaves beside it, and a seeded sampled row draws the same tokens alone or in a batch."""

import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest
from scipy.stats import chi2

from helpers.distribution import FALSE_ALARM, PARAMS, chi_square, exact_joint
from helpers.reference import plain_greedy, plain_greedy_prefix
from speculative import rollback
from speculative.batched import speculator
from speculative.batched import BatchSpeculator, Joiner
from speculative.batched.prefill import prefill_groups, sharing_waves
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from helpers.drafts import drafted
from speculative.errors import DynoError
from speculative.events import Parked, Provenance, Round, Token
from speculative.loader import load_checkpoint
from speculative.prompt_cache.store import PrefixCache, Resume
from speculative.round.row import Row
from speculative.stats import GenerationStats

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="row invariance holds on the CPU backend")

PROMPTS = [  # different lengths, so rows carry different left padding
    "def read_config(path):\n",
    "# Sort a list of numbers\ndef sort(xs):\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",  # the MoE model ends it at EOS
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


@pytest.fixture(scope="module")
def bundled():
    """The bundled models, dense and MoE: trained heads, so rows accept different counts per round."""
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_checkpoint(ROOT / "assets" / name)
        return loaded[name]

    return get


def drive(batch, depth, joins, limit=1000):
    """Run rounds until every row has finished; `joins` maps a round number to the rows
    (id, prompt, params) joining before it. Returns each row's events and finish reason."""
    events, finish = {}, {}
    rounds = 0
    while (batch or any(r >= rounds for r in joins)) and rounds < limit:
        for row_id, prompt, params in joins.get(rounds, []):
            out = batch.join(row_id, prompt, params)
            events[row_id] = list(out.events)
            if out.finish:
                finish[row_id] = out.finish
        for row_id, out in batch.step(depth).items():
            events[row_id] += out.events
            if out.finish:
                finish[row_id] = out.finish
        rounds += 1
    return events, finish


def tokens(events):
    return [e.id for e in events if isinstance(e, Token)]


@pytest.mark.parametrize("name", ["dyno-tiny", "dyno-tiny-moe"])
@pytest.mark.parametrize("depth", [1, 3])
def test_every_row_is_plain_greedy(bundled, name, depth):
    """Rows of different lengths; rows leave early (max_tokens, EOS) and join mid-generation."""
    lm = bundled(name)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    limits = [60, 70, 40, 25]
    joins = {0: [(i, prompts[i], SamplingParams(max_tokens=limits[i])) for i in (0, 1)],
             3: [(2, prompts[2], SamplingParams(max_tokens=limits[2]))],
             6: [(3, prompts[3], SamplingParams(max_tokens=limits[3]))]}
    batch = BatchSpeculator(lm)
    events, finish = drive(batch, depth, joins)
    assert len(batch) == 0
    for i, prompt in enumerate(prompts):
        want = plain_greedy_prefix(lm, prompt, limits[i])
        assert tokens(events[i]) == want, f"row {i}"
        assert finish[i] == ("stop" if want[-1] in lm.eos_token_ids else "length")
    # Rows 0 and 1 (in the batch together from the first round) accepted different counts in the
    # same round: the ragged rollback was exercised.
    accepted = [[e.accepted for e in events[i] if isinstance(e, Round)] for i in (0, 1)]
    assert any(a != b for a, b in zip(accepted[0], accepted[1]))


def test_events_fold_as_single_row_events(bundled):
    """Each row's events fold in GenerationStats as a single speculator's do: the same tokens,
    provenance and acceptance counts."""
    lm = bundled("dyno-tiny")
    prompt = lm.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=40)
    single = drafted(lm, params, 3)  # a batch of one row
    alone = []
    for e in single.run(prompt):
        alone.append(e)
        if len(tokens(alone)) == 40:
            break
    batch = BatchSpeculator(lm)
    events, _ = drive(batch, 3, {0: [("a", prompt, params), ("b", lm.tokenizer.encode(PROMPTS[2]), params)]})
    got, want = GenerationStats(3), GenerationStats(3)
    for e in events["a"]:
        got.add(e)
    for e in alone:
        want.add(e)
    assert (got.tokens, got.provenance, got.rounds, got.accepted_per_position) == \
           (want.tokens, want.provenance, want.rounds, want.accepted_per_position)
    assert Provenance.BONUS in [e.provenance for e in events["a"] if isinstance(e, Token)]


def test_a_row_that_leaves_mid_generation_leaves_the_others_exact(bundled):
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    batch = BatchSpeculator(lm)
    got = {i: tokens(batch.join(i, p, SamplingParams(max_tokens=45)).events) for i, p in enumerate(prompts)}
    for r in range(40):
        if r == 4:
            batch.leave(1)  # a cancel or a stop string, between rounds
        for i, out in batch.step(2).items():
            got[i] += tokens(out.events)
    assert 1 not in batch
    for i in (0, 2, 3):
        assert got[i] == plain_greedy_prefix(lm, prompts[i], 45)


def test_a_row_ending_at_its_first_token_never_joins(bundled):
    lm = bundled("dyno-tiny")
    batch = BatchSpeculator(lm)
    out = batch.join("x", lm.tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=1))
    assert out.finish == "length" and len(tokens(out.events)) == 1 and len(batch) == 0


SAMPLED = SamplingParams(temperature=0.8, top_k=20, max_tokens=40, seed=7)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_seeded_row_draws_the_same_alone_and_in_a_batch(bundled, depth):
    """And the same as plain mlx-lm's seeded text: the row's RNG is its own."""
    lm = bundled("dyno-tiny")
    prompt = lm.tokenizer.encode(PROMPTS[0])
    reference = [e.id for e in generate(lm, prompt, SAMPLED, SpecConfig("off")) if isinstance(e, Token)]
    alone, _ = drive(BatchSpeculator(lm), depth, {0: [("s", prompt, SAMPLED)]})
    other = [("g", lm.tokenizer.encode(PROMPTS[2]), SamplingParams(max_tokens=30)),
             ("t", lm.tokenizer.encode(PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=50))]
    beside, _ = drive(BatchSpeculator(lm), depth, {0: other[:1], 2: [("s", prompt, SAMPLED)], 5: other[1:]})
    assert tokens(alone["s"]) == reference
    assert tokens(beside["s"]) == reference
    # The greedy row took the batched greedy acceptance alone, the per-row one beside sampled rows.
    assert tokens(beside["g"]) == plain_greedy_prefix(lm, lm.tokenizer.encode(PROMPTS[2]), 30)


def test_a_row_with_processors_beside_a_free_row(bundled):
    """Penalties and logit bias apply to the row's own drafts and verify rows, with its own history."""
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS[:2]]
    shaped = SamplingParams(max_tokens=50, repetition_penalty=1.3, logit_bias={198: -2.0})
    free = SamplingParams(max_tokens=50)
    events, _ = drive(BatchSpeculator(lm), 3, {0: [(0, prompts[0], shaped), (1, prompts[1], free)]})
    plain = [e.id for e in generate(lm, prompts[0], shaped, SpecConfig("off")) if isinstance(e, Token)]
    assert tokens(events[0]) == plain
    assert tokens(events[1]) == plain_greedy_prefix(lm, prompts[1], 50)
    assert plain != plain_greedy_prefix(lm, prompts[0], 50)  # the processors did change the text


@pytest.mark.parametrize("mode", ["mtp", "off"])  # "off": the entry has no head rows (shifted head cache)
def test_a_row_resumed_from_the_prefix_cache_beside_a_cold_one(bundled, mode):
    lm = bundled("dyno-tiny")
    cache = PrefixCache()
    first = lm.tokenizer.encode(PROMPTS[0])
    done = list(generate(lm, first, SamplingParams(max_tokens=12), SpecConfig(mode, 3), prefix_cache=cache))
    prompt = first + tokens(done) + lm.tokenizer.encode("\n# next\n")
    resume = cache.take(prompt, head_layers=len(lm.head.layers))
    assert resume is not None and len(resume) > len(first)
    cold = lm.tokenizer.encode(PROMPTS[3])
    batch = BatchSpeculator(lm)
    got = {"cold": tokens(batch.join("cold", cold, SamplingParams(max_tokens=40)).events)}
    got["warm"] = tokens(batch.join("warm", prompt, SamplingParams(max_tokens=40), resume,
                                    cache.plan(len(prompt), (), len(resume))).events)
    while batch:
        for i, out in batch.step(3).items():
            got[i] += tokens(out.events)
    assert got["warm"] == plain_greedy_prefix(lm, prompt, 40)
    assert got["cold"] == plain_greedy_prefix(lm, cold, 40)


def test_shared_left_padding_is_dropped(bundled, monkeypatch):
    """Rows that reject drafts pile up left padding; once every row has some it is cut, unchanged output."""
    monkeypatch.setattr(rollback, "COMPACT_AT", 2)
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS[:2]]
    batch = BatchSpeculator(lm)
    events, _ = drive(batch, 3, {0: [(i, p, SamplingParams(max_tokens=60)) for i, p in enumerate(prompts)]})
    for i, p in enumerate(prompts):
        assert tokens(events[i]) == plain_greedy_prefix(lm, p, 60)


@pytest.mark.slow
def test_rows_sampled_side_by_side_follow_the_model(tiny_lm):
    """Chi-square per row against the exact distribution of its first three tokens, with the other
    row sampling beside it (its own prompt, its own seed) in every round."""
    lm = tiny_lm("tied-gqa2")
    prompts = {"a": lm.tokenizer.encode("x = "), "b": lm.tokenizer.encode("def f(y):\n")}
    joints = {i: exact_joint(lm, p) for i, p in prompts.items()}
    n = 600
    counts = {i: {} for i in prompts}
    for seed in range(n):
        rows = [(i, p, dataclasses.replace(PARAMS, seed=seed * 2 + j)) for j, (i, p) in enumerate(prompts.items())]
        events, _ = drive(BatchSpeculator(lm), 2, {0: rows})
        for i in prompts:
            key = tuple(tokens(events[i]))
            counts[i][key] = counts[i].get(key, 0) + 1
    for i in prompts:
        stat, dof = chi_square(counts[i], joints[i], n)
        assert stat < chi2.isf(FALSE_ALARM, dof), (i, stat, dof)


def drive_schedule(batch, depths, joins, limit=1000, told=False):
    """As `drive`, with round r at depth depths[r % len(depths)]; `told`: each round is told the next
    one's depth (the work it queues), else it queues for its own depth."""
    events, finish = {}, {}
    rounds = 0
    while (batch or any(r >= rounds for r in joins)) and rounds < limit:
        for row_id, prompt, params in joins.get(rounds, []):
            out = batch.join(row_id, prompt, params)
            events[row_id] = list(out.events)
        then = depths[(rounds + 1) % len(depths)] if told else None
        for row_id, out in batch.step(depths[rounds % len(depths)], then).items():
            events[row_id] += out.events
            if out.finish:
                finish[row_id] = out.finish
        rounds += 1
    return events, finish


@pytest.mark.parametrize("name", ["dyno-tiny", "dyno-tiny-moe"])
@pytest.mark.parametrize("depths", [[0], [0, 3, 1, 0, 2], [0, 0, 0, 2, 0, 0, 3, 3, 0, 1]])
@pytest.mark.parametrize("told", [False, True])
def test_depth_zero_and_changing_depths_stay_plain_greedy(bundled, monkeypatch, name, depths, told):
    """Depth 0 is a plain batched round; rounds switch between it and drafting (the head catches up
    on the rows plain rounds deferred, here every two), rows join and leave in between: every row is
    plain greedy."""
    monkeypatch.setattr(speculator, "HEAD_BACKLOG", 2)
    lm = bundled(name)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    limits = [60, 70, 40, 25]
    joins = {0: [(i, prompts[i], SamplingParams(max_tokens=limits[i])) for i in (0, 1)],
             3: [(2, prompts[2], SamplingParams(max_tokens=limits[2]))],
             7: [(3, prompts[3], SamplingParams(max_tokens=limits[3]))]}
    events, finish = drive_schedule(BatchSpeculator(lm), depths, joins, told=told)
    for i, prompt in enumerate(prompts):
        want = plain_greedy_prefix(lm, prompt, limits[i])
        assert tokens(events[i]) == want, f"row {i}"
        assert finish[i] == ("stop" if want[-1] in lm.eos_token_ids else "length")


def test_depth_zero_rounds_are_not_drafting_rounds(bundled):
    """A depth-0 round emits no Round but a Parked and a PLAIN token, so tokens per round and acceptance
    count the drafting rounds alone; a row at depth 0 throughout folds as plain decoding, all parked."""
    lm = bundled("dyno-tiny")
    prompt = lm.tokenizer.encode(PROMPTS[0])
    events, _ = drive_schedule(BatchSpeculator(lm), [0], {0: [("p", prompt, SamplingParams(max_tokens=20))]})
    assert not any(isinstance(e, Round) for e in events["p"])
    assert {e.provenance for e in events["p"] if isinstance(e, Token)} == {Provenance.PLAIN}
    plain = GenerationStats()
    for e in events["p"]:
        plain.add(e)
    assert not plain.speculative and plain.tokens_per_round is None
    assert plain.parked_rounds == sum(isinstance(e, Parked) for e in events["p"]) == 19  # the first: the prefill's
    assert plain.parked_share == 1.0
    events, _ = drive_schedule(BatchSpeculator(lm), [3, 0], {0: [("m", prompt, SamplingParams(max_tokens=40))]})
    mixed = GenerationStats()
    for e in events["m"]:
        mixed.add(e)
    drafting = [e for e in events["m"] if isinstance(e, Round)]
    assert all(r.drafted == 3 for r in drafting)
    assert mixed.rounds == len(drafting) and mixed.tokens_per_round == 1 + mixed.accepted_tokens / len(drafting)


def test_a_seeded_row_draws_the_same_alone_and_beside_others_at_depth_zero(bundled):
    lm = bundled("dyno-tiny")
    prompt = lm.tokenizer.encode(PROMPTS[0])
    alone, _ = drive_schedule(BatchSpeculator(lm), [0, 2], {0: [("s", prompt, SAMPLED)]})
    other = [("g", lm.tokenizer.encode(PROMPTS[2]), SamplingParams(max_tokens=30)),
             ("t", lm.tokenizer.encode(PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=50))]
    beside, _ = drive_schedule(BatchSpeculator(lm), [0, 2], {0: [("s", prompt, SAMPLED)] + other})
    told, _ = drive_schedule(BatchSpeculator(lm), [0, 2], {0: [("s", prompt, SAMPLED)] + other}, told=True)
    assert tokens(alone["s"]) == tokens(beside["s"]) == tokens(told["s"]) and len(tokens(alone["s"])) == SAMPLED.max_tokens


def test_the_plain_pass_queued_ahead_is_taken_back_exactly(bundled):
    """A plain round queues the next plain pass before its own sync; a join, a leave, a row ending
    and a drafting round each take it back (caches rewound, RNG keys restored). So at depth 0 beside
    rows that come and go, a seeded row draws what it draws alone and greedy rows stay plain greedy."""
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    depths = [0] * 9 + [2] + [0] * 100
    alone, _ = drive_schedule(BatchSpeculator(lm), depths, {0: [("s", prompts[0], SAMPLED)]})
    batch, got = BatchSpeculator(lm), {}
    schedule = {0: [("s", prompts[0], SAMPLED), ("a", prompts[1], SamplingParams(max_tokens=12))],
                3: [("b", prompts[2], SamplingParams(max_tokens=30))],
                6: [("c", prompts[3], SamplingParams(max_tokens=30))]}
    taken_back = 0
    for r, depth in enumerate(depths):
        for row_id, prompt, params in schedule.get(r, []):
            taken_back += batch.ahead is not None
            got[row_id] = tokens(batch.join(row_id, prompt, params).events)
        if r == 14:
            taken_back += batch.ahead is not None
            batch.leave("c")  # a cancel, between rounds
        taken_back += depth > 0 and batch.ahead is not None
        for row_id, out in batch.step(depth).items():
            got[row_id] += tokens(out.events)
        if not batch:
            break
    assert taken_back >= 4  # the joins at rounds 3 and 6, the drafting round, the leave
    assert got["s"] == tokens(alone["s"]) and len(got["s"]) == SAMPLED.max_tokens
    assert got["a"] == plain_greedy_prefix(lm, prompts[1], 12)
    assert got["b"] == plain_greedy_prefix(lm, prompts[2], 30)
    assert got["c"] == plain_greedy_prefix(lm, prompts[3], 30)[: len(got["c"])] and len(got["c"]) < 30


def test_rows_on_the_metal_kernel_branch_are_plain_greedy(bundled, metal_kernel, monkeypatch):
    """Metal's Gated DeltaNet branch (emulated, helpers/metal.py): the verify pass keeps replay tapes and
    the commit replays the rows that rejected drafts, all in one call; rows stay plain greedy."""
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS[:2]]
    limits = [24, 16]
    commits, replay_rows = [], rollback.replay_rows
    monkeypatch.setattr(rollback, "replay_rows", lambda *a: commits.append(a[-1]) or replay_rows(*a))
    rows = [(i, p, SamplingParams(max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, limits))]
    events, _ = drive(BatchSpeculator(lm), 3, {0: rows})
    for i, prompt in enumerate(prompts):
        assert tokens(events[i]) == plain_greedy(lm, prompt, limits[i]), f"row {i}"
    assert (2, 4) in [k[:2] for _, k, *_ in metal_kernel.calls]  # the verify of 2 rows x 4 tokens took it
    assert any(len(set(c)) > 1 for c in commits)  # a ragged commit, by replay


def test_rows_pinned_to_their_own_depths_share_rounds(bundled):
    """Ragged drafts: rows pinned at 0, 1 and 4 beside unpinned rows whose depth the rounds change; each
    drafts at its own depth in every round (a row at 0 never drafts) and every row is plain greedy;
    a sampled row pinned at 2 keeps its seed's tokens."""
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    pins = {"zero": 0, "one": 1, "four": 4, "free": None}
    batch, events = BatchSpeculator(lm), {}
    for i, (name, pin) in enumerate(pins.items()):
        events[name] = list(batch.join(name, prompts[i], SamplingParams(max_tokens=40), depth=pin).events)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=40, seed=7)
    events["seeded"] = list(batch.join("seeded", prompts[0], seeded, depth=2).events)
    r, schedule = 0, [2, 0, 3, 1]
    while batch:
        for name, out in batch.step(schedule[r % 4], schedule[(r + 1) % 4]).items():
            events[name] += out.events
        r += 1
    for i, name in enumerate(pins):
        assert tokens(events[name]) == plain_greedy(lm, prompts[i], 40), name
    depths = {name: {e.drafted for e in evs if isinstance(e, Round)} for name, evs in events.items()}
    assert depths["zero"] == set() and depths["one"] == {1} and depths["four"] <= {4} and depths["seeded"] == {2}
    assert depths["free"] == {1, 2, 3}  # the rounds' own depths (its depth-0 rounds drafted for the others)
    want = [e.id for e in generate(lm, prompts[0], seeded, SpecConfig("off")) if isinstance(e, Token)]
    assert tokens(events["seeded"]) == want  # plain mlx-lm's seeded text


def next_turn(lm, cache, prompt, n=30):
    """A request resumed from `cache`'s longest entry, drafting in a batch: (its tokens, its Resume)."""
    resume = cache.take(prompt, head_layers=len(lm.head.layers))
    batch = BatchSpeculator(lm)
    out = batch.join("next", prompt, SamplingParams(max_tokens=n), resume, cache.plan(len(prompt), (), len(resume)))
    got = tokens(out.events)
    while batch:
        for out in batch.step(3).values():
            got += tokens(out.events)
    return got, resume


def assert_resumes_exactly(lm, entries, prompts, delivered):
    """Each row's entry holds its prompt and delivered tokens but the last, with head rows; a next turn
    (the conversation so far and a new line) resumes at its end and answers as plain greedy decoding."""
    cache = PrefixCache()
    for i, entry in entries.items():
        assert list(entry.tokens) == prompts[i] + delivered[i][:-1], i
        assert entry.last_hidden is not None and {c.offset for c in entry.head_cache} == {len(entry.tokens) - 1}, i
        cache.put(entry)
    for i in entries:
        prompt = prompts[i] + delivered[i] + lm.tokenizer.encode("\n# next\n")
        got, resume = next_turn(lm, cache, prompt)
        assert len(resume) == len(prompts[i]) + len(delivered[i]) - 1 and resume.hidden is not None, i
        assert got == plain_greedy_prefix(lm, prompt, 30), i


@pytest.mark.parametrize("name", ["dyno-tiny", "dyno-tiny-moe"])
def test_rows_finishing_inside_a_round_keep_states_that_resume_exactly(bundled, name):
    """Rows end at max_tokens or EOS before their round's last token (the round committed tokens past
    it), several in one round: each settles to the tokens it emitted but the last."""
    lm = bundled(name)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    limits = [5, 6, 40, 9]  # the MoE model ends row 2 at EOS, its 7th token
    batch = BatchSpeculator(lm)
    got = {i: tokens(batch.join(i, p, SamplingParams(max_tokens=limits[i])).events) for i, p in enumerate(prompts)}
    left, finish = {}, {}
    while batch:
        for i, out in batch.step(3).items():
            got[i] += tokens(out.events)
            if out.finish:
                left[i], finish[i] = out.left, out.finish
    assert sum(len(x.row.generated) > len(got[i]) for i, x in left.items()) >= 2  # cut inside their rounds
    assert ("stop" in finish.values()) == (name == "dyno-tiny-moe")
    for i, prompt in enumerate(prompts):
        assert got[i] == plain_greedy_prefix(lm, prompt, limits[i]), i
    assert_resumes_exactly(lm, {i: x.settle(len(got[i])) for i, x in left.items()}, prompts, got)
    with pytest.raises(DynoError, match="already settled"):  # it let go of the round's caches and tapes
        left[0].settle(len(got[0]))


def test_a_batch_that_keeps_no_states_hands_none_back(bundled):
    """Without a prompt cache to keep them in, rows leave no state behind (nothing of the round held for
    them) and decode the same tokens."""
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS[:3]]
    batch = BatchSpeculator(lm, keep_states=False)
    got = {i: tokens(batch.join(i, p, SamplingParams(max_tokens=6 + i)).events) for i, p in enumerate(prompts)}
    while batch:
        for i, out in batch.step(3).items():
            got[i] += tokens(out.events)
            assert out.left is None
    assert all(got[i] == plain_greedy_prefix(lm, p, 6 + i) for i, p in enumerate(prompts))


def test_rows_stopped_inside_a_round_or_after_plain_rounds_keep_what_they_delivered(bundled):
    """A stop string after the first of a round's tokens: the row leaves between rounds and settles to
    the tokens delivered (its tape undoes the rest); a cancel after depth-0 rounds: the head rows they
    owe are run for that row alone. The rows staying stay plain greedy."""
    lm = bundled("dyno-tiny")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    batch = BatchSpeculator(lm)
    got = {i: tokens(batch.join(i, p, SamplingParams(max_tokens=40)).events) for i, p in enumerate(prompts)}
    delivered, entries = {}, {}

    def step(depth):
        outs = {i: tokens(out.events) for i, out in batch.step(depth).items()}
        for i, new in outs.items():
            got[i] += new
        return outs

    while 0 in batch:  # row 0 stops after the first token of the first round that gives it several
        new = step(3)[0]
        if len(new) > 1:
            delivered[0] = got[0][: len(got[0]) - len(new) + 1]
            entries[0] = batch.leave(0).settle(len(delivered[0]))
    for _ in range(3):
        step(0)
    assert batch.backlog  # the head owes row 1 the plain rounds' rows
    delivered[1] = got[1]
    entries[1] = batch.leave(1).settle(len(delivered[1]))
    while batch:
        step(3)
    for i in (2, 3):
        assert got[i] == plain_greedy_prefix(lm, prompts[i], 40), i
    assert delivered[0] == plain_greedy_prefix(lm, prompts[0], len(delivered[0]))
    assert delivered[1] == plain_greedy_prefix(lm, prompts[1], len(delivered[1]))
    assert_resumes_exactly(lm, entries, prompts, delivered)


def test_rows_joining_together_are_prefilled_together(bundled, monkeypatch):
    """Cold rows and two resumed ones (with head rows, and without: a shifted head), each with its own
    cuts, some cold ones shorter than the resumed ones' uncached tokens, are prefilled in one padded
    pass: every row stays plain greedy, a cold row's checkpoints are the single-row prefill's, a row
    ending at its first token settles to a state that resumes exactly, and a row whose processors
    raise at its first token fails alone."""
    lm = bundled("dyno-tiny")
    cache = PrefixCache()
    warm = []
    for text, mode in ((PROMPTS[0], "mtp"), (PROMPTS[1], "off")):
        first = lm.tokenizer.encode(text)
        done = list(generate(lm, first, SamplingParams(max_tokens=12), SpecConfig(mode, 3), prefix_cache=cache))
        warm.append(first + tokens(done) + lm.tokenizer.encode("\n# next\n"))
    prompts = {"short0": lm.tokenizer.encode("x ="), "short1": lm.tokenizer.encode("def"),
               "warm0": warm[0], "warm1": warm[1], "cold": lm.tokenizer.encode(PROMPTS[3]),
               "one": lm.tokenizer.encode(PROMPTS[2]), "raises": lm.tokenizer.encode(PROMPTS[0])}
    limits = {"short0": 20, "short1": 20, "warm0": 30, "warm1": 30, "cold": 30, "one": 1, "raises": 13}
    joiners = []
    for name, prompt in prompts.items():
        resume = cache.take(prompt, head_layers=len(lm.head.layers)) if name.startswith("warm") else None
        assert (resume is not None) == name.startswith("warm")
        cuts = cache.plan(len(prompt), (5, 11), len(resume) if resume else 0)
        joiners.append(Joiner(name, prompt, SamplingParams(max_tokens=limits[name]), resume, cuts))
    cold = next(j for j in joiners if j.row_id == "cold")
    uncached = {j.row_id: len(j.prompt) - len(j.resume or ()) for j in joiners}
    assert max(uncached["short0"], uncached["short1"]) < min(uncached["warm0"], uncached["warm1"])  # cold first
    assert len(set(uncached.values())) >= 5 and len(cold.cuts) >= 2  # padded

    real_process, real_hidden, widths = Row.process, lm.target.hidden, []

    def process(row, rows, drafts=None):
        if row.params.max_tokens == limits["raises"]:
            raise ValueError("a processor failed")
        return real_process(row, rows, drafts)

    def hidden(tokens, cache, *args, **kwargs):
        widths.append(tokens.shape[0])
        return real_hidden(tokens, cache, *args, **kwargs)

    monkeypatch.setattr(Row, "process", process)
    monkeypatch.setattr(lm.target, "hidden", hidden)
    batch = BatchSpeculator(lm)
    out = batch.join_all(joiners)
    groups = [{j.row_id for j in g} for g in prefill_groups(joiners)]
    assert {"short0", "short1", "warm0", "warm1"} <= groups[0] and min(map(len, groups)) > 1
    assert widths and set(widths) == {len(g) for g in groups}  # each prefill pass and last tokens' pass: a group at once
    assert isinstance(out["raises"].error, ValueError) and "raises" not in batch
    assert out["one"].finish == "length" and "one" not in batch
    got = {name: tokens(o.events) for name, o in out.items() if o.error is None}
    checkpoints = batch.rows[batch.ids.index("cold")].checkpoints
    monkeypatch.undo()
    while batch:
        for name, o in batch.step(3).items():
            got[name] += tokens(o.events)
    for name in set(prompts) - {"raises"}:
        assert got[name] == plain_greedy_prefix(lm, prompts[name], limits[name]), name

    alone = drafted(lm, SamplingParams(max_tokens=30), 3)  # prefilled alone
    next(alone.run(cold.prompt, None, cold.cuts))
    assert sorted(checkpoints) == sorted(alone.row.checkpoints) == sorted(cold.cuts)
    for at, want in alone.row.checkpoints.items():
        have = checkpoints[at]
        pairs = [(a, b) for x, y in zip(have.recurrent, want.recurrent) if x is not None for a, b in zip(x, y)]
        assert pairs and all(mx.array_equal(a, b).item() for a, b in pairs + [(have.hidden, want.hidden)]), at
    assert_resumes_exactly(lm, {"one": out["one"].left.settle(1)}, prompts, got)


def test_a_long_prompt_is_not_padded_onto_short_ones():
    """Joiners share a prefill while the padding stays small; a long prompt gets its own, after them."""
    def joiner(name, n, resumed=0):
        resume = Resume(resumed, []) if resumed else None
        return Joiner(name, list(range(n)), SamplingParams(), resume)

    joiners = [joiner("long", 3000), joiner("a", 40), joiner("b", 90), joiner("warm", 5000, resumed=4930),
               joiner("c", 30), joiner("longer", 3900)]
    assert [[j.row_id for j in g] for g in prefill_groups(joiners)] == [["c", "a", "warm", "b"], ["long", "longer"]]


def test_prompts_sharing_a_long_prefix_wait_for_each_other():
    """More than 64 shared leading tokens: a later wave (it resumes from the first one's state)."""
    system = list(range(100, 200))
    prompts = [system + [1, 2], [7, 8, 9], system + [3], system[:50] + [4], [7, 8, 9, 10], system + [5]]
    assert sharing_waves(prompts) == [[0, 1, 3, 4], [2], [5]]
