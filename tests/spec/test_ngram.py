"""The n-gram (prompt lookup) proposer: longest suffix first, newest occurrence first, verified tokens only."""
from __future__ import annotations

import pytest

from hf2q.spec import SpecConfig, TokenView
from hf2q.spec.ngram import NgramProposer


def test_proposes_what_followed_the_newest_occurrence():
    p = NgramProposer(min_n=2, max_n=4)
    #            0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2]
    assert p.propose(history, 3) == [3, 5, 1]  # [1, 2] ends at 6 (newest) and at 1


def test_longer_match_beats_newer_one():
    p = NgramProposer(min_n=2, max_n=4)
    history = [7, 1, 2, 30, 31, 8, 1, 2, 40, 7, 1, 2]
    assert p.propose(history, 2) == [30, 31]  # [7, 1, 2] matches only the older occurrence


def test_no_match_and_short_history():
    p = NgramProposer(min_n=2, max_n=3)
    assert p.propose([5], 3) == []
    assert p.propose([5, 6, 7, 8], 3) == []
    assert p.propose([5, 6, 7, 8], 0) == []


def test_continuation_stops_at_the_end_of_the_history():
    p = NgramProposer(min_n=1, max_n=2)
    assert p.propose([4, 4, 4], 3) == [4]  # [4, 4] ends at 1; only position 2 follows it


def test_incremental_index_agrees_with_a_fresh_one():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2, 3, 1, 2]
    inc = NgramProposer(min_n=2, max_n=5)
    for n in range(1, len(seq) + 1):
        assert inc.propose(seq[:n], 3) == NgramProposer(2, 5).propose(seq[:n], 3), n
    with pytest.raises(ValueError):
        inc.propose(seq[:3], 3)


def test_token_view_reads_prompt_then_output():
    prompt, output = [1, 2, 3], [4, 5]
    view = TokenView(prompt, output)
    assert len(view) == 5 and list(view) == [1, 2, 3, 4, 5] and view[-1] == 5 and view[2:4] == [3, 4]
    output.append(6)
    assert len(view) == 6 and view[5] == 6


def test_config_validates():
    assert not SpecConfig().enabled and SpecConfig(method="ngram").enabled
    for bad in (dict(method="mtp?"), dict(num_tokens=0), dict(ngram_min=3, ngram_max=2), dict(max_batch=0),
                dict(cost_window=-1)):
        with pytest.raises(ValueError):
            SpecConfig(**bad)


@pytest.mark.parametrize("min_n", [1, 2, 3])
def test_no_proposal_after_one_more_token_where_none_may_come(min_n):
    """`may_propose_after_one_more` is False only where no next token whatever gives a proposal (what lets a
    step be queued ahead of the host); it is not always True either."""
    import random

    rng = random.Random(min_n)
    outcomes = set()
    for _ in range(300):
        history = [rng.randrange(4) for _ in range(rng.randrange(12))]
        p = NgramProposer(min_n, 4)
        may = p.may_propose_after_one_more(history)
        outcomes.add(may)
        if not may:
            for x in range(5):  # every token of the alphabet, and one never seen
                assert NgramProposer(min_n, 4).propose(history + [x], 3) == [], (history, x)
        # incremental: the same proposer goes on proposing as a fresh one would
        assert p.propose(history + [0], 3) == NgramProposer(min_n, 4).propose(history + [0], 3)
    assert outcomes == {True, False}, outcomes
