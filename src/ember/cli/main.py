"""`ember` entry point: parses the subcommand, sets up logging, and turns user errors into one line.

Every subcommand module exposes `add_parser(subparsers)` and `run(args) -> int`. An EmberError is printed as
`error: <message>` with exit code 1; nothing a user can cause prints a traceback (`--verbose` shows them).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

SUBCOMMANDS = ("generate", "chat", "serve", "browser", "list", "download", "bench", "eval")


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
    try:  # Ctrl-C while torch and the subcommands import (seconds) is an exit too, not a traceback
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
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
    except BrokenPipeError:
        # The reader of stdout left (`ember generate ... | head -c 10`): stop quietly, as a process killed by
        # SIGPIPE does, and send what is still buffered nowhere, so that the exit flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
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
