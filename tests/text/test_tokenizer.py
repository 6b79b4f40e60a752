"""Tokenizer from GGUF metadata: the same ids as the Qwen3.5 reference encoder, lossless round trips."""
import copy
import random
import time
import unicodedata

import pytest

from hf2q.text.tokenizer import Tokenizer, TokenizerError, TokenType
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
