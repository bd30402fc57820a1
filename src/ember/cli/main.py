"""`ember` entry point: parses the subcommand, sets up logging, and turns user errors into one line.

Every subcommand module exposes `add_parser(subparsers)` and `run(args) -> int`. An EmberError is printed as
`error: <message>` with exit code 1; nothing a user can cause prints a traceback (`--verbose` shows them).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ("generate", "chat", "serve", "browser", "list", "download", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember", description="Run open large language models with PyTorch, anywhere PyTorch runs."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"ember.cli.{name.replace('list', 'list_models')}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from ember.errors import EmberError

    try:
        return args.run(args)
    except EmberError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            raise
        print(
            f"error: internal error ({type(e).__name__}: {e}); run with --verbose for details",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
