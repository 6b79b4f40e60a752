"""`hf2q serve --speculative ngram` through HTTP: a reply that repeats itself is drafted and accepted,
streamed text and usage are what the script says, and /metrics counts the drafts (totals, acceptance
length, accepted per position, per proposer)."""
from __future__ import annotations

import re

import httpx
import openai

REPLY = "Thought.\n</think>\n\n" + "one two three four five six seven eight. " * 4


def test_streamed_reply_with_accepted_drafts(server_factory):
    server = server_factory("--max-model-len", "512", "--max-num-seqs", "2", "--speculative", "ngram",
                            "--num-speculative-tokens", "3", "--spec-ngram-min", "2", "--spec-cost-window", "0",
                            "--served-model-name", "m", scripted=[REPLY])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}],
                                            stream=True, stream_options={"include_usage": True})
    content, reasoning, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert (reasoning, content) == ("Thought.", REPLY.split("\n\n", 1)[1])
    metrics = httpx.get(server.url + "/metrics").text

    def value(name):
        return float(re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M).group(1))

    accepted, drafts = value("hf2q_spec_decode_num_accepted_tokens_total"), value("hf2q_spec_decode_num_drafts_total")
    assert accepted >= 10 and usage.completion_tokens > accepted
    # every round in the histogram, every accepted token at its position, all of them the n-gram's
    assert value("hf2q_spec_decode_acceptance_length_count") == drafts
    assert value("hf2q_spec_decode_acceptance_length_sum") == accepted
    per_pos = [value(f'hf2q_spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}') for p in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2] > 0
    assert value('hf2q_spec_decode_proposer_num_accepted_tokens_total{proposer="ngram"}') == accepted
    assert value('hf2q_spec_decode_proposer_num_drafts_total{proposer="ngram"}') == drafts
