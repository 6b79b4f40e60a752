"""POST /tokenize and /detokenize, as vLLM offers them: what the model sees, without generating."""
from __future__ import annotations

from hf2q.server.errors import bad_request
from hf2q.server.schemas import DetokenizeRequest, TokenizeRequest
from hf2q.server.serving_chat import render_prompt
from hf2q.server.state import ServerState


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
    ids = tokenizer.encode(text)
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
