"""Codec training: encoder + straight-through FSQ + decoder on teacher audio, time-boxed and resumable.

Losses: multi-resolution STFT + log-mel L1 (training/codec_losses.py); `--adversarial` adds the light MPD+MSD with
LSGAN and feature matching. One call trains until `--train-seconds` (a device call lasts ≤ 10 minutes), then
writes `codec_resume.safetensors` (generator in upstream's weight-norm layout, discriminators, step and configs),
`codec_log.jsonl` and `codec_sample.wav` (held-out audio, then its reconstruction) into `--out`. The LR schedule
runs over `--total-steps` across calls; each call re-warms Adam for `warmup_steps`. Subcommand `pack` writes the
audio shards that travel (training/audio_pack.py). Usage in TRAINING.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.codec_config import CodecConfig

from .audio_pack import DEFAULT_PACK_RATE_HZ, DEFAULT_SHARD_BYTES, AudioShard, pack_shards, read_manifest
from .checkpoints import load_resume, require_resume_file, save_resume, write_wav
from .codec_losses import Discriminators, ReconstructionLoss, discriminator_loss, generator_adversarial_loss
from .codec_model import TrainableCodec
from .configs import CODEC_CANDIDATES, named_config
from .run_log import jsonl_log

RESUME_NAME = "codec_resume.safetensors"
LOG_NAME = "codec_log.jsonl"
SAMPLE_NAME = "codec_sample.wav"
# Seconds of held-out audio written to the sample WAV (original then reconstruction).
SAMPLE_S = 4.0
VALIDATION_CROPS = 16


@dataclass(frozen=True, slots=True)
class CodecTrainConfig:
    codec: dict[str, Any]  # codec_config.json contents
    # batch 16 at 1e-4 in fp32: the H200 trainings of 2026-11-30 (training/TRAINING.md) collapsed the FSQ to
    # one code per group at 5e-4 (with or without bf16) once the warm-up reached ~2e-4; 1e-4 recovered, and batch 16
    # reached the lowest mel loss per second (mel 0.63 after 200 s, 5 runs sharing one GPU)
    batch_size: int = 16
    segment_frames: int = 16  # crop length in code frames (16 · 2048 samples = 0.74 s)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.8, 0.99)  # HiFiGAN's
    total_seconds: float = 960.0  # cosine LR horizon in training seconds over all calls (calls are time-boxed)
    total_steps: int = 0  # or a horizon in steps (used when total_seconds is 0)
    warmup_steps: int = 200  # at the start and after every resume (Adam restarts with empty moments)
    min_lr_ratio: float = 0.1
    adversarial: bool = False
    freeze_encoder: bool = False  # train the decoder only: codes stay exactly as they were (GAN fine-tuning)
    recon_weight_adversarial: float = 15.0  # reconstruction weight beside the GAN terms (HiFiGAN: 45 on one mel)
    feature_match_weight: float = 2.0
    grad_clip: float = 100.0
    gain_db_range: tuple[float, float] = (-6.0, 0.0)  # random level per crop (encoder robustness for references)
    holdout_fraction: float = 0.02
    seed: int = 0
    amp: bool = False  # bf16 autocast on CUDA (losses stay fp32); off by default, see lr
    # reconstruction-only steps on CUDA as one CUDA-graph replay (GraphedReconStep); the GAN phase stays eager
    cuda_graph: bool = False


@dataclass
class CodecTrainResult:
    model: TrainableCodec
    discriminators: Discriminators | None
    step: int
    history: list[dict[str, float]] = field(default_factory=list)


def lr_at(cfg: CodecTrainConfig | Any, step: int, seconds: float, steps_this_call: int) -> float:
    """Cosine from cfg.lr to min_lr_ratio·lr over total_seconds (else total_steps; neither: constant), times a
    linear warm-up over the first warmup_steps of this call."""
    if cfg.total_seconds > 0:
        progress = min(seconds / cfg.total_seconds, 1.0)
    else:
        progress = min(step / cfg.total_steps, 1.0) if cfg.total_steps > 0 else 0.0
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    warm = min(1.0, (steps_this_call + 1) / max(cfg.warmup_steps, 1))
    return float(cfg.lr * cosine * warm)


def _autocast(device: torch.device, enabled: bool) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and device.type == "cuda")


def train_codec(
    cfg: CodecTrainConfig,
    audio: AudioShard,
    *,
    device: torch.device | str = "cpu",
    max_steps: int | None = None,
    max_seconds: float | None = None,
    resume: Path | None = None,
    out: Path | None = None,
    log_every: int = 50,
    eval_every: int = 500,
    save_every_s: float = 180.0,
    on_log: Callable[[dict[str, float]], None] | None = None,
    new_phase: bool = False,
) -> CodecTrainResult:
    """Train from scratch or from `resume` until max_steps or max_seconds; save into `out` (if given).

    `new_phase` restarts the LR schedule at this call (e.g. GAN fine-tuning after the reconstruction phase); later
    calls resumed from its file continue that phase's schedule.
    """
    device = torch.device(device)
    codec_cfg = CodecConfig.from_dict(cfg.codec)
    model = TrainableCodec(codec_cfg, seed=cfg.seed).to(device)
    disc = Discriminators().to(device) if cfg.adversarial else None
    step = 0
    meta_prev: dict[str, Any] = {}
    if resume is not None:
        parts, meta_prev = load_resume(resume)
        model.codec.load_state_dict(parts["gen"], strict=True)
        if disc is not None and "disc" in parts:
            disc.load_state_dict(parts["disc"], strict=True)
        step = int(meta_prev.get("step", 0))
    model.codec.init_buffers(device)
    if cfg.freeze_encoder:
        model.encoder_parameters_require_grad(False)
    recon = ReconstructionLoss(codec_cfg.sample_rate).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    graphed = cfg.cuda_graph and device.type == "cuda" and disc is None and not cfg.amp
    if graphed:  # the optimizer reads its learning rate from a device tensor, so a replay sees each new value
        opt_g = torch.optim.AdamW(
            trainable, lr=torch.tensor(cfg.lr, device=device), betas=cfg.betas, weight_decay=0.0, capturable=True
        )
    else:
        opt_g = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=cfg.lr, betas=cfg.betas) if disc is not None else None
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    train_stream, held_out = audio.split(cfg.holdout_fraction)
    n_samples = cfg.segment_frames * codec_cfg.samples_per_frame
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    history: list[dict[str, float]] = []
    t_start = last_save = time.monotonic()
    elapsed_prev = float(meta_prev.get("elapsed_s", 0.0))
    first_step = step
    phase_s = elapsed_prev if new_phase else float(meta_prev.get("phase_start_s", 0.0))
    phase_step = step if new_phase else int(meta_prev.get("phase_start_step", 0))

    def save() -> None:
        if out is None:
            return
        meta = {
            "kind": "codec", "step": step, "codec_config": cfg.codec, "train_config": _jsonable(cfg),
            "elapsed_s": elapsed_prev + time.monotonic() - t_start, "history_tail": history[-5:],
            "phase_start_s": phase_s, "phase_start_step": phase_step,
        }  # fmt: skip
        parts: dict[str, Any] = {"gen": model.codec}
        if disc is not None:
            parts["disc"] = disc
        save_resume(out / RESUME_NAME, parts, meta)

    graph_step = GraphedReconStep(model, recon, opt_g, trainable, cfg.grad_clip) if graphed else None
    while True:
        if max_steps is not None and step - first_step >= max_steps:
            break
        if max_seconds is not None and time.monotonic() - t_start >= max_seconds:
            break
        model.train()
        lr = lr_at(cfg, step - phase_step, elapsed_prev + time.monotonic() - t_start - phase_s, step - first_step)
        real = AudioShard.crops(train_stream, cfg.batch_size, n_samples, gen)
        low, high = cfg.gain_db_range
        gain_db = low + (high - low) * torch.rand(cfg.batch_size, 1, generator=gen)
        real = real * (10 ** (gain_db / 20)).to(device)
        if graph_step is not None:
            logged, codes, grad_norm = graph_step.run(real, lr)
        else:
            logged, codes, grad_norm = _eager_step(
                cfg, model, recon, real, n_samples, opt_g, trainable, disc, opt_d, lr, device
            )
        step += 1
        if step % log_every == 0 or step == first_step + 1:
            usage = _code_usage(codes, codec_cfg.codebook_size)
            entry = {"step": step, "lr": lr, "grad_norm": float(grad_norm), "code_usage": usage}
            entry.update({k: float(v) for k, v in logged.items()})
            entry["elapsed_s"] = time.monotonic() - t_start
            history.append(entry)
            if on_log is not None:
                on_log(entry)
        if step % eval_every == 0 and held_out.shape[0] > n_samples:
            val = evaluate(model, held_out, n_samples, recon, device, cfg.amp)
            entry = {"step": step, "val_mel": val}
            history.append(entry)
            if on_log is not None:
                on_log(entry)
        if out is not None and time.monotonic() - last_save >= save_every_s:
            save()
            last_save = time.monotonic()
    save()
    return CodecTrainResult(model, disc, step, history)


Logged = dict[str, torch.Tensor]


def _eager_step(
    cfg: CodecTrainConfig, model: TrainableCodec, recon: ReconstructionLoss, real: torch.Tensor, n_samples: int,
    opt_g: torch.optim.Optimizer, trainable: list[torch.nn.Parameter], disc: Discriminators | None,
    opt_d: torch.optim.Optimizer | None, lr: float, device: torch.device,
) -> tuple[Logged, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One training step (reconstruction, plus the GAN terms when `disc`); metrics as 0-d tensors (no sync)."""
    for opt in (opt_g, opt_d):
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = lr
    with _autocast(device, cfg.amp):
        fwd = model(real)
    fake = fwd.audio[:, :n_samples].float()
    losses = recon(fake, real)
    loss_g = losses["mel"] + losses["stft"]
    logged = {"mel": losses["mel"].detach(), "stft": losses["stft"].detach()}
    if disc is not None and opt_d is not None:
        with _autocast(device, cfg.amp):
            d_real = disc(real)
            d_fake = disc(fake.detach())
        loss_d = discriminator_loss(d_real, d_fake)
        opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), cfg.grad_clip)
        opt_d.step()
        with _autocast(device, cfg.amp):
            d_fake = disc(fake)
        adv, fm = generator_adversarial_loss([(s.detach(), [f.detach() for f in fs]) for s, fs in d_real], d_fake)
        loss_g = cfg.recon_weight_adversarial * loss_g + adv + cfg.feature_match_weight * fm
        logged.update(d=loss_d.detach(), adv=adv.detach(), fm=fm.detach())
    opt_g.zero_grad(set_to_none=True)
    loss_g.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
    opt_g.step()
    return logged, fwd.codes, grad_norm


class GraphedReconStep:
    """The reconstruction-only step (forward, loss, backward, clipping, AdamW) as one CUDA-graph replay.

    The codec is small, so an eager step is launch-bound (15–18 steps/s on the H200). A replay issues the
    same kernels without Python in between. Crops go through a static input buffer; the optimizer is a capturable
    AdamW whose learning rate is a device tensor, refilled before each replay. The first WARMUP_STEPS steps run
    eagerly on a side stream (cuDNN picks its algorithms, Adam creates its state), as torch's whole-network capture
    recipe asks; those are real training steps too.
    """

    WARMUP_STEPS = 3

    def __init__(
        self, model: TrainableCodec, recon: ReconstructionLoss, opt: torch.optim.Optimizer,
        trainable: list[torch.nn.Parameter], grad_clip: float,
    ) -> None:  # fmt: skip
        self.model, self.recon, self.opt, self.trainable, self.grad_clip = model, recon, opt, trainable, grad_clip
        self.real: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[Logged, torch.Tensor, torch.Tensor] | None = None
        self.warm = 0
        self.side = torch.cuda.Stream()

    def _body(self, real: torch.Tensor) -> tuple[Logged, torch.Tensor, torch.Tensor]:
        fwd = self.model(real)
        losses = self.recon(fwd.audio[:, : real.shape[1]].float(), real)
        (losses["mel"] + losses["stft"]).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.grad_clip)
        self.opt.step()
        return {"mel": losses["mel"].detach(), "stft": losses["stft"].detach()}, fwd.codes, grad_norm

    def run(self, real: torch.Tensor, lr: float) -> tuple[Logged, torch.Tensor, torch.Tensor]:
        if self.real is None:
            self.real = torch.empty_like(real)
        self.real.copy_(real)
        for group in self.opt.param_groups:
            group["lr"].fill_(lr)
        if self.graph is None and self.warm < self.WARMUP_STEPS:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.opt.zero_grad(set_to_none=True)
                outputs = self._body(self.real)
            torch.cuda.current_stream().wait_stream(self.side)
            self.warm += 1
            return outputs
        if self.graph is None:
            self.opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph's pool
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self._body(self.real)
        self.graph.replay()
        assert self.outputs is not None
        return self.outputs


def _code_usage(codes: torch.Tensor, codebook_size: int) -> float:
    """Mean fraction of the codebook used per code row in a batch (collapse shows as a small value)."""
    rows = codes.transpose(0, 1).reshape(codes.shape[1], -1)
    return float(np.mean([torch.unique(r).numel() / min(codebook_size, r.numel()) for r in rows]))


@torch.no_grad()
def evaluate(
    model: TrainableCodec, stream: torch.Tensor, n_samples: int, recon: ReconstructionLoss, device: torch.device,
    amp: bool = True,
) -> float:  # fmt: skip
    """Mean mel L1 over VALIDATION_CROPS fixed crops of the held-out stream."""
    model.eval()
    crops = AudioShard.crops(stream, VALIDATION_CROPS, n_samples, torch.Generator().manual_seed(1234))
    with _autocast(device, amp):
        fake = model(crops).audio[:, :n_samples].float()
    return float(recon(fake, crops)["mel"])


def _jsonable(cfg: CodecTrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


@torch.no_grad()
def write_sample(model: TrainableCodec, stream: torch.Tensor, path: Path) -> None:
    """16-bit WAV: SAMPLE_S of held-out audio, 0.5 s of silence, then its reconstruction."""
    rate = model.config.sample_rate
    spf = model.config.samples_per_frame
    n = min(int(SAMPLE_S * rate), stream.shape[0]) // spf * spf
    if n == 0:
        return
    model.eval()
    real = stream[:n].unsqueeze(0)
    fake = model(real).audio[0, :n].float()
    write_wav(path, torch.cat([real[0].float(), torch.zeros(rate // 2, device=real.device), fake]), rate)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="manifest → int16 audio shards that travel to the GPU")
    pk.add_argument("--manifest", type=Path, required=True)
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--split", default="train", help="which manifest split to pack ('all' for every row)")
    pk.add_argument("--rate-hz", type=int, default=DEFAULT_PACK_RATE_HZ)
    pk.add_argument("--max-mib", type=float, default=DEFAULT_SHARD_BYTES / 2**20)
    tr = sub.add_parser("train", help="train (or resume) for a fixed wall-clock budget")
    tr.add_argument("--shards", type=Path, nargs="+", required=True)
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--config", default="small", help=f"small, tiny, {', '.join(CODEC_CANDIDATES)} or a JSON file")
    tr.add_argument("--resume", type=Path)
    tr.add_argument("--train-seconds", type=float, default=480.0)
    tr.add_argument("--max-steps", type=int)
    tr.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = CodecTrainConfig(codec={})
    for name in ("batch_size", "segment_frames", "total_steps", "warmup_steps", "seed"):
        tr.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    tr.add_argument("--lr", type=float, default=defaults.lr)
    tr.add_argument("--total-seconds", type=float, default=defaults.total_seconds, help="LR horizon, all calls")
    tr.add_argument("--adversarial", action="store_true")
    tr.add_argument("--freeze-encoder", action="store_true", help="decoder only: codes stay unchanged")
    tr.add_argument("--new-phase", action="store_true", help="restart the LR schedule at this call")
    tr.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA")
    tr.add_argument("--cuda-graph", action="store_true", help="reconstruction steps as CUDA-graph replays")
    args = parser.parse_args(argv)

    if args.command == "pack":
        rows = [u for u in read_manifest(args.manifest) if args.split in ("all", u.split)]
        for path in pack_shards(rows, args.out, rate_hz=args.rate_hz, max_shard_bytes=int(args.max_mib * 2**20)):
            print(f"{path} {path.stat().st_size / 2**20:.1f} MiB")
        return
    config_arg = args.config
    codec = json.loads(Path(config_arg).read_text()) if config_arg.endswith(".json") else None
    cfg = CodecTrainConfig(
        codec=codec or named_config(config_arg, CODEC_CANDIDATES), batch_size=args.batch_size,
        segment_frames=args.segment_frames, lr=args.lr, total_steps=args.total_steps,
        total_seconds=args.total_seconds, warmup_steps=args.warmup_steps, adversarial=args.adversarial,
        freeze_encoder=args.freeze_encoder, seed=args.seed, amp=args.amp, cuda_graph=args.cuda_graph,
    )  # fmt: skip
    if require_resume_file(args.resume) is not None:
        _, meta = load_resume(args.resume)
        cfg = dataclasses.replace(cfg, codec=meta.get("codec_config", cfg.codec))  # the resumed model's shape wins
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    audio = AudioShard(args.shards, CodecConfig.from_dict(cfg.codec).sample_rate, device)
    print(json.dumps({"audio_s": audio.duration_s, "device": str(device), "resume": str(args.resume)}), flush=True)
    with jsonl_log(args.out / LOG_NAME) as on_log:
        result = train_codec(
            cfg, audio, device=device, max_steps=args.max_steps, max_seconds=args.train_seconds,
            resume=args.resume, out=args.out,
            on_log=on_log, new_phase=args.new_phase,
        )  # fmt: skip
        _, held_out = audio.split(cfg.holdout_fraction)
        write_sample(result.model, held_out, args.out / SAMPLE_NAME)


if __name__ == "__main__":
    main()
