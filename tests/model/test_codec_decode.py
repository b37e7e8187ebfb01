"""Codec decode path vs upstream fixtures (FSQ decode, quantizer.upsample, full decode, prefixes), code clamping,
and the official config's full key manifest."""

from __future__ import annotations

import json
import re

import pytest
import torch

from model.codec_checkpoint import checkpoint_key_shapes, is_encoder_key
from model.codec_config import CodecConfig
from model.vocoder import FireflyCodec

from .codec_testing import fixture_codec, one_thread, small_codec
from .fixture_sets import firefly_sets, manifests_dir, params

_ = one_thread
pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX_KEY = re.compile(r"^prefix_decode_k(\d+)$")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_config_and_derived_rates(fs):
    cfg = CodecConfig.from_dict(fs.config)
    assert cfg.rows == fs.tensors()["codes"].shape[1]
    assert cfg.codebook_size == 1000
    assert cfg.samples_per_frame == fs.tensors()["audio"].shape[-1] // fs.tensors()["codes"].shape[-1]
    assert CodecConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_fsq_and_upsample_match_upstream(fs):
    codec, t = fixture_codec(fs.path), fs.tensors()
    with torch.no_grad():
        z = codec.fsq_decode(t["codes"])
        assert _max_diff(z, t["z_fsq"]) <= 1e-6
        assert _max_diff(codec.upsampled_features(t["codes"]), t["z_upsampled"]) <= 1e-5


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_audio_matches_upstream(fs):
    codec, t = fixture_codec(fs.path), fs.tensors()
    for codes_key, audio_key in (("codes", "audio"), ("codes_long", "audio_long")):
        audio = codec.decode(t[codes_key])
        assert audio.dtype == torch.float32
        assert audio.shape == (1, t[codes_key].shape[-1] * codec.config.samples_per_frame)
        assert _max_diff(audio, t[audio_key][:, 0]) <= 1e-4, audio_key
        assert audio.abs().max() > 0.1  # a real waveform, not silence


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_prefix_decodes(fs):
    codec, t = fixture_codec(fs.path), fs.tensors()
    keys = {key: int(m.group(1)) for key in t if (m := PREFIX_KEY.match(key))}
    assert keys, "fixture set has no prefix_decode_k* tensors"
    for key, k in keys.items():
        assert _max_diff(codec.decode(t["codes_long"][..., :k]), t[key][:, 0]) <= 1e-4, key


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_batch_equals_single(fs):
    codec, t = fixture_codec(fs.path), fs.tensors()
    a, b = t["codes_long"][..., :6], t["codes_long"][..., 20:26]
    both = codec.decode(torch.cat([a, b]))
    assert _max_diff(both[0:1], codec.decode(a)) <= 1e-5
    assert _max_diff(both[1:2], codec.decode(b)) <= 1e-5


def test_out_of_range_codes_are_clamped_and_counted():
    codec = small_codec()
    cs = codec.config.codebook_size
    codes = torch.randint(0, cs, (2, codec.config.rows, 5))
    bad = codes.clone()
    bad[0, 0, 1] = 1023  # the LLM's codebook is 1024 wide
    bad[1, 3, 4] = cs
    bad[1, 2, 0] = -7
    before = codec.clamped_codes.item()
    audio = codec.decode(bad)
    assert codec.clamped_codes.item() - before == 3
    assert codec.clamped_codes.dtype == torch.int64
    assert torch.isfinite(audio).all()
    assert torch.equal(audio, codec.decode(bad.clamp(0, cs - 1)))
    codec.decode(codes)
    assert codec.clamped_codes.item() - before == 3  # valid codes are not counted


def test_rows_mismatch_is_an_error():
    codec = small_codec()
    with pytest.raises(ValueError, match="rows"):
        codec.decode(torch.zeros(1, codec.config.rows + 1, 3, dtype=torch.long))


def test_official_config_matches_manifest():
    mdir = manifests_dir()
    if mdir is None or not (mdir / "firefly_generator_keys.json").exists():
        pytest.skip("no firefly generator manifest")
    manifest = json.loads((mdir / "firefly_generator_keys.json").read_text())
    official = CodecConfig.official()
    assert CodecConfig.from_dict(manifest["config"]) == official
    assert (official.samples_per_frame, official.rows, official.codebook_size) == (2048, 8, 1000)
    expected = {k: tuple(v["shape"]) for k, v in manifest["keys"].items()}
    got = checkpoint_key_shapes(official, with_encoder=True)
    assert sorted(set(expected) - set(got)) == []
    assert sorted(set(got) - set(expected)) == []
    assert {k: s for k, s in got.items() if s != expected[k]} == {}
    for k, v in manifest["keys"].items():
        assert is_encoder_key(k) == v["role"].startswith("encoder-only"), k
    decode_keys = checkpoint_key_shapes(official, with_encoder=False)
    assert set(decode_keys) == {k for k, v in manifest["keys"].items() if v["role"].startswith("decode")}
    if "num_tensors_elements" in manifest:
        total = sum(torch.Size(s).numel() for s in got.values())
        assert total == manifest["num_tensors_elements"]
    with torch.device("meta"):  # the decode-only module tree builds without allocating
        codec = FireflyCodec(official)
    assert all(p.is_meta for p in codec.parameters())
