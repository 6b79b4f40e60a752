"""Tiny random Qwen3.5 checkpoints (dense and MoE, with MTP weights) built with `transformers`.

Weights use a large init range and random norm weights so that greedy paths vary (the default 0.02
gives near-uniform logits). transformers does not build the MTP layer, so its `mtp.*` tensors are
added here with the same shapes a real checkpoint carries.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.support.tokenizer_dir import cached_tokenizer_dir

VOCAB = 248320


def text_config(kind: str, dense: dict, moe: dict, **common):
    """A Qwen3.5 text config with its `architectures` entry: `common` keys plus those of its kind ("dense", "moe")."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if kind == "dense":
        cfg = Qwen3_5TextConfig(**dense, **common)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif kind == "moe":
        cfg = Qwen3_5MoeTextConfig(**moe, **common)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    else:
        raise ValueError(kind)
    return cfg


def tiny_config(kind: str = "dense", tie: bool = False, num_layers: int = 4):
    common = dict(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.08,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        eos_token_id=248046, pad_token_id=248044,
    )
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)
    cfg = text_config(kind, dict(intermediate_size=256), moe, **common)
    cfg.mtp_num_hidden_layers = 1
    return cfg


def build_model(kind: str = "dense", seed: int = 0, tie: bool = False):
    """An HF model in fp32 with random (non-trivial) weights, plus its extra `mtp.*` tensors."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(kind, tie)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model, mtp_tensors(model, cfg, gen)


def mtp_tensors(model, cfg, gen) -> dict[str, torch.Tensor]:
    """Random `mtp.*` weights: fc over [emb; hidden], two pre-fc norms, one full-attention layer, norm."""
    h = cfg.hidden_size
    std = cfg.initializer_range
    full_idx = cfg.layer_types.index("full_attention")
    template = {k: v for k, v in model.state_dict().items() if k.startswith(f"model.layers.{full_idx}.")}
    out = {
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * std,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=gen) * 0.2,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=gen) * 0.2,
        "mtp.norm.weight": torch.randn(h, generator=gen) * 0.2,
    }
    for k, v in template.items():
        name = "mtp.layers.0." + k.split(".", 3)[3]
        scale = 0.2 if k.endswith("norm.weight") else std
        out[name] = torch.randn(v.shape, generator=gen) * scale
    return out


def write_checkpoint(out_dir: Path, kind: str = "dense", seed: int = 0, tie: bool = False) -> Path:
    """Save a tiny checkpoint (safetensors + config + real Qwen3.5 tokenizer and template)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    model, mtp = build_model(kind, seed, tie)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(out_dir / "mtp.safetensors"))
    index_path = out_dir / "model.safetensors.index.json"
    from safetensors import safe_open

    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map.update({k: "mtp.safetensors" for k in mtp})
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in cached_tokenizer_dir().glob("*.json"):  # built once per cache, copied into every checkpoint
        shutil.copyfile(f, out_dir / f.name)
    return out_dir
