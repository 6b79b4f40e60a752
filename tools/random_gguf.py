"""Write a random-weight GGUF of a real model shape (`hf2q bench`'s shapes), for measuring `hf2q serve`
on a machine that cannot download a model.

    python tools/random_gguf.py --shape 9b --mix q4_k_m [--mtp] -o 9b-q4_k_m.gguf

The file has the real Qwen3.5 vocabulary and the demo's chat template, llama.cpp's tensor names and
layout, and random values: bf16 everywhere (`--mix bf16`), or llama.cpp's Q4_K_M types (Q4_K; Q6_K for
the head and the `use_more_bits` layers' attn_v / ffn_down; Q5_K for the DeltaNet attn_qkv; Q4_K
for the token embedding) as valid random blocks. `--mtp` adds the MTP layer (block N, llama.cpp's `nextn`
tensors), as the converter writes it by default, for measuring `--speculative mtp`. Quantized rows are drawn
from a pool of random rows per type and width, as `hf2q bench` does, so a 9B file is written in about a minute.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import torch

from hf2q import demo
from hf2q.bench_shapes import SHAPES, quant_plan
from hf2q.checkpoint.names import BLOCK, GLOBAL, NEXTN
from hf2q.models.qwen35 import DecoderLayer, Qwen35Model
from hf2q.models.qwen35_mtp import MTPHead
from hf2q.quant import random_blocks

POOL_ROWS = 4096
STD = 0.02


def gguf_names(net: Qwen35Model) -> dict[str, str]:
    """Parameter path -> GGUF tensor name, by the loader's own table read backwards."""
    to_gguf = {param: name for name, param in GLOBAL.items()}
    n = net.config.num_layers
    to_gguf |= {param: f"blk.{n}.{name}" for name, param in NEXTN.items()}
    names = {}
    for path, _ in net.named_parameters():
        if path in to_gguf:
            names[path] = to_gguf[path]
            continue
        if path.startswith("mtp.layer."):
            rest = path.removeprefix("mtp.layer.")
            names[path] = f"blk.{n}." + next(g for g, p in BLOCK.items() if p == rest)
            continue
        _, layer, rest = path.split(".", 2)
        suffix = next(g for g, p in BLOCK.items() if p == rest)
        names[path] = f"blk.{layer}.{suffix}"
    return names


def quant_types(net: Qwen35Model, mix: str) -> dict[str, str]:
    """Parameter path -> GGUF type for the quantized weights of `mix`."""
    if mix == "bf16":
        return {}
    owners = {id(m): path for path, m in net.named_modules()}
    types = {"embed": "Q4_K"}
    for module, stack, qtype in quant_plan(net, mix):
        types[f"{owners[id(module)]}.{stack or 'weight'}"] = qtype
    return types


def dense_values(gguf_name: str, shape: tuple[int, ...], gen: torch.Generator) -> np.ndarray:
    """Random values of a tensor kept dense, in the ranges its role needs (llama.cpp's layout)."""
    if gguf_name.endswith("ssm_a"):
        return -(torch.rand(shape, generator=gen) * 15 + 1).numpy()  # -exp(A_log)
    if gguf_name.endswith("ssm_dt.bias"):
        return np.ones(shape, dtype=np.float32)
    if gguf_name.endswith("norm.weight") or gguf_name.endswith("ssm_norm.weight"):
        return (1 + torch.randn(shape, generator=gen) * 0.1).numpy()
    value = torch.randn(shape, generator=gen) * (0.3 if "conv1d" in gguf_name else STD)
    if len(shape) == 1 or "conv1d" in gguf_name or "gate_inp" in gguf_name:
        return value.numpy()
    return value.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def write(shape: str, mix: str, out: Path, seed: int = 0, mtp: bool = False) -> None:
    cfg, tie = SHAPES[shape]
    with torch.device("meta"):
        net = Qwen35Model(cfg, tie_embeddings=tie)
        if mtp:
            net.mtp = MTPHead(cfg, DecoderLayer(cfg, cfg.num_layers, rotary=None))
    names, types = gguf_names(net), quant_types(net, mix)
    w = gguf.GGUFWriter(str(out), cfg.arch)  # qwen35, or qwen35moe: the loader reads each key under it
    w.add_name(f"hf2q random {shape} {mix}" + (" mtp" if mtp else ""))
    w.add_block_count(cfg.num_layers + mtp)
    if mtp:
        w.add_uint32(f"{cfg.arch}.nextn_predict_layers", 1)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.hidden_size)
    if cfg.is_moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_rope_dimension_sections(list(cfg.rope_sections))
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.linear_k_head_dim)
    w.add_ssm_group_count(cfg.linear_num_k_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_v_heads)
    w.add_ssm_inner_size(cfg.linear_num_v_heads * cfg.linear_v_head_dim)
    w.add_full_attention_interval(cfg.full_attention_interval)
    demo.add_vocabulary(w)
    gen = torch.Generator().manual_seed(seed)
    pools: dict[tuple[str, int], np.ndarray] = {}
    for i, (path, param) in enumerate(net.named_parameters()):
        shape_ = tuple(param.shape)
        qtype = types.get(path)
        if qtype is None:
            value = dense_values(names[path], shape_, gen)
            raw = gguf.GGMLQuantizationType.BF16 if value.dtype == np.uint16 else None
            w.add_tensor(names[path], value, raw_dtype=raw)
            continue
        key = (qtype, shape_[-1])
        if key not in pools:
            pools[key] = random_blocks(qtype, POOL_ROWS, shape_[-1], std=STD, seed=seed + i).numpy()
        pool = pools[key]
        rows = int(np.prod(shape_[:-1]))
        pick = (np.arange(rows) * 7 + 131 * i) % POOL_ROWS  # every weight its own order of the pool's rows
        w.add_tensor(names[path], pool[pick].reshape(*shape_[:-1], pool.shape[1]),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    p.add_argument("--mix", choices=("bf16", "q4_k_m"), default="q4_k_m")
    p.add_argument("--mtp", action="store_true", help="with the MTP layer (block N, nextn tensors)")
    p.add_argument("-o", "--out", type=Path, required=True)
    args = p.parse_args()
    write(args.shape, args.mix, args.out, mtp=args.mtp)


if __name__ == "__main__":
    main()
