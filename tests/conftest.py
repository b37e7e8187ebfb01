"""Session-wide test set-up.

CPython 3.11 (and 3.12 before its backported fix) keeps `ast.parse`'s recursion-depth counter in interpreter-wide
state (gh-106905), so a second parse that starts while one is building its tree corrupts it, and the first raises
`SystemError: AST constructor recursion depth mismatch`. In this suite that happened while pytest parsed a failing
test's source to print it: a garbage collection inside the parse ran the finalizer of a leaked asyncio object,
which logged a traceback, and 3.11's traceback module parses each line to place its carets. Pytest then died with
an INTERNALERROR and the failure it was about to report was lost. So: no collection during a parse, one parse at a
time across threads, and a parse nested in another on the same thread (a finalizer that still ran) gets a
SyntaxError, which the traceback module takes as "no carets".
"""

from __future__ import annotations

import ast
import gc
import threading

_parse = ast.parse
_parse_lock = threading.Lock()
_parsing = threading.local()


def _serialized_parse(*args, **kwargs):
    if getattr(_parsing, "active", False):
        raise SyntaxError("ast.parse re-entered on this thread (tests/conftest.py)")
    with _parse_lock:
        _parsing.active = True
        collecting = gc.isenabled()
        gc.disable()
        try:
            return _parse(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()
            _parsing.active = False


ast.parse = _serialized_parse  # type: ignore[assignment]
