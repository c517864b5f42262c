"""Splitting streamed text at markers that a later delta may still complete."""

from __future__ import annotations


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a marker but not a whole one: text
    that must wait for the next delta before it can be told apart from plain text."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
