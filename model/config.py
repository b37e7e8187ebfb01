"""DualAR model configuration, read from an official `config.json` with upstream's post-init rules.

Owns the field defaults (those of upstream `BaseModelArgs`/`DualARModelArgs`), the derived values (head dims are
always recomputed, `fast_*` fall back to the slow values) and validation with messages that name the fix.
Knows nothing about weights or tensors.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Config fields that only matter for training; accepted and ignored.
TRAINING_ONLY_FIELDS = frozenset(
    {"dropout", "use_gradient_checkpointing", "initializer_range", "scale_codebook_embeddings"}
)
# Fields whose config value upstream overwrites (head_dim := dim // n_head); accepted and ignored.
RECOMPUTED_FIELDS = frozenset({"head_dim", "fast_head_dim"})


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


class ConfigError(ValueError):
    """config.json cannot describe a model fishgate can run; the message names the field and the fix."""

    code = "bad_config"


@dataclass(frozen=True, slots=True)
class DualARConfig:
    """Effective (post-init) DualAR configuration. Defaults are upstream's dataclass defaults."""

    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = 0  # 0 → find_multiple(int(2·4·dim/3), 256), as upstream's None
    n_local_heads: int = -1  # -1 → n_head (no GQA)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048  # sizes the slow RoPE table and bounds prompt + generation
    tie_word_embeddings: bool = True  # true → logits use embeddings.weightᵀ, no output.weight
    attention_qkv_bias: bool = False
    codebook_size: int = 160
    num_codebooks: int = 4
    share_codebook_embeddings: bool = True  # codebook i looks up row code + i·codebook_size
    is_reward_model: bool = False
    n_fast_layer: int = 4
    fast_dim: int = 0  # 0 → dim (and likewise for every fast_* field below)
    fast_n_head: int = 0
    fast_n_local_heads: int = 0
    fast_intermediate_size: int = 0
    fast_attention_qkv_bias: bool | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.n_local_heads == -1:
            put("n_local_heads", self.n_head)
        if not self.intermediate_size:
            put("intermediate_size", find_multiple(int(2 * 4 * self.dim / 3), 256))
        put("fast_dim", self.fast_dim or self.dim)
        put("fast_n_head", self.fast_n_head or self.n_head)
        put("fast_n_local_heads", self.fast_n_local_heads or self.n_local_heads)
        put("fast_intermediate_size", self.fast_intermediate_size or self.intermediate_size)
        if self.fast_attention_qkv_bias is None:
            put("fast_attention_qkv_bias", self.attention_qkv_bias)
        self._validate()

    def _validate(self) -> None:
        if self.is_reward_model:
            raise ConfigError("is_reward_model=true checkpoints are not text-to-speech models; use a TTS checkpoint")
        for heads, local, dim, what in (
            (self.n_head, self.n_local_heads, self.dim, ""),
            (self.fast_n_head, self.fast_n_local_heads, self.fast_dim, "fast_"),
        ):
            if heads <= 0 or dim % heads:
                raise ConfigError(f"{what}dim ({dim}) must be a positive multiple of {what}n_head ({heads})")
            if local <= 0 or heads % local:
                raise ConfigError(f"{what}n_head ({heads}) must be a multiple of {what}n_local_heads ({local})")
            if (dim // heads) % 2:
                raise ConfigError(f"{what}dim // {what}n_head must be even for rotary embeddings")
        if self.num_codebooks < 1 or self.codebook_size < 1:
            raise ConfigError("num_codebooks and codebook_size must be positive")

    # Derived sizes -------------------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def fast_head_dim(self) -> int:
        return self.fast_dim // self.fast_n_head

    @property
    def has_fast_project_in(self) -> bool:
        return self.fast_dim != self.dim

    # Construction ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DualARConfig:
        model_type = data.get("model_type")
        if model_type != "dual_ar":
            raise ConfigError(
                f"config.json has model_type={model_type!r}; fishgate serves Fish Speech 1.5 'dual_ar' checkpoints"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - TRAINING_ONLY_FIELDS - RECOMPUTED_FIELDS - {"model_type"})
        if unknown:
            raise ConfigError(f"config.json has fields fishgate does not know: {', '.join(unknown)}")
        kwargs = {k: v for k, v in data.items() if k in known}
        # upstream treats null/0 fast fields as "use the slow value"; our sentinel is 0 / None
        for name in ("fast_dim", "fast_n_head", "fast_n_local_heads", "fast_intermediate_size", "intermediate_size"):
            if kwargs.get(name) is None:
                kwargs.pop(name, None)
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"config.json has a field of the wrong type ({e})") from e

    @classmethod
    def from_json(cls, path: Path) -> DualARConfig:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path} as JSON ({type(e).__name__})") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Effective values in config.json spelling (head dims included, as upstream's save() writes them)."""
        d = dataclasses.asdict(self)
        return {"model_type": "dual_ar", **d, "head_dim": self.head_dim, "fast_head_dim": self.fast_head_dim}
