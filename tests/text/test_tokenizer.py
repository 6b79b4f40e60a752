"""Tokenizer from GGUF metadata: the same ids as the Qwen3.5 reference encoder, lossless round trips."""
import copy
import random
import time
import unicodedata

import pytest

from gguf.vocab import bytes_to_unicode
from tokenizers import AddedToken

from hf2q.text.chat_template import ChatTemplate
from hf2q.text.segment_cache import SegmentCache
from hf2q.text.tokenizer import MESSAGE_START, Tokenizer, TokenizerError, TokenType, _pieces
from tests.support.llama_cpp_sources import SourcesUnavailable, qwen35_chat_template
from tests.support.tokenizer_dir import reference_tokenizer, tokenizer_gguf_metadata

HAND_WRITTEN = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "\r\n", "a", "Hello, world!", " Hello", "hello   world",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "DON'T SHOUT, I'M HERE", "don't won't can't shan't y'all", "3 33 333 3333 33333 333333 3.3 3..3 3...3",
    "1234567890", "π ≈ 3.14159, e ≈ 2.71828", "-1e-10 + 0x1F == 0b1011?", "$12,345.67 (≈ €11k)",
    "你好，世界！", "我想在apple工作1314151天～", "日本語のテキストと カタカナ ひらがな", "한국어 문장입니다.",
    "нещо на Български", "Ελληνικά κείμενα", "עברית מימין לשמאל", "مرحبا بالعالم", "हिन्दी पाठ", "ภาษาไทย",
    "កាន់តែពិសេសអាច😁", "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "👨\u200d👩\u200d👧\u200d👦 family 🏳️\u200d🌈 flag 👍🏽 tone", "e\u0301 vs é (NFC)", "Å Å", "ﬁ ligature",
    "------======= '''''' ```````\"\"\"\"......!!!!!!??????", "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "<div class=\"x\">&amp;</div>",
    "SELECT * FROM t WHERE id = 42;", '{"key": [1, 2.5, true, null], "nested": {"a": "b"}}',
    "https://example.com/path?q=1&r=2#frag", "C:\\Users\\name\\file.txt", "a\u00a0b\u2009c\u3000d",
    "zero\u200bwidth", "tab\tseparated\tvalues\n", "trailing spaces   \n   leading", "    \n    ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<think>\nreasoning\n</think>\n\nanswer",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<tool_response>\n{\"temp\": 21}\n</tool_response>", "text<|endoftext|>more", "<|im_end|><|im_end|>",
    "<think></think>", "< think>", "<|im_end", "im_end|>", "<<|im_start|>>", "<|vision_start|><|image_pad|><|vision_end|>",
    "[PAD248077]", "<|fim_prefix|>def<|fim_suffix|>\n<|fim_middle|>", "\u00ad soft hyphen", "\ufeffBOM",
    "emoji at end 🤖", "🤖", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "ℌ ℍ ℎ", "\x00\x01\x02 control", "x" * 300, "ab" * 200,
    " " * 100, "\n" * 50, "!" * 64,
]

FRAGMENTS = [
    "the", " quick", " brown", "fox", " jumps", "over", "lazy", " dog", "It's", " they're", " we'd", "'ll",
    "42", " 3.14", "2024-01-01", "1,000,000", "你好", "世界", "漢字", "😀", "🤖", "👍🏽", "🇫🇷", "é", "ü", "ß", "ñ",
    "Привет", "مرحبا", "नमस्ते", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "()", "{}", "[]", "=>", "::", "->",
    "def ", "return ", "if ", "else:", "x += 1", "print('hi')", "<", ">", "</", "/>", "&&", "||", "...", "?!",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<function=f>", "<parameter=x>", "\u0301", "\u200d", "\u00a0",
]


def generated_strings(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 20))))
    for _ in range(n // 4):  # arbitrary code points, including rare planes and combining marks
        out.append("".join(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff),
                                           rng.randint(0x3000, 0x9fff), rng.randint(0x1f300, 0x1faff)]))
                           for _ in range(rng.randint(1, 30))))
    return out


@pytest.fixture(scope="module")
def meta(request):
    return tokenizer_gguf_metadata(request)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def ref():
    return reference_tokenizer()


def test_loads_fast(meta):
    start = time.perf_counter()
    Tokenizer.from_gguf_metadata(meta)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("which", ["hand", "generated"])
def test_same_ids_as_reference(tok, ref, which):
    strings = HAND_WRITTEN if which == "hand" else generated_strings(240)
    mismatches = [(s, tok.encode(s), ref.encode(s)) for s in strings if tok.encode(s) != ref.encode(s)]
    assert not mismatches, mismatches[:3]


def test_round_trip(tok):
    for s in HAND_WRITTEN + generated_strings(240, seed=7):
        # NFC is part of encoding, so the round trip returns the normalised text
        assert tok.decode(tok.encode(s)) == unicodedata.normalize("NFC", s)


def test_special_text_is_the_special_id(tok):
    ids = tok.encode("a<|im_end|>b<think>c")
    assert tok.token_to_id("<|im_end|>") in ids and tok.token_to_id("<think>") in ids
    assert tok.encode("<tool_call>") == [tok.token_to_id("<tool_call>")]
    assert all(i in tok.special_ids for i in tok.encode("<|im_start|><|im_end|></think>"))


def test_eos_and_special_sets(tok, meta):
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert {im_end, eot, meta["tokenizer.ggml.eos_token_id"]} <= tok.eos_token_ids
    assert tok.token_to_id("<|im_start|>") not in tok.eos_token_ids
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert tok.id_to_token(im_end) == "<|im_end|>" and tok.id_to_token(tok.vocab_size) is None
    assert tok.token_to_id("no such token anywhere") is None


def test_eot_token_id_joins_eos(meta):
    extra = dict(meta, **{"tokenizer.ggml.eot_token_id": 11})
    assert 11 in Tokenizer.from_gguf_metadata(extra).eos_token_ids


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_user_defined_tokens(meta):
    """Real Qwen3.5 GGUFs store <think>/<tool_call> as user-defined: matched in text, kept on decode."""
    types = list(meta["tokenizer.ggml.token_type"])
    tokens = meta["tokenizer.ggml.tokens"]
    for name in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        types[tokens.index(name)] = TokenType.USER_DEFINED
    tok = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.token_type": types}))
    ids = tok.encode("<think>x</think><|im_end|>")
    assert ids[0] == tokens.index("<think>") and ids[-1] == tokens.index("<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"
    assert tokens.index("<think>") in tok.special_ids and tokens.index("<think>") not in tok.control_ids


def test_add_special_tokens_adds_bos_only_where_the_gguf_asks(tok):
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi")  # Qwen3.5: no BOS
    with_bos = copy.copy(tok)
    with_bos.add_bos_token, with_bos.bos_token_id = True, tok.token_to_id("<|endoftext|>")
    assert with_bos.encode("Hi", add_special_tokens=True) == [with_bos.bos_token_id, *tok.encode("Hi")]
    assert with_bos.encode("Hi") == tok.encode("Hi")  # prompts: the chat template writes BOS where it belongs


def test_token_bytes_concatenate_to_decode(tok):
    for s in generated_strings(60, seed=3):
        ids = tok.encode(s)
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == tok.decode(ids)


@pytest.mark.parametrize("key,value,message", [
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model"),
    ("tokenizer.ggml.model", None, "tokenizer.ggml.model"),
    ("tokenizer.ggml.pre", "llama3", "tokenizer.ggml.pre"),
    ("tokenizer.ggml.token_type", [1, 1], "token_type"),
    ("tokenizer.ggml.merges", ["nospace"], "merges"),
])
def test_refuses_unusable_metadata(meta, key, value, message):
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf_metadata(dict(meta, **{key: value}))


def test_refuses_missing_tokens(meta):
    broken = {k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata(broken)


def test_check_vocab(tok):
    tok.check_vocab(tok.vocab_size)
    tok.check_vocab(tok.vocab_size + 64)
    with pytest.raises(ValueError, match="embedding"):
        tok.check_vocab(tok.vocab_size - 1)


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather — « 日本 »",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat(turns: int, seed: int = 0) -> list[dict]:
    """A long conversation: thinking, tool calls and results, unicode, spaces and newlines at both ends of
    messages, and the literal text of a message start inside content."""
    rng = random.Random(seed)

    def words(n):
        return " ".join(rng.choice(FRAGMENTS[:34] + ["<think>", "</think>", "<tool_call>"]) for _ in range(n))

    messages = [{"role": "system", "content": "  You are terse. Ünïcödé ✓\n\n"}]
    for i in range(turns):
        messages.append({"role": "user", "content": rng.choice([" ", "\n", "", " \n "]) + words(40) +
                         rng.choice([" ", "\n\n", "", f" {MESSAGE_START} ", f"\n{MESSAGE_START}user\nfake"])})
        if i % 3 == 1:
            messages.append({"role": "assistant", "content": "", "reasoning_content": words(10), "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": words(2)}}}]})
            messages.append({"role": "tool", "tool_call_id": "c", "content": f'{{"temp": {i}, "note": "{words(5)}"}}'})
        messages.append({"role": "assistant", "content": words(40) + " \n", "reasoning_content": "\n" + words(15)})
    return messages


@pytest.fixture(scope="module")
def template():
    try:
        return ChatTemplate(qwen35_chat_template(), eos_token="<|im_end|>")
    except SourcesUnavailable as exc:
        pytest.skip(str(exc))


class _Recording:
    """The library tokenizer, recording the texts `encode_batch` is given."""

    def __init__(self, inner):
        self.inner, self.batched = inner, []

    def encode_batch(self, texts, **kwargs):
        self.batched.extend(texts)
        return self.inner.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def recording(tok: Tokenizer, max_chars: int = 8 << 20) -> Tokenizer:
    """`tok` with an empty cache of its own and its library tokenizer wrapped in `_Recording`."""
    spy = copy.copy(tok)
    spy._tok, spy._segments = _Recording(tok._tok), SegmentCache(max_chars)
    return spy


def whole(tok: Tokenizer, text: str) -> list[int]:
    return tok._tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"add_generation_prompt": False},
                                    {"tools": [TOOL]}])
def test_long_chats_encode_as_the_whole_text(tok, template, kwargs):
    """Encoding message by message gives the ids of the whole text, for texts the chat template writes."""
    spy = recording(tok)
    for seed in range(3):
        text = template.render(chat(12, seed), **kwargs)
        assert len(text) > 4096 and text.count(MESSAGE_START) > 20
        assert spy.encode(text) == whole(tok, text)
    assert len(spy._tok.batched) > 60  # the texts went through the piecewise path


def test_long_random_texts_encode_as_the_whole_text(tok):
    rng = random.Random(5)
    spy = recording(tok)
    for _ in range(8):
        text = "".join(rng.choice(FRAGMENTS + [MESSAGE_START] * 8) for _ in range(1500))
        assert spy.encode(text) == whole(tok, text)
    assert spy._tok.batched
    spy.add_bos_token, spy.bos_token_id = True, tok.token_to_id("<|endoftext|>")
    assert spy.encode(text, add_special_tokens=True) == [spy.bos_token_id, *whole(tok, text)]


def test_follow_up_encodes_only_new_messages(tok, template):
    spy = recording(tok)
    history = chat(12)[:-1]
    first = template.render(history)
    follow = template.render([*history, {"role": "assistant", "content": "Sunny."},
                              {"role": "user", "content": "And tomorrow?"}])
    assert spy.encode(first) == whole(tok, first)
    spy._tok.batched.clear()
    assert spy.encode(follow) == whole(tok, follow)
    new = [p for p in _pieces(follow, MESSAGE_START) if p not in _pieces(first, MESSAGE_START)]
    assert len(new) == 2 and spy._tok.batched == new
    spy._tok.batched.clear()
    assert spy.encode(follow) == whole(tok, follow) and not spy._tok.batched
    assert spy.encode("short text <|im_start|>user\nhi") == whole(tok, "short text <|im_start|>user\nhi")


def test_cache_holds_at_most_its_bound(tok, template):
    spy = recording(tok, max_chars=4000)
    text = template.render(chat(12))
    pieces = _pieces(text, MESSAGE_START)
    assert spy.encode(text) == whole(tok, text)
    assert 0 < spy._segments.chars <= 4000 and pieces[0] not in spy._segments and pieces[-1] in spy._segments
    assert spy._segments.chars == sum(len(p) for p in dict.fromkeys(pieces) if p in spy._segments)
    assert spy.encode(text) == whole(tok, text)  # evicted pieces are encoded again


def test_segment_cache_evicts_least_recently_used():
    cache = SegmentCache(max_chars=10)
    cache.store("aaaa", [1])
    cache.store("bbbb", [2])
    assert list(cache.lookup(["aaaa", "zz"])) == ["aaaa"]
    cache.store("cccc", [3])  # over the bound: "bbbb", the least recently used, goes
    assert "bbbb" not in cache and "aaaa" in cache and cache.chars == 8
    assert list(cache.store("x" * 11, [4])) == [4] and len(cache) == 2  # too big to hold


def _tiny_tokenizer(start_type, cls=Tokenizer, extra=()) -> Tokenizer:
    """Byte-level vocabulary with one merge ("Ġ<": a space joins a following "<"), the message start token as
    `start_type` (None: not in the vocabulary) and `extra` user-defined tokens."""
    chars = list(bytes_to_unicode().values())
    tokens, types = chars + ["Ġ<", "<|im_end|>"], [TokenType.NORMAL] * (len(chars) + 1) + [TokenType.CONTROL]
    if start_type is not None:
        tokens, types = tokens + [MESSAGE_START], types + [start_type]
    return cls(tokens + list(extra), types + [TokenType.USER_DEFINED] * len(extra), ["Ġ <"], "qwen35")


class _StripsBefore(Tokenizer):
    """The message start token matched with the whitespace before it, so it cannot be cut out exactly."""

    def _build(self, *args):
        tok = super()._build(*args)
        tok.add_special_tokens([AddedToken(MESSAGE_START, special=True, normalized=False, lstrip=True)])
        return tok


@pytest.mark.parametrize("start_type,cls,extra", [
    (None, Tokenizer, ()), (TokenType.NORMAL, Tokenizer, ()), (TokenType.CONTROL, _StripsBefore, ()),
    (TokenType.CONTROL, Tokenizer, ["Q<|im"]),  # an added token that matches across the cut
])
def test_inexact_message_start_encodes_whole_texts(start_type, cls, extra):
    tok = _tiny_tokenizer(start_type, cls, extra)
    text = "a <|im_start|>user\n b  <|im_start|> xQ<|im_start|>\n" * 100
    assert tok._segments is None and tok.encode(text) == whole(tok, text)
    assert _tiny_tokenizer(TokenType.CONTROL)._segments is not None
