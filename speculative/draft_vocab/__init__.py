"""The draft vocabulary: the draft step's lm_head over a subset (head), and the ranking that picks it (rank)."""
