"""Real Qwen3.5 shapes with random weights, built directly on the target device (no files).

Speed of a dense model does not depend on its weight values, but zeros run faster than data, so every
weight is random. Used by `hf2q bench` and by the GPU tests (a tiny shape).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from hf2q.config import ModelConfig

_COMMON = dict(num_mtp_layers=0, head_dim=256, rms_norm_eps=1e-6, context_length=262144, rope_theta=1e7,
               rotary_dim=64, rope_sections=(11, 11, 10, 0), full_attention_interval=4, linear_k_head_dim=128,
               linear_v_head_dim=128, conv_kernel=4, vocab_size=248320)

SHAPES: dict[str, tuple[ModelConfig, bool]] = {  # name -> (config, tied embeddings)
    "2b": (ModelConfig(arch="qwen35", hidden_size=2048, num_layers=24, num_heads=8, num_kv_heads=2,
                       linear_num_k_heads=16, linear_num_v_heads=16, intermediate_size=6144, name="2b-style",
                       **_COMMON), True),
    "9b": (ModelConfig(arch="qwen35", hidden_size=4096, num_layers=32, num_heads=16, num_kv_heads=4,
                       linear_num_k_heads=16, linear_num_v_heads=32, intermediate_size=12288, name="9b-style",
                       **_COMMON), False),
    "35b-a3b": (ModelConfig(arch="qwen35moe", hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
                            linear_num_k_heads=16, linear_num_v_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            name="35b-a3b-style", **_COMMON), False),
}


def tiny_config(moe: bool = False) -> ModelConfig:
    """4 layers (3 DeltaNet + 1 attention), tiled value heads (n_v = 2 n_k), GQA 2:1; kernel-friendly dims."""
    base = dataclasses.replace(SHAPES["9b"][0], hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                               head_dim=32, rotary_dim=16, linear_num_k_heads=2, linear_num_v_heads=4,
                               linear_k_head_dim=16, linear_v_head_dim=16, intermediate_size=96, vocab_size=512,
                               rope_sections=(3, 3, 2, 0), name="tiny")
    if moe:
        base = dataclasses.replace(base, arch="qwen35moe", intermediate_size=0, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48)
    return base


@torch.no_grad()
def random_model(cfg: ModelConfig, tie: bool = False, device="cpu", dtype=torch.bfloat16, std: float = 0.02,
                 seed: int = 0):
    """A Qwen35Model with random weights: matrices in `dtype`, 1-D parameters and conv weights in fp32
    (as the GGUF loader keeps them)."""
    from hf2q.models.qwen35 import Qwen35Model

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = Qwen35Model(cfg, tie_embeddings=tie)
    finally:
        torch.set_default_dtype(old)
    _fill_random(net, torch.Generator(device=device).manual_seed(seed), std)
    return net.pack_weights().eval()


def _fill_random(net, gen: torch.Generator, std: float) -> None:
    for name, p in net.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() >= 2 and leaf != "conv":
            p.normal_(0.0, std, generator=gen)
            continue
        p.data = p.data.float()
        if leaf == "a":  # -exp(A_log), A_log = log U(1, 16)
            p.uniform_(1.0, 16.0, generator=gen).neg_()
        elif leaf == "conv":
            p.uniform_(-0.5, 0.5, generator=gen)
        elif leaf == "dt_bias":
            p.normal_(1.0, 0.1, generator=gen)
        else:  # norm weights hold 1 + gamma
            p.normal_(1.0, 0.1, generator=gen)


# ---- quantized random models ----------------------------------------------------------------------------
QUANT_MIXES = ("q8_0", "q4_k_m")


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_plan(net, mix: str) -> list[tuple[object, str | None, str]]:
    """(module, expert stack or None for a Linear, GGUF type) for every weight a `mix` file quantizes.

    q4_k_m follows llama.cpp's Q4_K_M: Q4_K by default; Q6_K for the output head and for attn_v /
    ffn_down (dense and expert) in the layers `use_more_bits` picks; Q5_K for the fused DeltaNet
    attn_qkv. Routers and the 1-row shared-expert gate stay dense, as llama.cpp leaves them in F32.
    """
    from hf2q.layers.linear import Linear
    from hf2q.layers.moe import EXPERT_STACKS, MoE

    if mix not in QUANT_MIXES:
        raise ValueError(f"quant mix must be one of {QUANT_MIXES}, not {mix!r}")
    n = len(net.layers)
    v_layers = [i for i, layer in enumerate(net.layers) if layer.is_full_attention]

    def pick(role: str, i: int) -> str:
        if mix == "q8_0":
            return "Q8_0"
        if role == "head":
            return "Q6_K"
        if role == "attn_v" and _more_bits(v_layers.index(i), len(v_layers)):
            return "Q6_K"
        if role == "ffn_down" and _more_bits(i, n):
            return "Q6_K"
        return "Q5_K" if role == "attn_qkv" else "Q4_K"

    plan = [] if net.lm_head is None else [(net.lm_head, None, pick("head", -1))]
    for i, layer in enumerate(net.layers):
        for name, m in layer.named_modules():
            if isinstance(m, MoE):
                plan += [(m, s, pick("ffn_down" if s == "down_exps" else "ffn", i)) for s in EXPERT_STACKS]
            elif isinstance(m, Linear) and not name.endswith(("router", "shared_gate")):
                role = {"mixer.v": "attn_v", "mixer.qkv": "attn_qkv"}.get(name, "")
                role = "ffn_down" if name.endswith("down") else role
                plan.append((m, None, pick(role, i)))
    return plan


@torch.no_grad()
def random_quant_model(cfg: ModelConfig, mix: str, tie: bool = False, device="cuda", dtype=torch.bfloat16,
                       std: float = 0.02, seed: int = 0):
    """A Qwen35Model whose projections, head and expert stacks are valid random GGUF blocks of the `mix`
    (see quant_plan); other weights random as in random_model. No dense copy of a quantized weight is
    ever made, so a 35B-A3B Q4_K_M fits where its bf16 twin would not. Each weight's rows are drawn from
    POOL_ROWS random rows of its type and width: numpy makes blocks at 50-90 MB/s on a 2-core CPU, minutes
    for the 20 GB of a 35B-A3B Q4_K_M."""
    from hf2q.layers.rotary import RotaryEmbedding
    from hf2q.models.qwen35 import Qwen35Model
    from hf2q.quant import interleaved_on, keep_blocks, kept_row, random_blocks

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            net = Qwen35Model(cfg, tie_embeddings=tie)
    finally:
        torch.set_default_dtype(old)
    plan = quant_plan(net, mix)
    for m, stack, qtype in plan:  # meta blocks drop the dense weights before anything is allocated
        shape = m.stack_shape(stack) if stack else (m.out_features, m.in_features)
        dtype_kept, width = kept_row(qtype, shape[-1], interleaved_on(qtype, device))  # as keep_blocks lays them out
        raw = torch.empty(*shape[:-1], width, dtype=dtype_kept, device="meta")
        if stack:
            m.set_quantized(stack, raw, qtype)
        else:
            m.set_quantized(raw, qtype)
    net = net.to_empty(device=device)
    net.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_sections).to(device)
    for layer in net.layers:
        if layer.is_full_attention:
            layer.mixer.rotary = net.rotary
    _fill_random(net, torch.Generator(device=device).manual_seed(seed), std)
    pools: dict[tuple[str, int], torch.Tensor] = {}
    for i, (m, stack, qtype) in enumerate(plan):
        raw = m.quant_stack(stack)[0] if stack else m.qweight
        rows = raw.numel() // raw.shape[-1]
        in_features = (m.stack_shape(stack) if stack else (m.in_features,))[-1]
        pool = pools.get((qtype, in_features))
        if pool is None:
            pool = pools[qtype, in_features] = keep_blocks(random_blocks(qtype, POOL_ROWS, in_features, std=std,
                                                                         seed=seed + i), qtype, device)
        # Rows are drawn from the pool in a different order per weight: every byte is still its own in
        # memory and read as such, and a 20 GB model builds in seconds instead of minutes.
        pick = (torch.arange(rows, device=device) * 7 + 131 * i) % POOL_ROWS
        raw.view(rows, -1).copy_(pool[pick])
    return net.pack_weights().eval()


POOL_ROWS = 8192  # random rows made per (type, width) by random_quant_model


def matrix_elems(net) -> int:
    """Multiply-add weights per token of every projection, dense or quantized (MoE: all experts)."""
    from hf2q.layers.linear import Linear
    from hf2q.layers.moe import EXPERT_STACKS, MoE

    total = 0
    for m in net.modules():
        if isinstance(m, Linear):
            total += m.in_features * m.out_features
        elif isinstance(m, MoE):
            total += sum(math.prod(m.stack_shape(s)) for s in EXPERT_STACKS)
    return total


def weight_bytes(net, active_experts: float | None = None) -> int:
    """Bytes of the weights one decode step reads: every matrix (dense, or its quantized blocks) but the
    input embedding (unless tied), with MoE expert stacks counted for `active_experts` experts per
    layer (None: all)."""
    tensors = list(net.named_parameters())
    # kept blocks: ggml bytes (uint8) or interleaved K-quant rows (int32 words)
    tensors += [(n, b) for n, b in net.named_buffers() if b is not None and b.dtype in (torch.uint8, torch.int32)]
    total = 0
    for name, p in tensors:
        if name == "embed" and not net.tie_embeddings:
            continue
        nbytes = p.numel() * p.element_size()
        if name.endswith(("_exps", "_qexps")) and active_experts is not None:
            nbytes = nbytes * active_experts / p.shape[0]
        total += nbytes
    return int(total)
