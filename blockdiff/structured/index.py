"""A regular expression and a vocabulary -> the arrays of a token automaton, with outlines-core.

Runs as a script in a child process (`python index.py`, a pickled job on stdin, the pickled
arrays on stdout), so that a build can be stopped at its time bound by ending the process; it
imports nothing of blockdiff (whose package would import torch) and only numpy and outlines-core.

outlines-core's `Index` walks every token from every state of the regex's DFA. Its index (0.2.14)
leaves out a token that goes on from a state where the regex has matched to one where it has not
("1" -> "1.5" of `[0-9]+(\\.[0-9]+)?`, a second repetition of `(ab)+`), so the index is built for the
regex followed by a sentinel character that no token spells, plus one token spelling the sentinel:
no state matches before the sentinel, so every transition is kept, and a state accepts exactly
where the sentinel token completes the match. The sentinel's transitions are then dropped.

From the transitions this keeps the states that can still reach acceptance, and groups tokens into atoms:
tokens that every state treats alike (the same next state everywhere, or refused everywhere),
found by hashing each token's (state, next state) pairs. Transitions are then per (state, atom):
a string state that allows almost every token costs its few atoms, not the vocabulary.
"""

from __future__ import annotations

import pickle
import sys

import numpy as np

UNREACHABLE = np.iinfo(np.int64).max // 2
SENTINEL = "\U0010FFFD"  # a private-use character of the last plane: no vocabulary spells it


def build_index(regex: str, tokens: list[bytes | None], vocab_size: int) -> dict:
    """tokens[i]: the bytes token i spells (None: never allowed). -> initial, final [S], distance [S],
    atom_of [vocab_size], and the atom transitions src, atom, dst."""
    from outlines_core import Index, Vocabulary

    sentinel = SENTINEL.encode()
    by_text: dict[bytes, list[int]] = {}
    for i, t in enumerate(tokens):
        if t:
            if sentinel in t:
                raise ValueError("a token spells the sentinel character U+10FFFD")
            by_text.setdefault(t, []).append(i)
    by_text[sentinel] = [vocab_size]
    eos = vocab_size + 1  # outlines-core adds transitions on its EOS id; the requests' own end tokens are handled apart
    index = Index(f"(?:{regex}){SENTINEL}", Vocabulary(eos, by_text))
    transitions = index.get_transitions()
    done = set(index.get_final_states())
    accepting = {q for q, d in transitions.items() if d.get(vocab_size) in done}
    src = np.fromiter((q for q, d in transitions.items() for _ in range(len(d))), np.int64)
    tok = np.fromiter((t for d in transitions.values() for t in d), np.int64)
    dst = np.fromiter((n for d in transitions.values() for n in d.values()), np.int64)
    ordinary = tok < vocab_size
    src, tok, dst = src[ordinary], tok[ordinary], dst[ordinary]
    # The states the ordinary tokens reach from the initial one (not those after the sentinel).
    initial = index.get_initial_state()
    names_all = np.unique(np.concatenate((src, dst, [initial])))
    src, dst = np.searchsorted(names_all, src), np.searchsorted(names_all, dst)
    reached = np.zeros(len(names_all), dtype=bool)
    reached[np.searchsorted(names_all, initial)] = True
    while True:
        more = reached.copy()
        more[dst[reached[src]]] = True
        if np.array_equal(more, reached):
            break
        reached = more
    number = np.cumsum(reached) - 1
    keep = reached[src]
    src, tok, dst = number[src[keep]], tok[keep], number[dst[keep]]
    names = names_all[reached]
    states = len(names)
    final = np.array([q in accepting for q in names.tolist()], dtype=bool)
    pairs = np.unique(src * (states + 1) + dst)  # the distance needs each (state, next state) once
    distance = _distance(final, pairs // (states + 1), pairs % (states + 1))
    live = distance < UNREACHABLE
    keep = live[src] & live[dst]
    src, tok, dst = src[keep], tok[keep], dst[keep]
    # Atoms: tokens with the same (state -> next state) pairs everywhere. Two 64-bit hashes of the
    # pairs, summed per token, name the set (a collision needs both to agree by chance).
    pair = (src * (states + 1) + dst).astype(np.uint64)
    sig = np.zeros((vocab_size, 2), dtype=np.uint64)
    h = _mix(pair)
    np.add.at(sig[:, 0], tok, h)
    np.add.at(sig[:, 1], tok, _mix(h ^ np.uint64(0x5DEECE66D)))
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[tok] = True
    _, atom_of = np.unique(sig, axis=0, return_inverse=True)
    atom_of = atom_of.reshape(-1)
    # Renumber the atoms of allowed tokens 0..A-1; tokens allowed nowhere are -1.
    used = np.unique(atom_of[allowed])
    renumber = np.full(int(atom_of.max(initial=0)) + 1, -1, dtype=np.int64)
    renumber[used] = np.arange(len(used))
    atom_of = np.where(allowed, renumber[atom_of], -1).astype(np.int32)
    # One representative token per atom carries the atom's transitions.
    first = np.full(len(used), -1, dtype=np.int64)
    ids = np.flatnonzero(allowed)
    first[atom_of[ids][::-1]] = ids[::-1]
    is_first = np.zeros(vocab_size, dtype=bool)
    is_first[first] = True
    rep = is_first[tok]
    return {
        "initial": int(number[np.searchsorted(names_all, initial)]),
        "final": final,
        "distance": distance,
        "atom_of": atom_of,
        "src": src[rep].astype(np.int32),
        "atom": atom_of[tok[rep]].astype(np.int32),
        "dst": dst[rep].astype(np.int32),
    }


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _distance(final: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Fewest transitions from each state to an accepting one (UNREACHABLE: none)."""
    d = np.where(final, 0, UNREACHABLE).astype(np.int64)
    while True:
        new = d.copy()
        np.minimum.at(new, src, np.minimum(d[dst] + 1, UNREACHABLE))
        if np.array_equal(new, d):
            return d
        d = new


def main() -> None:
    regex, tokens, vocab_size = pickle.load(sys.stdin.buffer)
    try:
        out = build_index(regex, tokens, vocab_size)
    except Exception as e:  # the regex or the index: a one-line reason for the parent
        sys.stderr.write(f"{type(e).__name__}: {e}".replace("\n", " ")[:2000])
        sys.exit(2)
    pickle.dump(out, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)


if __name__ == "__main__":
    main()
