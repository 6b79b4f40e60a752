"""The model's tokenizer, built from the GGUF's `tokenizer.ggml.*` metadata on the `tokenizers` library.

The GGUF is the only source: no side `tokenizer.json`, so the vocabulary can never drift from the weights.
Only the pre-tokenizers we have checked against the model's own encoder are accepted; anything else is
refused by name rather than tokenized slightly wrong.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Any, Iterable, Mapping

from gguf.vocab import bytes_to_unicode
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from hf2q.text.segment_cache import SegmentCache


class TokenType(IntEnum):
    """llama.cpp's `llama_token_type`, as stored in `tokenizer.ggml.token_type`."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SUPPORTED_MODELS = ("gpt2",)  # byte-level BPE

# `tokenizer.ggml.pre` -> the split regex of the original tokenizer.json (llama.cpp's llama-vocab.cpp).
PRE_TOKENIZER_PATTERNS = {
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

# Chat models end a turn with these whatever the GGUF's eos id says; stopping on them by name is safe.
EOS_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>")

_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}
_LONG_TEXT = 1 << 16  # characters; shorter texts encode in well under a millisecond

# Where a message begins in the Qwen3.5 chat format: a special token, split out of the text before
# pre-tokenizing, so a conversation's ids are its messages' ids end to end.
MESSAGE_START = "<|im_start|>"
_SEGMENTED_TEXT = 2048  # characters; shorter texts are encoded whole
_SEGMENT_CACHE_CHARS = 8 << 20
# Texts around a message start whose ids must not depend on being cut there: whitespace on either side,
# special tokens and words next to it, a combining mark after it.
_PROBES = [left + MESSAGE_START + right
           for left in ("", "a", "a\n", "a ", "a\n\n", " \n ", "<|im_end|>\n", "e")
           for right in ("", "user\nb", " b", "\nb", "  \n", "\u0301", MESSAGE_START)]


class TokenizerError(ValueError):
    """GGUF tokenizer metadata this server cannot use; the message says which key and why."""


class Tokenizer:
    """Byte-level BPE tokenizer: text <-> token ids, special-token text encodes as the special id."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: Iterable[str], pre: str,
                 eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None,
                 pad_token_id: int | None = None, add_bos_token: bool = False):
        if pre not in PRE_TOKENIZER_PATTERNS:
            raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(PRE_TOKENIZER_PATTERNS)}")
        if len(token_types) != len(tokens):
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError("tokenizer.ggml.tokens holds duplicate token strings")
        self._tokens = tokens
        self.vocab_size = len(tokens)
        self.control_ids = frozenset(i for i, t in enumerate(token_types) if t == TokenType.CONTROL)
        self.user_defined_ids = frozenset(i for i, t in enumerate(token_types) if t == TokenType.USER_DEFINED)
        self.special_ids = self.control_ids | self.user_defined_ids
        self._tok = self._build(vocab, merges, pre)
        self._check_added_ids()
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        named = (vocab[name] for name in EOS_TOKEN_NAMES if name in vocab)
        self.eos_token_ids = frozenset([*eos_token_ids, *named])
        self._bytes: dict[int, bytes] = {}
        self._segments = SegmentCache(_SEGMENT_CACHE_CHARS) if self._splits_exactly(MESSAGE_START) else None

    def _build(self, vocab: dict[str, int], merges: Iterable[str], pre: str) -> _HFTokenizer:
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right:
                raise TokenizerError(f"malformed entry in tokenizer.ggml.merges: {merge!r}")
            pairs.append((left, right))
        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        # Control tokens are skipped by skip_special_tokens; user-defined ones (e.g. <think>) are kept,
        # as in the source tokenizer. Both match as whole tokens inside text.
        tok.add_special_tokens([AddedToken(self._tokens[i], special=True, normalized=False)
                                for i in sorted(self.control_ids)])
        tok.add_tokens([AddedToken(self._tokens[i], special=False, normalized=False)
                        for i in sorted(self.user_defined_ids)])
        return tok

    def _splits_exactly(self, mark: str) -> bool:
        """Whether every text's ids are the ids of its pieces cut before each `mark`, end to end: `mark` is an
        added token matched as it stands (no stripping, normalising or whole-word rule), no other added token
        can match across such a cut, and the probe texts agree."""
        added = self._tok.get_added_tokens_decoder()
        token = added.get(self._tok.token_to_id(mark))
        if token is None or token.content != mark or token.lstrip or token.rstrip or token.single_word \
                or token.normalized:
            return False
        for other in added.values():
            tails = (other.content[j:] for j in range(1, len(other.content)))
            if other.content != mark and any(t.startswith(mark) or mark.startswith(t) for t in tails):
                return False

        def ids(text: str) -> list[int]:
            return self._tok.encode(text, add_special_tokens=False).ids

        return all(ids(probe) == [i for piece in _pieces(probe, mark) for i in ids(piece)] for probe in _PROBES)

    def _check_added_ids(self) -> None:
        for i in self.special_ids:
            if self._tok.token_to_id(self._tokens[i]) != i:
                raise TokenizerError(f"special token {self._tokens[i]!r} does not keep its id {i}")

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from `GGUFFile(path).metadata`; refuses unknown `tokenizer.ggml.model` / `.pre` values."""
        model = meta.get("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r}; supported: {list(SUPPORTED_MODELS)}")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre"):
            if key not in meta:
                raise TokenizerError(f"GGUF metadata lacks {key}")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if not isinstance(meta[key], list) or not all(isinstance(t, str) for t in meta[key]):
                raise TokenizerError(f"GGUF metadata {key} must be a list of strings")
        for key in ("eos_token_id", "eot_token_id", "bos_token_id", "padding_token_id"):
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TokenizerError(f"GGUF metadata tokenizer.ggml.{key} must be an integer, got {value!r}")
        tokens = list(meta["tokenizer.ggml.tokens"])
        token_types = list(meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens)))
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        return cls(tokens, token_types, meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.pre"],
                   eos_token_ids=(int(i) for i in eos),
                   bos_token_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id")),
                   pad_token_id=_optional_int(meta.get("tokenizer.ggml.padding_token_id")),
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text becomes the special id. BOS is added only when asked for
        (`/tokenize`'s `add_special_tokens`) and the GGUF says the model wants it: prompts never get it here,
        the chat template writes it where the model expects it."""
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        prefix = [self.bos_token_id] if wants_bos else []
        if self._segments is not None and len(text) > _SEGMENTED_TEXT:
            return prefix + self._encode_messages(text)
        if len(text) > _LONG_TEXT:  # the batch call releases the GIL: a server thread keeps answering meanwhile
            return prefix + self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return prefix + self._tok.encode(text, add_special_tokens=False).ids

    def _encode_messages(self, text: str) -> list[int]:
        """`text` cut before each message start; the pieces the cache holds (a follow-up turn's history) are not
        encoded again, the new ones are encoded in one batch call (which releases the GIL)."""
        pieces = _pieces(text, MESSAGE_START)
        held = self._segments.lookup(pieces)
        new = list(dict.fromkeys(p for p in pieces if p not in held))
        if new:
            for piece, encoding in zip(new, self._tok.encode_batch(new, add_special_tokens=False)):
                held[piece] = self._segments.store(piece, encoding.ids)
        ids: list[int] = []
        for piece in pieces:
            ids.extend(held[piece])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. `skip_special_tokens` drops control tokens."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token's vocabulary string (byte-level form for ordinary tokens); None when out of range."""
        return self._tokens[token_id] if 0 <= token_id < self.vocab_size else None

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token contributes to decoded text (possibly part of a UTF-8 character)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            text = self._tokens[token_id]
            if token_id in self.special_ids or any(c not in _BYTE_OF_CHAR for c in text):
                cached = text.encode("utf-8")
            else:
                cached = bytes(_BYTE_OF_CHAR[c] for c in text)
            self._bytes[token_id] = cached
        return cached

    def check_vocab(self, n_embedding_rows: int) -> None:
        """Refuse a vocabulary with ids the embedding table has no row for."""
        if self.vocab_size > n_embedding_rows:
            raise ValueError(f"tokenizer has {self.vocab_size} tokens but the token embedding has only "
                             f"{n_embedding_rows} rows: token ids >= {n_embedding_rows} cannot be embedded")
        bad = [i for i in (self.bos_token_id, self.pad_token_id, *self.eos_token_ids)
               if i is not None and not 0 <= i < n_embedding_rows]
        if bad:
            raise ValueError(f"special token ids {sorted(bad)} are outside the {n_embedding_rows} embedding rows")


def _pieces(text: str, mark: str) -> list[str]:
    """`text` cut just before each occurrence of `mark` (no empty pieces)."""
    first, *rest = text.split(mark)
    return ([first] if first else []) + [mark + piece for piece in rest]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
