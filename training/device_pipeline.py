"""One GPU-machine hold, end to end: codec → teacher audio on the machine's own cores → codes → DualAR ∥ GAN phase.

A device call lasts at most 10 minutes and carries at most 64 MiB, but a machine stays held between calls, and a
process that starts its own session (setsid) outlives the call that started it. So the long work runs as daemons
under one work folder, and each call only starts a stage, waits, or collects:

  start-codec   copy the code to WORK/src and start the codec's reconstruction phase on the carried shards (daemon)
  start-rest    start the orchestrator (daemon): Piper speaks the corpus on all but a few cores while the codec
                trains; once the codec has finished it stops Piper, encodes every finished utterance to codes on the
                GPU, then trains the DualAR and the codec's GAN phase (encoder frozen: the codes stay valid) side by
                side until the deadline
  start-dual-ar hold B: the DualAR on carried codes ∥ the decoder-only phase on carried shards (daemons)
  start-teacher hold E: Piper speaks the corpus items a carried code pack lacks (all, without one); their codes join
                the pack that running DualARs re-read (daemon `teach`)
  wait          block until the orchestrator is done or N seconds have passed, printing progress, then collect
  collect       copy the small outputs (checkpoints, logs, codes, samples, ≤ 16 MiB each) into OUT

The teacher data never leaves the machine: only codes and checkpoints come back. Usage in training/TRAINING.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# A file that comes back from the device may be at most 16 MiB.
MAX_RETURN_BYTES = 16 * 2**20
# Seconds kept free before the deadline for the trainers' final save and sampling.
FINISH_MARGIN_S = 60.0
# Audio of the device's own teacher data packed for the GAN phase (besides the carried shards).
GAN_EXTRA_AUDIO_S = 3600.0
POLL_S = 5.0
# How often the teacher's new utterances are encoded and handed to the DualAR trainer.
DEFAULT_REFRESH_S = 180.0


def log(work: Path, message: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {message}"
    print(line, flush=True)
    with (work / "pipeline.log").open("a") as f:
        f.write(line + "\n")


def daemon(cmd: list[str], *, cwd: Path, log_path: Path, rc_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session (it outlives the device call); its exit status goes to `rc_path`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if rc_path is not None:
        quoted = " ".join(_quote(c) for c in cmd)
        cmd = ["sh", "-c", f"{quoted}; echo $? > {_quote(str(rc_path))}"]
    with log_path.open("ab") as out:
        return subprocess.Popen(
            cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


# Trainer flags that name a file. The daemons run in WORK/src, so these are made absolute where a call starts them:
# a relative `--codes-refresh` would otherwise name no file there, and the trainer would silently never refresh.
PATH_FLAGS = ("--resume", "--codes-refresh", "--config")


def _flags(text: str) -> list[str]:
    """One string of trainer flags → arguments, with the files of PATH_FLAGS made absolute."""
    return _absolute_paths(shlex.split(text))


def _absolute_paths(flags: list[str]) -> list[str]:
    def absolute(name: str, value: str) -> str:
        if name == "--config" and not value.endswith(".json"):  # a config's name (small, tiny, …)
            return value
        return str(Path(value).absolute())

    out: list[str] = []
    for flag in flags:
        name, eq, value = flag.partition("=")
        if eq and name in PATH_FLAGS:
            out.append(f"{name}={absolute(name, value)}")
        elif out and out[-1] in PATH_FLAGS:
            out.append(absolute(out[-1], flag))
        else:
            out.append(flag)
    return out


def copy_code(repo: Path, work: Path) -> Path:
    """The packages the trainers import, copied once: later calls replace the checkout under running daemons."""
    src = work / "src"
    if not src.exists():
        src.mkdir(parents=True)
        for name in ("model", "training"):
            shutil.copytree(repo / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _copy_shards(carried: list[str], work: Path) -> list[str]:
    """The carried audio shards, copied under WORK (a later call may replace the carried files); their new paths."""
    (work / "shards").mkdir(exist_ok=True)
    shards = []
    for s in carried:
        shards.append(str(work / "shards" / Path(s).name))
        shutil.copyfile(s, shards[-1])
    return shards


def start_codec(args: argparse.Namespace) -> None:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = copy_code(Path.cwd(), work)
    (work / "t0").write_text(f"{time.time()}\n")
    shards = _copy_shards(args.shards, work)
    cmd = [sys.executable, "-m", "training.codec_train", "train", "--shards", *shards, "--out", str(work / "codec"),
           "--train-seconds", str(args.seconds), "--total-seconds", str(args.seconds)]  # fmt: skip
    (work / "codec").mkdir(exist_ok=True)
    extra = _absolute_paths(args.extra)
    daemon(cmd + extra, cwd=src, log_path=work / "codec.log", rc_path=work / "codec.rc")
    (work / "codec_shards.json").write_text(json.dumps(shards))
    log(work, f"codec started: {' '.join(cmd[3:] + extra)}")


def start_rest(args: argparse.Namespace) -> None:
    work: Path = args.work
    src = copy_code(Path.cwd(), work)
    corpus = work / "corpus.jsonl"
    shutil.copyfile(args.corpus, corpus)
    if not (work / "t0").exists():  # codec-on-device-audio mode: no start-codec before
        (work / "t0").write_text(f"{time.time()}\n")
    deadline = float((work / "t0").read_text()) + args.total_seconds
    cmd = [sys.executable, "-m", "training.device_pipeline", "orchestrate", "--work", str(work),
           "--deadline", str(deadline), "--teacher-workers", str(args.teacher_workers),
           "--piper-python", args.piper_python, "--teacher-shard-items", str(args.teacher_shard_items),
           "--refresh-s", str(args.refresh_s), f"--dual-ar-args={json.dumps(_flags(args.dual_ar_args))}",
           f"--gan-args={json.dumps(_flags(args.gan_args))}", f"--encode-device={args.encode_device}",
           f"--codec-args={json.dumps(_flags(args.codec_args))}", "--codec-audio-s", str(args.codec_audio_s),
           "--codec-seconds", str(args.codec_seconds), "--codec-variants", *args.codec_variants]  # fmt: skip
    cmd += ["--codes-only"] if args.codes_only else []
    daemon(cmd, cwd=src, log_path=work / "orchestrator.log")
    log(work, "orchestrator started")


def start_dual_ar(args: argparse.Namespace) -> None:
    """Hold B: the DualAR on carried codes (and each `--variant`, side by side: a small model leaves the GPU mostly
    idle) and, given `--shards`, the decoder-only codec phase on them (without, the codec can train elsewhere:
    `start-codec --extra --resume FILE --freeze-encoder --new-phase`)."""
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = copy_code(Path.cwd(), work)
    codes = work / "carried_codes.npz"  # not codes_live.npz: it came from here, collect need not send it back
    shutil.copyfile(args.codes, codes)
    if args.shards:  # the decoder-only phase continues that codec
        if args.codec is None:
            raise SystemExit("--shards needs --codec: the codec resume file whose decoder they train")
        (work / "codec").mkdir(exist_ok=True)
        shutil.copyfile(args.codec, work / "codec" / "codec_resume.safetensors")
    shards = _copy_shards(args.shards, work)
    seconds = f"{args.seconds:.0f}"
    runs = {"dual_ar": _flags(args.dual_ar_args)}
    for variant in args.variant:
        name, _, extra = variant.partition("=")
        if not name.isidentifier() or f"dual_ar_{name}" in runs:
            raise SystemExit(f"--variant {variant!r}: give NAME=FLAGS with a distinct NAME of letters, digits, _")
        runs[f"dual_ar_{name}"] = _flags(args.dual_ar_args) + _flags(extra)  # the variant's flags win
    for name, extra_args in runs.items():
        cmd = [sys.executable, "-m", "training.dual_ar_train", "--codes", str(codes), "--out", str(work / name),
               "--train-seconds", seconds, "--total-seconds", seconds, *extra_args]  # fmt: skip
        daemon(cmd, cwd=src, log_path=work / f"{name}.log", rc_path=work / f"{name}.rc")
    jobs = list(runs)
    if shards:
        gan = [sys.executable, "-m", "training.codec_train", "train", "--shards", *shards, "--resume",
               str(work / "codec" / "codec_resume.safetensors"), "--out", str(work / "gan"), "--freeze-encoder",
               "--new-phase", "--train-seconds", seconds, "--total-seconds", seconds,
               *_flags(args.gan_args)]  # fmt: skip
        daemon(gan, cwd=src, log_path=work / "gan.log", rc_path=work / "gan.rc")
        jobs.append("gan")
    rcs = [_quote(str(work / f"{name}.rc")) for name in jobs]
    pending = " || ".join(f"[ ! -f {rc} ]" for rc in rcs)
    done = f"while {pending}; do sleep 5; done; echo finished > {_quote(str(work / 'DONE'))}"
    daemon(["sh", "-c", done], cwd=src, log_path=work / "waiter.log")
    phase = " and the decoder-only phase" if shards else " (no decoder-only phase: no shards)"
    log(work, f"{', '.join(runs)}{phase} started for {seconds} s")


def _start_teacher(work: Path, workers: int, piper_python: str, shard_items: int) -> subprocess.Popen[bytes]:
    """training.teacher on WORK/corpus.jsonl into WORK/teacher (resumes: finished shards are kept)."""
    log(work, f"teacher started on {workers} cores")
    return subprocess.Popen(
        [sys.executable, "-m", "training.teacher", "--corpus", str(work / "corpus.jsonl"), "--out",
         str(work / "teacher"), "--piper-python", piper_python, "--workers", str(workers),
         "--shard-items", str(shard_items), "--piper-threads", "1"],
        cwd=work / "src", stdout=(work / "teacher.log").open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def _stop_teacher(teacher: subprocess.Popen[bytes]) -> None:
    if teacher.poll() is None:
        teacher.send_signal(signal.SIGTERM)  # training.teacher kills its Piper processes and keeps done shards
        try:
            teacher.wait(60)
        except subprocess.TimeoutExpired:
            teacher.kill()


def _encode(
    work: Path,
    manifest: Path,
    codec: Path,
    out: Path,
    device: str,
    previous: Path | None = None,
    load_workers: int = 12,
) -> int:
    """training.encode_codes: every utterance of `manifest` (reusing `previous`' codes) into `out`; its exit status."""
    cmd = [sys.executable, "-m", "training.encode_codes", "--manifest", str(manifest), "--codec", str(codec),
           "--out", str(out), "--device", device, "--batch-s", "900", "--load-workers", str(load_workers)]  # fmt: skip
    cmd += ["--previous", str(previous)] if previous is not None else []
    with (work / "encode.log").open("ab") as encode_log:
        return subprocess.call(cmd, cwd=work / "src", stdout=encode_log, stderr=subprocess.STDOUT)


def start_teacher_hold(args: argparse.Namespace) -> None:
    """Hold E: Piper speaks the training items of the corpus that a carried code pack lacks, while DualARs train on
    that pack (`start-dual-ar` with `--codes-refresh WORK/codes_live.npz` in its flags). Every `--refresh-s` the new
    utterances are encoded with the pack's codec into WORK/codes_new.npz (they alone: it comes back) and
    WORK/codes_live.npz (the pack plus them) is replaced; the trainers re-read it at their next epoch. Without a
    carried pack every training item is spoken and codes_live.npz holds only what was spoken here (start the DualAR
    once it exists). The codec is a resume file or a checkpoint folder (the shipped `model/default_model`)."""
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = copy_code(Path.cwd(), work)
    from training.dual_ar_data import CodesPack

    known: set[str] = set()
    if args.base_codes is not None:
        shutil.copyfile(args.base_codes, work / "base_codes.npz")
        known = set(CodesPack.load(work / "base_codes.npz").ids)
    if args.codec.is_dir():  # a checkpoint folder: encode_codes loads it with model/'s own loader
        codec = work / "teacher_codec"
        shutil.copytree(args.codec, codec, dirs_exist_ok=True)
    else:
        codec = work / "teacher_codec.safetensors"
        shutil.copyfile(args.codec, codec)
    kept = skipped = 0
    with args.corpus.open() as src_rows, (work / "corpus.jsonl").open("w") as rest:
        for line in src_rows:
            row = json.loads(line)
            if row["split"] != "train" or row["id"] in known:  # held-out items never reach a trainer
                skipped += 1
                continue
            rest.write(line if line.endswith("\n") else line + "\n")
            kept += 1
    deadline = time.time() + args.seconds
    cmd = [sys.executable, "-m", "training.device_pipeline", "teach", "--work", str(work), "--deadline",
           str(deadline), "--codec", str(codec), "--workers", str(args.workers), "--piper-python", args.piper_python,
           "--shard-items", str(args.shard_items), "--refresh-s", str(args.refresh_s),
           "--encode-device", args.encode_device]  # fmt: skip
    daemon(cmd, cwd=src, log_path=work / "teach.log", rc_path=work / "teach.rc")
    log(work, f"teacher hold: {kept} corpus items to speak ({skipped} held out or already in the pack)")


def teach(args: argparse.Namespace) -> None:
    """The daemon of `start-teacher`: speak, encode every `--refresh-s`, hand the grown pack to the trainers."""
    from training.dual_ar_data import CodesPack
    from training.encode_codes import merge_packs
    from training.teacher import merge_manifests

    work: Path = args.work
    new, live = work / "codes_new.npz", work / "codes_live.npz"
    base_file = work / "base_codes.npz"
    base = CodesPack.load(base_file) if base_file.exists() else None  # none carried: the spoken codes alone
    teacher = _start_teacher(work, args.workers, args.piper_python, args.shard_items)
    encoded = 0
    try:
        while True:
            finished = teacher.poll() is not None
            if not finished:
                time.sleep(max(0.0, min(args.refresh_s, args.deadline - time.time())))
            if time.time() >= args.deadline:
                log(work, "teacher hold: deadline reached")
                break
            if (work / "teacher" / "shards").exists():
                manifest, rows, hours = merge_manifests(work / "teacher")
                if rows > encoded:
                    previous = new if new.exists() else None
                    rc = _encode(work, manifest, args.codec, work / "codes_new_next.npz", args.encode_device,
                                 previous, load_workers=4)  # fmt: skip
                    if rc != 0:
                        log(work, f"encoding failed (rc {rc}); see encode.log")
                        break
                    os.replace(work / "codes_new_next.npz", new)
                    spoken = CodesPack.load(new)
                    (spoken if base is None else merge_packs(base, spoken)).save(work / "codes_live_next.npz")
                    os.replace(work / "codes_live_next.npz", live)
                    encoded = rows
                    beside = len(base.ids) if base is not None else 0
                    log(work, f"codes refreshed: {rows} new utterances ({hours:.2f} h) beside {beside}")
            if finished:
                log(work, f"teacher finished (rc {teacher.returncode})")
                break
    finally:
        _stop_teacher(teacher)


def orchestrate(args: argparse.Namespace) -> None:
    work: Path = args.work
    src = work / "src"
    deadline: float = args.deadline
    teacher_dir = work / "teacher"

    def start_teacher(workers: int) -> subprocess.Popen[bytes]:
        return _start_teacher(work, workers, args.piper_python, args.teacher_shard_items)

    teacher = start_teacher(args.teacher_workers)
    sys.path.insert(0, str(src))
    from training.teacher import merge_manifests

    try:
        if args.codec_audio_s > 0:  # hold A: the codec trains on the device's own teacher audio
            while True:
                time.sleep(POLL_S)
                manifest, _, _ = merge_manifests(teacher_dir)
                if _audio_prefix(manifest, teacher_dir / "codec_manifest.jsonl", args.codec_audio_s)[1] >= (
                    args.codec_audio_s
                ):
                    break
                if teacher.poll() is not None:  # finished or crashed before there was enough audio
                    log(work, f"teacher exited with {teacher.returncode} before {args.codec_audio_s:.0f} s of audio")
                    (work / "FAILED").write_text("teacher\n")
                    return
            rc = subprocess.call(
                [sys.executable, "-m", "training.codec_train", "pack", "--manifest",
                 str(teacher_dir / "codec_manifest.jsonl"), "--out", str(work / "codec_shards"), "--max-mib", "400"],
                cwd=src, stdout=(work / "codec.log").open("ab"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            packed = sorted(str(p) for p in (work / "codec_shards").glob("shard_*.npz"))
            if rc != 0 or not packed:
                log(work, f"packing the codec's audio failed (rc {rc}); see codec.log")
                (work / "FAILED").write_text("codec pack\n")
                return
            (work / "codec_shards.json").write_text(json.dumps(packed))
            for i, variant in enumerate(args.codec_variants):  # several sizes side by side: the GPU has room
                name = "codec" if i == 0 else f"codec_{variant}"
                (work / name).mkdir(exist_ok=True)
                cmd = [sys.executable, "-m", "training.codec_train", "train", "--shards", *packed, "--out",
                       str(work / name), "--config", variant, "--train-seconds", f"{args.codec_seconds:.0f}",
                       "--total-seconds", f"{args.codec_seconds:.0f}", *args.codec_args]  # fmt: skip
                daemon(cmd, cwd=src, log_path=work / f"{name}.log", rc_path=work / f"{name}.rc")
            log(work, f"codec {args.codec_variants} started on {len(packed)} packed shards of the device's audio "
                      f"for {args.codec_seconds} s")  # fmt: skip
        while not (work / "codec.rc").exists():
            if teacher.poll() is not None and teacher.returncode != 0:
                log(work, f"teacher exited with {teacher.returncode} (see teacher.log); waiting for the codec")
            time.sleep(POLL_S)
    finally:
        _stop_teacher(teacher)
    codec_rc = (work / "codec.rc").read_text().strip()
    codec_file = work / "codec" / "codec_resume.safetensors"
    if codec_rc != "0" or not codec_file.exists():
        log(work, f"codec failed (rc {codec_rc}); see codec.log")
        (work / "FAILED").write_text("codec\n")
        return
    manifest, rows, hours = merge_manifests(teacher_dir)
    log(work, f"codec done; teacher stopped with {rows} utterances, {hours:.2f} h")
    if rows == 0:
        log(work, "no teacher audio was finished (see teacher.log)")
        (work / "FAILED").write_text("teacher\n")
        return
    started = time.monotonic()

    def encode(codec: Path, out: Path, previous: Path | None = None, load_workers: int = 12) -> int:
        return _encode(work, manifest, codec, out, args.encode_device, previous, load_workers)

    rc = encode(codec_file, work / "codes.npz")
    if rc != 0:
        log(work, f"encoding failed (rc {rc}); see encode.log")
        (work / "FAILED").write_text("encode\n")
        return
    log(work, f"codes written in {time.monotonic() - started:.0f} s")
    shutil.copyfile(work / "codes.npz", work / "codes_live.npz")
    for variant in args.codec_variants[1:]:  # the other sizes' codes, for choosing by codec_wer afterwards
        while not (work / f"codec_{variant}.rc").exists():
            time.sleep(POLL_S)
        other = work / f"codec_{variant}" / "codec_resume.safetensors"
        rc = encode(other, work / f"codes_{variant}.npz") if other.exists() else -1
        log(work, f"codes of {variant}: rc {rc}")
    if args.codes_only:
        (work / "DONE").write_text(json.dumps({"codes": rows}) + "\n")
        log(work, "finished: codec and codes (codes-only)")
        return
    seconds = max(60.0, deadline - time.time() - FINISH_MARGIN_S)
    dual_ar = [sys.executable, "-m", "training.dual_ar_train", "--codes", str(work / "codes.npz"),
               "--out", str(work / "dual_ar"), "--train-seconds", f"{seconds:.0f}", "--total-seconds", f"{seconds:.0f}",
               "--codes-refresh", str(work / "codes_live.npz"),
               *args.dual_ar_args]  # fmt: skip
    gan_manifest = teacher_dir / "gan_manifest.jsonl"  # beside manifest.jsonl: audio paths are relative to it
    carried = json.loads((work / "codec_shards.json").read_text())
    shards = " ".join(_quote(s) for s in carried)
    pack = ""
    if _audio_prefix(manifest, gan_manifest, GAN_EXTRA_AUDIO_S)[0]:  # the device's own audio too, packed first
        pack = (f"{_quote(sys.executable)} -m training.codec_train pack --manifest {_quote(str(gan_manifest))} "
                f"--out {_quote(str(work / 'gan_shards'))} --max-mib 400 && ")  # fmt: skip
        shards += f" {_quote(str(work / 'gan_shards'))}/shard_*.npz"
    gan_seconds = max(60.0, seconds - 60.0)  # packing the extra audio takes a little of its budget
    gan = (pack + f"{_quote(sys.executable)} -m training.codec_train train --shards {shards} "
           f"--resume {_quote(str(codec_file))} "
           f"--out {_quote(str(work / 'gan'))} --freeze-encoder --new-phase "
           f"--train-seconds {gan_seconds:.0f} --total-seconds {gan_seconds:.0f} "
           + " ".join(_quote(a) for a in args.gan_args))  # fmt: skip
    procs = {
        "dual_ar": daemon(dual_ar, cwd=src, log_path=work / "dual_ar.log", rc_path=work / "dual_ar.rc"),
        "gan": daemon(["sh", "-c", gan], cwd=src, log_path=work / "gan.log", rc_path=work / "gan.rc"),
    }
    log(work, f"DualAR and GAN phase started for {seconds:.0f} s")
    # the teacher goes on speaking on the cores the trainers leave free; every --refresh-s its new utterances are
    # encoded (reusing the codes already made) and handed to the DualAR trainer, which re-reads the pack per epoch
    teacher = start_teacher(max(1, args.teacher_workers - 2))
    live = work / "codes_live.npz"
    try:
        while time.time() < deadline - FINISH_MARGIN_S - args.refresh_s and procs["dual_ar"].poll() is None:
            time.sleep(args.refresh_s)
            manifest, rows, hours = merge_manifests(teacher_dir)
            rc = encode(codec_file, work / "codes_next.npz", previous=live, load_workers=4)
            if rc != 0:
                log(work, f"re-encoding failed (rc {rc}); the DualAR keeps its current pack")
                break
            os.replace(work / "codes_next.npz", live)
            log(work, f"codes refreshed: {rows} utterances, {hours:.2f} h")
    finally:
        _stop_teacher(teacher)
    status = {name: p.wait() for name, p in procs.items()}
    rcs = {name: (work / f"{name}.rc").read_text().strip() if (work / f"{name}.rc").exists() else "?" for name in procs}
    log(work, f"finished: {rcs} (wrappers {status})")
    (work / "DONE").write_text(json.dumps(rcs) + "\n")


def _audio_prefix(manifest: Path, out: Path, seconds: float) -> tuple[int, float]:
    """The first `seconds` of training audio of a manifest (its rows are in a hash order: a representative mix);
    returns (rows written, their seconds): short of `seconds` only when the manifest has no more."""
    kept, total = [], 0.0
    for line in manifest.read_text().splitlines():
        row = json.loads(line)
        if row.get("split") != "train" or total >= seconds:
            continue
        kept.append(line)
        total += float(row["duration_s"])
    out.write_text("".join(k + "\n" for k in kept))
    return len(kept), total


# What comes back, relative to WORK (missing files are skipped).
RETURNED = [
    "pipeline.log", "codec.log", "orchestrator.log", "teacher.log", "teach.log", "encode.log", "dual_ar.log", "gan.log",
    "codec/codec_resume.safetensors", "codec/codec_log.jsonl", "codec/codec_sample.wav",
    "teacher/timings.jsonl", "teacher/manifest.jsonl", "codes_live.npz",
    "dual_ar/dual_ar_best.safetensors", "dual_ar/dual_ar_resume.safetensors", "dual_ar/dual_ar_log.jsonl",
    "dual_ar/dual_ar_samples.npz", "gan/codec_resume.safetensors", "gan/codec_log.jsonl", "gan/codec_sample.wav",
    "DONE", "FAILED",
]  # fmt: skip


def _own_file(rel: str) -> bool:
    """Checkpoints and code packs come back as files of their own (a call returns at most 8 files: a hold returns
    ≤ 7 of these); logs and samples go into small.tar.gz."""
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(("codec_resume.safetensors", "dual_ar_best.safetensors", "dual_ar_resume.safetensors")) or (
        name.startswith("codes_") and name.endswith(".npz")
    )


def _return_pack_in_parts(path: Path, out: Path) -> list[str]:
    """A code pack over the return limit as `NAME.partK.npz` files of consecutive utterances, each at most
    MAX_RETURN_BYTES (`encode_codes.merge_packs` joins them again, in order); the names written."""
    from training.dual_ar_data import CodesPack

    pack = CodesPack.load(path)
    parts = -(-path.stat().st_size // MAX_RETURN_BYTES)
    while True:
        bounds = [round(k * len(pack.ids) / parts) for k in range(parts + 1)]
        names = [f"{path.stem}.part{k}.npz" for k in range(parts)]
        for name, lo, hi in zip(names, bounds, bounds[1:], strict=False):
            CodesPack(
                ids=pack.ids[lo:hi], texts=pack.texts[lo:hi], splits=pack.splits[lo:hi], codes=pack.codes[lo:hi],
                samples_per_frame=pack.samples_per_frame, sample_rate_hz=pack.sample_rate_hz,
            ).save(out / name)  # fmt: skip
        if all((out / name).stat().st_size <= MAX_RETURN_BYTES for name in names):
            return names
        for name in names:
            (out / name).unlink()
        parts += 1


def collect(work: Path, out: Path) -> None:
    """Checkpoints as files of their own, everything small in one `small.tar.gz`: at most 8 files come back. A code
    pack over 16 MiB comes back in parts; codes_live.npz not beside codes_new.npz (the carried pack plus those)."""
    out.mkdir(parents=True, exist_ok=True)
    small: list[str] = []
    extra = sorted(str(p.relative_to(work)) for p in work.glob("codec_*/codec_*") if p.is_file())
    # not the packs being written now (`*_next.npz`)
    extra += sorted(p.name for p in work.glob("codes_*.npz") if p.name != "codes_live.npz" and "_next" not in p.name)
    extra += sorted(p.name for p in work.glob("codec_*.log"))
    for run in sorted(work.glob("dual_ar_*/")):  # hold B's variants
        # the final weights (a best-by-validation-loss checkpoint can come before the model reads the text)
        names = ("dual_ar_resume.safetensors", "dual_ar_log.jsonl", "dual_ar_samples.npz")
        extra += [f"{run.name}/{name}" for name in names]
        extra.append(f"{run.name}.log")
    carried = (work / "carried_codes.npz").exists()  # hold B: the codec came from here
    teacher_hold = (work / "codes_new.npz").exists()  # hold E: codes_live.npz is the carried pack plus codes_new.npz
    for rel in RETURNED + extra:
        path = work / rel
        if not path.is_file() or (carried and rel == "codec/codec_resume.safetensors"):
            continue
        if teacher_hold and rel == "codes_live.npz":
            continue
        if path.stat().st_size > MAX_RETURN_BYTES and rel.startswith("codes_") and rel.endswith(".npz"):
            parts = _return_pack_in_parts(path, out)
            print(f"{rel} returned in {len(parts)} parts: {', '.join(parts)}", flush=True)
        elif path.stat().st_size > MAX_RETURN_BYTES:
            print(f"not returned (over 16 MiB): {rel}", flush=True)
        elif _own_file(rel):
            shutil.copyfile(path, out / rel.replace("/", "__"))
        else:
            small.append(rel)
    with tarfile.open(out / "small.tar.gz", "w:gz") as tar:
        for rel in small:
            tar.add(work / rel, arcname=rel)


def wait(args: argparse.Namespace) -> None:
    work: Path = args.work
    until = time.monotonic() + args.seconds
    shown: dict[str, int] = {}
    while time.monotonic() < until and not (work / "DONE").exists() and not (work / "FAILED").exists():
        time.sleep(min(30.0, max(0.0, until - time.monotonic())))
        variant_logs = sorted(p.name for p in work.glob("dual_ar_*.log"))
        logs = ("pipeline.log", "codec.log", "teacher.log", "teach.log", "encode.log", "dual_ar.log", "gan.log")
        for name in (*logs, *variant_logs):
            path = work / name
            if not path.exists():
                continue
            lines = path.read_text(errors="replace").splitlines()
            new = lines[shown.get(name, 0) :]
            shown[name] = len(lines)
            for line in new[-3:]:
                print(f"[{name}] {line[:300]}", flush=True)
    done = sorted((work / "teacher" / "shards").glob("*.jsonl")) if (work / "teacher" / "shards").exists() else []
    print(f"teacher shards done: {len(done)}", flush=True)
    if args.out is not None:
        collect(work, args.out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("start-codec")
    c.add_argument("--work", type=Path, required=True)
    c.add_argument("--shards", nargs="+", required=True)
    c.add_argument("--seconds", type=float, required=True)
    c.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    r = sub.add_parser("start-rest")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--corpus", type=Path, required=True)
    r.add_argument("--total-seconds", type=float, required=True, help="from start-codec to the trainers' end")
    r.add_argument("--teacher-workers", type=int, default=max(1, (os.cpu_count() or 4) - 3))
    r.add_argument("--piper-python", default=sys.executable)
    r.add_argument("--teacher-shard-items", type=int, default=40)
    r.add_argument("--refresh-s", type=float, default=DEFAULT_REFRESH_S)
    r.add_argument("--dual-ar-args", default="", help="extra dual_ar_train flags, one string (use --dual-ar-args=...)")
    r.add_argument("--gan-args", default="", help="extra codec_train train flags for the GAN phase, one string")
    r.add_argument("--encode-device", default="cuda")
    r.add_argument(
        "--codec-audio-s",
        type=float,
        default=0.0,
        help="> 0: no start-codec; the codec trains on this much of the device's own teacher audio",
    )
    r.add_argument("--codec-seconds", type=float, default=0.0, help="the codec's training time in that mode")
    r.add_argument("--codec-args", default="", help="extra codec_train train flags in that mode, one string")
    r.add_argument("--codes-only", action="store_true", help="stop after the codes (hold A: codec and codes)")
    r.add_argument(
        "--codec-variants",
        nargs="+",
        default=["small"],
        help="codec configs trained side by side in that mode; the first one's codes feed the DualAR",
    )
    d = sub.add_parser("start-dual-ar")
    d.add_argument("--work", type=Path, required=True)
    d.add_argument("--codes", type=Path, required=True, help="codes_live.npz of hold A")
    d.add_argument("--codec", type=Path, help="the codec resume file that made those codes (with --shards)")
    d.add_argument("--shards", nargs="*", default=[], help="shards for the decoder-only phase (none: no such phase)")
    d.add_argument("--seconds", type=float, required=True)
    d.add_argument("--dual-ar-args", default="", help="dual_ar_train flags for every DualAR run, one string")
    d.add_argument(
        "--variant", action="append", default=[], help="NAME=FLAGS: one more DualAR run (dual_ar_NAME); repeatable"
    )
    d.add_argument("--gan-args", default="")
    t = sub.add_parser("start-teacher")
    t.add_argument("--work", type=Path, required=True)
    t.add_argument("--corpus", type=Path, required=True)
    t.add_argument("--base-codes", type=Path, help="the pack the trainers start from (none: speak every item)")
    t.add_argument(
        "--codec", type=Path, required=True, help="what made that pack: a codec resume file or a checkpoint folder"
    )
    t.add_argument("--seconds", type=float, required=True, help="stop speaking and encoding after this long")
    t.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 4) - 3))
    t.add_argument("--piper-python", default=sys.executable)
    t.add_argument("--shard-items", type=int, default=40)
    t.add_argument("--refresh-s", type=float, default=60.0)
    t.add_argument("--encode-device", default="cuda")
    e = sub.add_parser("teach")
    e.add_argument("--work", type=Path, required=True)
    e.add_argument("--deadline", type=float, required=True)
    e.add_argument("--codec", type=Path, required=True)
    e.add_argument("--workers", type=int, required=True)
    e.add_argument("--piper-python", required=True)
    e.add_argument("--shard-items", type=int, required=True)
    e.add_argument("--refresh-s", type=float, required=True)
    e.add_argument("--encode-device", required=True)
    o = sub.add_parser("orchestrate")
    o.add_argument("--work", type=Path, required=True)
    o.add_argument("--deadline", type=float, required=True)
    o.add_argument("--teacher-workers", type=int, required=True)
    o.add_argument("--piper-python", required=True)
    o.add_argument("--teacher-shard-items", type=int, required=True)
    o.add_argument("--refresh-s", type=float, required=True)
    o.add_argument("--dual-ar-args", type=json.loads, required=True)
    o.add_argument("--gan-args", type=json.loads, required=True)
    o.add_argument("--encode-device", required=True)
    o.add_argument("--codec-args", type=json.loads, required=True)
    o.add_argument("--codec-audio-s", type=float, required=True)
    o.add_argument("--codec-seconds", type=float, required=True)
    o.add_argument("--codes-only", action="store_true")
    o.add_argument("--codec-variants", nargs="+", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--work", type=Path, required=True)
    w.add_argument("--seconds", type=float, required=True)
    w.add_argument("--out", type=Path)
    k = sub.add_parser("collect")
    k.add_argument("--work", type=Path, required=True)
    k.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # the daemons run in WORK/src: relative paths handed to them would name other files there
    args.work = args.work.absolute()
    if "/" in getattr(args, "piper_python", ""):  # a path, not a command on PATH (absolute(): keep a venv's link)
        args.piper_python = str(Path(args.piper_python).absolute())
    if args.command == "start-codec":
        start_codec(args)
    elif args.command == "start-rest":
        start_rest(args)
    elif args.command == "start-dual-ar":
        start_dual_ar(args)
    elif args.command == "start-teacher":
        start_teacher_hold(args)
    elif args.command == "teach":
        teach(args)
    elif args.command == "orchestrate":
        orchestrate(args)
    elif args.command == "wait":
        wait(args)
    else:
        collect(args.work, args.out)


if __name__ == "__main__":
    main()
