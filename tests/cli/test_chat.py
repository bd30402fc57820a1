"""`ember chat` as a person uses it: typed lines on stdin, commands, and Ctrl-C mid-answer."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def _as_at_a_terminal() -> None:
    # A chat started from a terminal gets Ctrl-C; a test run started in the background of a shell without job
    # control inherits SIGINT ignored, and so would the chat (then Ctrl-C is never seen, as in one CI run).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_chat(model_dir, *extra: str) -> subprocess.Popen:
    """`ember chat` on model_dir, with Ctrl-C as a terminal delivers it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "ember.cli.main", "chat", str(model_dir), "--temperature", "0", *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_as_at_a_terminal,
    )


def test_chat_turns_and_commands(tiny_llama_dir):
    proc = start_chat(tiny_llama_dir, "--max-new-tokens", "6")
    out, err = proc.communicate(
        "Hello there\n/system Be brief.\n/bogus\nSecond question\n/reset\n/quit\n", 120
    )
    assert proc.returncode == 0, err
    assert "(system message set, history cleared)" in err
    assert "unknown command '/bogus'" in err
    assert "(history cleared)" in err
    # Each line read prints a "> " prompt; an answer (ending in a newline) follows only the two questions.
    assert out.count("> ") == 6
    answers = [segment for segment in out.split("> ") if segment]
    assert len(answers) == 2 and all(a.endswith("\n") for a in answers)


def test_ctrl_c_stops_the_answer_and_keeps_the_chat(tiny_llama_dir):
    proc = start_chat(tiny_llama_dir, "--max-new-tokens", "450", "--max-seq-len", "512")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("Tell me a long story\n")
    proc.stdin.flush()
    # Wait until the answer is streaming, then press Ctrl-C.
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline and len(seen) < 20:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            seen += os.read(proc.stdout.fileno(), 64).decode(errors="replace")
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate("/quit\n", 60)
    assert proc.returncode == 0, err
    assert "[stopped]" in seen + out


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(tiny_llama_dir):
    # Under a UTF-8 locale without Python's UTF-8 mode, stdin decodes strictly: such a line used to end the chat
    # with "internal error (UnicodeDecodeError ...)" (under the C locale, with a TypeError from the tokenizer).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LC_ALL": "C.UTF-8", "PYTHONUTF8": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ember.cli.main", "chat", str(tiny_llama_dir), "--max-new-tokens", "6"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    out, err = proc.communicate(b"caf\xe9\n/system \xff\nHello there\n/quit\n", 120)
    err_text = err.decode()
    assert proc.returncode == 0, err_text
    assert "error: the message is not valid UTF-8 text (byte 0xe9 at character 3)" in err_text
    assert "error: the system message is not valid UTF-8 text (byte 0xff at character 0)" in err_text
    answers = [segment for segment in out.decode().split("> ") if segment]
    assert len(answers) == 1 and answers[0].endswith("\n"), out  # "Hello there" was answered
