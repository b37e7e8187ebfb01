"""Run a test script under Triton's CPU interpreter, in a subprocess: the interpreter is chosen when a module's
kernels are defined (at import), so a test process that imported them compiled cannot switch. The script ends by
printing "ok"; anything else (an assertion, an exception, no "ok") fails the calling test with its output."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, timeout_s: float = 600) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-3000:]
