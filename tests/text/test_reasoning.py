"""ReasoningSplitter: the Qwen3.5 think-block conventions, under every way of chunking the text."""
import random

import pytest

from hf2q.text.reasoning import ReasoningSplitter, partial_suffix, prompt_opens_reasoning


def chunkings(text: str, seed: int = 0, n_random: int = 8):
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def split(text_chunks, starts_in_reasoning: bool, **kw):
    splitter = ReasoningSplitter(starts_in_reasoning, **kw)
    pieces = []
    for chunk in text_chunks:
        pieces += splitter.push(chunk)
    pieces += splitter.flush()
    assert all(text for _, text in pieces), "empty pieces are never emitted"
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content


CASES = [
    # (starts_in_reasoning, generated text, expected reasoning, expected content)
    (True, "Let me think.\nStep 2.\n</think>\n\nThe answer is 4.", "Let me think.\nStep 2.", "The answer is 4."),
    (True, "\nleading newline\n</think>\n\nok", "leading newline", "ok"),
    (False, "The answer is 4.", "", "The answer is 4."),
    (False, "<think>\n\n</think>\n\nHello", "", "Hello"),
    (False, "<think>\nreason\n</think>\n\nHello", "reason", "Hello"),
    (False, "  \n<think>reason</think>Hello", "reason", "Hello"),
    (True, "<think>\nrepeated open\n</think>\n\nx", "repeated open", "x"),
    # unclosed think followed by a tool call: the call is content
    (True, "I should call it.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "</function>\n</tool_call>",
     "I should call it.",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    # `<tool_call>` without `<function=` stays reasoning
    (True, "the <tool_call> tag is how I call tools\n</think>\n\ndone",
     "the <tool_call> tag is how I call tools", "done"),
    (True, "maybe <tool_call>\n</think>\n\ndone", "maybe <tool_call>", "done"),
    # unclosed reasoning at end of generation: all reasoning, trailing whitespace dropped
    (True, "still thinking about it\n\n", "still thinking about it", ""),
    (True, "almost </thi", "almost </thi", ""),
    # text after the first block stays content, tags and all
    (False, "<think>a</think>b <think>c</think>", "a", "b <think>c</think>"),
    (False, "no think here, <think> mid-text", "", "no think here, <think> mid-text"),
    (False, "<thinking is not a tag", "", "<thinking is not a tag"),
    (True, "", "", ""),
    (False, "  ", "", "  "),
    (True, "a  b\n\nc \n</think>\n\n  d  e\n", "a  b\n\nc", "d  e\n"),
]


@pytest.mark.parametrize("starts, text, reasoning, content", CASES)
def test_split_is_chunking_invariant(starts, text, reasoning, content):
    for i, chunks in enumerate(chunkings(text, seed=len(text))):
        assert split(chunks, starts) == (reasoning, content), f"chunking #{i}: {chunks!r}"


def test_tool_call_rule_can_be_turned_off():
    text = "thinking <tool_call>\n<function=f>\n</function>\n</tool_call> more\n</think>\n\nend"
    assert split([text], True, tool_call_ends_reasoning=False) == (
        "thinking <tool_call>\n<function=f>\n</function>\n</tool_call> more", "end")
    assert split(list(text), True)[0] == "thinking"


def test_in_reasoning_tracks_the_close_tag():
    splitter = ReasoningSplitter(True)
    assert splitter.in_reasoning
    splitter.push("abc </th")
    assert splitter.in_reasoning
    splitter.push("ink>")
    assert not splitter.in_reasoning
    off = ReasoningSplitter(False)
    off.push("<think>")
    assert off.in_reasoning


def test_partial_tags_are_held_back_not_lost():
    splitter = ReasoningSplitter(True)
    assert splitter.push("abc</") == [("reasoning", "abc")]
    assert splitter.push("think") == []
    assert splitter.push(">\n\nxyz") == [("content", "xyz")]
    assert splitter.flush() == []


def test_prompt_opens_reasoning():
    on = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt_opens_reasoning(on)
    assert not prompt_opens_reasoning(off)
    assert not prompt_opens_reasoning("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("")


def test_partial_suffix():
    assert partial_suffix("abc</thi", "</think>") == 5
    assert partial_suffix("abc", "</think>") == 0
    assert partial_suffix("</think>", "</think>") == 0  # a complete tag is not partial
