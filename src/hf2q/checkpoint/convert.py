"""`hf2q convert`: an HF Qwen3.5 / Qwen3.5-MoE checkpoint -> a GGUF file in llama.cpp's own layout.

The output matches llama.cpp's `convert_hf_to_gguf.py` (tensor names, transformations, types, metadata,
tokenizer) so that our files and theirs are interchangeable. Tensors are planned first (names,
shapes, types), then read, transformed and written one at a time, so a large checkpoint is never
held in memory.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

log = logging.getLogger(__name__)

ARCHES = {"Qwen3_5ForCausalLM": "qwen35", "Qwen3_5ForConditionalGeneration": "qwen35",
          "Qwen3_5MoeForCausalLM": "qwen35moe", "Qwen3_5MoeForConditionalGeneration": "qwen35moe"}
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
OUTTYPES = tuple(_FILE_TYPES)

# MTP wrapper tensors, in the block after the last decoder layer (gguf's name map lacks them).
_NEXTN = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
          "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight"}
_MTP_TOP = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
            "norm": "shared_head.norm"}
# llama.cpp keeps these in F32 whatever the outtype (besides 1-D tensors, norms and non-weights).
_F32_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def load_hparams(hf_dir: Path) -> tuple[dict, str]:
    """config.json (with `text_config` lifted to the top) and the GGUF architecture name."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    hf_arch = (config.get("architectures") or [None])[0]
    if hf_arch not in ARCHES:
        raise ValueError(f"Unsupported architecture {hf_arch!r} in {path}; "
                         f"hf2q convert supports {', '.join(ARCHES)}")
    return {**config, **config.get("text_config", {})}, ARCHES[hf_arch]


# ---------------------------------------------------------------------------------------- tensors

def _canonical(name: str, n_layers: int) -> str | None:
    """`model.layers.{i}.*` form of a checkpoint name, MTP moved to layer n_layers+k; None to skip."""
    if "visual." in name or "vision_" in name:
        return None
    name = name.replace("language_model.", "").replace("model.mtp.", "mtp.", 1)
    if not name.startswith("mtp."):
        return name
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
        return f"model.layers.{n_layers + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in _MTP_TOP:
        return f"model.layers.{n_layers}.{_MTP_TOP[parts[1]]}.{parts[2]}"
    raise ValueError(f"Unknown MTP tensor {name!r}")


def _gguf_name(name: str, name_map) -> str:
    """GGUF name of a canonical checkpoint name, from gguf's own HF -> GGUF table."""
    bid, suffix = _split_layer(name)
    if suffix in _NEXTN:
        return f"blk.{bid}.{_NEXTN[suffix]}"
    if suffix == "linear_attn.dt_bias":
        name = name.removesuffix("dt_bias") + "dt_proj.bias"
    if (new := name_map.get_name(name, try_suffixes=(".weight", ".bias"))) is None:
        raise ValueError(f"No GGUF name for checkpoint tensor {name!r}")
    return new


def _split_layer(name: str) -> tuple[int | None, str]:
    if not name.startswith("model.layers."):
        return None, name
    bid, suffix = name[len("model.layers."):].split(".", 1)
    return int(bid), suffix


def _tiled(t: torch.Tensor, dim: int, nk: int, nv: int, head_dim: int) -> torch.Tensor:
    """V heads along `dim` from grouped order (v // (nv/nk) is the key head) to tiled (v % nk)."""
    shape = list(t.shape)
    dim %= len(shape)
    grouped = t.reshape(*shape[:dim], nk, nv // nk, head_dim, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _transform(suffix: str, t: torch.Tensor, hp: dict) -> torch.Tensor:
    """One checkpoint tensor as llama.cpp stores it (V-head re-tiling, -exp(A_log), +1 on norms)."""
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    if suffix.startswith("linear_attn.") and nk != nv:
        dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
        if suffix.startswith(("linear_attn.in_proj_qkv.", "linear_attn.conv1d.")):
            t = t.squeeze() if "conv1d" in suffix else t
            qk, v = t[:2 * nk * dk], t[2 * nk * dk:]  # rows: [q heads | k heads | v heads]
            t = torch.cat([qk, _tiled(v, 0, nk, nv, dv)], dim=0)
        elif suffix.startswith("linear_attn.in_proj_z."):
            t = _tiled(t, 0, nk, nv, dv)
        elif suffix.startswith(("linear_attn.in_proj_a.", "linear_attn.in_proj_b.", "linear_attn.A_log",
                                "linear_attn.dt_bias")):
            t = _tiled(t, 0, nk, nv, 1)  # one row (or value) per V head
        elif suffix.startswith("linear_attn.out_proj."):
            t = _tiled(t, 1, nk, nv, dv)
    if suffix.endswith(".A_log"):
        t = -torch.exp(t)
    elif "conv1d" in suffix:
        t = t.squeeze()  # [channels, 1, kernel] -> [channels, kernel]
    elif suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":
        t = t + 1  # llama.cpp's RMSNorm multiplies by the weight itself
    return t


@dataclass
class _Job:
    """One GGUF tensor: its shape, the checkpoint tensors it is made from, and how."""
    name: str
    shape: tuple[int, ...]
    sources: list[str]
    make: Callable[[list[torch.Tensor]], torch.Tensor]


class _Checkpoint:
    """Lazy access to the safetensors files of a checkpoint, in llama.cpp's reading order."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            parts = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            parts = sorted(p.name for p in hf_dir.glob("model*.safetensors"))
        if not parts:
            raise FileNotFoundError(f"No safetensors weights in {hf_dir}")
        self.where = {k: f for p in parts for f in [safe_open(str(hf_dir / p), framework="pt")] for k in f.keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def load(self, name: str) -> torch.Tensor:
        t = self.where[name].get_tensor(name)
        return t if t.dtype in (torch.float16, torch.float32) else t.to(torch.float32)


def plan_tensors(ckpt: _Checkpoint, hp: dict, arch: str, no_mtp: bool) -> tuple[list[_Job], int]:
    """The GGUF tensors in llama.cpp's order, and the number of MTP layers among them."""
    n_layers = hp["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers + 8)
    jobs, experts, mtp_layers = [], {}, set()
    for src in ckpt.where:
        name = None if no_mtp and src.startswith(("mtp.", "model.mtp.")) else _canonical(src, n_layers)
        if name is None:
            continue
        bid, suffix = _split_layer(name)
        if bid is not None and bid >= n_layers:
            mtp_layers.add(bid)
        shape, parts = ckpt.shape(src), suffix.split(".")
        exps = f"model.layers.{bid}.mlp.experts.{{}}.weight"
        if parts[:2] == ["mlp", "experts"] and parts[2].isdecimal():  # experts.{e}.{w}.weight
            got = experts.setdefault(bid, {})
            got.setdefault(parts[3], []).append((int(parts[2]), src))
            if sum(map(len, got.values())) == 3 * hp["num_experts"]:  # llama.cpp stacks once all are read
                for w in ("down_proj", "gate_proj", "up_proj"):
                    srcs = [s for _, s in sorted(got[w])]
                    jobs.append(_Job(_gguf_name(exps.format(w), names), (len(srcs), *ckpt.shape(srcs[0])), srcs,
                                     lambda ts: torch.stack(ts, dim=0)))
                del experts[bid]
        elif suffix.startswith("mlp.experts.gate_up_proj"):  # fused [experts, 2 * ff, hidden]
            for half, w in enumerate(("gate_proj", "up_proj")):
                jobs.append(_Job(_gguf_name(exps.format(w), names), (*shape[:-2], shape[-2] // 2, shape[-1]), [src],
                                 lambda ts, h=half: ts[0].chunk(2, dim=-2)[h].contiguous()))
        elif suffix.startswith("mlp.experts.down_proj"):
            jobs.append(_Job(_gguf_name(exps.format("down_proj"), names), shape, [src], lambda ts: ts[0]))
        else:
            if "conv1d" in suffix:
                shape = tuple(d for d in shape if d != 1)
            jobs.append(_Job(_gguf_name(name, names), shape, [src],
                             lambda ts, s=suffix: _transform(s, ts[0], hp)))
    if experts:
        raise ValueError(f"Incomplete expert tensors in layers {sorted(experts)}")
    return jobs, len(mtp_layers)


def tensor_type(name: str, shape: tuple[int, ...], outtype: str):
    """The GGML type llama.cpp's converter gives this tensor for `outtype`."""
    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith(("_norm.weight",) + _F32_SUFFIXES) or not name.endswith(".weight"):
        return Q.F32
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] != 0:
        return Q.F16  # llama.cpp falls back to F16 for rows that do not fill whole blocks
    return qtype


# --------------------------------------------------------------------------------------- metadata

class _Writer(gguf.GGUFWriter):
    """A GGUFWriter that packs long arrays in one pass.

    The stock writer packs arrays item by item: about 15 s for a 248k vocabulary and 500k merges.
    """

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype != gguf.GGUFValueType.ARRAY or len(val) < 256:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        ltype = sub_type or gguf.GGUFValueType.get_type(val[0])
        fmt = self._simple_value_packing.get(ltype)
        if fmt is None and ltype != gguf.GGUFValueType.STRING:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
        head = (struct.pack(f"{order}I", vtype) if add_vtype else b"") + struct.pack(f"{order}IQ", ltype, len(val))
        if fmt is not None:
            return head + struct.pack(f"{order}{len(val)}{fmt}", *val)
        length = struct.Struct(f"{order}Q").pack
        enc = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
        return head + b"".join(length(len(e)) + e for e in enc)


def _add_model_keys(w, hp: dict, arch: str, ftype: int, n_mtp: int) -> None:
    """The `{arch}.*` keys, in llama.cpp's order."""
    def optional(*pairs):
        for key, add in pairs:
            if hp.get(key) is not None:
                add(hp[key])

    n_layers = hp["num_hidden_layers"]
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and hp.get(key) is not None:
            rope[key] = hp[key]
    w.add_block_count(n_layers + n_mtp)
    optional(("max_position_embeddings", w.add_context_length), ("hidden_size", w.add_embedding_length),
             ("intermediate_size", w.add_feed_forward_length), ("num_attention_heads", w.add_head_count),
             ("num_key_value_heads", w.add_head_count_kv))
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind in ("linear", "yarn") and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in (None, "default"):
        log.warning("RoPE type %r is not written to the GGUF", kind)
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    optional(("num_experts", w.add_expert_count), ("num_experts_per_tok", w.add_expert_used_count),
             ("head_dim", w.add_key_length), ("head_dim", w.add_value_length))
    w.add_file_type(ftype)
    optional(("moe_intermediate_size", w.add_expert_feed_forward_length),
             ("shared_expert_intermediate_size", w.add_expert_shared_feed_forward_length))
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if (layer_types := hp.get("layer_types")) is not None:
        if len(layer_types) != n_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected {n_layers}")
        recurrent = [t == "linear_attention" for t in layer_types] + [False] * n_mtp
        w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if "mrope_section" not in rope:  # Qwen3.5 always uses interleaved M-RoPE; this is its default
        w.add_rope_dimension_sections([11, 11, 10, 0])


def _add_general(w, hf_dir: Path, file_kind: str = gguf.GGUFType.MODEL) -> None:
    """general.type / name / size_label, from the checkpoint folder as llama.cpp derives them."""
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, hf_dir, None, total)
    if meta.name is None:
        meta.name = hf_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    w.add_type(file_kind)
    meta.set_gguf_meta_model(w)


def _looks_special(token: str) -> bool:
    pairs = (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">"))
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or any(
        token.startswith(a) and token.endswith(b) for a, b in pairs)


def _token_list(hf_dir: Path, tok_json: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and their types as llama.cpp lists them: added tokens are control or user-defined."""
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    reverse = {i: t for t, i in tok_json["model"]["vocab"].items()} | {i: a["content"] for i, a in added.items()}
    if max(reverse) >= vocab_size:
        raise ValueError(f"Tokenizer has id {max(reverse)} but vocab_size is {vocab_size}")
    tokens = [reverse.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.NORMAL if i in reverse else gguf.TokenType.UNUSED for i in range(vocab_size)]
    tok = None
    for i, a in added.items():
        token = a["content"]
        # llama.cpp stores added tokens in normalized form: encoded and decoded back. That is the
        # identity for printable ASCII (every Qwen special token), so the tokenizer loads only if needed.
        if not a.get("normalized", True) and not (token.isascii() and token.isprintable()):
            if tok is None:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
            token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
        if a.get("special") or _looks_special(token):
            tokens[i], types[i] = token, gguf.TokenType.CONTROL
        else:
            tokens[i], types[i] = token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED
    return tokens, types


def _add_tokenizer(w, hf_dir: Path, vocab_size: int) -> None:
    """Byte-level BPE vocabulary, token types, merges, special ids and chat template."""
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens, types = _token_list(hf_dir, tok_json, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")  # the pre-tokenizer of every Qwen3.5 / 3.6 vocabulary
    w.add_token_list(tokens)
    w.add_token_types(types)
    # gguf.SpecialVocab's merge conversion takes seconds; spaces inside a merge are written as U+0120
    merges = tok_json["model"]["merges"]
    if merges and not isinstance(merges[0], str):
        if any(" " in a or " " in b for a, b in merges):
            merges = [[part.replace(" ", "\u0120") for part in pair] for pair in merges]
        merges = [" ".join(pair) for pair in merges]
    w.add_token_merges(merges)
    special = gguf.SpecialVocab(hf_dir, load_merges=False)
    post = tok_json.get("post_processor") or {}
    if any(p.get("type") == "ByteLevel" for p in post.get("processors", [post])):
        # llama.cpp's newer SpecialVocab: a ByteLevel post-processor adds neither BOS nor EOS
        rest = {k: v for k, v in special.add_special_token.items() if k not in ("bos", "eos")}
        special.add_special_token = {"bos": False, "eos": False, **rest}
    special.add_to_gguf(w, quiet=True)


def convert(hf_dir, out_path, outtype: str = "f32", no_mtp: bool = False) -> Path:
    """Convert an HF Qwen3.5 checkpoint folder to a GGUF file; returns the output path.

    The file is written next to `out_path` under a temporary name and renamed when complete.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    hf_dir, out_path = Path(hf_dir).resolve(), Path(out_path)
    hp, arch = load_hparams(hf_dir)
    ckpt = _Checkpoint(hf_dir)
    jobs, n_mtp = plan_tensors(ckpt, hp, arch, no_mtp)
    if not no_mtp and hp.get("mtp_num_hidden_layers", 0) > n_mtp:
        raise ValueError(f"config.json declares {hp['mtp_num_hidden_layers']} MTP layers but the checkpoint "
                         f"has {n_mtp}; convert with no_mtp (--no-mtp)")
    ftype = gguf.LlamaFileType[_FILE_TYPES[outtype]]

    w = _Writer(path=None, arch=arch)
    qtypes = []
    for job in jobs:
        qtypes.append(tensor_type(job.name, job.shape, outtype))
        byte_shape = gguf.quant_shape_to_byte_shape(job.shape, qtypes[-1])
        w.add_tensor_info(job.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtypes[-1])
    _add_general(w, hf_dir)
    _add_model_keys(w, hp, arch, int(ftype), n_mtp)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, hf_dir, hp["vocab_size"])

    return write_gguf(w, jobs, qtypes, ckpt, out_path)


def write_gguf(w, jobs: list[_Job], qtypes: list, ckpt: _Checkpoint, out_path: Path) -> Path:
    """Write header, keys and tensors one at a time under a temporary name, renamed when complete."""
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.part")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for job, qtype in zip(jobs, qtypes):
            data = job.make([ckpt.load(s) for s in job.sources]).numpy()
            assert data.shape == job.shape, (job.name, data.shape, job.shape)
            w.write_tensor_data(gguf.quants.quantize(data, qtype))
        w.close()
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path
