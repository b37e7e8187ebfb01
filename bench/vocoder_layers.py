"""Where a streaming-vocoder chunk spends its time, layer by layer, in the default and channels-last layouts.

Run 14 found two cuDNN `conv2d_grouped_direct_kernel` calls taking 183 ms of the channels-last layout's 272 ms at
64 × 24 frames, and the whole-graph kernel profile cannot say which layers launch them. This script decodes chunks
eagerly with a CUDA event pair around every decode-path conv layer (forward pre-hook and hook), so each layer's
device time, its input shape and strides, and the layout it produced are listed, slowest first. Eager timing
includes each layer's launch gaps; at 64 × 24 frames the kernels dominate.

    python -m bench.vocoder_layers --shape 64x24 --out $OUT/vocoder_layers.json     (GPU, ~1 min)
    python -m bench.vocoder_layers --tiny                                           (CPU smoke test, wall times)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.fullsize import environment, random_codec, write_json
from model.codec_layers import is_time_minor
from model.vocoder_stream import StreamingDecoder

LAYOUTS = ("default", "channels_last")


class _LayerClock:
    """CUDA events (or host clocks on CPU) around each layer's forward; times summed per layer name over calls."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.open: dict[str, Any] = {}
        self.spans: dict[str, list[tuple[Any, Any]]] = {}
        self.info: dict[str, dict[str, Any]] = {}

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def attach(self, name: str, layer: torch.nn.Module) -> None:
        def before(_m: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            self.info[name] = {
                "in_shape": list(x.shape), "in_strides": list(x.stride()), "in_time_major": is_time_minor(x),
                "weight_strides": list(layer.conv.weight.stride()), "groups": layer.conv.groups,
                "kind": type(layer).__name__,
            }  # fmt: skip
            self.open[name] = self._now()

        def after(_m: torch.nn.Module, _args: tuple, y: torch.Tensor) -> None:
            self.spans.setdefault(name, []).append((self.open.pop(name), self._now()))
            self.info[name]["out_time_major"] = is_time_minor(y)

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)

    def rows(self) -> list[dict[str, Any]]:
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for name, spans in self.spans.items():
            ms = sum(a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in spans) / len(spans)
            out.append({"layer": name, "ms": round(ms, 4), **self.info[name]})
        return sorted(out, key=lambda r: -r["ms"])


@torch.inference_mode()
def profile_layout(layout: str, batch: int, frames: int, device: str, tiny: bool, calls: int) -> dict[str, Any]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    codec = random_codec(device, dtype, tiny=tiny)
    decoder = StreamingDecoder(codec, max_slots=batch, channels_last=layout == "channels_last")
    slots = torch.arange(batch, device=device)
    codes = torch.randint(0, 1000, (batch, codec.config.rows, frames), device=device)
    decoder.decode(codes, slots)  # warm-up: cuDNN's algorithm choice, allocator
    clock = _LayerClock(device)
    names = {id(m): n for n, m in codec.named_modules()}
    for layer in codec.decode_path_layers():
        clock.attach(names[id(layer)], layer)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        decoder.decode(codes, slots)
    if device == "cuda":
        torch.cuda.synchronize()
    rows = clock.rows()
    return {"layout": layout, "batch": batch, "frames": frames, "call_ms": (time.perf_counter() - t0) * 1e3 / calls,
            "layers_ms": sum(r["ms"] for r in rows), "layers": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true", help="the tiny codec config on CPU (a smoke test)")
    ap.add_argument("--shape", default="64x24", help="batch×frames")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    batch, frames = (int(n) for n in args.shape.split("x"))
    results = []
    for layout in args.layouts.split(","):
        r = profile_layout(layout, batch, frames, device, args.tiny, args.calls)
        results.append(r)
        print(f"\n{layout} {batch}×{frames}: {r['call_ms']:.2f} ms a call, {r['layers_ms']:.2f} ms in its layers")
        for row in r["layers"][: args.top]:
            print(f"  {row['ms']:>9.3f} ms  {row['layer']:<34} {row['kind']:<22} in {row['in_shape']} "
                  f"strides {row['in_strides']} weight strides {row['weight_strides']} groups {row['groups']} "
                  f"time-major in/out {row['in_time_major']}/{row['out_time_major']}")  # fmt: skip
        write_json(args.out, {"environment": environment(), "device": device, "results": results})


if __name__ == "__main__":
    main()
