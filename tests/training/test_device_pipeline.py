"""The one-hold device pipeline's pieces that run anywhere: what comes back, the GAN audio prefix, Piper's launcher.

The whole pipeline (codec → Piper → codes → DualAR ∥ decoder phase, as daemons) was run end to end with real Piper on
this CPU and on the H200 (training/TRAINING.md); CI has no Piper, so the end-to-end test here runs the real
daemons with a stand-in for Piper's process.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from model.weights import write_safetensors
from training import device_pipeline
from training.checkpoints import load_resume
from training.device_pipeline import MAX_RETURN_BYTES, _audio_prefix, _flags, collect
from training.dual_ar_data import CodesPack
from training.encode_codes import merge_packs
from training.teacher import PIPER_LAUNCHER, TeacherConfig, piper_command

REPO = Path(__file__).resolve().parents[2]
FAKE_PIPER = Path(__file__).with_name("fake_piper.py")


def test_collect_returns_checkpoints_and_one_archive(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    for rel in ("codec/codec_resume.safetensors", "dual_ar/dual_ar_best.safetensors", "codes_live.npz",
                "codec_codec-c128-g8/codec_resume.safetensors", "codes_codec-c128-g8.npz"):  # fmt: skip
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(b"x" * 10)
    for rel in ("pipeline.log", "dual_ar/dual_ar_log.jsonl", "teacher/manifest.jsonl", "DONE",
                "codec_codec-c128-g8/codec_log.jsonl", "codec_codec-c128-g8.log"):  # fmt: skip
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(rel)
    (work / "dual_ar" / "dual_ar_resume.safetensors").write_bytes(b"\0" * (MAX_RETURN_BYTES + 1))
    collect(work, out)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["codec__codec_resume.safetensors", "codec_codec-c128-g8__codec_resume.safetensors",
                     "codes_codec-c128-g8.npz", "codes_live.npz", "dual_ar__dual_ar_best.safetensors",
                     "small.tar.gz"]  # fmt: skip
    assert len(names) <= 8  # a device call returns at most 8 files
    with tarfile.open(out / "small.tar.gz") as tar:
        assert sorted(tar.getnames()) == [
            "DONE", "codec_codec-c128-g8.log", "codec_codec-c128-g8/codec_log.jsonl", "dual_ar/dual_ar_log.jsonl",
            "pipeline.log", "teacher/manifest.jsonl",
        ]  # fmt: skip


def test_collect_returns_a_pack_over_the_limit_in_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hold's codes outgrow one returned file (16 MiB, ~22 h of speech): they come back as parts that join into
    the pack again; codes_live.npz (the carried pack plus codes_new.npz) and packs being written stay."""
    rng = np.random.default_rng(0)
    pack = CodesPack(
        ids=[f"u{i:02d}" for i in range(40)], texts=[f"text {i}." for i in range(40)], splits=["train"] * 40,
        codes=[rng.integers(0, 1024, (8, 150)).astype(np.int16) for _ in range(40)], samples_per_frame=2048,
        sample_rate_hz=44100,
    )  # fmt: skip
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    pack.save(work / "codes_new.npz")
    pack.save(work / "codes_live.npz")
    (work / "codes_new_next.npz").write_bytes(b"half written")
    limit = (work / "codes_new.npz").stat().st_size // 3
    monkeypatch.setattr(device_pipeline, "MAX_RETURN_BYTES", limit)
    collect(work, out)
    parts = sorted(out.glob("codes_new.part*.npz"), key=lambda p: int(p.stem.rsplit("part", 1)[1]))
    assert len(parts) >= 3 and all(p.stat().st_size <= limit for p in parts)
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in parts), "small.tar.gz"])
    joined = functools.reduce(merge_packs, [CodesPack.load(p) for p in parts])
    assert joined.ids == pack.ids and joined.texts == pack.texts
    assert all(np.array_equal(a, b) for a, b in zip(joined.codes, pack.codes, strict=True))


def test_trainer_flags_name_files_by_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemons run in WORK/src: a relative --codes-refresh would name no file there (the trainer would never
    refresh, silently), a relative --resume would be refused."""
    monkeypatch.chdir(tmp_path)
    flags = _flags("--resume r/dual_ar.safetensors --codes-refresh=w/codes_live.npz --config small --p-history 0.5")
    assert flags == ["--resume", str(tmp_path / "r/dual_ar.safetensors"),
                     f"--codes-refresh={tmp_path / 'w/codes_live.npz'}", "--config", "small", "--p-history", "0.5"]  # fmt: skip
    assert _flags("--config c.json --resume /abs/r.safetensors") == [
        "--config", str(tmp_path / "c.json"), "--resume", "/abs/r.safetensors",
    ]  # fmt: skip


def test_gan_audio_prefix_takes_training_rows_up_to_the_budget(tmp_path: Path) -> None:
    rows = [{"id": f"u{i}", "split": "test" if i == 0 else "train", "duration_s": 4.0} for i in range(10)]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 4 + 4 + 4 s: the row crossing 10 s is kept
    assert _audio_prefix(manifest, tmp_path / "gan.jsonl", 10.0) == (3, 12.0)
    kept = [json.loads(line)["id"] for line in (tmp_path / "gan.jsonl").read_text().splitlines()]
    assert kept == ["u1", "u2", "u3"]


def test_piper_launcher_caps_threads_only_when_asked(tmp_path: Path) -> None:
    config = TeacherConfig(model_path="voice.onnx", piper_version="1.8.0")
    plain = piper_command("py", config, tmp_path / "in.txt", tmp_path / "wav")
    capped = piper_command("py", config, tmp_path / "in.txt", tmp_path / "wav", threads=1)
    assert plain[:3] == ["py", "-m", "piper"]
    assert capped[:3] == ["py", str(PIPER_LAUNCHER), "1"] and capped[3:] == plain[3:]
    source = PIPER_LAUNCHER.read_text()
    assert "import training" not in source and "from training" not in source and "import model" not in source


def _wait_for(work: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in ("DONE", "FAILED"):
            if (work / name).exists():
                return name
        time.sleep(0.5)
    return "timeout"


def _run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "training.device_pipeline", *args], cwd=REPO, check=True, timeout=60)


def test_hold_a_then_hold_b_run_end_to_end_with_a_stand_in_piper(tmp_path: Path) -> None:
    """The daemons as a device call starts them, on this CPU: hold A (teacher → packed audio → codec → codes of every
    utterance) then hold B (DualAR on those codes beside the decoder-only phase), then what `wait` returns. A stand-in
    replaces Piper (tests/training/fake_piper.py); everything else is the real pipeline with the tiny configs."""
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "stars",
        "shine",
        "above",
        "quiet",
        "hills",
    ]
    rows = []
    for i in range(24):
        text = " ".join(words[(i + k) % len(words)] for k in range(4 + i % 5)).capitalize() + "."
        rows.append({"id": f"u{i:02d}", "source": "test", "text": text, "norm": text, "n_words": len(text.split()),
                     "split": "test" if i < 3 else "train"})  # fmt: skip
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hold_a, hold_b = tmp_path / "a", tmp_path / "b"
    try:
        _run("start-rest", "--work", str(hold_a), "--corpus", str(corpus), "--total-seconds", "300",
             "--teacher-workers", "2", "--teacher-shard-items", "4", "--piper-python", str(FAKE_PIPER),
             "--encode-device", "cpu", "--codec-audio-s", "10", "--codec-seconds", "6", "--codes-only",
             "--codec-variants", "tiny", "--codec-args=--device cpu --batch-size 2 --segment-frames 4")  # fmt: skip
        assert _wait_for(hold_a, 240) == "DONE", (hold_a / "pipeline.log").read_text()
        pack = CodesPack.load(hold_a / "codes_live.npz")
        assert pack.indices("test") and len(pack.indices("train")) >= 4 and all(c.shape[0] == 4 for c in pack.codes)
        _run("start-dual-ar", "--work", str(hold_b), "--codes", str(hold_a / "codes_live.npz"), "--codec",
             str(hold_a / "codec" / "codec_resume.safetensors"), "--shards",
             str(hold_a / "codec_shards" / "shard_000.npz"), "--seconds", "5",
             "--dual-ar-args=--config tiny --device cpu --max-tokens 1024", "--variant", "guided=--guided-weight 1",
             "--gan-args=--device cpu --batch-size 2 --segment-frames 4")  # fmt: skip
        assert _wait_for(hold_b, 240) == "DONE"
        for name in ("dual_ar", "dual_ar_guided", "gan"):
            assert (hold_b / f"{name}.rc").read_text().strip() == "0", (hold_b / f"{name}.log").read_text()[-2000:]
        assert '"guided_loss"' in (hold_b / "dual_ar_guided" / "dual_ar_log.jsonl").read_text()
        assert '"guided_loss"' not in (hold_b / "dual_ar" / "dual_ar_log.jsonl").read_text()
        _run("collect", "--work", str(hold_b), "--out", str(tmp_path / "out"))
        back = sorted(p.name for p in (tmp_path / "out").iterdir())
        assert {"dual_ar__dual_ar_resume.safetensors", "dual_ar_guided__dual_ar_resume.safetensors",
                "gan__codec_resume.safetensors", "small.tar.gz"} <= set(back)  # fmt: skip
        assert "codec__codec_resume.safetensors" not in back and "carried_codes.npz" not in back  # carried in
        assert len(back) <= 8
        hold_c = tmp_path / "c"  # no shards: the DualAR alone (the codec trains elsewhere)
        _run("start-dual-ar", "--work", str(hold_c), "--codes", str(hold_a / "codes_live.npz"), "--codec",
             str(hold_a / "codec" / "codec_resume.safetensors"), "--seconds", "3",
             "--dual-ar-args=--config tiny --device cpu --max-tokens 1024")  # fmt: skip
        assert _wait_for(hold_c, 240) == "DONE"
        assert (hold_c / "dual_ar.rc").read_text().strip() == "0" and not (hold_c / "gan.log").exists()
        _hold_e_speaks_what_the_pack_lacks(tmp_path, corpus, hold_a)
        _hold_f_speaks_everything_without_a_pack(tmp_path, corpus, hold_a)
    finally:  # the daemons outlive their starter by design: end them with the test
        _kill_processes_mentioning(str(tmp_path))


def _hold_e_speaks_what_the_pack_lacks(tmp_path: Path, corpus: Path, hold_a: Path) -> None:
    """Hold E: a pack missing some training items; the teacher speaks just those, and a DualAR started on the pack
    re-reads the grown one (its log says so)."""
    full = CodesPack.load(hold_a / "codes_live.npz")
    keep = full.indices("test") + full.indices("train")[:8]
    base = CodesPack(
        ids=[full.ids[i] for i in keep], texts=[full.texts[i] for i in keep], splits=[full.splits[i] for i in keep],
        codes=[full.codes[i] for i in keep], samples_per_frame=full.samples_per_frame,
        sample_rate_hz=full.sample_rate_hz,
    )  # fmt: skip
    base.save(tmp_path / "base.npz")
    hold_e = tmp_path / "e"
    codec = str(hold_a / "codec" / "codec_resume.safetensors")
    _run("start-teacher", "--work", str(hold_e), "--corpus", str(corpus), "--base-codes", str(tmp_path / "base.npz"),
         "--codec", codec, "--seconds", "200", "--workers", "2", "--shard-items", "4", "--refresh-s", "1",
         "--piper-python", str(FAKE_PIPER), "--encode-device", "cpu")  # fmt: skip
    trainer = f"--config tiny --device cpu --max-tokens 1024 --codes-refresh {hold_e / 'codes_live.npz'}"
    _run("start-dual-ar", "--work", str(hold_e), "--codes", str(tmp_path / "base.npz"), "--seconds", "20",
         f"--dual-ar-args={trainer}")  # fmt: skip
    assert _wait_for(hold_e, 240) == "DONE"
    deadline = time.monotonic() + 120
    while not (hold_e / "teach.rc").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (hold_e / "teach.rc").read_text().strip() == "0", (hold_e / "teach.log").read_text()[-2000:]
    new = CodesPack.load(hold_e / "codes_new.npz")
    lacking = {full.ids[i] for i in full.indices("train")[8:]}
    assert set(new.ids) == lacking and set(new.splits) == {"train"}  # the held-out items are never spoken
    live = CodesPack.load(hold_e / "codes_live.npz")
    assert live.ids == base.ids + new.ids
    log = [json.loads(line) for line in (hold_e / "dual_ar" / "dual_ar_log.jsonl").read_text().splitlines()]
    assert max(row.get("refreshed_utterances", 0) for row in log) > len(base.ids)  # the trainer took the grown pack


def _hold_f_speaks_everything_without_a_pack(tmp_path: Path, corpus: Path, hold_a: Path) -> None:
    """Issue 41's plan: no carried pack, the codec as a checkpoint folder (model/default_model on the device), every
    path relative to the checkout; the DualAR starts once the first codes exist and re-reads the growing pack."""
    repo = tmp_path / "checkout"  # start-* copy model/ and training/ from the current folder
    repo.mkdir()
    for name in ("model", "training"):
        (repo / name).symlink_to(REPO / name)
    parts, meta = load_resume(hold_a / "codec" / "codec_resume.safetensors")
    (repo / "codec").mkdir()
    (repo / "codec" / "codec_config.json").write_text(json.dumps(meta["codec_config"]))
    write_safetensors(parts["gen"], repo / "codec" / "generator.safetensors")
    shutil.copyfile(corpus, repo / "corpus.jsonl")

    def run(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "training.device_pipeline", *args], cwd=repo, check=True, timeout=60)

    run("start-teacher", "--work", "f", "--corpus", "corpus.jsonl", "--codec", "codec", "--seconds", "200",
        "--workers", "2", "--shard-items", "4", "--refresh-s", "1", "--piper-python", str(FAKE_PIPER),
        "--encode-device", "cpu")  # fmt: skip
    work = repo / "f"
    deadline = time.monotonic() + 120
    while not (work / "codes_live.npz").exists() and not (work / "teach.rc").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (work / "codes_live.npz").exists(), (work / "teach.log").read_text()[-2000:]
    run("start-dual-ar", "--work", "f", "--codes", "f/codes_live.npz", "--seconds", "5",
        "--dual-ar-args=--config tiny --device cpu --max-tokens 1024 --codes-refresh f/codes_live.npz")  # fmt: skip
    assert _wait_for(work, 240) == "DONE"
    while not (work / "teach.rc").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (work / "teach.rc").read_text().strip() == "0", (work / "teach.log").read_text()[-2000:]
    assert (work / "dual_ar.rc").read_text().strip() == "0", (work / "dual_ar.log").read_text()[-2000:]
    spoken = CodesPack.load(work / "codes_new.npz")
    train = [json.loads(line)["id"] for line in corpus.read_text().splitlines() if '"train"' in line]
    assert sorted(spoken.ids) == sorted(train) and CodesPack.load(work / "codes_live.npz").ids == spoken.ids
    log = [json.loads(line) for line in (work / "dual_ar" / "dual_ar_log.jsonl").read_text().splitlines()]
    assert any("refreshed_utterances" in row for row in log)  # the relative --codes-refresh named the live pack
    run("collect", "--work", "f", "--out", "back")
    back = sorted(p.name for p in (repo / "back").iterdir())
    assert "codes_new.npz" in back and "codes_live.npz" not in back  # the same utterances: sent once


def _kill_processes_mentioning(text: str) -> None:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone already, or not ours
