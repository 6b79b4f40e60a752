"""A Q4_K_M-style GGUF made from one of our f32 fixture files, for the quantized loading and kernel tests.

Types follow llama.cpp's Q4_K_M choices (`bench_shapes.quant_plan`): Q6_K for the output head and, in
the layers `use_more_bits` picks, attn_v and ffn_down; Q5_K for the DeltaNet attn_qkv; Q4_K for every
other projection and the token embedding; routers, norms, convolutions and 1-D tensors stay F32. A
tensor whose rows do not fill whole 256-value super-blocks (the tiny fixture is 128 wide) gets Q8_0,
quantized from its values (llama.cpp would pick Q5_0 there, which this server does not keep as blocks).
gguf-py cannot quantize to K-quants, so K-quant tensors hold valid random blocks with the source
tensor's spread: the file is a different random model of the same shape, which is all a test comparing
a file's kernel path to its own dequantized path needs.
"""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from hf2q.bench_shapes import _more_bits
from hf2q.checkpoint.convert import _Writer
from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.quant import random_blocks

_KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layers: int, attn_layers: list[int]) -> str:
    """The type this file gives tensor `name` (torch-order shape)."""
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith(_KEEP_F32):
        return "F32"
    m = re.match(r"blk\.(\d+)\.(.+)$", name)
    i, suffix = (int(m.group(1)), m.group(2)) if m else (-1, name)
    if name == "output.weight":
        qtype = "Q6_K"
    elif suffix == "attn_v.weight" and i in attn_layers and _more_bits(attn_layers.index(i), len(attn_layers)):
        qtype = "Q6_K"
    elif suffix.startswith("ffn_down") and _more_bits(i, n_layers):
        qtype = "Q6_K"
    elif suffix == "attn_qkv.weight":
        qtype = "Q5_K"
    else:
        qtype = "Q4_K"
    return qtype if shape[-1] % 256 == 0 else "Q8_0"


def write_q4_k_m(src: Path, dst: Path) -> None:
    """Write the Q4_K_M-style twin of the f32 GGUF `src` to `dst`."""
    f = GGUFFile(src)
    reader = f._reader
    arch = f.metadata["general.architecture"]
    n_layers = int(f.metadata[f"{arch}.block_count"])
    attn_layers = sorted({int(n.split(".")[1]) for n in f.tensor_names if n.endswith("attn_q.weight")})
    w = _Writer(path=None, arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.metadata[key]
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, list(value) if sub is not None else value, field.types[0], sub_type=sub)
    blobs = []
    for name in f.tensor_names:
        info = f.info(name)
        values = f.tensor(name).numpy()
        qtype = q4_k_m_type(name, info.shape, n_layers, attn_layers)
        if qtype == "F32":
            data = values.astype(np.float32)
        elif qtype == "Q8_0":
            data = gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        else:
            rows = int(np.prod(info.shape[:-1]))
            std = float(values.std()) or 0.02
            data = random_blocks(qtype, rows, info.shape[-1], std=std, seed=len(blobs)).numpy()
            data = data.reshape(*info.shape[:-1], -1)
        raw = gguf.GGMLQuantizationType[qtype]
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw if qtype != "F32" else None)
        blobs.append(data)
    w.write_header_to_file(path=dst)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in blobs:
        w.write_tensor_data(data)
    w.close()
