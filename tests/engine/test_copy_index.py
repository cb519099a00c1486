"""The copy drafter's index: the longest n-gram ending the context that occurred before, at its
latest earlier occurrence, and what followed it; built incrementally, the same as built at once."""

import random

import pytest

from speculative.round.copy_index import ContextIndex, Match


def brute_match(tokens, sizes):
    """The reference: for the longest size whose last n-gram occurred earlier, the latest earlier end."""
    for n in sorted(sizes, reverse=True):
        if len(tokens) < n:
            continue
        tail = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tail:
                return Match(n, end)
    return None


def test_nothing_matches_in_a_context_without_repeats():
    index = ContextIndex((4, 2))
    index.extend(range(50))
    assert index.match() is None and index.proposal(8) == []


def test_the_longest_size_wins_and_the_latest_occurrence():
    # "1 2 3 4 9" then "7 3 4 5" then "1 2 3 4": the 4-gram 1 2 3 4 occurred ending at 3, the 2-gram
    # 3 4 last ended at 6; the longest size is taken even though a shorter one is more recent.
    index = ContextIndex((4, 2))
    index.extend([1, 2, 3, 4, 9, 3, 4, 5, 1, 2, 3, 4])
    assert index.match() == Match(4, 3)
    assert index.proposal(3) == [9, 3, 4]
    index = ContextIndex((4, 2))
    index.extend([3, 4, 9, 3, 4, 5, 1, 3, 4])  # only 2-grams repeat: the latest earlier 3 4 ends at 4
    assert index.match() == Match(2, 4)
    assert index.proposal(2) == [5, 1]


def test_a_proposal_past_the_end_repeats_the_pattern():
    """A match that ends just before the end copies what it copies, as LZ77 does: a short period repeats."""
    index = ContextIndex((2,))
    index.extend([5, 1, 2, 1, 2])
    assert index.match() == Match(2, 2)
    assert index.proposal(5) == [1, 2, 1, 2, 1]
    index = ContextIndex((2,))
    index.extend([7, 7, 7])
    assert index.proposal(4) == [7, 7, 7, 7]


@pytest.mark.parametrize("sizes", [(2,), (3,), (4, 2), (8, 4, 2)])
def test_incremental_equals_the_brute_force_reference(sizes):
    rng = random.Random(len(sizes))
    tokens = [rng.randrange(6) for _ in range(400)]  # a small alphabet: many repeats of every size
    index = ContextIndex(sizes)
    done = 0
    while done < len(tokens):  # appended in uneven pieces, as rounds append their tokens
        step = rng.randrange(1, 7)
        index.extend(tokens[done : done + step])
        done = min(done + step, len(tokens))
        assert index.match() == brute_match(tokens[:done], sizes), done
    whole = ContextIndex(sizes)
    whole.extend(tokens)
    assert whole.match() == index.match() and whole.proposal(16) == index.proposal(16)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram sizes"):
        ContextIndex((0,))
    with pytest.raises(ValueError, match="n-gram sizes"):
        ContextIndex(())
