"""Codec checkpoint folder → ready `FireflyCodec`: file choice, config choice, key normalisation, weight-norm fold.

Owns which files of a folder are the codec (official `firefly-gan-vq-fsq-8x1024-21hz-generator.pth`, or
`generator.safetensors` / `generator.pth`, safetensors preferred), which config applies (`codec_config.json`, a
`config.json` without `model_type`, else the official one), upstream's key rules (`state_dict` wrapper, the
`generator.` rule, both weight-norm spellings), the key/shape check and folding `w = g·v/‖v‖` at load time.
File I/O itself is model/weights.py; the modules are model/vocoder.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .codec_config import CodecConfig
from .codec_layers import CausalLayer
from .vocoder import FireflyCodec
from .weights import CheckpointError, check_keys, read_state_dict

OFFICIAL_GENERATOR_NAME = "firefly-gan-vq-fsq-8x1024-21hz-generator"
# Weight files tried in this order: safetensors first (zero-copy mmap, no pickle), then the upstream pickles.
WEIGHT_FILE_NAMES = (
    "generator.safetensors",
    f"{OFFICIAL_GENERATOR_NAME}.safetensors",
    "generator.pth",
    f"{OFFICIAL_GENERATOR_NAME}.pth",
)
CODEC_CONFIG_NAME = "codec_config.json"
# Spellings of a weight-norm pair (g, v) after `<conv>.conv.`: torch's parametrization and the legacy hook.
WN_G, WN_V = "parametrizations.weight.original0", "parametrizations.weight.original1"
LEGACY_WN = {"weight_g": WN_G, "weight_v": WN_V}
ENCODER_PREFIXES = ("backbone.", "quantizer.downsample.")


def is_encoder_key(key: str) -> bool:
    """True for keys only the encoder uses (backbone, quantizer downsample, FSQ project_in)."""
    return key.startswith(ENCODER_PREFIXES) or (key.startswith("quantizer.residual_fsq.") and ".project_in." in key)


def codec_weights_file(folder: Path | str) -> Path:
    """The codec weight file of a folder (or the file itself); CheckpointError if there is none."""
    folder = Path(folder)
    if folder.is_file():
        return folder
    for name in WEIGHT_FILE_NAMES:
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(
        f"no codec weights in {folder}: expected one of {', '.join(WEIGHT_FILE_NAMES)} "
        f"(download {OFFICIAL_GENERATOR_NAME}.pth from the fishaudio/fish-speech-1.5 repository)"
    )


def load_codec_config(folder: Path | str) -> CodecConfig:
    """`codec_config.json`, else a `config.json` without `model_type` (the DualAR's has one), else official."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    for name in (CODEC_CONFIG_NAME, "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e})") from e
        if name == "config.json" and (not isinstance(data, dict) or "model_type" in data):
            continue
        try:
            return CodecConfig.from_dict(data)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: {e}. Fix the file or remove it to use the official codec config") from e
    return CodecConfig.official()


def read_codec_state_dict(path: Path | str) -> dict[str, torch.Tensor]:
    """Read a generator file and normalise keys to upstream's layout (`generator.` rule, parametrization names)."""
    sd = read_state_dict(Path(path))
    if any("generator" in k for k in sd):  # upstream inference.py rule, verbatim in behaviour
        sd = {k.replace("generator.", ""): v for k, v in sd.items() if "generator." in k}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        head, _, last = k.rpartition(".")
        out[f"{head}.{LEGACY_WN[last]}" if last in LEGACY_WN else k] = v
    return out


def _weight_normed_convs(codec: FireflyCodec) -> list[str]:
    """Module-layout names (`<m>.conv.weight`) of every conv that upstream stores as a weight-norm pair."""
    return [f"{n}.conv.weight" for n, m in codec.named_modules() if isinstance(m, CausalLayer) and m.weight_normed]


def checkpoint_key_shapes(config: CodecConfig, with_encoder: bool = True) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of an upstream generator state_dict for `config` (derived from our modules on meta)."""
    with torch.device("meta"):
        codec = FireflyCodec(config, with_encoder=True)
    shapes = {k: tuple(t.shape) for k, t in codec.state_dict().items()}
    for name in _weight_normed_convs(codec):
        w = shapes.pop(name)
        base = name.removesuffix("weight")
        shapes[base + WN_G] = (w[0], 1, 1)  # g: dim 0 of the weight (out ch for Conv1d, in ch for transposed)
        shapes[base + WN_V] = w
    if not with_encoder:
        shapes = {k: s for k, s in shapes.items() if not is_encoder_key(k)}
    return shapes


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w = g · v / ‖v‖, the norm over every dim but 0 (torch weight_norm with dim=0), computed in fp32."""
    v32 = v.float()
    return v32 * (g.float() / torch.linalg.vector_norm(v32, dim=tuple(range(1, v.ndim)), keepdim=True))


def load_codec(
    folder: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoder: bool = False,
) -> FireflyCodec:
    """Build the codec on the meta device and assign the checkpoint's tensors (never two copies in RAM).

    Without the encoder, encoder-only keys may be present (they are skipped) or absent. Missing, unexpected or
    mis-shaped keys raise CheckpointError naming them. A conv stored already folded (`<m>.conv.weight`) is
    accepted in place of its weight-norm pair.
    """
    path = codec_weights_file(folder)
    config = load_codec_config(folder)
    sd = read_codec_state_dict(path)
    with torch.device("meta"):
        codec = FireflyCodec(config, with_encoder=with_encoder)
    expected = checkpoint_key_shapes(config, with_encoder=with_encoder)
    wn_names = _weight_normed_convs(codec)
    for name in wn_names:  # accept pre-folded weights
        base = name.removesuffix("weight")
        if name in sd and base + WN_G not in sd and base + WN_V not in sd and base + WN_V in expected:
            expected[name] = expected.pop(base + WN_V)
            del expected[base + WN_G]
    check_keys(
        expected, sd, f"codec checkpoint {path}", ignore_unexpected=lambda k: not with_encoder and is_encoder_key(k)
    )

    target = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    for name in wn_names:
        base = name.removesuffix("weight")
        if base + WN_V in sd:
            state[name] = fold_weight_norm(sd.pop(base + WN_G), sd.pop(base + WN_V)).to(target, dtype)
    for k, t in sd.items():
        if k in expected:
            state[k] = t.to(target, dtype) if t.is_floating_point() else t.to(target)
    codec.load_state_dict(state, strict=True, assign=True)
    codec.init_buffers(target)
    codec.eval()
    codec.requires_grad_(False)
    return codec
