"""Export: a trained pair becomes an official-layout folder that model/ loads and the engine speaks from."""

from __future__ import annotations

import asyncio
import json
from functools import cache

import numpy as np
import pytest
import soundfile as sf
import torch

from model.checkpoint import load_dual_ar
from model.codec_checkpoint import load_codec
from model.codec_config import CodecConfig
from streaming.config import BackendConfig
from streaming.engine import Engine, EngineConfig
from streaming.session import AudioChunk, SegmentDone, SynthesisSettings, UtteranceDone, Voice
from training.audio_pack import read_manifest
from training.checkpoints import export_model_folder
from training.codec_model import TrainableCodec
from training.configs import CODEC_TINY, DUAL_AR_TINY
from training.dual_ar_data import CodesPack
from training.encode_codes import encode_batch, encode_utterances, frames_for, merge_packs
from training.encode_codes import main as encode_main

from .helpers import SAMPLE_RATE_HZ, TEXTS, chirp, memorised_codes, memorised_dual_ar, one_thread  # noqa: F401

GREEDY = SynthesisSettings(temperature=0.0, top_p=1.0, repetition_penalty=1.0, seed=1)


@cache
def tiny_codec() -> TrainableCodec:
    """An untrained tiny codec rescaled to unit-gain convs and ~0.1 RMS output (HiFiGAN's init gives ~1e-11)."""
    model = TrainableCodec(CodecConfig.from_dict(CODEC_TINY), seed=5)
    with torch.no_grad():
        for conv in model.weight_normed_convs():
            gain = getattr(conv.parametrizations, "weight").original0  # getattr: typed Module | Tensor
            gain.mul_(2.0 / conv.weight[0].numel() ** 0.5 / float(conv.weight.std()))
        probe = model.decode_values(_values(model.codec, torch.randint(0, 1000, (1, 4, 32))))
        post = model.weight_normed_convs()[-1]
        assert post is model.codec.head.conv_post.conv
        getattr(post.parametrizations, "weight").original0.mul_(0.1 / float(probe.std()))
    return model


def export(tmp_path, **kwargs):
    return export_model_folder(
        tmp_path / "voice", dual_ar_state=memorised_dual_ar().model.state_dict(), dual_ar_config=DUAL_AR_TINY,
        codec_state=tiny_codec().inference_state_dict(), codec_config=CODEC_TINY, name="test-voice", **kwargs,
    )  # fmt: skip


async def speak_all(engine: Engine, texts) -> tuple[np.ndarray, list[SegmentDone]]:
    session = engine.open_session(Voice(), GREEDY)
    for t in texts:
        session.speak(t)
    session.end_utterance()
    pcm, segments = [], []
    while True:
        ev = await asyncio.wait_for(session.next_event(), 60)
        if isinstance(ev, AudioChunk):
            pcm.append(ev.pcm)
        elif isinstance(ev, SegmentDone):
            segments.append(ev)
        elif isinstance(ev, UtteranceDone):
            break
    session.close()
    return np.concatenate(pcm), segments


@pytest.mark.usefixtures("one_thread")
def test_exported_folder_loads_and_speaks_the_trained_codes(tmp_path) -> None:
    folder = export(tmp_path).path
    files = sorted(p.name for p in folder.iterdir())
    assert files == [
        "codec_config.json", "config.json", "fishgate.json", "generator.safetensors", "model.safetensors",
        "special_tokens.json", "tokenizer.tiktoken",
    ]  # fmt: skip
    meta = json.loads((folder / "fishgate.json").read_text())
    assert meta["name"] == "test-voice" and meta["untrained"] is False
    # weights survive the fp16 round trip through model/'s loaders
    loaded = load_dual_ar(folder, dtype=torch.float32)
    assert not any(p.requires_grad for p in loaded.model.parameters())  # an eager engine step records no autograd
    trained = memorised_dual_ar().model
    for k, v in trained.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[k], v, rtol=1e-3, atol=1e-4)
    codes = torch.from_numpy(memorised_codes()[0].astype(np.int64)).unsqueeze(0)
    with torch.no_grad():
        reference = tiny_codec().decode_values(_values(tiny_codec().codec, codes))
    got = load_codec(folder).decode(codes)
    assert float((got - reference).abs().max()) <= 2e-3 * float(reference.abs().max())

    engine = Engine(EngineConfig(BackendConfig(checkpoint=folder, max_sessions=2)))
    engine.start()
    try:
        assert engine.wait_ready(120), engine.fault
        assert engine.info is not None and engine.info.untrained is False and engine.info.name == "test-voice"
        pcm, segments = asyncio.run(speak_all(engine, TEXTS))
    finally:
        engine.stop()
    assert [s.ended_by for s in segments] == ["end_token", "end_token"]
    for seg, expected in zip(segments, memorised_codes(), strict=True):
        np.testing.assert_array_equal(seg.codes, expected)  # the second segment ran with the first as history
    assert pcm.shape[0] == sum(c.shape[1] for c in memorised_codes()) * 2048
    assert 0.01 < float(np.sqrt(np.mean(pcm**2))) < 0.5


def _values(codec, codes: torch.Tensor) -> torch.Tensor:
    """FSQ values (B, G, T, C) of integer codes, as the decoder's project_out reads them."""
    return codec.quantizer.residual_fsq.codes_to_values(codes, torch.float32)


def test_export_refuses_an_oversized_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="over the"):
        export(tmp_path, max_bytes=100_000)
    assert not (tmp_path / "voice").exists()


@pytest.mark.usefixtures("one_thread")
def test_batched_encoding_equals_encoding_alone(tmp_path) -> None:
    """encode_codes pads a batch at the end: every frame but the last equals encoding the utterance alone."""
    folder = export(tmp_path).path
    codec = load_codec(folder, with_encoder=True)
    rows = []
    for i, seconds in enumerate((0.3, 0.71, 0.52)):
        sf.write(tmp_path / f"u{i}.flac", chirp(seconds, seed=i), SAMPLE_RATE_HZ, subtype="PCM_16")
        rows.append({"id": f"u{i}", "text": f"T{i}.", "norm": f"t{i}", "duration_s": seconds, "audio": f"u{i}.flac",
                     "split": "train"})  # fmt: skip
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    utts = read_manifest(tmp_path / "manifest.jsonl")
    pack = encode_utterances(codec, utts, batch_s=10.0)
    assert pack.ids == ["u0", "u1", "u2"] and pack.texts == ["t0", "t1", "t2"]
    for u, codes in zip(utts, pack.codes, strict=True):
        audio = sf.read(u.audio_path, dtype="float32")[0]
        alone = encode_batch(codec, [audio])[0]
        assert codes.shape == alone.shape == (4, frames_for(len(audio), codec))
        np.testing.assert_array_equal(codes[:, :-1], alone[:, :-1])
    loaded = type(pack).load(_saved(pack, tmp_path))
    assert loaded.ids == pack.ids and all(np.array_equal(a, b) for a, b in zip(loaded.codes, pack.codes, strict=True))
    # decoding ahead in threads gives the same pack (batch order and membership do not change)
    threaded = encode_utterances(codec, utts, batch_s=0.8, load_workers=3)
    alone_batches = encode_utterances(codec, utts, batch_s=0.8)
    assert threaded.ids == alone_batches.ids
    assert all(np.array_equal(a, b) for a, b in zip(threaded.codes, alone_batches.codes, strict=True))
    # --previous: utterances already in the old pack are reused, not re-encoded; new ones are appended
    encode_main(["--manifest", str(tmp_path / "manifest.jsonl"), "--codec", str(folder), "--out",
                 str(tmp_path / "first.npz")])  # fmt: skip
    extra = {"id": "u3", "text": "T3.", "norm": "t3", "duration_s": 0.4, "audio": "u3.flac", "split": "test"}
    sf.write(tmp_path / "u3.flac", chirp(0.4, seed=3), SAMPLE_RATE_HZ, subtype="PCM_16")
    with (tmp_path / "manifest.jsonl").open("a") as f:
        f.write(json.dumps(extra) + "\n")
    first = CodesPack.load(tmp_path / "first.npz")
    first.codes[0][:] = 7  # marks the reused utterance
    first.save(tmp_path / "first.npz")
    encode_main(["--manifest", str(tmp_path / "manifest.jsonl"), "--codec", str(folder), "--out",
                 str(tmp_path / "grown.npz"), "--previous", str(tmp_path / "first.npz")])  # fmt: skip
    grown = CodesPack.load(tmp_path / "grown.npz")
    assert grown.ids == ["u0", "u1", "u2", "u3"] and grown.splits[-1] == "test"
    assert (grown.codes[0] == 7).all()
    np.testing.assert_array_equal(grown.codes[3][:, :-1], encode_batch(codec, [chirp(0.4, seed=3)])[0][:, :-1])
    with pytest.raises(ValueError, match="different codecs"):
        merge_packs(grown, CodesPack([], [], [], [], 1024, 44100))


def _saved(pack, tmp_path):
    path = tmp_path / "codes.npz"
    pack.save(path)
    return path


@pytest.mark.usefixtures("one_thread")
def test_codec_resynthesis_writes_every_test_clip(tmp_path) -> None:
    """training.codec_wer: held-out teacher clips through the codec's encoder and decoder, lengths kept."""
    from training.codec_wer import resynthesize

    folder = export(tmp_path).path
    rows = []
    for i, (seconds, split) in enumerate(((0.5, "test"), (0.4, "train"), (0.6, "test"))):
        sf.write(tmp_path / f"c{i}.flac", chirp(seconds, seed=i), SAMPLE_RATE_HZ, subtype="PCM_16")
        rows.append({"id": f"c{i}", "norm": f"clip {i}", "audio": f"c{i}.flac", "split": split})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    clips = resynthesize(folder, tmp_path / "m.jsonl", tmp_path / "resynth", None)
    assert [c[0] for c in clips] == ["c0", "c2"] and [c[2] for c in clips] == ["clip 0", "clip 2"]
    for (_, wav, _), seconds in zip(clips, (0.5, 0.6), strict=True):
        audio, rate = sf.read(wav)
        assert rate == SAMPLE_RATE_HZ and abs(len(audio) / rate - seconds) < 2 * 2048 / SAMPLE_RATE_HZ


def test_the_history_default_follows_the_training_mix_unless_given() -> None:
    """export's `--condition-on-previous-chunks auto`: a DualAR trained with no previous segment in its prompts
    (p_history 0, the default voice) gets a folder that reads each segment alone; one that saw history keeps Fish's
    default; `true` / `false` override."""
    from training.checkpoints import history_default

    never = {"train_config": {"mix": {"p_history": 0.0, "p_reference": 0.0}}}
    often = {"train_config": {"mix": {"p_history": 0.5}}}
    assert history_default("auto", never) is False and history_default("auto", often) is True
    assert history_default("auto", {}) is True  # unknown: Fish's default
    assert history_default("true", never) is True and history_default("false", often) is False


@pytest.mark.usefixtures("one_thread")
def test_resume_files_from_an_exported_folder_rebuild_it(tmp_path) -> None:
    """`resume-from-folder`: a shipped folder whose resume files are gone becomes resume files again — the DualAR's
    loads strictly into the trainer's model, and `export` from both rebuilds the same weights and card."""
    from model.config import DualARConfig
    from model.dual_ar import DualARTransformer
    from model.weights import read_safetensors
    from training.checkpoints import byte_tokenizer, load_resume
    from training.checkpoints import main as checkpoints_main

    card = {"dual_ar_step": 12, "codec_step": 34, "sampling": {"condition_on_previous_chunks": False}}
    folder = export(tmp_path, max_frames_per_char=7.0, extra_metadata=card).path
    checkpoints_main(["resume-from-folder", str(folder), "--out", str(tmp_path / "resume")])
    ar, codec = tmp_path / "resume" / "dual_ar_resume.safetensors", tmp_path / "resume" / "codec_resume.safetensors"
    parts, meta = load_resume(ar)
    assert meta["step"] == 12 and meta["dual_ar_config"] == DUAL_AR_TINY
    trainer_model = DualARTransformer(
        DualARConfig.from_dict(meta["dual_ar_config"]), byte_tokenizer().semantic_begin_id
    )
    trainer_model.load_state_dict(parts["model"], strict=True)  # what dual_ar_train --resume does
    checkpoints_main(["export", "--dual-ar", str(ar), "--codec", str(codec), "--out", str(tmp_path / "again"),
                      "--name", "test-voice", "--text", "Hi."])  # fmt: skip
    for name in ("model.safetensors", "generator.safetensors"):
        before, after = read_safetensors(folder / name), read_safetensors(tmp_path / "again" / name)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), name
    again = json.loads((tmp_path / "again" / "fishgate.json").read_text())
    assert again["max_frames_per_char"] == 7.0 and again["dual_ar_step"] == 12 and again["codec_step"] == 34
    assert again["sampling"] == {"condition_on_previous_chunks": False}  # read alone, as the folder did
