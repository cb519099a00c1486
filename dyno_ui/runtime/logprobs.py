"""Engine log-probabilities (speculative.events.TokenLogprobs: token ids) as the APIs report them:
each token's own bytes and their text (runtime/outputs.TokenLogprob)."""

from typing import Dict

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

from speculative.events import TokenLogprobs

from .outputs import TokenLogprob


class TokenBytes:
    """Token id -> its bytes, through the tokenizer's own token map (mlx-lm's detokenizer reads
    the same one); memoized, as the top alternatives repeat."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = getattr(tokenizer, "_detokenizer", None)
        self.memo: Dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        if (known := self.memo.get(token)) is None:
            known = self.memo[token] = self._bytes(token)
        return known

    def _bytes(self, token: int) -> bytes:
        d = self.detokenizer
        tokenmap = getattr(d, "tokenmap", None)
        if isinstance(d, BPEStreamingDetokenizer) and token < len(tokenmap):  # GPT-2's bytes-as-characters
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in tokenmap[token])
        if isinstance(d, SPMStreamingDetokenizer) and token < len(tokenmap):
            return tokenmap[token].replace(SPMStreamingDetokenizer._sep, b" ")
        return self.tokenizer.decode([token]).encode("utf-8")


def described(names: TokenBytes, token: int, scores: TokenLogprobs) -> TokenLogprob:
    """The TokenLogprob of `token` (and its alternatives) from the engine's scores."""

    def one(t: int, logprob: float, top=()) -> TokenLogprob:
        raw = names(t)
        return TokenLogprob(raw.decode("utf-8", "replace"), tuple(raw), logprob, top)

    return one(token, scores.logprob, tuple(one(t, v) for t, v in scores.top))
