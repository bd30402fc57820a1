"""`ember chat`: an interactive multi-turn chat in the terminal.

Commands: /reset clears the history, /system TEXT sets the system message (and resets), /quit leaves.
Ctrl-C while an answer streams stops that answer and keeps the chat; Ctrl-C or Ctrl-D at the prompt leaves.
The oldest turns are dropped when the history no longer fits the context with room for an answer.
"""

from __future__ import annotations

import argparse
import sys

from ember.cli.common import (
    add_model_options,
    add_sampling_options,
    load_llm,
    sampling_params,
    stdin_keeps_bad_bytes,
)
from ember.errors import EmberError
from ember.tokenizer.tokenizer import check_text

HELP = "commands: /reset, /system TEXT, /quit"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal", description=__doc__)
    add_model_options(p, positional=True)
    add_sampling_options(p)
    p.add_argument("--system", default=None, help="initial system message")
    p.set_defaults(run=run)


def fit_history(llm, system: list[dict], turns: list[dict], room: int) -> tuple[list[dict], list[int]]:
    """Drops the oldest user/assistant pairs until the prompt leaves `room` tokens; returns (turns, ids)."""
    while True:
        ids = llm.encode_chat(system + turns)
        if len(ids) + room <= llm.context or len(turns) <= 1:
            return turns, ids
        turns = turns[2:]


def refused(text: str, what: str) -> bool:
    """Whether a typed line is refused (not UTF-8: `check_text`), said on stderr; the chat goes on."""
    try:
        check_text(text, what)
    except EmberError as e:
        print(f"error: {e}", file=sys.stderr)
        return True
    return False


def run(args: argparse.Namespace) -> int:
    if args.system:
        check_text(args.system, "--system")
    llm = load_llm(args)
    if llm.tokenizer.chat_template is None:
        raise EmberError(
            f"{llm.loaded.name} has no chat template; use `ember generate --no-chat` for completion"
        )
    params = sampling_params(args, llm.loaded.generation_defaults)
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict] = []
    print(f"ember chat with {llm.loaded.name} ({HELP})", file=sys.stderr)
    stdin_keeps_bad_bytes()
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            turns = []
            print("(history cleared)", file=sys.stderr)
            continue
        if text.startswith("/system"):
            content = text[len("/system") :].strip()
            if refused(content, "the system message"):
                continue
            system = [{"role": "system", "content": content}] if content else []
            turns = []
            print("(system message set, history cleared)", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}; {HELP}", file=sys.stderr)
            continue
        if refused(line, "the message"):
            continue
        turns.append({"role": "user", "content": line})
        turns, prompt_ids = fit_history(llm, system, turns, params.max_tokens or 0)
        answer = ""
        try:
            for chunk in llm.stream_ids(prompt_ids, params):
                answer += chunk.text
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        except EmberError as e:
            turns.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        turns.append({"role": "assistant", "content": answer})
