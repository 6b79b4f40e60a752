"""Real Qwen3.5 shapes with random weights, built directly on the target device (no files).

Speed of a dense model does not depend on its weight values, but zeros run faster than data, so every
weight is random. Used by `hf2q bench` and by the GPU tests (a tiny shape).
"""
from __future__ import annotations

import dataclasses

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
    gen = torch.Generator(device=device).manual_seed(seed)
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
    return net.eval()


def weight_bytes(net, active_experts: float | None = None) -> int:
    """Bytes of the weights one decode step reads: every matrix but the input embedding (unless tied),
    with MoE expert tensors counted for `active_experts` experts per layer (None: all)."""
    total = 0
    for name, p in net.named_parameters():
        if name == "embed" and not net.tie_embeddings:
            continue
        nbytes = p.numel() * p.element_size()
        if name.endswith("_exps") and active_experts is not None:
            nbytes = nbytes * active_experts / p.shape[0]
        total += nbytes
    return int(total)
