"""Device and dtype choice for `serve` and `generate`: CUDA in bf16 when present, else the exact fp32 CPU path.

torch is imported where it is used, not with the module: the flags are defined here, and `hf2q --help` or a
mistyped flag should not wait for torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # torch's names, as --dtype takes them


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device. A blocking copy to a GPU first waits for all
    work queued on the stream, so the host would prepare its next step only once the device had finished this
    one (and async scheduling's overlap would end): small uploads on a step's path go through pinned memory."""
    import torch

    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def resolve_device(name: str = "auto") -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (use auto, cpu, cuda or cuda:N)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
    return getattr(torch, name)


def add_device_args(parser) -> None:
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="weights and K/V cache (default: %(default)s: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "fp32", "bf16", "fp16", "fp8", "tq8", "tq6", "tq5"],
                        help="full-attention K/V storage: auto (the --dtype), a float dtype, fp8 (e4m3, a scale per "
                             "token and head) or TurboQuant tq8/tq6/tq5 (Hadamard-rotated codebook indices); "
                             "default: %(default)s")
    parser.add_argument("--dequantize", action="store_true",
                        help="on CUDA, dequantize block-quantized GGUF weights to --dtype at load instead of "
                             "keeping their blocks (more memory; today's quantized mat-vec is slower than bf16)")


def keep_quantized(args) -> bool | None:
    """None lets the loader choose (blocks stay quantized on CUDA); False when --dequantize is given."""
    return False if args.dequantize else None


def dtype_name(dtype: torch.dtype) -> str:
    import torch

    return next(name for name in DTYPES if getattr(torch, name) == dtype)
