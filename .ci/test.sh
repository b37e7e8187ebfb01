#!/usr/bin/env bash
# Installs everything the test suite needs into ./.venv (from scratch on a fresh machine) and runs it:
# lint (ruff), types (mypy), then pytest. This is the README's test command; .ci/run calls it from a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's chromium for the demo page test (playwright drives it; it never downloads a browser)
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# CPU torch first and pinned: a looser requirement resolved before it would pull gigabytes of CUDA wheels.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
