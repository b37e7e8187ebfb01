"""Codec training: the training path equals the inference codec, gradients flow, a tiny codec learns, shards travel."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import soundfile as sf
import torch

from model.codec_checkpoint import is_encoder_key
from model.codec_config import CodecConfig
from training.audio_pack import AudioShard, pack_shards, read_manifest, upsample
from training.checkpoints import load_codec_from_resume, load_resume, save_resume
from training.codec_losses import Discriminators, ReconstructionLoss, generator_adversarial_loss
from training.codec_model import TrainableCodec, is_parametrized
from training.codec_train import CodecTrainConfig, _eager_step, train_codec
from training.configs import CODEC_TINY

from .helpers import SAMPLE_RATE_HZ, chirp, one_thread  # noqa: F401


class InMemoryAudio(AudioShard):
    """An AudioShard over an array (skips the .npz files)."""

    def __init__(self, audio: np.ndarray) -> None:
        self.audio = torch.from_numpy(audio)
        self.rate_hz = SAMPLE_RATE_HZ
        self.ids = ["chirp"]


@pytest.mark.usefixtures("one_thread")
def test_training_path_equals_inference_codec(tmp_path) -> None:
    """Codes of the straight-through encoder == FireflyCodec.encode, and its reconstruction == FireflyCodec.decode,
    after the weights went through a resume file and model/'s loader (weight-norm pairs folded there)."""
    model = TrainableCodec(CodecConfig.from_dict(CODEC_TINY), seed=3)
    with torch.no_grad():  # move away from the init so every layer matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert is_parametrized(model)
    audio = torch.from_numpy(np.stack([chirp(0.4, seed=1), chirp(0.4, seed=2)]))
    with torch.no_grad():
        out = model(audio)
    save_resume(tmp_path / "codec_resume.safetensors", {"gen": model.codec}, {"codec_config": CODEC_TINY})
    codec = load_codec_from_resume(tmp_path / "codec_resume.safetensors")
    codes = codec.encode(audio)
    assert codes.shape == out.codes.shape == (2, 4, 9)  # ⌈(17640 // 512) / 4⌉ frames
    assert torch.equal(codes, out.codes)
    decoded = codec.decode(codes)
    torch.testing.assert_close(decoded, out.audio, rtol=0, atol=1e-4 * float(out.audio.abs().max()))


@pytest.mark.usefixtures("one_thread")
def test_gradients_reach_every_trainable_part() -> None:
    model = TrainableCodec(CodecConfig.from_dict(CODEC_TINY), seed=0)
    audio = torch.from_numpy(chirp(0.2)).unsqueeze(0)
    out = model(audio)
    loss = ReconstructionLoss(SAMPLE_RATE_HZ)(out.audio[:, : audio.shape[1]], audio)
    (loss["mel"] + loss["stft"]).backward()
    for name in ("backbone.", "quantizer.downsample.", "project_in", "project_out", "quantizer.upsample.", "head."):
        grads = [p.grad for n, p in model.codec.named_parameters() if name in n]
        assert grads and all(g is not None for g in grads), name
        assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0, name


@pytest.mark.usefixtures("one_thread")
def test_tiny_codec_learns_a_chirp(tmp_path) -> None:
    """60 steps on 4 s of a harmonic glide: mel L1 falls well below its start, in the codec's own resume format."""
    cfg = CodecTrainConfig(
        codec=CODEC_TINY, batch_size=4, segment_frames=4, lr=3e-3, warmup_steps=5, total_steps=200, total_seconds=0.0,
        gain_db_range=(0.0, 0.0), holdout_fraction=0.1,
    )  # fmt: skip
    audio = InMemoryAudio(chirp(4.0))
    result = train_codec(cfg, audio, max_steps=60, log_every=5, eval_every=60, out=tmp_path)
    mel = [h["mel"] for h in result.history if "mel" in h]
    assert mel[-1] < 0.6 * mel[0], mel
    val = [h["val_mel"] for h in result.history if "val_mel" in h]
    assert val and val[-1] < 0.7 * mel[0]
    parts, meta = load_resume(tmp_path / "codec_resume.safetensors")
    assert meta["step"] == 60 and meta["codec_config"] == CODEC_TINY
    assert any(".parametrizations.weight.original0" in k for k in parts["gen"])  # upstream's weight-norm layout


@pytest.mark.usefixtures("one_thread")
def test_adversarial_steps_resume_and_frozen_encoder(tmp_path) -> None:
    """GAN steps run and resume exactly; with the encoder frozen only the decoder moves, so codes stay the same."""
    cfg = CodecTrainConfig(codec=CODEC_TINY, batch_size=1, segment_frames=2, adversarial=True, warmup_steps=1)
    audio = InMemoryAudio(chirp(2.0))
    first = train_codec(cfg, audio, max_steps=2, log_every=1, out=tmp_path)
    assert {"d", "adv", "fm", "mel"} <= set(first.history[-1])
    parts, _ = load_resume(tmp_path / "codec_resume.safetensors")
    assert "disc" in parts and "gen" in parts
    resumed = TrainableCodec(CodecConfig.from_dict(CODEC_TINY))
    resumed.codec.load_state_dict(parts["gen"])
    before = first.model.codec.state_dict()
    for k, v in resumed.codec.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)

    frozen = dataclasses.replace(cfg, freeze_encoder=True)
    second = train_codec(frozen, audio, max_steps=2, resume=tmp_path / "codec_resume.safetensors", log_every=1)
    assert second.step == 4
    after = second.model.codec.state_dict()
    encoder = [k for k in after if is_encoder_key(k)]
    decoder = [k for k in after if not is_encoder_key(k)]
    assert encoder and all(torch.equal(after[k], before[k]) for k in encoder)
    assert any(not torch.equal(after[k], before[k]) for k in decoder)
    probe = torch.from_numpy(chirp(0.3, seed=9)).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(first.model(probe).codes, second.model(probe).codes)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("adversarial", [False, True])
def test_generator_step_weights_each_loss_term_as_configured(adversarial: bool) -> None:
    """One training step moves the generator along the gradient of mel + stft (reconstruction only), or, with the
    discriminators, of 15·(mel + stft) + adv + 2·fm (the defaults recon_weight_adversarial and feature_match_weight).
    Each term is differentiated alone on an untouched twin of the generator; the step's gradient must equal their
    weighted sum to within 5 % of the smallest term's share, so a wrong, missing or extra weight on any term shows."""
    cfg = CodecTrainConfig(codec=CODEC_TINY, adversarial=adversarial, grad_clip=1e9)  # no clipping
    codec_cfg = CodecConfig.from_dict(CODEC_TINY)
    model, twin = TrainableCodec(codec_cfg, seed=4), TrainableCodec(codec_cfg, seed=4)
    torch.manual_seed(4)
    with torch.no_grad():  # away from the init, whose near-silent output gives the spectral terms tiny gradients
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    twin.load_state_dict(model.state_dict())
    disc = Discriminators() if adversarial else None
    disc_before = copy.deepcopy(disc)  # the step scores real audio before it updates the discriminators
    recon = ReconstructionLoss(SAMPLE_RATE_HZ)
    n = 2 * codec_cfg.samples_per_frame
    real = torch.from_numpy(np.stack([chirp(0.2, seed=5)[:n], chirp(0.2, seed=6)[:n]]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt_g = torch.optim.AdamW(trainable, lr=1e-4)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=1e-4) if disc is not None else None
    _eager_step(cfg, model, recon, real, n, opt_g, trainable, disc, opt_d, 1e-4, torch.device("cpu"))
    got = torch.cat([p.grad.flatten() for p in trainable if p.grad is not None])

    fake = twin(real).audio[:, :n].float()
    losses = recon(fake, real)
    terms = {"mel": losses["mel"], "stft": losses["stft"]}
    weights = {"mel": 1.0, "stft": 1.0}
    if disc is not None and disc_before is not None:
        d_real = [(s.detach(), [f.detach() for f in fs]) for s, fs in disc_before(real)]
        terms["adv"], terms["fm"] = generator_adversarial_loss(d_real, disc(fake))  # the updated discriminators
        weights = {"mel": 15.0, "stft": 15.0, "adv": 1.0, "fm": 2.0}
    params = [p for p in twin.parameters() if p.requires_grad]

    def flat_grad(loss: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])

    parts = {k: weights[k] * flat_grad(v) for k, v in terms.items()}
    error = (got - sum(parts.values())).norm()
    for name, part in parts.items():
        assert error < 0.05 * part.norm(), f"{name}: step gradient off by {error:.3g}, term {part.norm():.3g}"


def test_upsample_interpolates_band_limited_audio() -> None:
    rate = 22050
    t = np.arange(rate) / rate
    low = np.sin(2 * np.pi * 3000 * t) * 0.5
    up = upsample(torch.from_numpy(low).float(), 2).numpy()
    t2 = np.arange(2 * rate) / (2 * rate)
    want = np.sin(2 * np.pi * 3000 * t2) * 0.5
    inner = slice(200, -200)  # away from the zero-padded ends
    assert np.abs(up[inner] - want[inner]).max() < 2e-3
    np.testing.assert_allclose(up[::2][100:-100], low[100:-100].astype(np.float32), atol=1e-6)  # samples kept


def test_manifest_pack_and_shard_roundtrip(tmp_path) -> None:
    rows = []
    for i, seconds in enumerate((0.5, 0.8, 0.3)):
        audio = chirp(seconds, seed=i)  # harmonics < 1.1 kHz: nothing lost at 22.05 kHz
        sf.write(tmp_path / f"u{i}.flac", audio, SAMPLE_RATE_HZ, subtype="PCM_16")
        rows.append({"id": f"u{i}", "text": f"Text {i}.", "norm": f"text {i}", "duration_s": seconds,
                     "audio": f"u{i}.flac", "split": "test" if i == 2 else "train"})  # fmt: skip
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    utts = read_manifest(tmp_path / "manifest.jsonl")
    assert [u.normalized_text for u in utts] == ["text 0", "text 1", "text 2"]
    train = [u for u in utts if u.split == "train"]
    paths = pack_shards(train, tmp_path / "shards", max_shard_bytes=30_000)  # 0.5 s = 22 kB: one utterance a shard
    assert len(paths) == 2
    shard = AudioShard(paths, SAMPLE_RATE_HZ)
    original = np.concatenate([chirp(0.5, seed=0), chirp(0.8, seed=1)])
    assert shard.ids == ["u0", "u1"] and abs(shard.audio.shape[0] - original.shape[0]) <= 2
    n = min(shard.audio.shape[0], original.shape[0])
    err = np.abs(shard.audio.numpy()[:n] - original[:n])
    assert err[1000:20000].max() < 3e-3  # 16-bit storage + two resamplings


def test_a_resume_file_that_does_not_exist_is_refused(tmp_path) -> None:
    """`--resume` names a file the user means: a typo must not start a fresh run that looks like a resumed one."""
    from training.codec_train import main

    missing = tmp_path / "nope.safetensors"
    with pytest.raises(SystemExit, match=r"--resume .*nope\.safetensors: no such file \(leave --resume out"):
        main(["train", "--shards", str(tmp_path / "s.npz"), "--out", str(tmp_path / "out"), "--resume", str(missing)])


def test_the_held_out_tail_is_never_training_audio() -> None:
    audio = InMemoryAudio(np.arange(10_000, dtype=np.float32))
    train, held = audio.split(0.1)
    assert train.shape[0] + held.shape[0] == 10_000 and held.shape[0] == 1_000
    assert torch.equal(torch.cat([train, held]), audio.audio)  # a cut, in order: no sample on both sides
    crops = AudioShard.crops(train, 64, 500, torch.Generator().manual_seed(0))
    assert crops.max() < held.min()  # training crops come from before the held-out tail
