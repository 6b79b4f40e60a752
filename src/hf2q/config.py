"""Frozen configuration objects, layered by consumer (model, cache, scheduler, server)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("qwen35", "qwen35moe")


class ConfigError(ValueError):
    """A GGUF's metadata does not describe a model this server can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen3.5 / 3.6 hybrid decoder, as read from GGUF metadata."""

    arch: str
    hidden_size: int
    num_layers: int  # decoder layers, MTP layers excluded
    num_mtp_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    context_length: int
    rope_theta: float
    rotary_dim: int
    rope_sections: tuple[int, ...]
    full_attention_interval: int
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_head_dim: int
    linear_v_head_dim: int
    conv_kernel: int
    vocab_size: int
    intermediate_size: int = 0  # dense FFN width (0 for MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_full_attention(self, layer: int) -> bool:
        """Layer i is full attention iff (i + 1) % interval == 0; MTP layers are always full attention."""
        return layer >= self.num_layers or (layer + 1) % self.full_attention_interval == 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_full_attention(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_full_attention(i))

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_num_k_heads * self.linear_k_head_dim + self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers holding K/V: the full-attention decoder layers, then the MTP layers."""
        return len(self.full_attention_layers) + self.num_mtp_layers

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {arch!r}: hf2q runs {', '.join(SUPPORTED_ARCHITECTURES)}")

        def get(key: str, default: Any = ...) -> Any:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is ...:
                raise ConfigError(f"GGUF metadata lacks required key {full!r}")
            return default

        def count(key: str, default: Any = ..., minimum: int = 1, maximum: int = 1 << 31) -> int:
            value = get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
                raise ConfigError(f"GGUF metadata {arch}.{key} must be an integer in [{minimum}, {maximum}], "
                                  f"got {value!r}")
            return value

        def real(key: str) -> float:
            value = get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"GGUF metadata {arch}.{key} must be a finite number > 0, got {value!r}")
            return float(value)

        n_mtp = count("nextn_predict_layers", 0, minimum=0)
        block_count = count("block_count", maximum=1 << 16)  # loops over layers must stay short
        if block_count <= n_mtp:
            raise ConfigError(f"GGUF metadata {arch}.nextn_predict_layers ({n_mtp}) leaves no decoder layer "
                              f"of {arch}.block_count ({block_count})")
        key_len, value_len = count("attention.key_length"), count("attention.value_length")
        if key_len != value_len:
            raise ConfigError(f"attention key_length {key_len} != value_length {value_len}")
        n_v, n_k = count("ssm.time_step_rank"), count("ssm.group_count")
        inner = count("ssm.inner_size")
        heads, kv_heads = count("attention.head_count"), count("attention.head_count_kv")
        for a_key, a, b_key, b in (("attention.head_count", heads, "attention.head_count_kv", kv_heads),
                                   ("ssm.time_step_rank", n_v, "ssm.group_count", n_k),
                                   ("ssm.inner_size", inner, "ssm.time_step_rank", n_v)):
            if a % b:
                raise ConfigError(f"GGUF metadata {arch}.{a_key} ({a}) is not a multiple of {arch}.{b_key} ({b})")
        if count("rope.dimension_count", minimum=0) > key_len:
            raise ConfigError(f"GGUF metadata {arch}.rope.dimension_count exceeds the head size {key_len}")
        sections = get("rope.dimension_sections", (0, 0, 0, 0))
        if not isinstance(sections, (list, tuple)) or not all(type(x) is int for x in sections):
            raise ConfigError(f"GGUF metadata {arch}.rope.dimension_sections must be a list of integers")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []))
        common = dict(
            arch=arch,
            hidden_size=count("embedding_length"),
            num_layers=block_count - n_mtp,
            num_mtp_layers=n_mtp,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=key_len,
            rms_norm_eps=real("attention.layer_norm_rms_epsilon"),
            context_length=count("context_length"),
            rope_theta=real("rope.freq_base"),
            rotary_dim=count("rope.dimension_count", minimum=0),
            rope_sections=tuple(sections),
            full_attention_interval=count("full_attention_interval", 4),
            linear_num_k_heads=n_k,
            linear_num_v_heads=n_v,
            linear_k_head_dim=count("ssm.state_size"),
            linear_v_head_dim=inner // n_v,
            conv_kernel=count("ssm.conv_kernel"),
            vocab_size=int(vocab),
            name=str(meta.get("general.name", "")),
        )
        if arch == "qwen35moe":
            return cls(**common, num_experts=count("expert_count"),
                       num_experts_per_tok=count("expert_used_count"),
                       moe_intermediate_size=count("expert_feed_forward_length"),
                       shared_expert_intermediate_size=count("expert_shared_feed_forward_length", 0, minimum=0))
        return cls(**common, intermediate_size=count("feed_forward_length"))


STATE_DTYPES = ("float32", "bfloat16")  # what CacheConfig.state_dtype may be (the DeltaNet recurrent state's)


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the hybrid cache pools: paged K/V blocks and per-slot linear (DeltaNet) state."""

    num_slots: int = 8
    num_blocks: int = 512
    block_size: int = 16
    kv_dtype: str = "float32"
    state_dtype: str = "float32"
    prefix_cache_bytes: int = 0  # retained-prefix budget (K/V blocks + DeltaNet states); 0 turns reuse off
    prefix_checkpoint_stride: int = 1024  # also checkpoint prefill every this many prompt tokens (0: never)
    prefix_cache_dir: str | None = None  # also keep checkpoints as files here, across restarts
    prefix_cache_disk_bytes: int = 10 << 30  # LRU budget of those files


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests run and wait, and how many tokens one step computes (hf2q.engine.scheduler)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 2048
    max_waiting: int = 256
