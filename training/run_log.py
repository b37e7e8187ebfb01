"""A training run's log: one JSON object per line in a file, echoed to stdout as it is written."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def jsonl_log(path: Path) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Yields `log(entry)`: appends the entry to `path` (flushed, so a killed run keeps it) and prints it."""
    with path.open("a") as f:

        def log(entry: dict[str, Any]) -> None:
            line = json.dumps(entry)
            f.write(line + "\n")
            f.flush()
            print(line, flush=True)

        yield log
