"""Flags several commands share, and how they become options."""

import argparse
import os
import sys

from speculative.config import COPY_SOURCES, MAX_DRAFT_DEPTH, MODES

from ..options import ModelOptions

MODEL_HELP = ("model folder or Hugging Face repo id (ORG/NAME: the local Hugging Face cache, else downloaded; "
              "HF_HUB_OFFLINE=1 prevents that); default: $DYNO_MODEL, else the bundled dyno-tiny")
HEAD_BITS_HELP = ("precision the MTP head is kept at in memory: 16 (as stored), 8 or 4 (its linear layers "
                  "quantized at load, group 64); default: follow the trunk (docs/heads.md, Head memory)")


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
DRAFT_VOCAB_HELP = ("tokens the draft step scores: N (the model's N likeliest, special tokens always kept), auto "
                    "(N from the model's ranking; the whole vocabulary where a subset cannot pay; default) or full; "
                    "output stays exact either way (docs/heads.md, Draft vocabulary)")


COPIES_HELP = ("drafts copied from the context where the latest tokens occurred before (up to 16 a round): on, "
               "beside the head's drafts; off: the head alone; only: copies alone; output stays exact either way "
               "(default: %(default)s)")


def draft_vocab(value: str):
    """--draft-vocab: full is no restriction (None), digits a number; anything else ("auto" and typos alike)
    goes on to SpecConfig's check, which names what is allowed in one line."""
    if value == "full":
        return None
    try:
        return int(value)
    except ValueError:
        return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--speculative", choices=MODES, default=ModelOptions.speculative,
                   help="auto: draft when the model has an MTP head; mtp: require one; off: plain decoding "
                        "(default: %(default)s)")
    p.add_argument("--draft-depth", type=draft_depth, default=ModelOptions.draft_depth, metavar="K",
                   help=f"tokens drafted per round, 1..{MAX_DRAFT_DEPTH}, or auto: the depth `dyno tune` "
                        f"stored for this model and machine, else a cost-model estimate (default: %(default)s)")
    p.add_argument("--draft-vocab", type=draft_vocab, default=ModelOptions.draft_vocab, metavar="N|auto|full",
                   help=DRAFT_VOCAB_HELP)
    p.add_argument("--copies", choices=COPY_SOURCES, default=ModelOptions.copies, help=COPIES_HELP)
    p.add_argument("--mtp-head", metavar="DIR",
                   help="the MTP head to use: a head folder, a checkpoint of the same architecture with its head "
                        "embedded, or a repo id")
    p.add_argument("--mtp-head-bits", metavar="{16,8,4}", help=HEAD_BITS_HELP)
    p.add_argument("--mtp-base", metavar="REPO",
                   help="the original repository (or checkpoint folder) to take the head from (default: from the model card)")
    p.add_argument("--distributed", choices=("pipeline", "tensor"),
                   help="split the model across the ranks `mlx.launch` started, by layers (pipeline) or "
                        "within layers (tensor); drafting stays on (docs/distributed.md)")


def model_options(args: argparse.Namespace) -> ModelOptions:
    """The model flags as options, checked."""
    return ModelOptions(model=args.model, speculative=args.speculative, draft_depth=args.draft_depth,
                        draft_vocab=args.draft_vocab, mtp_head=args.mtp_head, mtp_head_bits=args.mtp_head_bits,
                        mtp_base=args.mtp_base, distributed=args.distributed, copies=args.copies)


def add_access_args(p: argparse.ArgumentParser) -> None:
    """Who may call the API: a key, browser origins, and the model names requests may use."""
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("DYNO_API_KEY"),
                   help="require this key on /v1/* (Authorization: Bearer KEY or x-api-key: KEY) and at the "
                        "playground's login page (default: $DYNO_API_KEY; none: open)")
    p.add_argument("--allowed-origins", metavar="ORIGIN[,ORIGIN]", action="append", default=[],
                   help="browser origins allowed to call the API (CORS), e.g. https://app.example.com, or *; "
                        "repeatable or comma-separated (default: none)")
    p.add_argument("--allowed-hosts", metavar="NAME[,NAME]", action="append", default=[],
                   help="Host header names served besides the bound address, localhost and loopback "
                        "(a name this machine is reached by; .example.com: the domain and below; *: any); "
                        "other names get a 403, against DNS rebinding")
    p.add_argument("--max-body-bytes", metavar="SIZE", default="32MiB",
                   help="the largest request body (e.g. 64MiB); larger ones get a 413 (default: 32MiB)")
    p.add_argument("--served-model-name", metavar="NAME", action="append", default=[],
                   help="a model id requests may use besides the folder name; repeatable")


def add_thinking_arg(p: argparse.ArgumentParser) -> None:
    """How an Anthropic request without `thinking` is read."""
    p.add_argument("--default-thinking", action="store_true",
                   help="Anthropic requests without a `thinking` field keep the chat template's default "
                        "(thinking on for Qwen3.5) instead of none, which is what Anthropic's API means")


def access_options(args: argparse.Namespace) -> dict:
    """The access flags as ServeOptions fields."""
    origins = [o.strip() for value in args.allowed_origins for o in value.split(",") if o.strip()]
    hosts = [h.strip() for value in args.allowed_hosts for h in value.split(",") if h.strip()]
    return dict(api_key=args.api_key or None, allowed_origins=tuple(origins), allowed_hosts=tuple(hosts),
                max_body_bytes=args.max_body_bytes, served_model_names=tuple(args.served_model_name))


def notify(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
