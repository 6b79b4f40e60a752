"""`hf2q convert --mmproj`: the vision tower of an HF Qwen3.5 image-text checkpoint -> llama.cpp's mmproj GGUF.

llama.cpp ships vision as a separate projector file ("clip" architecture, `v.*` and `mm.*` tensors) written by
`convert_hf_to_gguf.py --mmproj`; this writes the same bytes (names, Conv3D patch embedding split into two
Conv2D kernels, types, metadata), so files made here and there are interchangeable.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

from hf2q.checkpoint.convert import ARCHES, _add_general, _Checkpoint, _Job, _Writer, write_gguf

MMPROJ_OUTTYPES = ("f32", "f16")
_MERGER_FC = {"linear_fc1": 0, "linear_fc2": 2}  # llama.cpp numbers the merger's linears as Qwen2-VL's mm.0 / mm.2


def vision_hparams(hf_dir: Path) -> tuple[dict, dict, dict]:
    """(whole config.json, its vision_config, the image processor values) of an image-text checkpoint."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHES or "vision_config" not in config:
        raise ValueError(f"{hf_dir} is not a Qwen3.5 image-text checkpoint (architecture {arch!r}, "
                         f"vision_config {'present' if 'vision_config' in config else 'missing'})")
    processor: dict = {}
    for name, nested in (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor")):
        if (path := hf_dir / name).is_file():
            cfg = json.loads(path.read_text())
            processor |= {**cfg, **cfg.get(nested, {})}
    if "image_mean" not in processor or "image_std" not in processor:
        raise ValueError(f"{hf_dir} has no image_mean / image_std (preprocessor_config.json)")
    return config, config["vision_config"], processor


def _tensor_jobs(ckpt: _Checkpoint, depth: int) -> list[_Job]:
    """The mmproj tensors in llama.cpp's order (checkpoint order; the patch kernel split along time)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, depth)
    patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
    jobs = []
    for src in ckpt.where:
        name = src.replace("model.visual.", "visual.", 1)
        if not name.startswith("visual."):
            continue
        shape = ckpt.shape(src)
        if name == "visual.patch_embed.proj.weight":
            if shape[2] != 2:
                raise ValueError(f"temporal_patch_size must be 2 (llama.cpp's layout), got {shape[2]}")
            for t, suffix in enumerate(("", ".1")):
                jobs.append(_Job(f"{patch}.weight{suffix}", (*shape[:2], *shape[3:]), [src],
                                 lambda ts, t=t: ts[0][:, :, t].contiguous()))
            continue
        if name == "visual.patch_embed.proj.bias":
            new = f"{patch}.bias"
        elif name.startswith("visual.merger."):
            part, tail = name.removeprefix("visual.merger.").split(".", 1)
            if part in _MERGER_FC:
                new = f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_MMPROJ].format(bid=_MERGER_FC[part])}.{tail}"
            elif part == "norm":
                new = f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_POST_NORM]}.{tail}"
            else:
                raise ValueError(f"Unexpected merger tensor {src!r}")
        elif (new := names.get_name(name, try_suffixes=(".weight", ".bias"))) is None:
            raise ValueError(f"No mmproj GGUF name for checkpoint tensor {src!r}")
        jobs.append(_Job(new, shape, [src], lambda ts: ts[0]))
    return jobs


def mmproj_tensor_type(name: str, shape: tuple[int, ...], outtype: str):
    """The GGML type llama.cpp's converter gives this mmproj tensor for `outtype`."""
    Q = gguf.GGMLQuantizationType
    wide = Q.F16 if outtype == "f16" else Q.F32
    if ".patch_embd.weight" in name:
        return wide
    if len(shape) <= 1 or not name.endswith(".weight") or name.startswith("v.position_embd."):
        return Q.F32
    return wide


def _add_vision_keys(w, config: dict, vision: dict, processor: dict, ftype: int, n_blocks: int) -> None:
    """The `clip.*` keys, in llama.cpp's order."""
    text = {**config, **config.get("text_config", {})}
    patch = vision.get("patch_size", 16)
    image_size = vision.get("image_size") or int(vision.get("num_position_embeddings", 2304) ** 0.5 * patch)
    w.add_file_type(ftype)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(text["hidden_size"])
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(n_blocks)
    w.add_vision_head_count(vision["num_heads"])
    w.add_vision_image_mean(processor["image_mean"])
    w.add_vision_image_std(processor["image_std"])
    w.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    w.add_vision_use_gelu(True)
    if vision.get("spatial_merge_size") is not None:
        w.add_vision_spatial_merge_size(int(vision["spatial_merge_size"]))
    w.add_vision_attention_layernorm_eps(config.get("text_config", {}).get("rms_norm_eps", 1e-6))
    deepstack = [False] * n_blocks
    for i in vision.get("deepstack_visual_indexes", []):
        deepstack[i] = True
    if deepstack:
        w.add_vision_is_deepstack_layers(deepstack)


def convert_mmproj(hf_dir, out_path, outtype: str = "f32") -> Path:
    """Write the vision projector GGUF of an HF Qwen3.5 image-text checkpoint; returns the output path."""
    if outtype not in MMPROJ_OUTTYPES:
        raise ValueError(f"--mmproj outtype must be one of {MMPROJ_OUTTYPES}, got {outtype!r}")
    hf_dir, out_path = Path(hf_dir).resolve(), Path(out_path)
    config, vision, processor = vision_hparams(hf_dir)
    if vision.get("deepstack_visual_indexes"):
        raise ValueError("deepstack vision towers (Qwen3-VL) are not supported; Qwen3.5 has none")
    ckpt = _Checkpoint(hf_dir)
    jobs = _tensor_jobs(ckpt, vision["depth"])
    ftype = gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32

    w = _Writer(path=None, arch="clip")
    qtypes = []
    for job in jobs:
        qtypes.append(mmproj_tensor_type(job.name, job.shape, outtype))
        byte_shape = gguf.quant_shape_to_byte_shape(job.shape, qtypes[-1])
        w.add_tensor_info(job.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtypes[-1])
    _add_general(w, hf_dir, gguf.GGUFType.MMPROJ)
    _add_vision_keys(w, config, vision, processor, int(ftype), vision["depth"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return write_gguf(w, jobs, qtypes, ckpt, out_path)
