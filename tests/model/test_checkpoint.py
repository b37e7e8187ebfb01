"""DualAR checkpoint folders: both weight formats, upstream's key spellings, clear errors, full-size manifests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.checkpoint import expected_state_shapes, load_dual_ar, read_model_state
from model.config import ConfigError, DualARConfig
from model.rope import build_rope_table
from model.weights import CheckpointError, read_safetensors, write_safetensors
from tests.model.fixture_sets import FixtureSet, dual_ar_sets, manifests_dir, params

SETS = params(dual_ar_sets())
FOLDER_FILES = ("config.json", "tokenizer.tiktoken", "special_tokens.json")


def folder_with(
    tmp_path: Path, fs: FixtureSet, state: dict[str, torch.Tensor] | object, name: str = "model.pth"
) -> Path:
    """A copy of the fixture folder whose only weights are `state` saved as `name`."""
    out = tmp_path / "ckpt"
    out.mkdir(parents=True)
    for f in FOLDER_FILES:
        if fs.has(f):
            shutil.copy(fs.path / f, out / f)
    if name.endswith(".safetensors"):
        assert isinstance(state, dict)
        write_safetensors(state, out / name)
    else:
        torch.save(state, out / name)
    return out


def fixture_state(fs: FixtureSet) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in torch.load(fs.path / "model.pth", weights_only=True).items()}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fs", SETS)
def test_both_weight_formats_load_the_same_model(fs: FixtureSet, tmp_path: Path) -> None:
    assert fs.has("model.pth") and fs.has("model.safetensors")
    pth = load_dual_ar(folder_with(tmp_path / "a", fs, fixture_state(fs)), dtype=torch.float32)
    st = load_dual_ar(fs.path, dtype=torch.float32)  # prefers model.safetensors
    assert pth.weights_path.name == "model.pth" and st.weights_path.name == "model.safetensors"
    same_weights(pth.model, st.model)


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda sd: {"state_dict": sd}, id="lightning_wrapper"),
        pytest.param(lambda sd: {"model." + k: v for k, v in sd.items()}, id="model_prefix"),
        pytest.param(lambda sd: {"state_dict": {"model." + k: v for k, v in sd.items()}}, id="both"),
    ],
)
@pytest.mark.parametrize("fs", SETS)
def test_upstream_key_spellings_are_accepted(fs: FixtureSet, tmp_path: Path, wrap) -> None:
    reference = load_dual_ar(fs.path, dtype=torch.float32)
    loaded = load_dual_ar(folder_with(tmp_path, fs, wrap(fixture_state(fs))), dtype=torch.float32)
    same_weights(loaded.model, reference.model)


@pytest.mark.parametrize("fs", SETS)
def test_separate_q_k_v_and_saved_kv_caches_are_accepted(fs: FixtureSet, tmp_path: Path) -> None:
    state = fixture_state(fs)
    cfg = DualARConfig.from_json(fs.path / "config.json")
    kv = cfg.n_local_heads * cfg.head_dim
    wqkv = state.pop("layers.0.attention.wqkv.weight")
    (
        state["layers.0.attention.wq.weight"],
        state["layers.0.attention.wk.weight"],
        state["layers.0.attention.wv.weight"],
    ) = wqkv.split([cfg.dim, kv, kv])
    state["layers.0.attention.kv_cache.k_cache"] = torch.zeros(1, 2, 8, 4)  # upstream saved after setup_caches
    loaded = load_dual_ar(folder_with(tmp_path, fs, state), dtype=torch.float32)
    assert torch.equal(loaded.model.layers[0].attention.wqkv.weight, wqkv)


@pytest.mark.parametrize("fs", SETS)
def test_missing_unexpected_and_misshaped_keys_are_named(fs: FixtureSet, tmp_path: Path) -> None:
    state = fixture_state(fs)
    del state["norm.weight"]
    state["layers.0.surprise.weight"] = torch.zeros(3)
    state["fast_output.weight"] = state["fast_output.weight"][:-1]
    with pytest.raises(CheckpointError) as err:
        load_dual_ar(folder_with(tmp_path, fs, state), dtype=torch.float32)
    msg = str(err.value)
    assert "missing keys: norm.weight" in msg
    assert "unexpected keys: layers.0.surprise.weight" in msg
    assert "wrong shapes: fast_output.weight" in msg


@pytest.mark.parametrize("fs", SETS)
def test_bf16_checkpoint_loads_in_any_dtype(fs: FixtureSet, tmp_path: Path) -> None:
    """The official model.pth is a bf16 state dict; it loads as bf16 or upcast to fp32."""
    bf16 = {k: v.to(torch.bfloat16) for k, v in fixture_state(fs).items()}
    folder = folder_with(tmp_path, fs, bf16)
    as_bf16 = load_dual_ar(folder, dtype=torch.bfloat16).model
    as_fp32 = load_dual_ar(folder, dtype=torch.float32).model
    assert as_bf16.embeddings.weight.dtype == torch.bfloat16
    assert as_fp32.embeddings.weight.dtype == torch.float32
    assert torch.equal(as_fp32.embeddings.weight, as_bf16.embeddings.weight.float())
    assert as_bf16.freqs_cis.dtype == torch.float32  # RoPE math stays fp32


def test_bad_folders_fail_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_dual_ar(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "naive"}))
    (tmp_path / "tokenizer.tiktoken").write_text("")
    with pytest.raises(ConfigError, match="dual_ar"):
        load_dual_ar(tmp_path)
    with pytest.raises(ConfigError, match="fishgate does not know: warp_drive"):
        DualARConfig.from_dict({"model_type": "dual_ar", "warp_drive": 1})


def test_truncated_safetensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_safetensors(path)


def test_safetensors_roundtrip_is_zero_copy_and_exact(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(2, 2).bfloat16()}
    write_safetensors(tensors, tmp_path / "x.safetensors")
    back = read_safetensors(tmp_path / "x.safetensors")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    from safetensors.torch import load_file  # the reference reader agrees with our writer

    for k, v in load_file(str(tmp_path / "x.safetensors")).items():
        assert torch.equal(v, tensors[k])


def test_config_post_init_rules() -> None:
    cfg = DualARConfig.from_dict({"model_type": "dual_ar", "dim": 256, "n_head": 8, "head_dim": 999, "fast_dim": None})
    assert cfg.head_dim == 32  # the config's head_dim is ignored, as upstream
    assert cfg.n_local_heads == 8 and cfg.fast_dim == 256 and cfg.fast_n_head == 8
    assert cfg.intermediate_size == 768  # find_multiple(int(2·4·256/3), 256)
    assert cfg.fast_intermediate_size == 768 and cfg.fast_attention_qkv_bias is False
    assert cfg.norm_eps == 1e-5 and cfg.tie_word_embeddings is True  # upstream dataclass defaults


def _manifest(name: str) -> dict:
    root = manifests_dir()
    if root is None or not (root / name).exists():
        pytest.skip(f"no manifests/{name} under the fixtures root")
    return json.loads((root / name).read_text())


def test_full_size_model_matches_the_official_key_manifest() -> None:
    manifest = _manifest("fish15_model_keys.json")
    config = DualARConfig.from_dict(manifest["config"])
    persistent = {k: tuple(v["shape"]) for k, v in manifest["keys"].items() if v["kind"] == "param"}
    shapes = expected_state_shapes(config)
    assert shapes == persistent
    assert sum(torch.Size(s).numel() for s in shapes.values()) == manifest["num_params"]


def test_official_rope_tables() -> None:
    root = manifests_dir()
    if root is None or not (root / "rope_official_freqs_cis_bf16.safetensors").exists():
        pytest.skip("no official RoPE tables under the fixtures root")
    official = read_safetensors(root / "rope_official_freqs_cis_bf16.safetensors")
    manifest = _manifest("fish15_model_keys.json")
    cfg = DualARConfig.from_dict(manifest["config"])
    assert torch.equal(build_rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_base), official["freqs_cis"].float())
    assert torch.equal(
        build_rope_table(cfg.num_codebooks, cfg.fast_head_dim, cfg.rope_base), official["fast_freqs_cis"].float()
    )


def test_read_model_state_strips_prefix_only_when_first_key_has_it(tmp_path: Path) -> None:
    torch.save({"model.a": torch.zeros(1), "b": torch.ones(1)}, tmp_path / "m.pth")
    assert set(read_model_state(tmp_path / "m.pth")) == {"a", "b"}
    torch.save({"b": torch.ones(1), "model.a": torch.zeros(1)}, tmp_path / "n.pth")
    assert set(read_model_state(tmp_path / "n.pth")) == {"b", "model.a"}


def test_loading_the_default_model_never_imports_dynamo() -> None:
    """Building models on the meta device to load them must not run torch's Python reference kernels (meta
    `normal_`, `cat`, `floor_divide`), whose first use imports torch._dynamo: 1.5 s of a CPU server's 2 s engine
    start. A fresh interpreter loads both halves of the embedded default model the way the engine does."""
    import subprocess
    import sys

    code = (
        "import sys, torch, pathlib, model\n"
        "from model.checkpoint import load_dual_ar\n"
        "from model.codec_checkpoint import load_codec\n"
        "folder = pathlib.Path(model.__file__).parent / 'default_model'\n"
        "load_dual_ar(folder, device='cpu', dtype=torch.float32)\n"
        "load_codec(folder, device='cpu', dtype=torch.float32, with_encoder=True)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False", "loading imported torch._dynamo"
