"""The one table from GGUF tensor names (llama.cpp's layout) to module parameters."""
from __future__ import annotations

import re

GLOBAL = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}

# Per block: GGUF suffix -> parameter path under the decoder layer.
BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "post_attention_norm.weight": "ffn_norm.weight",
    # Gated DeltaNet
    "attn_qkv.weight": "mixer.qkv.weight",
    "attn_gate.weight": "mixer.z.weight",
    "ssm_alpha.weight": "mixer.alpha.weight",
    "ssm_beta.weight": "mixer.beta.weight",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.a",
    "ssm_conv1d.weight": "mixer.conv",
    "ssm_norm.weight": "mixer.norm",
    "ssm_out.weight": "mixer.out.weight",
    # Gated full attention
    "attn_q.weight": "mixer.q.weight",
    "attn_k.weight": "mixer.k.weight",
    "attn_v.weight": "mixer.v.weight",
    "attn_output.weight": "mixer.o.weight",
    "attn_q_norm.weight": "mixer.q_norm",
    "attn_k_norm.weight": "mixer.k_norm",
    # Dense FFN
    "ffn_gate.weight": "ffn.gate.weight",
    "ffn_up.weight": "ffn.up.weight",
    "ffn_down.weight": "ffn.down.weight",
    # MoE
    "ffn_gate_inp.weight": "ffn.router.weight",
    "ffn_gate_exps.weight": "ffn.gate_exps",
    "ffn_up_exps.weight": "ffn.up_exps",
    "ffn_down_exps.weight": "ffn.down_exps",
    "ffn_gate_shexp.weight": "ffn.shared.gate.weight",
    "ffn_up_shexp.weight": "ffn.shared.up.weight",
    "ffn_down_shexp.weight": "ffn.shared.down.weight",
    "ffn_gate_inp_shexp.weight": "ffn.shared_gate.weight",
}

# MTP wrapper tensors on block N = num_layers.
NEXTN = {
    "nextn.eh_proj.weight": "mtp.eh_proj.weight",
    "nextn.enorm.weight": "mtp.enorm.weight",
    "nextn.hnorm.weight": "mtp.hnorm.weight",
    "nextn.shared_head_norm.weight": "mtp.shared_head_norm.weight",
    "nextn.embed_tokens.weight": "mtp.embed",
}

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def param_name(gguf_name: str, num_layers: int) -> str | None:
    """Module parameter path for a GGUF tensor, or None when the name is unknown."""
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    m = _BLK.match(gguf_name)
    if not m:
        return None
    layer, suffix = int(m.group(1)), m.group(2)
    if layer < num_layers:
        return f"layers.{layer}.{BLOCK[suffix]}" if suffix in BLOCK else None
    if suffix in NEXTN and layer == num_layers:
        return NEXTN[suffix]
    if suffix in BLOCK and layer == num_layers:
        return f"mtp.layer.{BLOCK[suffix]}"
    return None

# The vision projector file (llama.cpp's mmproj, "clip" architecture) -> `hf2q.vision.tower` parameters.
VISION = {
    "v.patch_embd.weight": "patch_embed.kernel_t0",  # the Conv3D kernel split along time into two Conv2Ds
    "v.patch_embd.weight.1": "patch_embed.kernel_t1",
    "v.patch_embd.bias": "patch_embed.bias",
    "v.position_embd.weight": "pos_embed",
    "v.post_ln.weight": "merger.norm.weight",
    "v.post_ln.bias": "merger.norm.bias",
    "mm.0.weight": "merger.fc1.weight",
    "mm.0.bias": "merger.fc1.bias",
    "mm.2.weight": "merger.fc2.weight",
    "mm.2.bias": "merger.fc2.bias",
}

# Per vision block `v.blk.{i}.`: GGUF suffix -> parameter path under the block.
VISION_BLOCK = {
    "ln1.weight": "norm1.weight", "ln1.bias": "norm1.bias",
    "ln2.weight": "norm2.weight", "ln2.bias": "norm2.bias",
    "attn_qkv.weight": "attn.qkv.weight", "attn_qkv.bias": "attn.qkv.bias",
    "attn_out.weight": "attn.proj.weight", "attn_out.bias": "attn.proj.bias",
    "ffn_up.weight": "mlp.fc1.weight", "ffn_up.bias": "mlp.fc1.bias",
    "ffn_down.weight": "mlp.fc2.weight", "ffn_down.bias": "mlp.fc2.bias",
}

_VBLK = re.compile(r"^v\.blk\.(\d+)\.(.+)$")


def vision_param_name(gguf_name: str, depth: int) -> str | None:
    """Vision tower parameter path for an mmproj tensor, or None when the name is unknown."""
    if gguf_name in VISION:
        return VISION[gguf_name]
    m = _VBLK.match(gguf_name)
    if m and int(m.group(1)) < depth and m.group(2) in VISION_BLOCK:
        return f"blocks.{int(m.group(1))}.{VISION_BLOCK[m.group(2)]}"
    return None
