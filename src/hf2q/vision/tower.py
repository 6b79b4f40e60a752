"""The Qwen3.5 vision tower: patch embedding, ViT blocks with 2-D rotary attention, the 2x2 merger.

Runs the images of one request (each `ImageInput` already in the processor's merge-block patch order) and
returns one soft token per merged 2x2 patch group, in the text model's hidden size. Plain torch ops and SDPA,
so the same code is the exact fp32 CPU path and the CUDA path. Attention is bidirectional within one frame
of one image and never across images.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf2q.checkpoint.mmproj import Mmproj, VisionConfig
from hf2q.vision.inputs import ImageInput

ROPE_THETA = 10000.0  # the vision rotary base of every Qwen3.5 tower (not stored in the mmproj file)


class PatchEmbed(nn.Module):
    """The Conv3D patch kernel (stride = kernel) as one matrix product over flattened patches."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.hidden_size, cfg.in_channels, cfg.patch_size, cfg.patch_size)
        self.kernel_t0 = nn.Parameter(torch.empty(kernel), requires_grad=False)
        self.kernel_t1 = nn.Parameter(torch.empty(kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([self.kernel_t0, self.kernel_t1], dim=2).flatten(1)  # [hidden, C * T * P * P]
        return F.linear(pixels.to(weight.dtype), weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in parts)).transpose(0, 1)
               for parts in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(out).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in fp32 (rotate-half layout), cos/sin [tokens, head_dim] shared across heads."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """LayerNorm per patch, then each 2x2 group (consecutive in merge-block order) -> one text-sized token."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        merged = cfg.hidden_size * cfg.merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(merged, merged)
        self.fc2 = nn.Linear(merged, cfg.out_hidden_size)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).reshape(-1, self.merged))))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Parameter(torch.empty(cfg.num_position_embeddings, cfg.hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)

    @classmethod
    def from_mmproj(cls, mmproj: Mmproj, device="cpu", dtype=torch.float32) -> "VisionTower":
        """The tower with the projector file's weights (norms and biases stay fp32 only when dtype is)."""
        with torch.device("meta"):
            tower = cls(mmproj.config)
        tower.load_state_dict(mmproj.tensors, strict=True, assign=True)
        return tower.to(device=device, dtype=dtype).eval()

    @torch.no_grad()
    def forward(self, images: list[ImageInput]) -> torch.Tensor:
        """Soft tokens of every image, concatenated in order: [sum of num_tokens, out_hidden_size]."""
        device = self.pos_embed.device
        pixels = torch.cat([im.pixel_values for im in images]).to(device)
        x = self.patch_embed(pixels)
        x = x + torch.cat([self._position_embedding(im.grid_thw) for im in images]).to(x.dtype)
        cos, sin = self._rotary([im.grid_thw for im in images])
        lengths = [h * w for im in images for h, w in [im.grid_thw[1:]] for _ in range(im.grid_thw[0])]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _merge_order(self, grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order -> [h * w, ...] in the processor's merge-block order."""
        m = self.cfg.merge_size
        return grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2).reshape(h * w, *grid.shape[2:])

    def _position_embedding(self, thw: tuple[int, int, int]) -> torch.Tensor:
        """The learned square position table resampled bilinearly (corners aligned) to the image's grid."""
        t, h, w = thw
        side = int(self.cfg.num_position_embeddings ** 0.5)
        table = self.pos_embed.float().reshape(side, side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        return self._merge_order(grid, h, w).repeat(t, 1)

    def _rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [patches, head_dim]: row frequencies then column frequencies, repeated for both halves."""
        device = self.pos_embed.device
        rows = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                            indexing="ij"), dim=-1)
            rows.append(self._merge_order(hw, h, w).repeat(t, 1))
        pos = torch.cat(rows).float()
        spatial = self.cfg.head_dim // 2
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, spatial, 2, device=device).float() / spatial)
        freqs = (pos[:, :, None] * inv_freq).flatten(1)  # [n, head_dim / 2]: row then column frequencies
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()
