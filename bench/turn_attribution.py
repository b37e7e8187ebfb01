"""Where the engine's turns went during one load level: /metrics before and after → per-turn milliseconds by phase.

Reads two Prometheus text dumps of `fishgate serve` (the `fishgate_engine{what=...}` counters: turns, turn_seconds,
prefill_seconds, step_seconds, vocode_seconds, steps, frames, vocode_calls, vocode_frames_run, vocoded_frames) and
prints one table row: turns, ms per turn, the share of prefill, decode step, vocoder and the rest (scheduling and
event posting), frames per step, vocoder calls per turn and the share of vocoded frames that were graph padding; then
the mean worker-side way of an utterance to its first audio (first_audio_*: waiting for its first segment to start,
its prompt to the first frame, decoding and vocoding its first chunk), where the server has those counters, with the
turns that held new prompts back (prefill_holds); and the GPU's time a turn on prompts, steps and vocoder calls beside
what the vocoder's graphs took alone (*_device_seconds, vocode_graph_seconds; CUDA only).

    python -m bench.turn_attribution before.txt after.txt --level 256

bench.gpu prints this split for its streams level.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

SAMPLE = re.compile(r'^fishgate_engine\{what="(?P<what>[a-z_]+)"\} (?P<value>[-+0-9.eE]+)$')


def counters(path: Path) -> dict[str, float]:
    return counters_from_text(path.read_text())


def counters_from_text(text: str) -> dict[str, float]:
    """The `fishgate_engine{what=...}` values of one Prometheus text dump."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line.strip())
        if m:
            out[m["what"]] = float(m["value"])
    return out


def attribution(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    turns = max(d.get("turns", 0.0), 1.0)
    turn_s = d.get("turn_seconds", 0.0)
    parts = {k: d.get(f"{k}_seconds", 0.0) for k in ("prefill", "step", "vocode")}
    rest = turn_s - sum(parts.values())
    return {
        "turns": d.get("turns", 0.0), "turn_ms": 1000 * turn_s / turns,
        **{f"{k}_ms": 1000 * v / turns for k, v in parts.items()}, "rest_ms": 1000 * rest / turns,
        "frames_per_step": d.get("frames", 0.0) / max(d.get("steps", 0.0), 1.0),
        "vocode_calls_per_turn": d.get("vocode_calls", 0.0) / turns,
        # share of the frames the vocoder ran that were graph padding (0 where the server predates the counter)
        "vocode_padding": 1 - d.get("vocoded_frames", 0.0) / d["vocode_frames_run"] if d.get("vocode_frames_run") else 0.0,
        # an utterance's mean way to first audio on the worker, by part (0 where the server predates the counters)
        "first_audio_utterances": d.get("first_audio_utterances", 0.0),
        **{f"first_audio_{k}_ms": 1000 * d.get(f"first_audio_{k}_seconds", 0.0) / max(d.get("first_audio_utterances", 0.0), 1.0)
           for k in ("wait", "prefill", "decode")},
        # turns that held new prompts back for a nearly dry client
        "prefill_holds": d.get("prefill_holds", 0.0),
        # turns in which streams far ahead of their clients sat out (--pace-lead-s), and rows paced a step
        "paced_turns": d.get("paced_turns", 0.0),
        "paced_rows_per_step": d.get("paced_rows", 0.0) / max(d.get("steps", 0.0), 1.0),
        # the GPU's time a turn on prompts (with first frames), steps and vocoder calls (beside the step when it runs
        # there), and the vocoder's graphs' time alone (timed at capture)
        **{f"{k}_device_ms": 1000 * d.get(f"{k}_device_seconds", 0.0) / turns for k in ("prefill", "step", "vocode")},
        "vocode_graph_ms": 1000 * d.get("vocode_graph_seconds", 0.0) / turns,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--level", default="?")
    args = parser.parse_args()
    a = attribution(counters(args.before), counters(args.after))
    print(
        f"level {args.level}: {a['turns']:.0f} turns, {a['turn_ms']:.1f} ms/turn = prefill {a['prefill_ms']:.1f} + "
        f"step {a['step_ms']:.1f} + vocode {a['vocode_ms']:.1f} + rest {a['rest_ms']:.1f}; "
        f"{a['frames_per_step']:.1f} frames/step; {a['vocode_calls_per_turn']:.2f} vocoder calls/turn, "
        f"{100 * a['vocode_padding']:.0f} % of vocoded frames padding"
    )
    if a["step_device_ms"]:
        print(
            f"  on the GPU a turn: prefill {a['prefill_device_ms']:.1f} + step {a['step_device_ms']:.1f} ms; vocoder "
            f"{a['vocode_device_ms']:.1f} ms, its graphs alone (timed at capture) {a['vocode_graph_ms']:.1f} ms"
        )
    if a["first_audio_utterances"]:
        print(
            f"  first audio on the worker, mean of {a['first_audio_utterances']:.0f} utterances: wait "
            f"{a['first_audio_wait_ms']:.1f} + prompt {a['first_audio_prefill_ms']:.1f} + first chunk "
            f"{a['first_audio_decode_ms']:.1f} ms; turns holding prompts {a['prefill_holds']:.0f}; paced turns "
            f"{a['paced_turns']:.0f} ({a['paced_rows_per_step']:.1f} rows paced a step)"
        )


if __name__ == "__main__":
    main()
