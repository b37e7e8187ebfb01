"""Where a checkpoint's load time goes, and what a faster path would take: the DualAR's safetensors file to the device.

Run 21 measured 4.3-7.8 s for the full-size DualAR's 1.3 GB on the H200 machine (warm page cache) against 0.3 s on a
CPU, where the move copies nothing. This times, on one file, each way of getting its tensors onto the device:

1. `engine`      — `model.checkpoint.load_dual_ar` as the engine calls it, split into read (mmap, key check, model on
   the meta device) and to_device (`Module.to`: one pageable copy per tensor from the mmap-ed file)
2. `mmap_copy`   — the same tensors, each `.to(device)` by itself (the copy without the module plumbing)
3. `pinned_bulk` — the file read into one pinned host buffer in 64 MiB pieces (`readinto`), one host→device copy,
   tensors as views of the device buffer
4. `pinned_file` — only reading the file into pinned memory (what 3 spends before its copy)
5. `safetensors` — the safetensors package's own `load_file(device=...)`, where it is installed

Every path is checked against the engine's tensors (bitwise). Each is timed `--repeat` times (the first also pays
page faults and allocator growth); the table shows the fastest and the first. JSON to `--out`.
Usage: python -m bench.make_checkpoint /tmp/ckpt /tmp/refs && python -m bench.load_weights /tmp/ckpt [--out r.json]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.fullsize import environment, write_json
from model.checkpoint import load_dual_ar, model_weights_path
from model.weights import read_safetensors, read_safetensors_header, safetensors_entries

PIECE_BYTES = 64 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_file(path: Path, pin: bool) -> tuple[torch.Tensor, dict, int]:
    """The whole file in one (pinned) uint8 host tensor, read in PIECE_BYTES pieces; with its header and the offset
    of its data section."""
    size = path.stat().st_size
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    view = memoryview(host.numpy())
    with open(path, "rb", buffering=0) as f:
        header, data_start = read_safetensors_header(f, path)
        f.seek(0)
        done = 0
        while done < size:
            n = f.readinto(view[done : done + PIECE_BYTES])
            if not n:
                raise OSError(f"{path}: short read at {done} of {size} bytes")
            done += n
    return host, header, data_start


def pinned_bulk(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    host, header, start = pinned_file(path, pin=device.type == "cuda")
    flat = host.to(device, non_blocking=True)
    out = {
        name: flat[start + begin : start + end].view(dtype).view(shape)
        for name, dtype, shape, begin, end in safetensors_entries(header, path)
    }
    _sync(device)
    return out


def mmap_copy(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    out = {k: v.to(device) for k, v in read_safetensors(path).items()}
    _sync(device)
    return out


def same(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> str:
    """ "equal (n tensors)" when every file tensor the model holds is bitwise the engine's, else what differs."""
    shared = [k for k in got if k in reference]
    bad = [k for k in shared if not torch.equal(got[k], reference[k])]
    return f"DIFFERS: {bad[:3]}" if bad or not shared else f"equal ({len(shared)} tensors)"


def timed(fn: Callable[[], object], repeat: int, device: torch.device) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeat):
        result = None  # the previous run's tensors go before the next run allocates its own
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    path = model_weights_path(args.checkpoint)
    if path.suffix != ".safetensors":
        raise SystemExit(f"{path}: this benchmark reads safetensors (fishgate convert writes them)")
    if device.type == "cuda":
        torch.empty(1, device=device)  # the context, outside every timing (the engine creates it before its load)
    size_gb = path.stat().st_size / 1e9

    splits: list[dict[str, float]] = []

    def engine() -> torch.nn.Module:
        split: dict[str, float] = {}
        model = load_dual_ar(args.checkpoint, device=device, dtype=torch.bfloat16, timings_s=split).model
        splits.append(split)
        return model

    rows = {}
    t_engine, model = timed(engine, args.repeat, device)
    reference = dict(model.state_dict())  # type: ignore[union-attr]
    rows["engine"] = t_engine
    del model
    t_mmap, got = timed(lambda: mmap_copy(path, device), args.repeat, device)
    rows["mmap_copy"] = t_mmap
    checks = {"mmap_copy": same(got, reference)}  # type: ignore[arg-type]
    del got
    t_bulk, got = timed(lambda: pinned_bulk(path, device), args.repeat, device)
    rows["pinned_bulk"] = t_bulk
    checks["pinned_bulk"] = same(got, reference)  # type: ignore[arg-type]
    del got
    rows["pinned_file"], _ = timed(lambda: pinned_file(path, pin=device.type == "cuda"), args.repeat, device)
    try:
        from safetensors.torch import load_file
    except ImportError:
        load_file = None
    if load_file is not None:
        rows["safetensors"], got = timed(lambda: load_file(path, device=str(device)), args.repeat, device)
        checks["safetensors"] = same(got, reference)  # type: ignore[arg-type]
        del got

    print(f"{path} ({size_gb:.2f} GB) → {device}")
    print(f"{'path':12s} {'best s':>7s} {'first s':>8s} {'GB/s':>6s}  equal")
    for name, times in rows.items():
        ok = checks.get(name, "")
        print(f"{name:12s} {min(times):7.3f} {times[0]:8.3f} {size_gb / min(times):6.2f}  {ok}")
    print("engine split (read / to_device), each run: " + "; ".join(
        f"{s.get('read', 0):.3f} / {s.get('to_device', 0):.3f}" for s in splits))  # fmt: skip
    if args.out is not None:
        write_json(args.out, {"environment": environment(), "file_gb": size_gb, "device": str(device),
                              "seconds": rows, "equal": checks, "engine_split": splits})  # fmt: skip


if __name__ == "__main__":
    main()
