"""Runs Piper's own command line with onnxruntime limited to N threads: `python piper_launcher.py N <piper args>`.

Executed by the Python that has piper-tts installed, as a separate process (fishgate never imports Piper, which is
GPL-3.0). Piper creates its onnxruntime session with default options, whose thread pool takes every core of the
host; with one Piper process per core that is cores² spinning threads (load ≈ 180 on a 16-core machine, ~5× slower
per process). Standalone on purpose: no fishgate imports.
"""

import runpy
import sys
from collections.abc import Callable
from typing import Any

import onnxruntime

_SessionOptions = onnxruntime.SessionOptions


def _limited(threads: int) -> Callable[[], Any]:
    def options() -> Any:
        o = _SessionOptions()
        o.intra_op_num_threads = threads
        o.inter_op_num_threads = 1
        return o

    return options


if __name__ == "__main__":
    onnxruntime.SessionOptions = _limited(int(sys.argv[1]))
    sys.argv = ["piper", *sys.argv[2:]]
    runpy.run_module("piper", run_name="__main__", alter_sys=True)
