"""State-dict file I/O shared by the DualAR and codec loaders.

Owns: reading `.pth` (torch pickle, mmap) and `.safetensors` (zero-copy mmap) into plain `{name: Tensor}` dicts,
unwrapping Lightning-style `state_dict` wrappers, stripping key prefixes, writing safetensors, and the key/shape
check that names every missing, unexpected or mis-shaped tensor. It knows nothing about any model's layout.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Longest key list printed in an error message before it is elided (a full-size mismatch can list hundreds).
MAX_KEYS_IN_MESSAGE = 40


class CheckpointError(ValueError):
    """A checkpoint folder or file cannot be used; the message says what is wrong and how to fix it."""

    code = "bad_checkpoint"


def read_safetensors_header(f: BinaryIO, path: Path) -> tuple[dict, int]:
    """A .safetensors file's JSON header (open file at offset 0) and where its data section starts."""
    header_len_bytes = f.read(8)
    if len(header_len_bytes) != 8:
        raise CheckpointError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
    (header_len,) = struct.unpack("<Q", header_len_bytes)
    try:
        header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON)") from e
    return header, 8 + header_len


def safetensors_entries(header: dict, path: Path) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """(name, dtype, shape, begin, end) of every tensor in a header, offsets relative to the data section."""
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        yield name, dtype, tuple(info["shape"]), begin, end


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Map a .safetensors file into memory; tensors share pages with the file (copy-on-write, no read)."""
    with open(path, "rb") as f:
        header, data_start = read_safetensors_header(f, path)
        # ACCESS_COPY gives a writable buffer without touching the file: torch.frombuffer needs writable memory,
        # and pages are only copied if someone writes to a tensor (nobody does; load_state_dict(assign=True)).
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in safetensors_entries(header, path):
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin)
        tensors[name] = flat.view(shape)
    return tensors


def read_pth(path: Path) -> dict[str, torch.Tensor]:
    """Load a torch pickle the way upstream does: CPU, mmap, weights only (no code execution)."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises several unrelated types for a bad pickle
        raise CheckpointError(f"{path} could not be read as a torch checkpoint ({type(e).__name__})") from e
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]  # Lightning checkpoint
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return dict(obj)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read either format, chosen by the file suffix."""
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    return read_pth(path)


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: Path,
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write tensors as safetensors, streaming one tensor at a time (never a second full copy in RAM).

    `progress(done_bytes, total_bytes)` is called after every tensor. The file is written to a temporary
    name and renamed, so an interrupted conversion never leaves a truncated file that a later load would prefer.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    inverse = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    offset = 0
    ordered = sorted(tensors)
    for name in ordered:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": inverse[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # align the data section
    tmp = path.with_name(path.name + ".partial")
    done = 0
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in ordered:
            t = tensors[name].detach().contiguous().cpu()
            if t.numel():
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
            done += t.numel() * t.element_size()
            if progress is not None:
                progress(done, offset)
    tmp.replace(path)


def strip_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Remove `prefix` from the start of every key that has it."""
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in tensors.items()}


def _elide(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:MAX_KEYS_IN_MESSAGE])
    more = len(keys) - MAX_KEYS_IN_MESSAGE
    return shown + (f", … and {more} more" if more > 0 else "")


def check_keys(
    expected: Mapping[str, tuple[int, ...]],
    got: Mapping[str, torch.Tensor],
    what: str,
    ignore_unexpected: Callable[[str], bool] = lambda _: False,
) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped keys (all of them, in one message)."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected and not ignore_unexpected(k)]
    misshaped = [
        f"{k} {tuple(got[k].shape)} (expected {tuple(expected[k])})"
        for k in expected
        if k in got and tuple(got[k].shape) != tuple(expected[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_elide(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_elide(unexpected)}")
    if misshaped:
        problems.append(f"wrong shapes: {_elide(misshaped)}")
    if problems:
        raise CheckpointError(
            f"{what} does not match its config ({'; '.join(problems)}). "
            "Check that config.json belongs to these weights."
        )
