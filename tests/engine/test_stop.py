"""Stop strings over streamed deltas: holdback, matches across deltas, overlapping stops, flush."""
from __future__ import annotations

import random

from hf2q.engine.stop import StopStringMatcher


def stream(stops, deltas):
    """Everything emitted (push outputs, then flush if no stop) and whether it stopped."""
    m = StopStringMatcher(stops)
    out = []
    for d in deltas:
        emit, stopped = m.push(d)
        out.append(emit)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_no_stop_strings_means_no_holdback():
    m = StopStringMatcher([])
    assert m.push("Hello") == ("Hello", False)
    assert m.push(" world") == (" world", False)
    assert m.flush() == ""


def test_holds_back_possible_prefix_and_releases_it():
    m = StopStringMatcher(["STOP"])
    assert m.push("abc S") == ("abc ", False)
    assert m.push("T") == ("", False)
    assert m.push("x") == ("STx", False)  # "STx" can no longer start "STOP"
    assert m.push("ST") == ("", False)
    assert m.flush() == "ST"


def test_stop_string_spanning_many_deltas_is_stripped():
    m = StopStringMatcher(["<END>"])
    assert m.push("answer <") == ("answer ", False)
    assert m.push("E") == ("", False)
    assert m.push("N") == ("", False)
    assert m.push("D> trailing") == ("", True)
    assert m.stopped
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_match_inside_one_delta_drops_the_rest():
    assert stream(["\n\n"], ["one\n", "\ntwo"]) == ("one", True)
    assert stream(["x"], ["abxcd"]) == ("ab", True)


def test_holds_back_longest_partial_over_several_stops():
    m = StopStringMatcher(["abcd", "cdx"])
    assert m.push("zzabc") == ("zz", False)  # "abc" is a prefix of "abcd"
    assert m.push("d") == ("", True)


def test_one_stop_a_prefix_of_another_earliest_position_wins():
    assert stream(["ab", "abc"], ["xxabc"]) == ("xx", True)
    assert stream(["abc", "ab"], ["xx", "a", "b", "c"]) == ("xx", True)
    assert stream(["hello world", "world"], ["say hello world"]) == ("say ", True)
    assert stream(["b", "ab"], ["zab"]) == ("z", True)


def test_result_is_independent_of_how_text_is_split():
    rng = random.Random(0)
    alphabet = "ab<>/ "
    stops = ["</a>", "<a", "b b", "a>", "</"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        chars = stream(stops, list(text))
        whole = stream(stops, [text])
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert stream(stops, pieces) == chars == whole
        if not chars[1]:
            assert chars[0] == text
        else:
            assert all(s not in chars[0] for s in stops)
            assert text.startswith(chars[0])


def test_empty_deltas_and_empty_stop_entries():
    m = StopStringMatcher(["", "END"])
    assert m.push("") == ("", False)
    assert m.push("E") == ("", False)
    assert m.push("") == ("", False)
    assert m.push("ND") == ("", True)
