"""Compiled regions saved to disk whole, so that a later start loads them instead of tracing them again.

A warm start through torch.compile finds inductor's code in its cache, yet dynamo still traces every region variant
(each batch bucket and shape) in Python before it gets there: on a GPU that was most of a warm engine start. Here
each variant that `model.compiled_regions` compiles with inductor is compiled by dynamo's `aot_compile` instead,
written to one file (its bytecode, guards and inductor's code), and at the next start loaded from that file without
tracing. A loaded variant still checks its guards on every call; one that refuses its arguments, or a file that
cannot be saved or read, falls back to torch.compile's own path with one warning. Those guards do not check module
globals, so the package's switches (`switches()`) name the file instead; a switch changed within one process takes
effect at the next model.compiled_regions.reset(), as the engine sets them all before it compiles.

The file name hashes what the compiled code depends on besides the guards it carries: the region, its shapes and
arguments, the compile options, this package's source and switches, the Python and torch versions and the GPU. A
change to any of them writes new files next to the old ones; deleting the folder (it lives in the compile cache
folder) forgets them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fishgate.compile")

NOT_SAVED = object()  # run's answer where the variant takes torch.compile's own path

_lock = threading.RLock()  # one compile at a time: dynamo is not safe to trace from two threads
_state: dict[str, Any] = {"folder": None, "salt": "", "write_failed": False}
_loaded: dict[tuple[Any, ...], Callable[..., Any] | None] = {}  # key → loaded variant, or None: torch.compile's path
_counts = {"regions_loaded": 0, "regions_saved": 0, "regions_refused": 0}
# dynamo's dimension marks on a tensor: needed to compile a symbolic variant, refused by a loaded one's guards
_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_has_dynamo_dim_marking")


def save_in(folder: Path | None) -> None:
    """Save every region variant compiled from now on under `folder` and load those saved there before (None: off,
    every variant takes torch.compile's path)."""
    with _lock:
        _loaded.clear()
        _state["folder"] = folder
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        _counts.update(dict.fromkeys(_counts, 0))
        _state["write_failed"] = False
        # torch.compile's wrappers offer aot_compile only with this switch (off by default before torch 2.13)
        if hasattr(torch._dynamo.config, "enable_aot_compile"):
            torch._dynamo.config.enable_aot_compile = True
        h = hashlib.sha256(f"{sys.version}|{torch.__version__}".encode())
        for path in sorted(Path(__file__).parent.glob("*.py")):
            h.update(path.name.encode() + path.read_bytes())
            if path.stem != "__init__":  # every module's switches present from now on, whichever a caller imported
                importlib.import_module(f"{__package__}.{path.stem}")
        if torch.cuda.is_available():
            h.update(torch.cuda.get_device_name().encode())
        _state["salt"] = h.hexdigest()


def forget() -> None:
    """Drop the variants loaded or compiled in this process (model.compiled_regions.reset): the next call of each
    finds its file again, named for the switches as they are then."""
    with _lock:
        _loaded.clear()


def folder() -> Path | None:
    return _state["folder"]


def counts() -> dict[str, int]:
    """Variants loaded from files, compiled and saved, and refused (torch.compile's path) since save_in; {} when off."""
    return dict(_counts) if _state["folder"] is not None else {}


def run(
    fn: Callable[..., Any], compiled: Any, variant: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """fn(*args, **kwargs) through its saved variant, loading or compiling and saving it first; NOT_SAVED where it
    has none. `compiled` is torch.compile's wrapper of fn with the variant's options; `variant` names the variant
    (options and argument signature, with a symbolic batch left out)."""
    key = (fn, *variant)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load_or_save(fn, compiled, variant, args, kwargs)
        saved = _loaded[key]
    if saved is None:
        return NOT_SAVED
    marks = _strip_marks(args, kwargs)
    try:
        return saved(*args, **kwargs)
    except RuntimeError as e:  # its guards refuse these arguments: torch.compile's path for this variant from now on
        if "GuardManager check failed" not in str(e):
            raise
        _restore_marks(marks)
        with _lock:
            _loaded[key] = None
            _counts["regions_refused"] += 1
        log.warning("the saved %s refused its arguments; it compiles as usual (%s)", fn.__qualname__, str(e)[:300])
        return NOT_SAVED


def _load_or_save(
    fn: Callable[..., Any], compiled: Any, variant: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any] | None:
    what = (fn.__module__, fn.__qualname__, variant, _state["salt"], switches())
    name = hashlib.sha256(repr(what).encode()).hexdigest()
    path = Path(_state["folder"]) / f"{fn.__qualname__}-{name[:24]}.bin"
    unsavable = path.with_suffix(".unsavable")  # an earlier start found it cannot be saved: not tried again
    if unsavable.is_file():
        _counts["regions_refused"] += 1
        return None
    if path.is_file():
        try:
            with path.open("rb") as f:
                out = torch.compiler.load_compiled_function(f)
        except Exception as e:  # a file that does not load: torch.compile's path for this variant
            _refuse(fn, f"could not be loaded from {path}", e)
            return None
        _counts["regions_loaded"] += 1
        return out
    try:
        out = compiled.aot_compile((args, kwargs))
    except Exception as e:  # not compilable this way: torch.compile's path
        _refuse(fn, "could not be compiled to be saved", e, unsavable)
        return None
    try:
        out.save_compiled_function(str(path))  # written whole or not at all (another engine may read the folder)
    except OSError as e:  # the folder: compiled and used all the same, said once
        _counts["regions_refused"] += 1
        if not _state["write_failed"]:
            _state["write_failed"] = True
            log.warning("compiled regions cannot be saved in %s (%s); later starts will trace them again",
                        _state["folder"], e)  # fmt: skip
    except Exception as e:  # not serialisable: used in this process all the same
        _refuse(fn, "could not be saved", e, unsavable, then="this process uses it unsaved")
    else:
        _counts["regions_saved"] += 1
    return out


def _refuse(
    fn: Callable[..., Any], what: str, e: Exception, unsavable: Path | None = None, then: str = "it compiles as usual"
) -> None:
    """Count and say it; with `unsavable`, leave that note so that later starts do not try to save it again."""
    _counts["regions_refused"] += 1
    log.warning("%s %s (%s: %s); %s", fn.__qualname__, what, type(e).__name__, str(e)[:300], then)
    if unsavable is not None:
        with contextlib.suppress(OSError):
            unsavable.write_text(f"{type(e).__name__}: {str(e)[:2000]}\n")


_SWITCH = re.compile(r"_?[A-Z][A-Z0-9_]*")
_PLAIN = (str, int, float, bool, type(None), tuple, list, dict, set, frozenset)


def switches() -> str:
    """This package's module-level switches and tables as they are now (`gemv.MODE`, `gemv.CONFIGS`, ...): the
    engine sets some from its settings, and the code a region compiled to depends on them, while the loaded code's
    guards do not check module globals (torch 2.11-2.13). Upper-case names of plain values, by that convention."""
    parts = []
    for module_name, module in sorted((n, m) for n, m in sys.modules.items() if n.startswith(f"{__package__}.")):
        for name, value in sorted(vars(module).items()):
            if _SWITCH.fullmatch(name) and isinstance(value, _PLAIN):
                parts.append(f"{module_name}.{name}={_stable_repr(value)}")
    b = torch.backends  # torch's own switches that the traced code may read as constants
    parts.append(f"torch: {b.cudnn.benchmark} {b.cudnn.deterministic} {b.cudnn.allow_tf32} {b.cuda.matmul.allow_tf32} "
                 f"{torch.get_float32_matmul_precision()} {torch.are_deterministic_algorithms_enabled()}")  # fmt: skip
    return "\n".join(parts)


def _stable_repr(value: Any) -> str:
    """repr, the same in every process: sets in a fixed order (a set of strings iterates in a per-process order),
    functions and objects by name."""
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return type(value).__name__ + "(" + ", ".join(_stable_repr(v) for v in value) + ")"
    if isinstance(value, str | int | float | bool | None):
        return repr(value)
    # a function or other object inside a table: its name, not its address (which differs from process to process)
    return getattr(value, "__qualname__", None) or type(value).__qualname__


def _strip_marks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, str, Any]]:
    removed = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            for name in _MARKS:
                if hasattr(a, name):
                    removed.append((a, name, getattr(a, name)))
                    delattr(a, name)
    return removed


def _restore_marks(marks: list[tuple[torch.Tensor, str, Any]]) -> None:
    for tensor, name, value in marks:
        setattr(tensor, name, value)
