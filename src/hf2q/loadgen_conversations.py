"""`hf2q bench serve --multi-turn`: each client plays `--requests-per-client` conversations, one after another,
sending turn k with the server's earlier answers appended, the way a chat client does, so a server that retains
prefixes can resume each follow-up from the turn before. The hit rate comes from
`usage.prompt_tokens_details.cached_tokens`.

`--shared-prefix-tokens N` opens every conversation with the same N-token system prompt (a shared history),
so the first turns of different clients can hit too.
"""
from __future__ import annotations

import random
from typing import Optional

import httpx

from hf2q.loadgen_stream import PROMPT_WORDS, RequestResult, send


def shared_prefix(tokens: int, seed: int) -> str:
    """A system prompt of about `tokens` tokens, the same for every client of a run."""
    rng = random.Random(f"shared-{seed}")
    return "".join(rng.choice(PROMPT_WORDS) for _ in range(tokens))


def questions(client: int, turns: int, words: int, seed: int) -> list[str]:
    """Client `client`'s user turns: different per client, so conversations share only the system prompt."""
    rng = random.Random(f"client-{seed}-{client}")
    return ["".join(rng.choice(PROMPT_WORDS) for _ in range(words)) for _ in range(turns)]


async def play(client: httpx.AsyncClient, user_turns: list[str], system: Optional[str], body: dict,
               progress) -> list[RequestResult]:
    """One conversation: each turn's request carries every earlier turn and the server's answers to them."""
    messages = [{"role": "system", "content": system}] if system else []
    results = []
    for turn, text in enumerate(user_turns):
        messages.append({"role": "user", "content": text})
        result = await send(client, "/v1/chat/completions", {**body, "messages": list(messages)})
        result.turn = turn
        results.append(result)
        progress.update(1)
        if result.error is not None:
            break  # the conversation cannot go on without its answer
        messages.append({"role": "assistant", "content": result.text})
    return results
