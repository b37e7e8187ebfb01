"""torch.compile of the decode step's repeated regions, switched on around the step only.

A decode step is ~2,400 small kernels on the full-size model (docs/archive/benchmark-log.md); inductor fuses the
elementwise ones.
Compiling the whole unrolled step took 112 s per (batch, length) bucket and dynamo re-traced it at every start;
compiling the *regions* the step repeats — one transformer block (24 slow and 4 × 8 fast calls share one compiled
graph per shape), one sampler, one noise hash — traces each region once per shape. Regions are functions decorated
with `@region`; they run compiled only inside `compiled(backend)` (the stepper enters it around decode steps and
first frames of small batches, before their CUDA graphs are captured) and eagerly everywhere else (prefill,
training, tests). A region whose compilation fails for some shapes runs eagerly for those shapes from then on,
with one warning in the log.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import torch

from . import saved_regions

log = logging.getLogger("fishgate.compile")

F = TypeVar("F", bound=Callable[..., Any])

# Shapes one region may be compiled for: batch buckets × attention-length buckets (the slow block), before dynamo
# falls back to eager for new ones.
RECOMPILE_LIMIT = 256


Backend = str | Callable[..., Any]  # a torch.compile backend: "inductor", "eager", or a callable


class _State(threading.local):
    backend: Backend | None = None
    tuned: bool = False
    symbolic_batch: int | None = None


_state = _State()
_compiled: dict[tuple[Callable[..., Any], Backend, bool, bool], Callable[..., Any]] = {}
_failed: set[tuple[Callable[..., Any], tuple[Any, ...]]] = set()  # (region, call signature) pairs that failed
_dynamic_regions: set[Callable[..., Any]] = set()  # regions declared with dynamic dims
_lock = threading.Lock()
# torch.compile mode for regions compiled from now on, and whether regions declared with dynamic dims compile
# static shapes instead (one compilation per shape: faster kernels, one compile per shape; benchmarks)
_DEFAULT_OPTIONS: dict[str, Any] = {"mode": None, "static_shapes": False}
_options: dict[str, Any] = dict(_DEFAULT_OPTIONS)


# Inductor options of `compiled(..., tuned=True)`: coordinate-descent tuning of every Triton kernel's launch
# config, and with it inductor's rule that turns a one-row matmul (a GEMV) into a Triton reduction fused with its
# neighbours (norms, activations, residual adds) instead of a cuBLAS call. The H200's batch-1 decode step went
# 3.28 → 2.64 ms (993 → 825 kernels) for ~4× the compile time (docs/archive/benchmark-log.md). CPU kernels are
# unaffected.
TUNED_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"coordinate_descent_tuning": True}
# ...and their kernels launched through Triton's own launcher (tuned_options). With the static launcher (inductor's
# default), a warm start loads them from the FX graph cache as static autotuners, and torch 2.11 then drops the tuned
# launch config found in its autotune cache for every kernel that has one starting config (CachingAutotuner.
# recheck_autotune_cache; fixed by 2.13), so coordinate descent ran again at every start (H200: 332-370
# benchmarks, 6-7 s of a 35-38 s warm start). The compiled regions run inside CUDA graphs, so how a kernel is
# launched costs nothing at replay.


def tuned_options() -> dict[str, Any]:
    """TUNED_OPTIONS, with the static launcher off where this torch has the switch (read when compiling: importing
    inductor's config imports dynamo, 1.2 s that a server that compiles nothing must not pay)."""
    known = torch._inductor.config.get_config_copy()
    return {**TUNED_OPTIONS, **{name: False for name in ("use_static_cuda_launcher",) if name in known}}


@contextlib.contextmanager
def compiled(backend: Backend | None, tuned: bool = False, symbolic_batch: int | None = None) -> Iterator[None]:
    """Regions called inside run compiled with `backend` ("inductor"; "eager" only traces); None = eagerly.
    `tuned` compiles them with TUNED_OPTIONS (inductor only): for one-row shapes, where GEMVs dominate.
    `symbolic_batch` = B (≥ 2): dim 0 of every tensor argument of size B is compiled as a symbolic size, in a variant
    shared by every such B, so large batch buckets cost one compilation per remaining shape (the attention length),
    not one per bucket and length."""
    if symbolic_batch is not None and symbolic_batch < 2:
        raise ValueError(f"symbolic_batch must be at least 2 (dynamo specialises sizes 0 and 1), got {symbolic_batch}")
    saved = _state.backend, _state.tuned, _state.symbolic_batch
    _state.backend, _state.tuned, _state.symbolic_batch = backend, tuned, symbolic_batch
    try:
        yield
    finally:
        _state.backend, _state.tuned, _state.symbolic_batch = saved


def active_backend() -> Backend | None:
    return _state.backend


@overload
def region(fn: F) -> F: ...
@overload
def region(*, dynamic_dims: dict[int, tuple[int, ...]]) -> Callable[[F], F]: ...
def region(fn: F | None = None, *, dynamic_dims: dict[int, tuple[int, ...]] | None = None) -> Any:
    """Mark `fn` as a compiled region (whole graph; see the module docstring). Shapes are static, except that
    `dynamic_dims` = {positional argument: dims} compiles those dims symbolically, so one compilation serves every
    size of them (dynamo still specialises sizes 0 and 1): `@region(dynamic_dims={1: (0, 2)})`."""
    if fn is None:
        return functools.partial(region, dynamic_dims=dynamic_dims)
    if dynamic_dims:
        _dynamic_regions.add(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        backend = _state.backend
        if backend is None:
            return fn(*args, **kwargs)
        symbolic = _state.symbolic_batch
        if not _options["static_shapes"]:
            for index, dims in (dynamic_dims or {}).items():
                for dim in dims if index < len(args) and isinstance(args[index], torch.Tensor) else ():
                    torch._dynamo.maybe_mark_dynamic(args[index], dim)
            if symbolic is not None:
                for a in (*args, *kwargs.values()):
                    if isinstance(a, torch.Tensor) and a.ndim > 0 and a.shape[0] == symbolic:
                        torch._dynamo.maybe_mark_dynamic(a, 0)
        if _failed and (fn, _signature(args, kwargs)) in _failed:  # the signature only once something failed
            return fn(*args, **kwargs)
        try:
            compiled = _compiled_fn(fn, backend, _state.tuned, symbolic is not None)
            if saved_regions.folder() is not None and backend == "inductor" and _options == _DEFAULT_OPTIONS:
                out = saved_regions.run(fn, compiled, _variant(args, kwargs, _state.tuned, symbolic), args, kwargs)
                if out is not saved_regions.NOT_SAVED:
                    return out
            return compiled(*args, **kwargs)
        except Exception as e:  # a compiler failure: run eagerly (a genuine error raises again from the eager call)
            if not _is_compile_error(e):
                raise
            _failed.add((fn, _signature(args, kwargs)))
            first_line = (str(e).strip().splitlines() or [""])[0][:300]
            log.warning(
                "compiling %s failed (%s: %s); it runs eagerly for these shapes from now on", fn.__qualname__,
                type(e).__name__, first_line,
            )  # fmt: skip
            return fn(*args, **kwargs)

    return call


def _compiled_fn(fn: Callable[..., Any], backend: Backend, tuned: bool, symbolic_batch: bool) -> Callable[..., Any]:
    tuned = tuned and backend == "inductor" and _options["mode"] is None
    symbolic_batch = symbolic_batch and not _options["static_shapes"]
    with _lock:
        out = _compiled.get((fn, backend, tuned, symbolic_batch))
        if out is None:
            config = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(config, name):
                    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
            # inductor warns at every split softmax reduction (the 102,048-token vocabulary): noise in a server log
            warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled", category=UserWarning)
            symbolic = (fn in _dynamic_regions or symbolic_batch) and not _options["static_shapes"]
            dynamic = None if symbolic else False  # None: the dims marked dynamic, the rest static
            out = torch.compile(
                fn, backend=backend, mode=_options["mode"], options=tuned_options() if tuned else None, fullgraph=True,
                dynamic=dynamic,
            )  # fmt: skip
            _compiled[(fn, backend, tuned, symbolic_batch)] = out
        return out


def _variant(args: tuple[Any, ...], kwargs: dict[str, Any], tuned: bool, symbolic: int | None) -> tuple[Any, ...]:
    """What names a saved variant of a region (model.saved_regions): its options; its signature, a symbolic batch as
    -1 (one name for every batch the variant serves); and per tensor what dynamo's guards check beyond shape and
    dtype: device, inference tensor or not (its dispatch keys), requires_grad."""
    signature = _signature(args, kwargs)
    if symbolic is not None:
        signature = _unbatched(signature, symbolic)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    kinds = tuple((str(a.device), a.is_inference(), a.requires_grad) for a in tensors)
    return (tuned, symbolic is not None, signature, kinds)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What one compiled variant of a region is specialised on: tensor shapes and dtypes, other values as they are."""

    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.dtype)
        if isinstance(a, int | float | str | bool | None):
            return a
        return type(a).__name__

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _unbatched(signature: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    """`signature` (_signature) with dim 0 = `batch` of each tensor as -1."""

    def one(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):  # a keyword argument
            return (x[0], one(x[1]))
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) and x[0][:1] == (batch,):
            return ((-1, *x[0][1:]), x[1])
        return x

    return tuple(one(x) for x in signature)


def reset(mode: str | None = None, static_shapes: bool = False) -> None:
    """Forget every compiled region and failure (and dynamo's caches); later compiles use `mode` and, with
    `static_shapes`, ignore regions' dynamic dims (benchmarks)."""
    with _lock:
        _compiled.clear()
        _failed.clear()
        _options["mode"] = mode
        _options["static_shapes"] = static_shapes
        saved_regions.forget()
        torch._dynamo.reset()


def _is_compile_error(e: Exception) -> bool:
    """Errors raised by dynamo/inductor while compiling (not by the computation itself)."""
    module = type(e).__module__
    return module.startswith(("torch._dynamo", "torch._inductor")) or "BackendCompilerFailed" in type(e).__name__


def failed_regions() -> list[str]:
    """Names of regions that fell back to eager after a compiler failure (for logs and benchmarks)."""
    return sorted({fn.__qualname__ for fn, _ in _failed})


# torch's compile counters (torch._dynamo.utils.counters) that say how much of a start came from the on-disk caches
CACHE_COUNTERS = {
    "fx_graphs_from_cache": ("inductor", "fxgraph_cache_hit"),  # inductor's output code loaded, not generated
    "fx_graphs_compiled": ("inductor", "fxgraph_cache_miss"),  # generated (and saved for the next start)
    "fx_graphs_uncacheable": ("inductor", "fxgraph_cache_bypass"),  # generated, and not cacheable
    # launch configurations benchmarked by coordinate-descent tuning: 0 on a warm start whose tuning results
    # (inductor's .best_config files) were found
    "tuning_benchmarks": ("inductor", "coordesc_tuning_bench"),
}


def cache_counts() -> dict[str, int]:
    """How this process's compiles used the on-disk caches so far (CACHE_COUNTERS); zeros before any compile
    (without importing dynamo, ~1.2 s, into a server that compiles nothing)."""
    if "torch._dynamo" not in sys.modules:
        return dict.fromkeys(CACHE_COUNTERS, 0)
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for name, (group, key) in CACHE_COUNTERS.items()} | saved_regions.counts()
