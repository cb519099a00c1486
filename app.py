"""Dyno's playground: `python app.py [--model PATH]` serves the Gradio UI at / (and /ui) in front of
the same FastAPI app and engine thread as `dyno serve` (the OpenAI API stays at /v1)."""

import argparse
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def main(argv=None) -> int:
    from dyno_ui.cli.common import access_options, add_access_args, add_model_args, add_thinking_arg, model_options
    from dyno_ui.options import ServeOptions
    from dyno_ui.server.run import run
    from dyno_ui.device import device_from_env
    from speculative.errors import DynoError

    parser = argparse.ArgumentParser(prog="app.py", description="The Dyno playground (Gradio) and OpenAI API.")
    add_model_args(parser)
    parser.add_argument("--host", default=ServeOptions.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 7860)),
                        help="port (default: $PORT or %(default)s; 0 picks a free one)")
    add_access_args(parser)
    add_thinking_arg(parser)
    args = parser.parse_args(argv)
    try:
        device_from_env()
        return run(ServeOptions(model=model_options(args), host=args.host, port=args.port, ui_front=True,
                                default_thinking=args.default_thinking, **access_options(args)))
    except DynoError as e:
        print(f"dyno: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
