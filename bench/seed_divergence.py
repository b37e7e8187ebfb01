"""How often a seeded stream's codes change when other sessions share its batch (issue 3, item 4), per engine mode.

For each seed, one utterance alone on a fresh engine turn ("solo") and the same seeded utterance started together
with `--load` other sessions speaking longer texts ("loaded"). Reported per mode: the share of seeds whose codes are
identical, the first frame where they differ, the share of frames equal up to there, and wall time per utterance
solo and loaded. Modes: the default GPU engine (kernels picked by batch size) and `batch_invariant` (every decode
step at one fixed batch). On CPU in fp32 both modes must give identical codes (tests/streaming cover that); this is
the GPU figure. Models: the embedded default voice (trained: realistic, peaked distributions) and, with
`--checkpoint`, a full-size Fish 1.5 folder (bench/make_checkpoint.py; random weights: flat, chaotic sampling).

    python -m bench.seed_divergence [--checkpoint /tmp/ckpt] [--seeds 12] [--load 7] --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.fullsize import environment, write_json
from streaming.config import BackendConfig
from streaming.engine import Engine, EngineConfig
from streaming.session import Cancelled, SegmentDone, Session, SessionError, SynthesisSettings, UtteranceDone, Voice

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green hills."
OTHER_TEXT = (
    "Another voice keeps talking at the same time, so the batch stays full while the seeded stream speaks. " * 2
)


async def codes_of(session: Session, text: str) -> np.ndarray:
    session.speak(text)
    session.end_utterance()
    segments = []
    while True:
        ev = await asyncio.wait_for(session.next_event(), 300)
        if isinstance(ev, SegmentDone):
            segments.append(ev.codes)
        elif isinstance(ev, SessionError) and ev.fatal:
            raise RuntimeError(f"session failed: {ev}")
        elif isinstance(ev, UtteranceDone | Cancelled):
            break
    session.close()
    return np.concatenate(segments, axis=1) if segments else np.zeros((0, 0), np.int64)


def compare(solo: np.ndarray, loaded: np.ndarray) -> dict[str, Any]:
    n = min(solo.shape[1], loaded.shape[1])
    differs = np.nonzero((solo[:, :n] != loaded[:, :n]).any(axis=0))[0]
    first = int(differs[0]) if len(differs) else None
    identical = first is None and solo.shape == loaded.shape
    return {"identical": identical, "first_diff_frame": first, "frames_solo": solo.shape[1],
            "frames_loaded": loaded.shape[1]}  # fmt: skip


async def run_mode(cfg: BackendConfig, seeds: list[int], load: int, max_frames: int) -> dict[str, Any]:
    engine = Engine(EngineConfig(cfg))
    t0 = time.perf_counter()
    engine.start()
    if not engine.wait_ready(600):
        raise RuntimeError(f"engine not ready: {engine.fault}")
    ready_s = time.perf_counter() - t0
    settings = {s: SynthesisSettings(seed=s, max_new_tokens=max_frames) for s in seeds}
    rows, solo_s, loaded_s = [], [], []
    try:
        for s in seeds:
            t = time.perf_counter()
            solo = await codes_of(engine.open_session(Voice(), settings[s]), TEXT)
            solo_s.append(time.perf_counter() - t)
            others = [engine.open_session(Voice(), SynthesisSettings(seed=1000 + s * 10 + i, max_new_tokens=max_frames))
                      for i in range(load)]  # fmt: skip
            t = time.perf_counter()
            target = asyncio.ensure_future(codes_of(engine.open_session(Voice(), settings[s]), TEXT))
            await asyncio.gather(*(codes_of(o, OTHER_TEXT) for o in others))
            loaded = await target
            loaded_s.append(time.perf_counter() - t)
            rows.append({"seed": s, **compare(solo, loaded)})
            print(f"  seed {s}: {rows[-1]}", flush=True)
    finally:
        engine.stop()
    firsts = [r["first_diff_frame"] for r in rows if r["first_diff_frame"] is not None]
    return {
        "ready_s": round(ready_s, 1),
        "identical_share": sum(r["identical"] for r in rows) / len(rows),
        "first_diff_frame_median": float(np.median(firsts)) if firsts else None,
        "frames_median": float(np.median([r["frames_solo"] for r in rows])),
        "solo_s_median": round(float(np.median(solo_s)), 3),
        "loaded_s_median": round(float(np.median(loaded_s)), 3),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="a full-size folder (else only the embedded default voice)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--load", type=int, default=7)
    ap.add_argument("--max-frames", type=int, default=120)
    ap.add_argument("--out")
    args = ap.parse_args()
    seeds = list(range(1, args.seeds + 1))
    models: list[Path | None] = [None] + ([args.checkpoint] if args.checkpoint else [])
    result: dict[str, Any] = {"environment": environment(), "load": args.load, "runs": []}
    for ckpt in models:
        for invariant in (False, True):
            name = (
                f"{'default voice' if ckpt is None else 'full-size'}, {'batch-invariant' if invariant else 'default'}"
            )
            print(f"== {name}", flush=True)
            cfg = BackendConfig(checkpoint=ckpt, device=args.device, max_sessions=args.load + 1,
                                batch_invariant=invariant)  # fmt: skip
            run = asyncio.run(run_mode(cfg, seeds, args.load, args.max_frames))
            run["name"] = name
            result["runs"].append(run)
            write_json(args.out, result)
    print(f"\n{'mode':<36}{'identical':>10}{'1st diff (median)':>19}{'frames':>8}{'solo s':>8}{'loaded s':>9}")
    for r in result["runs"]:
        first = "—" if r["first_diff_frame_median"] is None else f"{r['first_diff_frame_median']:.0f}"
        print(f"{r['name']:<36}{r['identical_share']:>10.2f}{first:>19}{r['frames_median']:>8.0f}"
              f"{r['solo_s_median']:>8.2f}{r['loaded_s_median']:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
