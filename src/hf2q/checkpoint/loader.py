"""Build a `Qwen35Model` from a GGUF file; every tensor must land on exactly one parameter."""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch
from torch import nn

from hf2q.checkpoint.gguf_file import GGUFError, GGUFFile
from hf2q.checkpoint.names import param_name
from hf2q.checkpoint.staging import StagedCopier
from hf2q.config import ModelConfig
from hf2q.layers.mlp import MLP
from hf2q.layers.rotary import RotaryEmbedding
from hf2q.models.qwen35 import DecoderLayer, Qwen35Model
from hf2q.models.qwen35_mtp import MTPHead


def build_model(gguf: GGUFFile, cfg: ModelConfig, device="cpu", dtype=torch.float32,
                with_mtp: bool = True, keep_quantized: bool = False) -> Qwen35Model:
    """keep_quantized: block-quantized projection weights, the LM head and MoE expert stacks stay as
    their GGUF bytes (meant for CUDA; the default dequantizes every tensor, the exact CPU path)."""
    names = set(gguf.tensor_names)
    embed_rows = gguf.info("token_embd.weight").shape[0] if "token_embd.weight" in names else None
    if embed_rows is None:
        raise GGUFError(f"{gguf.path}: no token_embd.weight tensor")
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if max(blocks, default=-1) + 1 != cfg.num_layers + cfg.num_mtp_layers:
        raise GGUFError(f"{gguf.path}: block_count is {cfg.num_layers + cfg.num_mtp_layers} but the file holds "
                        f"tensors for {max(blocks, default=-1) + 1} blocks")
    if embed_rows != cfg.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=embed_rows)
    with torch.device("meta"):
        model = Qwen35Model(cfg, tie_embeddings="output.weight" not in names)
        if with_mtp and cfg.num_mtp_layers:
            model.mtp = _make_mtp(cfg, names)
    _fill(model, gguf, cfg, device, dtype, with_mtp, keep_quantized)
    model.pack_weights()
    if torch.device(device).type == "cuda":  # decoding temporaries and the unpacked weights stay cached otherwise,
        torch.cuda.empty_cache()  # and the K/V pool is sized from the memory the driver reports free
    return model.eval()


def _make_mtp(cfg: ModelConfig, names: set[str]) -> MTPHead:
    n = cfg.num_layers
    head = MTPHead(cfg, DecoderLayer(cfg, n, rotary=None))
    if cfg.is_moe and f"blk.{n}.ffn_gate.weight" in names:  # a dense MTP block inside a MoE model
        head.layer.ffn = MLP(cfg.hidden_size, 1)
    if f"blk.{n}.nextn.embed_tokens.weight" in names:
        head.embed = nn.Parameter(torch.empty(0), requires_grad=False)
    return head


def _fill(model: Qwen35Model, gguf: GGUFFile, cfg: ModelConfig, device, dtype, with_mtp: bool,
          keep_quantized: bool = False) -> None:
    from tqdm import tqdm

    params = dict(model.named_parameters())
    filled: set[str] = set()
    copier = staged_copier(device)
    names = tqdm(gguf.tensor_names, desc="loading", unit="tensor", file=sys.stderr, disable=not sys.stderr.isatty())
    for name in names:
        target = param_name(name, cfg.num_layers)
        if target is None:
            raise GGUFError(f"{gguf.path}: unexpected tensor {name!r} for architecture {cfg.arch}")
        if target.startswith("mtp.") and model.mtp is None:
            continue  # MTP weights present but not wanted
        if target not in params:
            raise GGUFError(f"{gguf.path}: tensor {name!r} has no place in this {cfg.arch} model ({target})")
        if keep_quantized and _assign_quantized(model, target, name, gguf, device, copier):
            filled.add(target)
            continue
        value = _device_value(gguf, name, copier, keep_quantized) if copier is not None else None
        if value is None:
            value = gguf.tensor(name, dtype=torch.float32)
        _assign(model, target, params[target], value, name, gguf, device, dtype)
        filled.add(target)
    missing = sorted(set(params) - filled)
    if missing:
        raise GGUFError(f"{gguf.path}: missing tensors for {', '.join(missing[:8])}"
                        + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    # Buffers were made on the meta device: build the rotary tables for real and share them.
    model.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_sections).to(device)
    for layer in model.blocks():
        if layer.is_full_attention:
            layer.mixer.rotary = model.rotary


def _assign(model: nn.Module, target: str, param: nn.Parameter, value: torch.Tensor, name: str,
            gguf: GGUFFile, device, dtype) -> None:
    flexible = param.shape == (0,) or (target.startswith("mtp.layer.ffn.") and param.shape != value.shape)
    if not flexible and tuple(param.shape) != tuple(value.shape):
        raise GGUFError(f"{gguf.path}: tensor {name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(param.shape)}")
    keep_fp32 = value.dim() == 1 or name.endswith("ssm_conv1d.weight")
    new = nn.Parameter(value.to(device=device, dtype=torch.float32 if keep_fp32 else dtype), requires_grad=False)
    owner_path, _, attr = target.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    setattr(owner, attr, new)


# ---- quantized weights kept as blocks -----------------------------------------------------------------
def _assign_quantized(model: nn.Module, target: str, name: str, gguf: GGUFFile, device,
                      copier: StagedCopier | None = None) -> bool:
    """Copy a block-quantized Linear weight or MoE expert stack to `device` as bytes; False leaves it to
    the dense path (other types, other targets, shape mismatches)."""
    from hf2q.layers.linear import Linear
    from hf2q.layers.moe import EXPERT_STACKS, MoE
    from hf2q.quant import QUANT_TYPES, keep_blocks

    info = gguf.info(name)
    owner_path, _, attr = target.rpartition(".")
    if info.type_name not in QUANT_TYPES or owner_path == "":
        return False
    owner = model.get_submodule(owner_path)
    if isinstance(owner, Linear) and attr == "weight":
        shape = (owner.out_features, owner.in_features)
    elif isinstance(owner, MoE) and attr in EXPERT_STACKS:
        shape = owner.stack_shape(attr)
    else:
        return False
    if info.shape != shape:
        return False
    if copier is not None:  # bytes to the device first: the K-quant re-layout runs there
        raw = copier.copy(gguf.raw(name))
    else:
        raw = torch.from_numpy(np.array(gguf.raw(name), dtype=np.uint8))
    raw = keep_blocks(raw.reshape(*shape[:-1], -1), info.type_name, device)
    if isinstance(owner, MoE):
        owner.set_quantized(attr, raw, info.type_name)
    else:
        owner.set_quantized(raw, info.type_name)
    return True


# ---- dense values decoded on the device ---------------------------------------------------------------
def staged_copier(device) -> StagedCopier | None:
    """The copier that carries file bytes to `device` for decoding there: CUDA only (on the CPU the file's
    pages are read in place)."""
    return StagedCopier(device) if torch.device(device).type == "cuda" else None


def _device_value(gguf: GGUFFile, name: str, copier: StagedCopier, blocks: bool = True) -> torch.Tensor | None:
    """fp32 values of a tensor decoded on the copier's device, CUDA when loading (None: a type left to the
    host path).

    Float types convert exactly. With `blocks` (a model keeping its quantized weights, which it then reads
    through the Triton kernels anyway), block-quantized tensors such as a Q4_K token embedding are
    dequantized by the Triton kernel, within 1e-6 of the largest weight of gguf's reference
    (tests/quant/test_kernels.py), far below bf16's rounding; a dense model keeps gguf's exact values."""
    from hf2q.quant import QUANT_TYPES, keep_blocks

    info = gguf.info(name)
    floats = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if info.type_name in floats:
        return copier.copy(gguf.raw(name)).view(floats[info.type_name]).float().view(info.shape)
    if not blocks or info.type_name not in QUANT_TYPES or len(info.shape) != 2:
        return None
    from hf2q.kernels.quant.ops import dequantize

    raw = keep_blocks(copier.copy(gguf.raw(name)).view(info.shape[0], -1), info.type_name, copier.device)
    return dequantize(raw, info.type_name, info.shape, torch.float32)
