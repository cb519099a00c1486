"""`dyno`: the command line, one module per command. Nothing else imports this package."""

import argparse
import sys
from typing import List, Optional

from speculative.errors import DynoError

from . import bench, generate, heads, launch, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dyno", description="Exact MTP speculative decoding for Qwen3.5/3.6/3.8 on MLX."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_command(sub)
    heads.add_commands(sub)
    bench.add_commands(sub)
    serve.add_command(sub)
    launch.add_command(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv, client_args = launch.split_client_args(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    if client_args is not None:
        args.client_args = client_args
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        from dyno_ui.device import device_from_env  # here: it imports MLX, which --help does not need

        device_from_env()
        return args.func(args)
    except DynoError as e:
        print(f"dyno: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\ndyno: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
