"""IncrementalDetokenizer: whole characters only, and the same final text as a one-shot decode."""
import random

import pytest
from gguf.vocab import bytes_to_unicode

from hf2q.text.detokenizer import IncrementalDetokenizer
from hf2q.text.tokenizer import Tokenizer
from tests.support.tokenizer_dir import tokenizer_gguf_metadata
from tests.text.test_tokenizer import HAND_WRITTEN, generated_strings

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(request):
    return Tokenizer.from_gguf_metadata(tokenizer_gguf_metadata(request))


def stream(tok, ids, skip_special_tokens=False):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces, detok.text


def split_character_ids(tok):
    """Ids of single tokens that hold part of a UTF-8 character, found from the text itself."""
    ids = tok.encode("🦙🤖😶\u200d🌫️ 𝔘𝔫𝔦 龘 ꙮ")
    partial = [i for i in ids if not _is_utf8(tok.token_bytes(i))]
    assert partial, "the sample must split some character across tokens"
    return ids


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_split_characters_never_emit_partial_text(tok):
    ids = split_character_ids(tok)
    pieces, text = stream(tok, ids)
    assert text == tok.decode(ids)
    assert REPLACEMENT not in text
    assert "" in pieces[:-1], "some token only completed a character later"


def byte_token(tok, value: int) -> int:
    """The token made of exactly one byte (every byte-level vocabulary has all 256)."""
    return tok.token_to_id(bytes_to_unicode()[value])


def test_emoji_bytes_one_token_each(tok):
    """A 4-byte emoji fed as four one-byte tokens appears exactly when its last byte arrives."""
    ids = [byte_token(tok, b) for b in "🤖".encode()]
    pieces, _ = stream(tok, ids)
    assert pieces == ["", "", "", "🤖", ""]


def test_cjk_split_then_text(tok):
    ids = [byte_token(tok, b) for b in "漢".encode()] + tok.encode("字 ok")
    pieces, text = stream(tok, ids)
    assert pieces[:3] == ["", "", "漢"] and text == "漢字 ok" == tok.decode(ids)


@pytest.mark.parametrize("skip", [False, True])
def test_matches_one_shot_decode(tok, skip):
    for s in HAND_WRITTEN + generated_strings(200, seed=11):
        ids = tok.encode(s)
        pieces, text = stream(tok, ids, skip_special_tokens=skip)
        assert text == tok.decode(ids, skip_special_tokens=skip), s


def test_random_token_sequences(tok):
    """Arbitrary ids (invalid byte sequences, specials mid-character) still match the one-shot decode."""
    rng = random.Random(5)
    specials = sorted(tok.control_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            pieces, text = stream(tok, ids, skip_special_tokens=skip)
            assert text == tok.decode(ids, skip_special_tokens=skip), ids


def test_invalid_bytes_emitted_once_certain(tok):
    lead = byte_token(tok, 0xF0)
    detok = IncrementalDetokenizer(tok)
    assert detok.push(lead) == ""
    assert detok.push(tok.token_to_id("a")) == REPLACEMENT + "a"
    assert detok.push(lead) == ""
    assert detok.flush() == REPLACEMENT
    assert detok.text == REPLACEMENT + "a" + REPLACEMENT


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nDone 🤖<|im_end|>")
    _, text = stream(tok, ids)
    assert text == "<|im_start|>assistant\n<think>\nhm\n</think>\n\nDone 🤖<|im_end|>"
    _, text = stream(tok, ids, skip_special_tokens=True)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in text


def test_text_grows_with_pushes(tok):
    detok = IncrementalDetokenizer(tok)
    for i in tok.encode("one two three"):
        detok.push(i)
        assert "one".startswith(detok.text) or detok.text.startswith("one")
    assert detok.text == "one two three"
