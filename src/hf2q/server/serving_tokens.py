"""POST /tokenize, /detokenize and GET /tokenizer_info, as vLLM offers them: what the model sees, without
generating (lm-evaluation-harness tokenizes through them when no local tokenizer is given)."""
from __future__ import annotations

from hf2q.server.errors import bad_request
from hf2q.server.schemas import DetokenizeRequest, TokenizeRequest
from hf2q.server.serving_chat import render_prompt
from hf2q.server.state import ServerState
from hf2q.text.tokenizer import EOS_TOKEN_NAMES


def tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    """{"tokens", "count", "max_model_len"} (+ "token_strs"): a prompt's ids, or a conversation's as chat renders it."""
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = render_prompt(state, req.messages, tools, dict(req.chat_template_kwargs or {}),
                             req.add_generation_prompt)
    else:
        text = req.prompt
    tokenizer = state.model.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    out = {"tokens": ids, "count": len(ids), "max_model_len": state.config.max_model_len}
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    """{"prompt": text} of token ids; an id outside the vocabulary is a 400 naming its position."""
    state.check_model(req.model)
    tokenizer = state.model.tokenizer
    for i, token in enumerate(req.tokens):
        if not 0 <= token < tokenizer.vocab_size:
            raise bad_request(f"token id {token} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
                              param=f"tokens[{i}]")
    return {"prompt": tokenizer.decode(req.tokens)}


def tokenizer_info(state: ServerState) -> dict:
    """The special tokens as text, the chat template and the context limit: what a client needs to tokenize
    through /tokenize as the server does (vLLM's field names; a token the GGUF does not name is null)."""
    tokenizer = state.model.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(int(token_id))

    named_eos = [name for name in EOS_TOKEN_NAMES if tokenizer.token_to_id(name) is not None]
    # the GGUF's eos id (the tokenizer keeps only the set of ids that end a turn); without one, the turn end by name
    eos = text(state.model.metadata.get("tokenizer.ggml.eos_token_id")) or next(iter(named_eos), None)
    return {"tokenizer_class": "GGUF byte-level BPE", "eos_token": eos, "bos_token": text(tokenizer.bos_token_id),
            "pad_token": text(tokenizer.pad_token_id), "add_bos_token": tokenizer.add_bos_token,
            "chat_template": state.model.chat_template.source, "model_max_length": state.config.max_model_len,
            "vocab_size": tokenizer.vocab_size}
