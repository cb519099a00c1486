"""Flags several commands share, and how they become options."""

import argparse
import sys

from speculative.config import MAX_DRAFT_DEPTH, MODES

from ..options import ModelOptions

HEAD_BITS_HELP = ("precision the MTP head is kept at in memory: 16 (as stored), 8 or 4 (its linear layers "
                  "quantized at load, group 64); default: follow the trunk (README, Head memory)")


def int_or(word: str, value_for_word, what: str):
    """An argparse type: `word` (read as `value_for_word`) or an integer (range checked by SpecConfig)."""

    def parse(value: str):
        if value == word:
            return value_for_word
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} or {word}, got {value!r}") from None

    return parse


draft_depth = int_or("auto", "auto", "an integer")  # --draft-depth
draft_vocab = int_or("full", None, "a number of tokens")  # --draft-vocab: full is no restriction (None)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bundled dyno-tiny, or $DYNO_MODEL)")
    p.add_argument("--speculative", choices=MODES, default="auto",
                   help="auto: draft when the model has an MTP head (default); mtp: require one; off: plain decoding")
    p.add_argument("--draft-depth", type=draft_depth, default="auto", metavar="K",
                   help=f"tokens drafted per round, 1..{MAX_DRAFT_DEPTH}, or auto: the depth `dyno tune` "
                        f"stored for this model and machine, else a cost-model estimate (default: auto)")
    p.add_argument("--draft-vocab", type=draft_vocab, default=None, metavar="N|full",
                   help="tokens the draft step scores: the N most frequent (special tokens always kept), or "
                        "full (default); output stays exact either way (README, Draft vocabulary)")
    p.add_argument("--mtp-head", metavar="DIR", help="a standalone MTP head folder to use")
    p.add_argument("--mtp-head-bits", metavar="{16,8,4}", help=HEAD_BITS_HELP)
    p.add_argument("--mtp-base", metavar="REPO",
                   help="the original repository to take the head from (default: from the model card)")


def model_options(args: argparse.Namespace) -> ModelOptions:
    """The model flags as options, checked."""
    return ModelOptions(model=args.model, speculative=args.speculative, draft_depth=args.draft_depth,
                        draft_vocab=args.draft_vocab, mtp_head=args.mtp_head, mtp_head_bits=args.mtp_head_bits,
                        mtp_base=args.mtp_base)


def notify(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
