"""`dyno serve`: the flags, as ServeOptions for the server."""

from ..options import DEFAULT_BATCH_WIDTH, ServeOptions
from .common import access_options, add_access_args, add_model_args, add_thinking_arg, model_options


def add_command(sub) -> None:
    """Register `dyno serve` on the CLI's subparsers."""
    p = sub.add_parser("serve", help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
                       description="An OpenAI-compatible server with the Anthropic Messages API beside it; MTP "
                                   "drafting on when it is safe and exact.")
    add_model_args(p)
    p.add_argument("--host", default=ServeOptions.host, help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=ServeOptions.port, help="port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--decode-concurrency", type=concurrency, default=ServeOptions.decode_concurrency,
                   metavar="N|auto",
                   help="requests decoded together, batched and drafting in batches when the model has an MTP head; "
                        f"1 decodes one at a time (default: %(default)s, up to {DEFAULT_BATCH_WIDTH} within "
                        "--max-batch-memory; 1 with --distributed)")
    p.add_argument("--max-batch-memory", metavar="SIZE",
                   help="memory batched requests may hold (keys, values and states for prompt + max_tokens, "
                        "estimated), e.g. 8GB; more wait (default: 1/4 of what the model leaves of the recommended "
                        "working set, or of RAM)")
    p.add_argument("--max-queue", type=int, default=ServeOptions.max_queue, metavar="N",
                   help="requests that may wait for the engine; more are refused with 503 and Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens-default", type=int, default=ServeOptions.max_tokens_default, metavar="N",
                   help="max_tokens for requests that do not set it (default: %(default)s)")
    p.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="tokens a chat answer may think (inside <think>) before the server closes the block with "
                        "Qwen's closing phrase, for requests that set no budget (default: unlimited)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the Gradio playground at /ui")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in requests (10 s, --max-image-bytes); off: data: URLs only")
    p.add_argument("--max-images", type=int, default=ServeOptions.max_images, metavar="N",
                   help="images per request (default: %(default)s)")
    p.add_argument("--max-image-bytes", default=ServeOptions.max_image_bytes, metavar="SIZE",
                   help="encoded size per image, e.g. 20MiB (default: %(default)s bytes)")
    p.add_argument("--max-image-pixels", type=int, default=ServeOptions.max_image_pixels, metavar="N",
                   help="width x height per image, before the model's own resizing (default: %(default)s)")
    p.add_argument("--prompt-cache-bytes", metavar="SIZE",
                   help="memory kept for reusing earlier prompts' states, e.g. 8GB, 512MiB, 0 for none "
                        "(default: 1/8 of what the model leaves of the recommended working set, or of RAM)")
    p.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="keep prompt states evicted from memory, and on shutdown the live ones, as files in DIR, "
                        "reused after a restart (default: none)")
    p.add_argument("--prompt-cache-disk-bytes", metavar="SIZE",
                   help="the most DIR may hold for this model (default: half the free space, at most 4x the "
                        "default memory budget)")
    add_access_args(p)
    add_thinking_arg(p)
    p.set_defaults(func=cmd_serve)


def concurrency(value: str):
    """--decode-concurrency: a number, or auto (ServeOptions checks the range, as for every flag)."""
    return value if value == "auto" else int(value) if value.strip().lstrip("-").isdigit() else value


def options_from(args) -> ServeOptions:
    return ServeOptions(model=model_options(args), host=args.host, port=args.port,
                        decode_concurrency=args.decode_concurrency, max_tokens_default=args.max_tokens_default,
                        reasoning_budget=args.reasoning_budget,
                        ui=not args.no_ui, prompt_cache_bytes=args.prompt_cache_bytes,
                        prompt_cache_dir=args.prompt_cache_dir, prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
                        max_batch_memory=args.max_batch_memory, max_queue=args.max_queue,
                        default_thinking=args.default_thinking, allow_image_urls=args.allow_image_urls,
                        max_images=args.max_images, max_image_bytes=args.max_image_bytes,
                        max_image_pixels=args.max_image_pixels, **access_options(args))


def cmd_serve(args) -> int:
    from ..server.run import run

    return run(options_from(args))
