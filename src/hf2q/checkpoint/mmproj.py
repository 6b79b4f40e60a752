"""Load llama.cpp's vision projector file (`mmproj*.gguf`) for the Qwen3.5 vision tower, strictly.

Like the text loader, every tensor must land on exactly one tower parameter with the shape the file's own
`clip.vision.*` keys imply: a missing, extra or mis-shaped tensor is a clear error, never a silent default.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hf2q.checkpoint.gguf_file import GGUFError, GGUFFile
from hf2q.checkpoint.names import VISION, VISION_BLOCK, vision_param_name

PROJECTOR = "qwen3vl_merger"  # llama.cpp's projector type for the Qwen3-VL / Qwen3.5 merger


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    merge_size: int
    num_position_embeddings: int
    out_hidden_size: int  # the text model's hidden size
    layer_norm_eps: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    in_channels: int = 3
    temporal_patch_size: int = 2  # llama.cpp's layout stores exactly two temporal kernels

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tower parameter and its shape."""
        h, f, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_size ** 2
        kernel = (h, self.in_channels, self.patch_size, self.patch_size)
        out = {"patch_embed.kernel_t0": kernel, "patch_embed.kernel_t1": kernel, "patch_embed.bias": (h,),
               "pos_embed": (self.num_position_embeddings, h), "merger.norm.weight": (h,),
               "merger.norm.bias": (h,), "merger.fc1.weight": (m, m), "merger.fc1.bias": (m,),
               "merger.fc2.weight": (self.out_hidden_size, m), "merger.fc2.bias": (self.out_hidden_size,)}
        block = {"norm1.weight": (h,), "norm1.bias": (h,), "norm2.weight": (h,), "norm2.bias": (h,),
                 "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h),
                 "attn.proj.bias": (h,), "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,),
                 "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
        assert set(out) == set(VISION.values()) and set(block) == set(VISION_BLOCK.values())
        for i in range(self.depth):
            out |= {f"blocks.{i}.{k}": v for k, v in block.items()}
        return out


@dataclass
class Mmproj:
    config: VisionConfig
    tensors: dict[str, torch.Tensor]  # tower parameter path -> fp32 tensor


def vision_config(gguf: GGUFFile) -> VisionConfig:
    """The tower's configuration from the file's `clip.*` keys; refuses other projectors."""
    meta = gguf.metadata

    def key(name: str):
        if name not in meta:
            raise GGUFError(f"{gguf.path}: not a vision projector file (no {name})")
        return meta[name]

    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
        raise GGUFError(f"{gguf.path}: not a vision projector file (architecture "
                        f"{meta.get('general.architecture')!r}, expected 'clip' with a vision encoder)")
    if (kind := key("clip.projector_type")) != PROJECTOR:
        raise GGUFError(f"{gguf.path}: projector type {kind!r} is not supported (Qwen3.5's is {PROJECTOR!r})")
    if any(meta.get("clip.vision.is_deepstack_layers", [])):
        raise GGUFError(f"{gguf.path}: deepstack vision towers (Qwen3-VL) are not supported")
    patch, size = int(key("clip.vision.patch_size")), int(key("clip.vision.image_size"))
    return VisionConfig(
        hidden_size=int(key("clip.vision.embedding_length")),
        intermediate_size=int(key("clip.vision.feed_forward_length")),
        depth=int(key("clip.vision.block_count")), num_heads=int(key("clip.vision.attention.head_count")),
        patch_size=patch, merge_size=int(meta.get("clip.vision.spatial_merge_size", 2)),
        num_position_embeddings=(size // patch) ** 2, out_hidden_size=int(key("clip.vision.projection_dim")),
        layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        image_mean=tuple(float(x) for x in key("clip.vision.image_mean")),
        image_std=tuple(float(x) for x in key("clip.vision.image_std")))


def load_mmproj(path) -> Mmproj:
    """Every tensor of a vision projector file as fp32, named by the tower parameter it fills."""
    gguf = GGUFFile(path)
    gguf.check_types()
    cfg = vision_config(gguf)
    expected = cfg.shapes()
    tensors: dict[str, torch.Tensor] = {}
    for name in gguf.tensor_names:
        target = vision_param_name(name, cfg.depth)
        if target is None:
            raise GGUFError(f"{gguf.path}: unexpected tensor {name!r} in a Qwen3.5 vision projector")
        shape = gguf.info(name).shape
        if shape != expected[target]:
            raise GGUFError(f"{gguf.path}: tensor {name!r} has shape {shape}, expected {expected[target]}")
        tensors[target] = gguf.tensor(name, torch.float32)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise GGUFError(f"{gguf.path}: missing vision tensors for {', '.join(missing[:8])}"
                        + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return Mmproj(cfg, tensors)


def find_mmproj(model_path) -> Path | None:
    """The one `mmproj*.gguf` beside a model file; None when there is none, an error when several."""
    found = sorted(Path(model_path).parent.glob("mmproj*.gguf"))
    if len(found) > 1:
        raise GGUFError(f"several vision projector files beside {Path(model_path).name}: "
                        f"{', '.join(p.name for p in found)}; choose one with --mmproj")
    return found[0] if found else None
