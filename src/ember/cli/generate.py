"""`ember generate PROMPT`: one answer, streamed to stdout (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ember.cli.common import (
    add_model_options,
    add_sampling_options,
    load_llm,
    sampling_params,
    stdin_keeps_bad_bytes,
)
from ember.engine.generate import check_fits
from ember.tokenizer.tokenizer import check_text

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate an answer to one prompt", description=__doc__)
    p.add_argument("prompt", help="the prompt ('-' reads it from standard input)")
    add_model_options(p)
    add_sampling_options(p)
    p.add_argument("--no-chat", action="store_true", help="send the raw prompt, without the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, timings")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.prompt == "-":
        stdin_keeps_bad_bytes()
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    check_text(prompt)
    if args.system is not None:
        check_text(args.system, "--system")
    llm = load_llm(args)
    params = sampling_params(args, llm.loaded.generation_defaults)
    chat = not args.no_chat
    if chat and llm.tokenizer.chat_template is None:
        log.warning(
            "%s has no chat template (a base model?); completing the raw prompt instead (--no-chat says so)",
            llm.loaded.name,
        )
        chat = False
    if chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt_ids = llm.encode_chat(messages)
    else:
        prompt_ids = llm.encode_prompt(prompt)
    check_fits(len(prompt_ids), params.max_tokens, llm.context, name="--max-new-tokens ")

    start = time.perf_counter()
    text, ids, finish = "", [], None
    for chunk in llm.stream_ids(prompt_ids, params):
        text += chunk.text
        ids += chunk.token_ids
        finish = chunk.finish_reason or finish
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    total = time.perf_counter() - start
    t = llm.generator.timings
    if args.json:
        record = {
            "model": llm.loaded.name,
            "text": text,
            "token_ids": ids,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "finish_reason": finish,
            "timings": {
                "load_s": round(llm.loaded.load_s, 4),
                "time_to_first_token_s": round(t.first_token_s, 4),
                "prefill_tokens_per_s": round(t.prefill_tokens_per_s, 2),
                "decode_tokens_per_s": round(t.decode_tokens_per_s, 2),
                "total_s": round(total, 4),
            },
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        log.info(
            "%d prompt tokens, %d generated (%s); prefill %.1f tok/s, decode %.1f tok/s",
            len(prompt_ids),
            len(ids),
            finish,
            t.prefill_tokens_per_s,
            t.decode_tokens_per_s,
        )
    return 0
