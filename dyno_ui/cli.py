"""`dyno`: the command line. Argument parsing lives here; everything else in the engine."""

import argparse
import json
import sys
from typing import List, Optional

from speculative.config import MAX_DRAFT_DEPTH, MODES, SamplingParams, SpecConfig
from speculative.errors import DynoError

from .models import default_model

HEAD_BITS_HELP = ("precision the MTP head is kept at in memory: 16 (as stored), 8 or 4 (its linear layers "
                  "quantized at load, group 64); default: follow the trunk (README, Head memory)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bundled dyno-tiny, or $DYNO_MODEL)")
    p.add_argument("--speculative", choices=MODES, default="auto",
                   help="auto: draft when the model has an MTP head (default); mtp: require one; off: plain decoding")
    p.add_argument("--draft-depth", type=_depth, default="auto", metavar="K",
                   help=f"tokens drafted per round, 1..{MAX_DRAFT_DEPTH}, or auto: the depth `dyno tune` "
                        f"stored for this model and machine, else a cost-model estimate (default: auto)")
    p.add_argument("--draft-vocab", type=_vocab, default=None, metavar="N|full",
                   help="tokens the draft step scores: the N most frequent (special tokens always kept), or "
                        "full (default); output stays exact either way (README, Draft vocabulary)")
    p.add_argument("--mtp-head", metavar="DIR", help="a standalone MTP head folder to use")
    p.add_argument("--mtp-head-bits", metavar="{16,8,4}", help=HEAD_BITS_HELP)
    p.add_argument("--mtp-base", metavar="REPO",
                   help="the original repository to take the head from (default: from the model card)")


def _int_or(word: str, value_for_word, what: str):
    """An argparse type: `word` (read as `value_for_word`) or an integer (range checked by SpecConfig)."""

    def parse(value: str):
        if value == word:
            return value_for_word
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} or {word}, got {value!r}") from None

    return parse


_depth = _int_or("auto", "auto", "an integer")  # --draft-depth
_vocab = _int_or("full", None, "a number of tokens")  # --draft-vocab: full is no restriction (None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dyno", description="Exact MTP speculative decoding for Qwen3.5/3.6/3.8 on MLX."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate text; greedy output is the model's own greedy text.")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text (raw unless --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=256, metavar="N", help="default: %(default)s")
    gen.add_argument("--temp", type=float, default=None, metavar="T",
                     help="temperature; 0 is greedy (default: the model's generation_config, else 0)")
    gen.add_argument("--top-p", type=float, default=None, metavar="P")
    gen.add_argument("--top-k", type=int, default=None, metavar="K")
    gen.add_argument("--min-p", type=float, default=None, metavar="M")
    gen.add_argument("--seed", type=int, default=None, metavar="S")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=cmd_generate)
    from .head_cli import add_commands as add_head_commands

    add_head_commands(sub)
    from .bench_cli import add_commands as add_bench_commands

    add_bench_commands(sub)
    from .serve import add_command as add_serve_command

    add_serve_command(sub)
    return parser


def sampling_from(args, generation_config: dict) -> SamplingParams:
    """Command-line values over the model's generation_config.json over greedy."""
    gc = generation_config if generation_config.get("do_sample", True) else {}

    def pick(flag, key, default):
        value = getattr(args, flag)
        return value if value is not None else gc.get(key, default)

    temperature = pick("temp", "temperature", 0.0)
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(pick("top_p", "top_p", 1.0)),
        top_k=int(pick("top_k", "top_k", 0)),
        min_p=float(pick("min_p", "min_p", 0.0)),
        max_tokens=args.max_tokens,
        seed=args.seed,
    )


def _notify(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    from speculative.engine import generate
    from speculative.loader import load_model
    from speculative.stats import GenerationStats

    if args.draft_depth != "auto":
        SpecConfig(args.speculative, args.draft_depth)  # validate before loading anything
    SpecConfig(draft_vocab=args.draft_vocab)
    if args.max_tokens < 1:
        raise DynoError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not args.prompt:
        raise DynoError("the prompt is empty")
    sampling_from(args, {})  # reject bad sampling flags before loading anything
    lm = load_model(args.model or default_model(), mode=args.speculative, mtp_head=args.mtp_head,
                    mtp_base=args.mtp_base, notify=_notify, head_bits=args.mtp_head_bits)
    params = sampling_from(args, lm.generation_config)
    from speculative.tuning import resolve_depth

    spec = SpecConfig(args.speculative, resolve_depth(lm, args.draft_depth), args.draft_vocab)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        prompt = lm.tokenizer.encode(args.prompt)
    if not prompt:
        raise DynoError("the prompt is empty")
    stats = GenerationStats(draft_depth=spec.draft_depth)
    detok = lm.tokenizer.detokenizer
    detok.reset()
    eos = lm.eos_token_ids
    for event in generate(lm, prompt, params, spec):
        stats.add(event)
        if hasattr(event, "id") and event.id not in eos:
            detok.add_token(event.id)
            segment = detok.last_segment  # reading it consumes it
            if segment and not args.json:
                sys.stdout.write(segment)
                sys.stdout.flush()
    detok.finalize()
    if args.json:
        done = stats.done
        print(json.dumps({
            "text": detok.text,
            "tokens": stats.tokens,
            "provenance": stats.provenance,
            "finish_reason": done.finish_reason,
            "speculative": stats.speculative_json(),
            "timing": {"prefill_s": done.prefill_s, "decode_s": done.decode_s,
                       "decode_tokens_per_s": stats.decode_tokens_per_s},
        }))
    else:
        sys.stdout.write(detok.last_segment + "\n")
        sys.stdout.flush()
    print(stats.summary_line(), file=sys.stderr)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except DynoError as e:
        print(f"dyno: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\ndyno: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
