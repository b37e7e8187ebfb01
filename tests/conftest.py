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
import sys
import threading

import pytest

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


@pytest.fixture(autouse=True)
def _no_saved_regions_after_a_test():
    """A Backend that compiles turns on saving compiled regions process-wide (model.saved_regions); the tests after it
    start with saving off, as a new process would."""
    yield
    saved = sys.modules.get("model.saved_regions")
    if saved is not None and saved.folder() is not None:
        saved.save_in(None)
