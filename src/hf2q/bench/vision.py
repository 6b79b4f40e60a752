"""`hf2q bench vision`: the vision tower's image prefill time per image, random weights at a real shape.

An image of S x S pixels is (S/16)^2 patches through the ViT and (S/32)^2 soft tokens out of the merger; the
timing covers the tower for `--images` images in one call (what one request with that many images runs at
prefill), after warm-up, divided by the number of images.
"""
from __future__ import annotations

import argparse
import hashlib
import time

import torch

from hf2q.bench_shapes import SHAPES
from hf2q.checkpoint.mmproj import Mmproj, VisionConfig
from hf2q.vision.inputs import ImageInput
from hf2q.vision.tower import VisionTower

# Qwen3.5's vision tower (the same for every size; the merger projects to the text model's hidden size).
_TOWER = dict(hidden_size=1152, intermediate_size=4304, depth=27, num_heads=16, patch_size=16, merge_size=2,
              num_position_embeddings=2304, layer_norm_eps=1e-6, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def random_tower(text_hidden: int, device, dtype, seed: int = 0) -> VisionTower:
    cfg = VisionConfig(out_hidden_size=text_hidden, **_TOWER)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 1.0)
               for name, shape in cfg.shapes().items()}
    return VisionTower.from_mmproj(Mmproj(cfg, tensors), device=device, dtype=dtype)


def random_image(size: int, device, seed: int) -> ImageInput:
    side = size // 16
    pixels = torch.randn(side * side, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))
    return ImageInput(pixels.to(device), (1, side, side), hashlib.sha256(str(seed).encode()).hexdigest())


def add_bench_vision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b", help="text model shape the merger projects to")
    p.add_argument("--image", type=int, default=1024, help="image side in pixels (a multiple of 32)")
    p.add_argument("--images", type=int, nargs="+", default=[1, 4], help="images per request, each timed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per figure (the median is printed)")


def run_bench_vision(args) -> int:
    if args.image % 32:
        raise ValueError(f"--image must be a multiple of 32 pixels, got {args.image}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tower = random_tower(SHAPES[args.shape][0].hidden_size, args.device, dtype)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    for n in args.images:
        images = [random_image(args.image, args.device, i) for i in range(n)]
        tower(images)  # warm-up
        sync()
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            tokens = tower(images)
            sync()
            times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        print(f"vision {args.shape} {args.image}x{args.image} images={n}: {median * 1e3:.1f} ms per call, "
              f"{median * 1e3 / n:.1f} ms per image, {tokens.shape[0] // n} soft tokens per image ({args.dtype})")
    return 0
