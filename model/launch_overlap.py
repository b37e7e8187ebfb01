"""Programmatic dependent launch (PDL) for the decode step's own Triton kernels (Hopper and newer).

A one-row decode step is a chain of ~300 small kernels (model.gemv's products, model.decode_attention's two), each
~2-7 µs, and about 2 µs of each is not reading memory: the launch, the first loads' latency, the tail. Launched with
PDL, a kernel may start while the one before it still runs: it issues the reads that nothing earlier in the step
writes (the weights) first, then waits (`griddepcontrol.wait`: every earlier kernel complete, its writes visible)
before it reads the activations, the caches or anything else, and before it writes anything. Each of these kernels
also lets the next one launch as soon as all of its own programs run (`griddepcontrol.launch_dependents`), so the
weights of the next products stream in while this one finishes. Only the kernels' order in time changes: every
kernel reads and writes exactly what it read and wrote before, so results are bitwise the same (GPU test), and a
kernel launched without PDL (inductor's, cuBLAS's) waits for everything before it as usual.

MODE "auto" (the default): on for CUDA devices of compute capability 9.0 or newer, off elsewhere (and in Triton's
CPU interpreter, which has no such instruction); "off": plain launches (`--programmatic-launch off`).
"""

from __future__ import annotations

import functools
import os

import torch

MODE = "auto"


def enabled(device: torch.device) -> bool:
    """Whether the kernels launch on `device` with PDL (MODE, the device's compute capability)."""
    return MODE == "auto" and _supported(device.type, device.index)


@functools.cache
def _supported(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:  # Triton 3.3 brought the launch option and the grid-dependency instructions (torch 2.11 ships 3.6)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)


def kernel_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of one of these kernels on `device`: its PDL constexpr (which places the wait and the
    trigger) and, with PDL, Triton's launch_pdl; the two always agree (the interpreter takes no launch_pdl)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
