"""The bytes a GGUF model's weights take once loaded, checked against the device's free memory before loading:
a model that cannot fit is one clear error up front, not an out-of-memory failure (or the kernel's OOM killer)
partway through a long load."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.checkpoint.names import param_name
from hf2q.quant import QUANT_TYPES

GIB = 1 << 30
EMBEDDINGS = ("embed", "mtp.embed")  # looked up by row, never kept as blocks


class ModelTooLarge(ValueError):
    """The model's weights, as they would be loaded, exceed the device's free memory."""


def loaded_bytes(gguf: GGUFFile, num_layers: int, dtype: torch.dtype, keep_quantized: bool,
                 with_mtp: bool = True) -> int:
    """Bytes of the weights as the loader keeps them: blocks as stored for quantized matrices (with
    keep_quantized), other tensors as values in `dtype`, vectors and the DeltaNet conv in float32."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for name in gguf.tensor_names:
        target = param_name(name, num_layers)
        if target is None or (target.startswith("mtp.") and not with_mtp):
            continue
        info = gguf.info(name)
        if keep_quantized and info.type_name in QUANT_TYPES and target not in EMBEDDINGS and len(info.shape) > 1:
            total += info.n_bytes
        elif len(info.shape) == 1 or name.endswith("ssm_conv1d.weight"):
            total += 4 * math.prod(info.shape)
        else:
            total += size * math.prod(info.shape)
    return total


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory free for the weights: the GPU's free memory, or on the CPU what Linux reports available
    (None where that is unknown: no check; without a usable GPU, loading onto one fails on its own)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_fits(gguf: GGUFFile, num_layers: int, device: torch.device, dtype: torch.dtype, keep_quantized: bool,
               with_mtp: bool = True) -> None:
    """Raise ModelTooLarge, saying how much is needed and free and what would need less, when the weights as
    loaded would not fit in the device's free memory."""
    need, free = loaded_bytes(gguf, num_layers, dtype, keep_quantized, with_mtp), free_bytes(device)
    if free is None or need <= free:
        return
    quantized_file = any(gguf.info(n).type_name in QUANT_TYPES for n in gguf.tensor_names)
    values = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        how = "its quantized blocks kept" if keep_quantized and quantized_file else f"{values} values"
        hint = ("without --dequantize its blocks stay quantized" if quantized_file and not keep_quantized
                else "use a smaller quantization, or free the GPU's memory")
    else:
        how = f"every weight as {values} values (the CPU path dequantizes)"
        hint = ("--dtype bfloat16 halves the float32 weights, or serve it on a GPU, which keeps quantized blocks"
                if dtype == torch.float32 else "serve it on a GPU, which keeps quantized blocks")
    raise ModelTooLarge(f"{gguf.path.name} needs about {need / GIB:.1f} GiB of {device.type.upper()} memory loaded "
                        f"with {how}, and {free / GIB:.1f} GiB is free: {hint}")
