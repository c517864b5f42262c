"""A regular expression and a vocabulary -> the arrays of a token automaton.

Runs in a child process (`python -m blockdiff.structured.index MEMORY PARENT`, a pickled job on
stdin, the pickled arrays on stdout; builds.py), so that a build can be stopped at its time bound
by ending the process, and its memory bounded (RLIMIT_AS) apart from the server's; it imports
numpy, outlines-core and parallel/processes.py, none of which imports torch. A JSON schema's
regex is made here too (`regex_of`), and a regex longer than the job's bound, or a DFA of more
states, is refused (`Refused`).

1. The regex's byte-level DFA, from outlines-core: its `Index` over a vocabulary of the 256 single
   bytes is the DFA's transition table. outlines-core (0.2.14) leaves out a transition that goes on
   from a state where the regex has matched to one where it has not ("1" -> "1.5" of
   `[0-9]+(\\.[0-9]+)?`, a second repetition of `(ab)+`), so the regex is followed by a sentinel
   character, U+10FFFD: nothing matches before it, so every transition is kept, and a state accepts
   exactly where the sentinel's bytes lead to a match.
2. Tokens through the DFA, from every state the tokens reach (a breadth-first search from the
   initial state): the vocabulary's byte strings form a trie, and a chunk of states walks it level
   by level in numpy, one gather per trie node and state: densely for the states that keep most
   tokens alive (inside a JSON string), along the live paths only for the others. Bytes that every
   state treats alike are one class, and tokens spelling the same classes are walked once.
   (outlines-core's own token index walks every token from every state and stores every (state,
   token) pair: 190-198 s for a 20-field schema at 262,144 tokens, against 19 s here;
   docs/benchmarks.md, "Structured outputs".)
3. Atoms: tokens that every state treats alike (the same next state everywhere, or refused
   everywhere), found by hashing each token's (state, next state) pairs as the walk goes. The
   automaton keeps one representative per atom, whose transitions are walked once more: a string
   state that allows almost every token costs its few atoms, not the vocabulary.
4. The fewest tokens from each state to acceptance (for max_tokens), and the states that can still
   get there.
"""

from __future__ import annotations

import pickle
import resource
import sys

import numpy as np

from blockdiff.parallel.processes import exit_with_parent

UNREACHABLE = np.iinfo(np.int64).max // 2
SENTINEL = "\U0010FFFD"  # a private-use character of the last plane


class Refused(Exception):
    """A bound of the build exceeded: its message names the bound."""


def build_index(regex: str, tokens: list[bytes | None], vocab_size: int, max_states: int) -> dict:
    """tokens[i]: the bytes token i spells (None: never allowed). -> initial, final [S], distance [S],
    atom_of [vocab_size], and the atom transitions src, atom, dst. Refused past `max_states` DFA states."""
    table, start, accepting = _byte_dfa(regex, max_states)
    dead = table.shape[0] - 1
    # Bytes that every state treats alike are one class; tokens spelling the same classes are one
    # sequence (all non-ASCII text inside a JSON string, say), walked once.
    # (numbered by first appearance: np.unique over whole columns sorts them as bytes, 35 s at 240k states)
    columns: dict[bytes, int] = {}
    byte_class = np.array([columns.setdefault(table[:, b].tobytes(), len(columns)) for b in range(table.shape[1])])
    # [states + 1, classes], C-contiguous: each walk reads it through a flat view (a copy per walk was quadratic)
    by_class = np.ascontiguousarray(table[:, np.unique(byte_class.reshape(-1), return_index=True)[1]])
    translate = bytes(byte_class.reshape(-1).astype(np.uint8).tolist()) if by_class.shape[1] <= 256 else None
    seq_of_token = np.full(vocab_size, -1, dtype=np.int64)
    seqs: dict[bytes, int] = {}
    for i, t in enumerate(tokens[:vocab_size]):
        if t:
            seq_of_token[i] = seqs.setdefault(t.translate(translate), len(seqs))
    trie = _Trie(list(seqs))
    # Breadth-first over the states the tokens reach, hashing each sequence's (state, next state) pairs.
    sig = np.zeros((len(seqs), len(_PARTS)), dtype=np.float64)
    allowed = np.zeros(len(seqs), dtype=bool)
    order, seen, frontier = [], {start}, [start]
    while frontier:
        todo, frontier = frontier, []
        for a in range(0, len(todo), _STATES_AT_ONCE):
            states = np.array(todo[a : a + _STATES_AT_ONCE], dtype=np.int64)
            src, seq, nxt = trie.walk(by_class, states, dead)
            h = _mix(src.astype(np.uint64) * np.uint64(dead + 1) + nxt.astype(np.uint64))
            for j, shift in enumerate(_PARTS):  # exact sums in float64: 26-bit parts of the hash
                sig[:, j] += np.bincount(seq, weights=((h >> np.uint64(shift)) & np.uint64(_MASK)).astype(np.float64),
                                         minlength=len(seqs))
            allowed[seq] = True
            for q in np.unique(nxt).tolist():
                if q not in seen:
                    seen.add(q)
                    frontier.append(q)
            order.extend(states.tolist())
    seq_atom = np.full(len(seqs), -1, dtype=np.int64)
    if allowed.any():
        _, inverse = np.unique(sig[allowed], axis=0, return_inverse=True)
        seq_atom[allowed] = inverse.reshape(-1)
    atom_of = np.where(seq_of_token >= 0, seq_atom[np.maximum(seq_of_token, 0)], -1)
    atoms = int(atom_of.max(initial=-1)) + 1
    first = np.full(atoms, -1, dtype=np.int64)
    ids = np.flatnonzero(atom_of >= 0)
    first[atom_of[ids][::-1]] = ids[::-1]
    # The representatives' transitions from every state, byte by byte.
    names = np.array(order, dtype=np.int64)
    number = np.full(dead + 1, -1, dtype=np.int64)
    number[names] = np.arange(len(names))
    nxt = np.empty((len(names), atoms), dtype=np.int64)
    for k, t in enumerate(first.tolist()):
        cur = names
        for b in tokens[t]:
            cur = table[cur, b]
        nxt[:, k] = cur
    src, atom = np.nonzero(nxt != dead)
    dst = number[nxt[src, atom]]
    states = len(names)
    final = np.isin(names, accepting)
    pairs = np.unique(src * (states + 1) + dst)  # the distance needs each (state, next state) once
    distance = _distance(final, pairs // (states + 1), pairs % (states + 1))
    live = distance < UNREACHABLE
    keep = live[src] & live[dst]
    return {
        "initial": 0,
        "final": final,
        "distance": distance,
        "atom_of": atom_of.astype(np.int32),
        "src": src[keep].astype(np.int32),
        "atom": atom[keep].astype(np.int32),
        "dst": dst[keep].astype(np.int32),
    }


_PARTS = (0, 26, 52)  # a 64-bit hash as 26-bit parts (the last has 12 bits): sums stay exact in float64
_MASK = (1 << 26) - 1
_STATES_AT_ONCE = 16


def _byte_dfa(regex: str, max_states: int) -> tuple[np.ndarray, int, np.ndarray]:
    """(table [states + 1, 256] int64 with a last, dead row; the initial state; the accepting states)."""
    from outlines_core import Index, Vocabulary

    index = Index(f"(?:{regex}){SENTINEL}", Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    transitions = index.get_transitions()
    names = sorted(set(transitions) | {n for d in transitions.values() for n in d.values()} | {index.get_initial_state()})
    if len(names) > max_states:  # the table, and each walk over it, grows with the states
        raise Refused(f"its automaton has {len(names)} byte states, more than the {max_states} a constraint may have")
    number = {q: k for k, q in enumerate(names)}
    dead = len(names)
    table = np.full((dead + 1, 256), dead, dtype=np.int64)
    for q, d in transitions.items():
        for b, n in d.items():
            if b < 256:
                table[number[q], b] = number[n]
    done = np.zeros(dead + 1, dtype=bool)
    done[[number[f] for f in index.get_final_states()]] = True
    state = np.arange(dead + 1)
    for b in SENTINEL.encode():
        state = table[state, b]
    accepting = np.flatnonzero(done[state][:dead])
    return table, number[index.get_initial_state()], accepting


class _Trie:
    """Byte strings (here: sequences of byte classes) as a trie, its nodes numbered level by level
    in sorted order, so that each level's nodes and each node's children are contiguous: per level,
    each node's parent (in the level above) and last symbol, and the strings ending there."""

    def __init__(self, strings: list[bytes]):
        depth = max(map(len, strings), default=0)
        self.parent, self.symbol, self.term, self.seq = [], [], [], []  # per level 1..depth
        above = {b"": 0}
        by_length = sorted(range(len(strings)), key=lambda i: -len(strings[i]))
        count = len(strings)
        for k in range(1, depth + 1):
            while count and len(strings[by_length[count - 1]]) < k:
                count -= 1
            longer = [strings[i] for i in by_length[:count]]
            level = sorted({t[:k] for t in longer})
            index = {t: j for j, t in enumerate(level)}
            self.parent.append(np.array([above[t[:-1]] for t in level], dtype=np.int64))
            self.symbol.append(np.frombuffer(bytes(t[-1] for t in level), dtype=np.uint8).astype(np.int64))
            ending = [i for i in by_length[:count] if len(strings[i]) == k]
            self.term.append(np.array([index[strings[i]] for i in ending], dtype=np.int64))
            self.seq.append(np.array(ending, dtype=np.int64))
            above = index
        self.depth = depth

    def walk(self, table: np.ndarray, states: np.ndarray, dead: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every string from every one of `states` through `table` [states + 1, symbols]: -> (start
        state, string index, state reached), one row per string a start state allows. States that
        keep most first symbols alive (inside a JSON string, say) walk every node, level by level;
        the others follow only the paths that stay alive."""
        if self.depth == 0 or not len(states):
            return (np.zeros(0, dtype=np.int64),) * 3
        first = table[states][:, self.symbol[0]] != dead
        wide = first.mean(axis=1) >= 0.25
        parts = [self._dense(table, states[wide], dead), self._sparse(table, states[~wide], dead)]
        return tuple(np.concatenate([p[j] for p in parts]) for j in range(3))

    def _dense(self, table: np.ndarray, states: np.ndarray, dead: int):
        out = [[], [], []]
        width = table.shape[1]
        flat = table.reshape(-1)
        for a in range(0, len(states), _DENSE_STATES):
            chunk = states[a : a + _DENSE_STATES]
            cur = chunk[:, None]
            for k in range(self.depth):
                cur = flat[cur[:, self.parent[k]] * width + self.symbol[k]]
                if len(self.term[k]):
                    reached = cur[:, self.term[k]]
                    rows, cols = np.nonzero(reached != dead)
                    out[0].append(chunk[rows])
                    out[1].append(self.seq[k][cols])
                    out[2].append(reached[rows, cols])
        return [np.concatenate(o) if o else np.zeros(0, dtype=np.int64) for o in out]

    def _sparse(self, table: np.ndarray, states: np.ndarray, dead: int):
        out = [[], [], []]
        src, node, cur = states, np.zeros(len(states), dtype=np.int64), states
        for k in range(self.depth):
            if not len(src):
                break
            parent = self.parent[k]
            lo, hi = np.searchsorted(parent, node, "left"), np.searchsorted(parent, node, "right")
            count = hi - lo
            total = int(count.sum())
            if total == 0:
                break
            child = np.repeat(lo - np.cumsum(count) + count, count) + np.arange(total)
            src, cur = np.repeat(src, count), table[np.repeat(cur, count), self.symbol[k][child]]
            alive = cur != dead
            src, node, cur = src[alive], child[alive], cur[alive]
            if len(self.term[k]):
                at = np.full(len(parent), -1, dtype=np.int64)
                at[self.term[k]] = self.seq[k]
                end = at[node]
                done = end >= 0
                out[0].append(src[done])
                out[1].append(end[done])
                out[2].append(cur[done])
        return [np.concatenate(o) if o else np.zeros(0, dtype=np.int64) for o in out]


_DENSE_STATES = 8


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


def regex_of(what: tuple) -> str:
    """("regex", regex) or ("schema", schema JSON, whitespace) -> the regex: a schema's regex is
    built here, under this process's memory limit, since outlines-core writes one alternative per
    way of choosing optional properties (a 275 KB schema gives a regex of hundreds of MB)."""
    if what[0] == "regex":
        return what[1]
    from outlines_core.json_schema import build_regex_from_schema

    return build_regex_from_schema(what[1], what[2])


def _bound_process(memory: int, parent: int) -> None:
    """This process's address space at most `memory` bytes (numpy's and outlines-core's
    allocations fail past it), and its end when the thread that started it ends (Linux): a build
    thread lives as long as the server, so PR_SET_PDEATHSIG alone covers a server killed outright."""
    exit_with_parent(parent, pdeathsig=True, poll=False)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def main() -> None:
    """argv: the memory limit in bytes and the parent's pid. stdin: (what, tokens, vocab_size,
    max_regex_chars, max_states), pickled."""
    _bound_process(int(sys.argv[1]), int(sys.argv[2]))
    what, tokens, vocab_size, max_regex_chars, max_states = pickle.load(sys.stdin.buffer)
    try:
        regex = regex_of(what)
        if len(regex) > max_regex_chars:
            raise Refused(f"its regex has {len(regex)} characters, more than the {max_regex_chars} a constraint may have")
        out = build_index(regex, tokens, vocab_size, max_states)
    except MemoryError:
        sys.stderr.write("MemoryError")
        sys.exit(3)
    except Exception as e:  # the regex or the index: a one-line reason for the parent
        sys.stderr.write(f"{type(e).__name__}: {e}".replace("\n", " ")[:2000])
        sys.exit(2)
    pickle.dump(out, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)


if __name__ == "__main__":
    main()
