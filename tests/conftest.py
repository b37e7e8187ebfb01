"""Session-wide test set-up.

CPython 3.11 (and 3.12 before its backported fix) keeps `ast.parse`'s recursion-depth counter in interpreter-wide state (gh-106905), so two threads
parsing at once can corrupt it and one of them raises `SystemError: AST constructor recursion depth mismatch`.
In this suite that happens when pytest parses a failing test's source to print it while a server thread formats a
logged traceback (3.11's traceback module parses each line to place its carets): pytest then dies with an
INTERNALERROR and the failure it was about to report is lost. One lock around `ast.parse` serializes the parsers.
"""

from __future__ import annotations

import ast
import threading

_parse = ast.parse
_parse_lock = threading.RLock()


def _serialized_parse(*args, **kwargs):
    with _parse_lock:
        return _parse(*args, **kwargs)


ast.parse = _serialized_parse  # type: ignore[assignment]
