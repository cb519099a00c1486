"""`dyno generate`: one prompt, text streamed to stdout, the drafting summary on stderr."""

import json
import sys
from functools import partial

from speculative.config import SamplingParams
from speculative.errors import DynoError

from ..paths import default_model
from .common import add_model_args, model_options, notify


def add_command(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate text; greedy output is the model's own greedy text.")
    add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text (raw unless --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image the prompt is about (repeatable; a vision-language checkpoint and "
                          "pip install 'dyno-mlx[vision]'); without --chat each goes before the prompt")
    gen.add_argument("--max-tokens", type=int, default=SamplingParams.max_tokens, metavar="N",
                     help="default: %(default)s")
    gen.add_argument("--temp", type=float, default=None, metavar="T",
                     help="temperature; 0 is greedy (default: the model's generation_config, else 0)")
    gen.add_argument("--top-p", type=float, default=None, metavar="P")
    gen.add_argument("--top-k", type=int, default=None, metavar="K")
    gen.add_argument("--min-p", type=float, default=None, metavar="M")
    gen.add_argument("--seed", type=int, default=None, metavar="S")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=cmd_generate)


def sampling_from(args, generation_config: dict) -> SamplingParams:
    """Command-line values over the model's generation_config.json over greedy."""
    return SamplingParams.from_generation_config(
        generation_config, temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed)


def cmd_generate(args) -> int:
    from speculative import generate, load_model

    options = model_options(args)  # every flag checked before anything is loaded
    if args.max_tokens < 1:
        raise DynoError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not args.prompt:
        raise DynoError("the prompt is empty")
    sampling_from(args, {})
    images = [_read_image(p) for p in args.image]
    if options.distributed:
        if images:
            raise DynoError("--image is not supported with --distributed")
        return _generate_split(args, options)
    lm, spec = load_model(options.model or default_model(), **options.load_args(), draft_depth=options.draft_depth,
                          draft_vocab=options.draft_vocab, notify=notify)
    return _run(args, lm, spec, generate, images)


def _generate_split(args, options) -> int:
    """`mlx.launch ... dyno generate --distributed S`: every rank loads its part; rank 0 tokenizes,
    generates and prints, the others follow its rounds until it releases them."""
    from speculative import distributed, load_model

    member = distributed.Member(options.distributed)
    try:
        lm, spec = load_model(options.model or default_model(), **options.load_args(), draft_depth=options.draft_depth,
                              draft_vocab=options.draft_vocab, notify=notify if member.leader else None, split=member)
        if not member.leader:
            distributed.follow(lm)
            return 0
        try:
            return _run(args, lm, spec, distributed.generate)
        finally:
            distributed.release(lm)
    finally:
        member.close()


def _read_image(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DynoError(f"cannot read image {path}: {e.strerror}") from None


# How Qwen3.5's chat template renders an image part: the prompt's images go before its text so.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _run(args, lm, spec, generate, images=()) -> int:
    """Tokenize, generate with `generate` (one process's engine or the split one), print."""
    from speculative.loader.vision import images_for
    from speculative.stats import GenerationStats

    params = sampling_from(args, lm.generation_config)
    if images and lm.vision is None:
        raise DynoError(lm.vision_error)
    text = IMAGE_PLACEHOLDER * len(images) + args.prompt  # what any template makes of it: images, then text
    if args.chat:
        messages = [{"role": "user", "content": text}]
        prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        prompt = lm.tokenizer.encode(text)
    if not prompt:
        raise DynoError("the prompt is empty")
    prompt, vision = images_for(lm, prompt, images)
    if vision is not None:
        generate = partial(generate, vision=vision)
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
            # draft_vocab: the tokens the drafts scored (--draft-vocab auto resolved; null: all)
            "speculative": {**stats.speculative_json(), "draft_vocab": spec.draft_vocab if stats.speculative else None},
            "timing": {"prefill_s": done.prefill_s, "decode_s": done.decode_s,
                       "decode_tokens_per_s": stats.decode_tokens_per_s},
        }))
    else:
        sys.stdout.write(detok.last_segment + "\n")
        sys.stdout.flush()
    print(stats.summary_line(), file=sys.stderr)
    return 0
