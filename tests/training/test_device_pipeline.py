"""The one-hold device pipeline's pieces that run anywhere: what comes back, the GAN audio prefix, Piper's launcher.

The whole pipeline (codec → Piper → codes → DualAR ∥ decoder phase, as daemons) was run end to end on this CPU with
the tiny configs and on the H200 (training/TRAINING.md, run 1); CI has no Piper, so these tests cover the parts that
decide what a device call returns.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from training.device_pipeline import BIG_RETURNED, MAX_RETURN_BYTES, _audio_prefix, collect
from training.teacher import PIPER_LAUNCHER, TeacherConfig, piper_command


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
    assert len(BIG_RETURNED) + 1 <= 8  # a device call returns at most 8 files
    with tarfile.open(out / "small.tar.gz") as tar:
        assert sorted(tar.getnames()) == [
            "DONE", "codec_codec-c128-g8.log", "codec_codec-c128-g8/codec_log.jsonl", "dual_ar/dual_ar_log.jsonl",
            "pipeline.log", "teacher/manifest.jsonl",
        ]  # fmt: skip


def test_gan_audio_prefix_takes_training_rows_up_to_the_budget(tmp_path: Path) -> None:
    rows = [{"id": f"u{i}", "split": "test" if i == 0 else "train", "duration_s": 4.0} for i in range(10)]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _audio_prefix(manifest, tmp_path / "gan.jsonl", 10.0) == 3  # 4 + 4 + 4 s: the row crossing 10 s is kept
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
