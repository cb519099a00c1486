"""A broken head served with `--speculative auto` and batched drafting (--decode-concurrency 2): the
answers stay plain decoding's, one notice, plain rounds from the collapse on, and /stats and /metrics
say so (the serial engine's side: tests/engine/test_head_health.py)."""

import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.broken_heads import zeroed_fc_head
from helpers.reference import plain_greedy
from helpers.serving import MODEL_ID, detokenize, running_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

PROMPT = "# Copyright"  # the bundled model is confident over most of it (test_head_health.py)


def test_collapsed_head_stops_batched_drafting_and_shows_in_stats(tmp_path):
    head = zeroed_fc_head(tmp_path / "zeroed-fc")
    with running_server(BUNDLED_MODEL, SpecConfig("auto", 1), decode_concurrency=2, drafting_batch=True,
                        load_kw={"mtp_head": str(head)}) as server:
        lm = server.served.lm
        assert server.stats()["mtp_head"]["health"] == {"status": "checking", "confident_drafts": 0, "accepted": 0}
        assert server.metrics()["mlx:mtp_head_collapsed"] == 0
        reference = plain_greedy(lm, lm.tokenizer.encode(PROMPT), 80)

        def answer(n):
            out = server.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=n, temperature=0)
            return out.choices[0].text

        assert answer(80) == detokenize(lm, reference)
        stats = server.stats()
        assert stats["mtp_head"]["health"] == {"status": "collapsed", "confident_drafts": 64, "accepted": 0}
        assert server.metrics()["mlx:mtp_head_collapsed"] == 1
        # It stopped drafting mid-request: fewer drafts than the request's 79 rounds had.
        drafted = stats["speculative"]["draft_tokens"]
        assert 64 <= drafted < 79
        assert len([n for n in lm.notices if "MTP head from" in n]) == 1
        assert answer(16) == detokenize(lm, reference[:16])
        assert server.stats()["speculative"]["draft_tokens"] == drafted  # no drafts at all now
