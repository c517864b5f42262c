"""The per-client round robin (blockdiff/fairness.py) that the preprocessing and build pools share."""

from __future__ import annotations

import pytest

from blockdiff.fairness import RoundRobin


def test_clients_take_turns_whatever_they_queued():
    queue = RoundRobin()
    for i in range(3):
        queue.push("a", f"a{i}")
    queue.push("b", "b0")
    queue.push("c", "c0")
    queue.push("c", "c1")
    assert [queue.pop() for _ in range(6)] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert not queue
    with pytest.raises(IndexError):
        queue.pop()


def test_a_newcomer_goes_first_only_where_asked():
    for first, want in ((False, ["a0", "b0", "a1"]), (True, ["b0", "a0", "a1"])):
        queue = RoundRobin(newcomers_first=first)
        queue.push("a", "a0")
        queue.push("a", "a1")
        queue.push("b", "b0")
        assert [queue.pop() for _ in range(3)] == want, first


def test_removed_and_drained_items_are_gone():
    queue = RoundRobin()
    queue.push("a", 1)
    queue.push("b", 2)
    queue.push("b", 3)
    queue.remove("a", 1)
    queue.remove("a", 99)  # not queued: nothing happens
    assert queue.drain() == [2, 3] and not queue
