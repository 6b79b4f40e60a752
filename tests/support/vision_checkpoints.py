"""Tiny random `Qwen3_5ForConditionalGeneration` checkpoints (dense and MoE text, with a vision tower).

The text part is `checkpoints.tiny_config` without the MTP layer; the vision tower is two ViT blocks on
16-pixel patches with the 2x2 merger. `preprocessor_config.json` carries the Qwen2-VL processor values
that llama.cpp's `--mmproj` converter reads (mean, std, pixel limits).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.support.checkpoints import tiny_config
from tests.support.tokenizer_dir import cached_tokenizer_dir

PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "do_resize": True, "do_rescale": True,
    "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def tiny_vl_config(kind: str = "dense"):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = tiny_config(kind).to_dict()
    text.pop("mtp_num_hidden_layers", None)
    vision = dict(depth=2, hidden_size=64, hidden_act="gelu_pytorch_tanh", intermediate_size=128, num_heads=2,
                  in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=text["hidden_size"], num_position_embeddings=64, initializer_range=0.08)
    ids = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
               vision_end_token_id=248054)
    if kind == "dense":
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, **ids)
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    else:
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, **ids)
        cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    return cfg


def build_vl_model(kind: str = "dense", seed: int = 0):
    """An HF image-text model in fp32 with random (non-trivial) weights."""
    from transformers import AutoModelForImageTextToText

    cfg = tiny_vl_config(kind)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual." not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "visual." in name and ("norm" in name):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)
            elif "visual." in name and name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def write_vl_checkpoint(out_dir: Path, kind: str = "dense", seed: int = 0) -> Path:
    """Save a tiny image-text checkpoint (safetensors + configs + real Qwen3.5 tokenizer and template)."""
    out_dir = Path(out_dir)
    build_vl_model(kind, seed).save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    for f in cached_tokenizer_dir().glob("*.json"):
        shutil.copyfile(f, out_dir / f.name)
    return out_dir
