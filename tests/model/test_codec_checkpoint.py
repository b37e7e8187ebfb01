"""Codec checkpoint loading: both file formats, upstream key variants (prefix, wrapper, weight-norm spellings,
pre-folded), key errors, file/config choice, and the weight-norm fold against torch's own parametrization."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from model.codec_checkpoint import (
    OFFICIAL_GENERATOR_NAME,
    codec_weights_file,
    fold_weight_norm,
    is_encoder_key,
    load_codec,
    load_codec_config,
    read_codec_state_dict,
)
from model.codec_config import CodecConfig
from model.weights import CheckpointError, read_state_dict, write_safetensors

from .codec_testing import fixture_codec, one_thread
from .fixture_sets import firefly_sets, params

_ = one_thread
pytestmark = pytest.mark.usefixtures("one_thread")


def _raw(fs) -> dict[str, torch.Tensor]:
    name = "generator.safetensors" if fs.has("generator.safetensors") else "generator.pth"
    return {k: v.clone() for k, v in read_state_dict(fs.path / name).items()}


def _folder(tmp_path, fs, sd, name="generator.pth", wrap=False):
    """A checkpoint folder holding `sd` (pickle or safetensors by suffix) and the set's config."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(fs.path / "config.json", tmp_path / "config.json")
    if name.endswith(".safetensors"):
        write_safetensors(sd, tmp_path / name)
    else:
        torch.save({"state_dict": sd} if wrap else sd, tmp_path / name)
    return tmp_path


def _assert_same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_pth_and_safetensors_agree(fs):
    assert fs.has("generator.pth") and fs.has("generator.safetensors")
    from_pth = load_codec(fs.path / "generator.pth")
    from_st = load_codec(fs.path / "generator.safetensors")
    _assert_same_params(from_pth, from_st)
    assert codec_weights_file(fs.path).name == "generator.safetensors"  # preferred when both exist
    codes = fs.tensors()["codes"]
    assert torch.equal(from_pth.decode(codes), from_st.decode(codes))
    assert not any(is_encoder_key(k) for k in from_pth.state_dict())  # decode-only by default


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_key_variants_load_identically(fs, tmp_path):
    ref = fixture_codec(fs.path, with_encoder=True)
    sd = _raw(fs)
    prefixed = {f"generator.{k}": v for k, v in sd.items()}
    prefixed["discriminator.conv.weight"] = torch.zeros(3)  # dropped by upstream's "generator" rule
    renames = {"parametrizations.weight.original0": "weight_g", "parametrizations.weight.original1": "weight_v"}
    legacy = {}
    for key, v in sd.items():
        new_key = key
        for old, new in renames.items():
            new_key = new_key.replace(old, new)
        legacy[new_key] = v
    assert legacy.keys() != sd.keys()
    folded_codec = load_codec(fs.path, with_encoder=True)
    folded = {k: v for k, v in sd.items() if ".parametrizations." not in k}
    folded.update({k: v for k, v in folded_codec.state_dict().items() if k.startswith("head.") and "conv.weight" in k})
    variants = {
        "prefix": _folder(tmp_path / "prefix", fs, prefixed),
        "wrapper": _folder(tmp_path / "wrapper", fs, sd, wrap=True),
        "wrapped_prefix": _folder(tmp_path / "wp", fs, prefixed, wrap=True),
        "legacy_wn": _folder(tmp_path / "legacy", fs, legacy, name="generator.safetensors"),
        "folded": _folder(tmp_path / "folded", fs, folded, name="generator.safetensors"),
        "official_name": _folder(tmp_path / "official", fs, sd, name=f"{OFFICIAL_GENERATOR_NAME}.pth"),
    }
    for name, folder in variants.items():
        codec = load_codec(folder, with_encoder=True)
        _assert_same_params(codec, ref)
        assert codec.config == ref.config, name
    assert set(read_codec_state_dict(variants["prefix"] / "generator.pth")) == set(sd)


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_key_errors_name_the_key(fs, tmp_path):
    sd = _raw(fs)
    missing_key = "head.conv_post.conv.parametrizations.weight.original1"
    missing = {k: v for k, v in sd.items() if k != missing_key}
    with pytest.raises(CheckpointError, match=r"missing keys: .*conv_post\.conv\.parametrizations"):
        load_codec(_folder(tmp_path / "missing", fs, missing))
    extra = dict(sd, **{"head.extra_layer.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected keys: head\.extra_layer\.weight"):
        load_codec(_folder(tmp_path / "extra", fs, extra))
    bad_shape = dict(sd)
    bad_shape["head.conv_pre.conv.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"wrong shapes: head\.conv_pre\.conv\.bias \(3,\)"):
        load_codec(_folder(tmp_path / "shape", fs, bad_shape))


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_encoder_keys_optional_for_decode_only(fs, tmp_path):
    sd = _raw(fs)
    decode_only = {k: v for k, v in sd.items() if not is_encoder_key(k)}
    folder = _folder(tmp_path, fs, decode_only, name="generator.safetensors")
    codec = load_codec(folder)
    _assert_same_params(codec, fixture_codec(fs.path))
    with pytest.raises(CheckpointError, match=r"missing keys: backbone\."):
        load_codec(folder, with_encoder=True)


def test_file_and_config_choice(tmp_path):
    with pytest.raises(CheckpointError, match=OFFICIAL_GENERATOR_NAME):
        codec_weights_file(tmp_path)
    (tmp_path / f"{OFFICIAL_GENERATOR_NAME}.pth").write_bytes(b"")
    assert codec_weights_file(tmp_path).name == f"{OFFICIAL_GENERATOR_NAME}.pth"
    (tmp_path / "generator.pth").write_bytes(b"")
    assert codec_weights_file(tmp_path).name == "generator.pth"
    (tmp_path / "generator.safetensors").write_bytes(b"")
    assert codec_weights_file(tmp_path).name == "generator.safetensors"

    assert load_codec_config(tmp_path) == CodecConfig.official()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dual_ar", "dim": 1024}))
    assert load_codec_config(tmp_path) == CodecConfig.official()  # the LLM's config is not the codec's
    small = CodecConfig.official().to_dict()
    small["head"]["upsample_initial_channel"] = 64
    (tmp_path / "codec_config.json").write_text(json.dumps(small))
    assert load_codec_config(tmp_path).head.upsample_initial_channel == 64
    small["head"]["bogus"] = 1
    (tmp_path / "codec_config.json").write_text(json.dumps(small))
    with pytest.raises(CheckpointError, match="bogus"):
        load_codec_config(tmp_path)


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_load_dtype_and_buffers(fs):
    codec = load_codec(fs.path, dtype=torch.bfloat16)
    assert {p.dtype for p in codec.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad or p.is_meta for p in codec.parameters())
    assert not any(b.is_meta for b in codec.buffers())
    audio = codec.decode(fs.tensors()["codes"])
    assert audio.dtype == torch.bfloat16
    assert (audio.float() - fs.tensors()["audio"][:, 0]).abs().max() < 0.25  # bf16 noise, same waveform


@pytest.mark.parametrize("transposed", [False, True])
def test_fold_matches_torch_weight_norm(transposed):
    torch.manual_seed(0)
    conv = nn.ConvTranspose1d(6, 4, 5) if transposed else nn.Conv1d(6, 4, 5)
    conv = nn.utils.parametrizations.weight_norm(conv, dim=0)
    with torch.no_grad():
        conv.parametrizations.weight.original0.mul_(torch.rand_like(conv.parametrizations.weight.original0) + 0.5)
    g = conv.parametrizations.weight.original0
    assert g.shape == ((6 if transposed else 4), 1, 1)  # dim 0 of the weight: in-ch for transposed convs
    folded = fold_weight_norm(g, conv.parametrizations.weight.original1)
    assert torch.allclose(folded, conv.weight, atol=1e-7, rtol=1e-6)
