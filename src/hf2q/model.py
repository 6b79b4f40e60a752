"""A loaded model: the network plus everything a server needs from the same GGUF file."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf2q.checkpoint.footprint import check_fits
from hf2q.checkpoint.gguf_file import GGUFError, GGUFFile
from hf2q.config import ModelConfig
from hf2q.models.qwen35 import Qwen35Model


@dataclass
class Model:
    config: ModelConfig
    net: Qwen35Model
    tokenizer: Any
    chat_template: Any
    path: Path
    metadata: dict = field(repr=False, default_factory=dict)
    vision: Any = None  # hf2q.vision.tower.VisionTower when loaded with an mmproj file

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_token_ids

    @property
    def device(self) -> torch.device:
        return self.net.embed.device

    def logits(self, token_ids) -> torch.Tensor:
        return self.net.logits(token_ids)

    def mtp_logits(self, token_ids) -> torch.Tensor:
        return self.net.mtp_logits(token_ids)

    @torch.inference_mode()
    def image_logits(self, token_ids, images) -> torch.Tensor:
        """Logits for every position of one prompt with images, without a cache: [n, vocab] fp32."""
        from hf2q.forward import ForwardBatch
        from hf2q.vision.prompt import prompt_inputs

        embeds, positions, _ = prompt_inputs(self, list(token_ids), list(images))
        batch = ForwardBatch.single(token_ids, device=self.device)
        batch.positions = positions
        return self.net.compute_logits(self.net(batch, input_embeds=embeds))


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         chat_template: str | Path | None = None, with_mtp: bool = True,
         keep_quantized: bool | None = None, mmproj: str | Path | None = None) -> Model:
    """Load a Qwen3.5 / 3.6 GGUF file (llama.cpp's layout). Raises GGUFError / ConfigError on bad input.

    keep_quantized: None keeps block-quantized weights as their blocks on CUDA (memory, decode bandwidth)
    and dequantizes them to exact fp32 values elsewhere. mmproj: llama.cpp's vision projector file for the
    model's vision tower (`checkpoint.mmproj.find_mmproj` finds one beside the model)."""
    from hf2q.checkpoint.loader import build_model
    from hf2q.text.chat_template import ChatTemplate
    from hf2q.text.tokenizer import Tokenizer

    gguf = GGUFFile(path)
    gguf.check_types()
    cfg = ModelConfig.from_gguf_metadata(gguf.metadata)
    if keep_quantized is None:
        keep_quantized = torch.device(device).type == "cuda"
    check_fits(gguf, cfg.num_layers, torch.device(device), dtype, keep_quantized, with_mtp)
    # Building a 248k-token BPE takes seconds; it runs beside the weight copies, which mostly wait on I/O.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer_built = pool.submit(Tokenizer.from_gguf_metadata, gguf.metadata)
        net = build_model(gguf, cfg, device=device, dtype=dtype, with_mtp=with_mtp, keep_quantized=keep_quantized)
        tokenizer = tokenizer_built.result()
    tokenizer.check_vocab(net.config.vocab_size)
    if chat_template is not None:
        template = ChatTemplate.from_file(chat_template)
    else:
        template = ChatTemplate.from_gguf_metadata(gguf.metadata)
    vision = None
    if mmproj is not None:
        from hf2q.checkpoint.mmproj import load_mmproj
        from hf2q.vision.tower import VisionTower

        projector = load_mmproj(mmproj)
        if projector.config.out_hidden_size != net.config.hidden_size:
            raise GGUFError(f"{mmproj}: the projector makes {projector.config.out_hidden_size}-wide tokens but "
                            f"the model's hidden size is {net.config.hidden_size}")
        vision = VisionTower.from_mmproj(projector, device=device, dtype=dtype)
    return Model(net.config, net, tokenizer, template, Path(path), gguf.metadata, vision)
