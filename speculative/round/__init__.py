"""The speculative round and what it runs per row: the round for B >= 1 rows (rounds.py), a request's
row (row.py), its sampling, processors and acceptance rules, its tokens' log-probabilities, and the
policy that picks a batched round's depth."""
