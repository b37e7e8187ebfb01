"""Training checkpoints: one-file resume states, and export to the official folder layout the engine loads.

A resume state is one safetensors file: tensors under a part prefix (`gen.`, `disc.`, `model.`) in a compact dtype,
and a JSON `meta` string (step, configs, data cursor) in the header. Weights only: Adam restarts each call with a
short warm-up (moments would triple the bytes that travel). `export_model_folder` writes config.json,
model.safetensors, tokenizer.tiktoken (byte-level, official format), special_tokens.json, codec_config.json,
generator.safetensors and fishgate.json, then reloads them with model/'s loaders to prove the folder is servable.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model.checkpoint import load_dual_ar
from model.codec_checkpoint import load_codec
from model.codec_config import CodecConfig
from model.config import DualARConfig
from model.tokenizer import FishTokenizer
from model.vocoder import FireflyCodec
from model.weights import read_safetensors, write_safetensors

# The shipped folder must stay under this (issue 6: it travels with the package).
MAX_SHIPPED_BYTES = 15 * 10**6
# Resume files are fp32 while this small (exact continuation), else bf16: a file coming back from the device may
# be at most 16 MiB (the chosen DualAR is 14.1 MiB in fp32).
RESUME_FP32_MAX_BYTES = 15 * 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- tokenizer -------------------------------------------------------------------------------------------------------
def byte_ranks() -> dict[bytes, int]:
    """The 256 single-byte ranks: every UTF-8 string encodes, one token per byte (no merges)."""
    return {bytes([b]): b for b in range(256)}


def byte_tokenizer() -> FishTokenizer:
    return FishTokenizer(byte_ranks(), name="tokenizer")


def write_tokenizer(folder: Path) -> FishTokenizer:
    """tokenizer.tiktoken (`<base64> <rank>` lines, the official format) and special_tokens.json."""
    lines = "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in byte_ranks().items())
    (folder / "tokenizer.tiktoken").write_text(lines)
    tokenizer = FishTokenizer.from_file(folder / "tokenizer.tiktoken")
    (folder / "special_tokens.json").write_text(json.dumps(dict(tokenizer.special_ids), indent=1))
    return tokenizer


# ---- resume states ---------------------------------------------------------------------------------------------------
def _state(part: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = part.state_dict() if isinstance(part, nn.Module) else dict(part)
    return {k: v.detach() for k, v in sd.items()}


def resume_dtype(parts: Mapping[str, nn.Module | Mapping[str, torch.Tensor]], dtype: str) -> torch.dtype:
    """`auto`: fp32 if the fp32 file stays under RESUME_FP32_MAX_BYTES, else bf16; or an explicit name."""
    if dtype != "auto":
        return DTYPES[dtype]
    n_bytes = sum(4 * t.numel() for p in parts.values() for t in _state(p).values() if t.is_floating_point())
    return torch.float32 if n_bytes <= RESUME_FP32_MAX_BYTES else torch.bfloat16


def save_resume(
    path: Path, parts: Mapping[str, nn.Module | Mapping[str, torch.Tensor]], meta: dict[str, Any], dtype: str = "auto"
) -> Path:
    """Write every part's state under `<part>.` in one safetensors file with `meta` as JSON; atomic."""
    target = resume_dtype(parts, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, part in parts.items():
        for k, v in _state(part).items():
            tensors[f"{name}.{k}"] = (v.to(target) if v.is_floating_point() else v).cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, path, metadata={"meta": json.dumps(meta), "dtype": str(target)})
    return path


def load_resume(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """(parts {name: state dict (fp32 copies)}, meta) of a file written by save_resume."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = json.loads(header.get("__metadata__", {}).get("meta", "{}"))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in read_safetensors(path).items():
        name, _, rest = key.partition(".")
        parts.setdefault(name, {})[rest] = t.float().clone() if t.is_floating_point() else t.clone()
    return parts, meta


def require_resume_file(path: Path | None) -> Path | None:
    """A trainer's `--resume` as given, or SystemExit when it names no file: a typo must not start a fresh run that
    looks like a resumed one."""
    if path is not None and not path.is_file():
        raise SystemExit(f"--resume {path}: no such file (leave --resume out to train from scratch)")
    return path


# ---- export ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ExportedFolder:
    path: Path
    total_bytes: int
    dual_ar_params: int
    codec_params: int


def _cast(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for k, value in state.items():
        t = value.detach().cpu()
        if t.is_floating_point():
            t = t.to(dtype)
            if not torch.isfinite(t).all():
                raise ValueError(f"{k} does not fit {dtype} (overflow); export with dtype='bf16' or 'fp32'")
        out[k] = t.contiguous()
    return out


def export_model_folder(
    out: Path,
    *,
    dual_ar_state: Mapping[str, torch.Tensor],
    dual_ar_config: dict[str, Any],
    codec_state: Mapping[str, torch.Tensor],
    codec_config: dict[str, Any],
    name: str,
    dtype: str = "fp16",
    max_frames_per_char: float | None = 4.0,
    extra_metadata: dict[str, Any] | None = None,
    max_bytes: int = MAX_SHIPPED_BYTES,
) -> ExportedFolder:
    """Write a servable checkpoint folder (official layout + fishgate.json) and prove that model/ loads it.

    `codec_state` is the generator in upstream's layout (weight-norm pairs or folded weights, encoder included).
    `max_frames_per_char` caps a segment's frames by its text length (a safety net should the model miss its
    `<|im_end|>`). Raises ValueError if the folder exceeds `max_bytes` or fails to load.
    """
    torch_dtype = DTYPES[dtype]
    cfg = DualARConfig.from_dict(dual_ar_config)
    CodecConfig.from_dict(codec_config)  # validates
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))  # same file system: the final rename is atomic
    try:
        tokenizer = write_tokenizer(tmp)
        if cfg.vocab_size <= tokenizer.semantic_end_id:
            raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the byte tokenizer's {tokenizer.vocab_size}")
        (tmp / "config.json").write_text(json.dumps(dual_ar_config, indent=4, sort_keys=True))
        write_safetensors(_cast(dual_ar_state, torch_dtype), tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "codec_config.json").write_text(json.dumps(codec_config, indent=2))
        write_safetensors(_cast(codec_state, torch_dtype), tmp / "generator.safetensors", metadata={"format": "pt"})
        meta = {"name": name, "untrained": False, "max_frames_per_char": max_frames_per_char, **(extra_metadata or {})}
        (tmp / "fishgate.json").write_text(json.dumps(meta, indent=2) + "\n")
        total = sum(p.stat().st_size for p in tmp.iterdir())
        if total > max_bytes:
            raise ValueError(
                f"the exported folder is {total / 1e6:.1f} MB, over the {max_bytes / 1e6:.1f} MB limit; "
                "pick smaller configs (training/configs.py) or export with dtype='fp16'/'bf16'"
            )
        loaded = load_dual_ar(tmp, dtype=torch.float32)
        codec = load_codec(tmp, with_encoder=True)
        n_codec = sum(p.numel() for p in codec.parameters())
        n_ar = sum(p.numel() for p in loaded.model.parameters())
        if loaded.config.num_codebooks != codec.config.rows:
            raise ValueError(
                f"the DualAR predicts {loaded.config.num_codebooks} codebooks but the codec has {codec.config.rows} "
                "code rows; set num_codebooks = n_groups · n_codebooks"
            )
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp made it private; the folder ships inside a package
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportedFolder(out, total, n_ar, n_codec)


def load_codec_from_resume(path: Path, device: torch.device | str = "cpu") -> FireflyCodec:
    """The inference codec (with encoder) of a codec resume file, through model/'s own loader."""
    parts, meta = load_resume(path)
    if "gen" not in parts or "codec_config" not in meta:
        raise ValueError(f"{path} is not a codec resume file (no 'gen.' tensors / codec_config)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "codec_config.json").write_text(json.dumps(meta["codec_config"]))
        write_safetensors(parts["gen"], folder / "generator.safetensors")
        return load_codec(folder, device=device, with_encoder=True)


# The export's default `--frames-per-char-margin`: fishgate.json's `max_frames_per_char` is the corpus maximum × this.
EXPORT_FRAMES_PER_CHAR_MARGIN = 2.0


def resumes_from_folder(folder: Path, out_dir: Path) -> tuple[Path, Path]:
    """An exported model folder → `dual_ar_resume.safetensors` and `codec_resume.safetensors` (weights only, fp32
    copies of its fp16 tensors) in `out_dir`, so training can continue a shipped voice whose resume files are gone,
    and `export` can rebuild its folder from them. The meta carries what the folder records of its training: steps,
    the corpus' frames-per-character maximum, and whether the DualAR saw previous segments in its prompts (a folder
    that reads segments alone was trained without them: p_history 0)."""
    config = json.loads((folder / "config.json").read_text())
    codec_config = json.loads((folder / "codec_config.json").read_text())
    card_file = folder / "fishgate.json"
    card = json.loads(card_file.read_text()) if card_file.is_file() else {}
    load_dual_ar(folder, dtype=torch.float32)  # refuses a folder model/ cannot load
    load_codec(folder, with_encoder=True)
    history = card.get("sampling", {}).get("condition_on_previous_chunks", True)
    ar_meta: dict[str, Any] = {
        "kind": "dual_ar", "step": int(card.get("dual_ar_step") or 0), "dual_ar_config": config,
        "train_config": {"mix": {"p_history": 1.0 if history else 0.0}}, "source_folder": str(folder),
    }  # fmt: skip
    if card.get("max_frames_per_char"):
        ar_meta["max_frames_per_char"] = float(card["max_frames_per_char"]) / EXPORT_FRAMES_PER_CHAR_MARGIN
    codec_meta = {"kind": "codec", "step": int(card.get("codec_step") or 0), "codec_config": codec_config,
                  "source_folder": str(folder)}  # fmt: skip
    ar_state = read_safetensors(folder / "model.safetensors")
    gen_state = read_safetensors(folder / "generator.safetensors")
    ar_path = save_resume(out_dir / "dual_ar_resume.safetensors", {"model": ar_state}, ar_meta, dtype="fp32")
    codec_path = save_resume(out_dir / "codec_resume.safetensors", {"gen": gen_state}, codec_meta, dtype="fp32")
    return ar_path, codec_path


# ---- command line: export a trained pair, vocode sampled codes -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SpokenCheck:
    audio_s: float
    wall_s: float
    frames: list[int]
    ended_by: list[str]


def speak_once(folder: Path, text: str) -> SpokenCheck:
    """One utterance through the streaming engine from `folder` (CPU, the engine's defaults)."""
    import asyncio
    import time

    from streaming.config import BackendConfig
    from streaming.engine import Engine, EngineConfig
    from streaming.session import AudioChunk, SegmentDone, SynthesisSettings, UtteranceDone, Voice

    async def run(engine: Engine) -> SpokenCheck:
        session = engine.open_session(Voice(), SynthesisSettings(seed=0))
        t0 = time.perf_counter()
        session.speak(text)
        session.end_utterance()
        samples, frames, ended = 0, [], []
        while True:
            ev = await asyncio.wait_for(session.next_event(), 300)
            if isinstance(ev, AudioChunk):
                samples += len(ev.pcm)
            elif isinstance(ev, SegmentDone):
                frames.append(ev.frames)
                ended.append(ev.ended_by)
            elif isinstance(ev, UtteranceDone):
                break
        session.close()
        assert engine.info is not None
        return SpokenCheck(samples / engine.info.sample_rate_hz, time.perf_counter() - t0, frames, ended)

    engine = Engine(EngineConfig(BackendConfig(checkpoint=folder, max_sessions=1)))
    engine.start()
    try:
        if not engine.wait_ready(300):
            raise RuntimeError(f"the engine could not load {folder}: {engine.fault}")
        return asyncio.run(run(engine))
    finally:
        engine.stop()


def write_wav(path: Path, audio: torch.Tensor, rate_hz: int) -> None:
    """Float audio in [-1, 1] (clamped) → mono 16-bit WAV."""
    write_pcm16(path, (audio.detach().float().clamp(-1, 1).cpu().numpy() * 32767).astype("<i2"), rate_hz)


def write_pcm16(path: Path, pcm: np.ndarray, rate_hz: int) -> None:
    """int16 samples → mono 16-bit WAV (stdlib `wave`)."""
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate_hz)
        w.writeframes(np.asarray(pcm, dtype="<i2").tobytes())


def history_default(choice: str, dual_ar_meta: dict[str, Any]) -> bool:
    """The exported folder's `condition_on_previous_chunks`: `true`/`false` as given; `auto` follows the training mix
    (a DualAR that never saw a previous segment in its prompt reads each segment alone)."""
    if choice != "auto":
        return choice == "true"
    mix = dual_ar_meta.get("train_config", {}).get("mix", {})
    return float(mix.get("p_history", 1.0)) > 0


def main(argv: list[str] | None = None) -> None:
    import argparse

    # imported here: the device's trainers import this module from a copy of model/ and training/ only
    from streaming.sampling_defaults import SAMPLING_RANGES

    parser = argparse.ArgumentParser(
        description="export a trained DualAR + codec; vocode sampled codes; resume files from an exported folder"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="resume files → official-layout folder, then one engine utterance")
    ex.add_argument("--dual-ar", type=Path, required=True, help="dual_ar_best.safetensors or dual_ar_resume…")
    ex.add_argument("--codec", type=Path, required=True, help="codec_resume.safetensors")
    ex.add_argument("--out", type=Path, required=True)
    ex.add_argument("--name", default="fishgate-default")
    ex.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    ex.add_argument(
        "--frames-per-char-margin", type=float, default=EXPORT_FRAMES_PER_CHAR_MARGIN, help="× the corpus maximum"
    )
    ex.add_argument("--text-normalizer", default="english", help="what the DualAR was trained on ('none': raw text)")
    ex.add_argument("--text", default="Hello! This is the default voice of fishgate, speaking on a small CPU.")
    for name in SAMPLING_RANGES:
        ex.add_argument("--" + name.replace("_", "-"), type=float, help="the folder's default (fishgate.json)")
    ex.add_argument(
        "--condition-on-previous-chunks", choices=("auto", "true", "false"), default="auto",
        help="the folder's default for Fish's request field; auto: false when the DualAR trained without a previous "
        "segment in its prompts (p_history 0), since such a model misreads one (issue 6: 28.2 → 20.9 %% WER)",
    )  # fmt: skip
    rf = sub.add_parser("resume-from-folder", help="an exported folder → DualAR and codec resume files (weights only)")
    rf.add_argument("folder", type=Path, help="e.g. model/default_model")
    rf.add_argument("--out", type=Path, required=True, help="directory for the two resume files")
    vo = sub.add_parser("vocode", help="dual_ar_samples.npz → WAV files with the codec")
    vo.add_argument("--codec", type=Path, required=True)
    vo.add_argument("--samples", type=Path, required=True)
    vo.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "resume-from-folder":
        for path in resumes_from_folder(args.folder, args.out):
            print(path)
        return
    if args.command == "vocode":
        codec = load_codec_from_resume(args.codec)
        args.out.mkdir(parents=True, exist_ok=True)
        with np.load(args.samples, allow_pickle=False) as z:
            for k, text in enumerate(z["texts"]):
                codes = torch.from_numpy(z[f"codes_{k}"].astype(np.int64)).unsqueeze(0)
                write_wav(args.out / f"sample_{k}.wav", codec.decode(codes)[0], codec.config.sample_rate)
                print(f"sample_{k}.wav: {codes.shape[-1]} frames, ended={bool(z['ended'][k])}: {text}")
        return
    ar_parts, ar_meta = load_resume(args.dual_ar)
    codec_parts, codec_meta = load_resume(args.codec)
    fpc = float(ar_meta.get("max_frames_per_char") or 2.0) * args.frames_per_char_margin
    sampling: dict[str, float | bool] = {k: getattr(args, k) for k in SAMPLING_RANGES if getattr(args, k) is not None}
    if not history_default(args.condition_on_previous_chunks, ar_meta):
        sampling["condition_on_previous_chunks"] = False
    exported = export_model_folder(
        args.out, dual_ar_state=ar_parts["model"], dual_ar_config=ar_meta["dual_ar_config"],
        codec_state=codec_parts["gen"], codec_config=codec_meta["codec_config"], name=args.name, dtype=args.dtype,
        max_frames_per_char=round(fpc, 2),
        extra_metadata={
            "dual_ar_step": ar_meta.get("step"), "codec_step": codec_meta.get("step"),
            "text_normalizer": None if args.text_normalizer == "none" else args.text_normalizer,
            **({"sampling": sampling} if sampling else {}),
        },
    )  # fmt: skip
    print(f"{exported.path}: {exported.total_bytes / 1e6:.2f} MB, DualAR {exported.dual_ar_params / 1e6:.2f} M, "
          f"codec {exported.codec_params / 1e6:.2f} M parameters")  # fmt: skip
    check = speak_once(exported.path, args.text)
    rtf = check.wall_s / max(check.audio_s, 1e-9)
    print(f"engine: {check.audio_s:.2f} s of audio in {check.wall_s:.2f} s (RTF {rtf:.3f}), "
          f"frames {check.frames}, ended by {check.ended_by}")  # fmt: skip


if __name__ == "__main__":
    main()
