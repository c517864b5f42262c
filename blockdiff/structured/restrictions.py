"""vLLM's vocabulary restrictions as token automata: `allowed_token_ids` (only these tokens may be
generated) and `bad_words` (no generated text holds one of these words' token sequences), committed
by the same constrained commit as structured outputs (diffusion/constrained.py).

vLLM's semantics, kept here:
- allowed_token_ids masks every other token's logit, end tokens included: an EOS or stop token that
  is not allowed is never generated, so only max_tokens (or a stop string) ends the output.
- bad_words: each word is tokenized as it is (its leading spaces stripped) and with one leading space
  (kept when it tokenizes to as many tokens, the first one different; SamplingParams.
  update_from_tokenizer); a one-token word is never generated, a longer word's last token is never
  generated after the output's tokens that match the rest of it. Only generated tokens count, not
  the prompt's. Equivalently: no output contains one of the sequences, which an Aho-Corasick
  automaton over the sequences' tokens decides (its states: the longest suffix of the output that
  is a proper prefix of a sequence).

Every state of these automata accepts (an output may end anywhere), and every state has a way on,
so a restriction alone never finishes an output early, and min_tokens holds (no end token before it). With a structured output, allowed_token_ids
restricts its automaton's tokens (`restricted`), and bad_words make the product of its automaton and
theirs (`product`, bounded in size).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque

import numpy as np

from blockdiff.step import UNREACHABLE, Automaton
from blockdiff.sampling_params import MAX_BAD_WORDS, InvalidParam
from blockdiff.tokenizer import Tokenizer

# vLLM's bounds on one request's bad words after tokenization (MAX_BAD_WORDS sequences) and their tokens.
MAX_BAD_WORD_TOKENS = 1024
# A structured output's automaton times bad_words' is built in the engine's thread: bounded.
MAX_PRODUCT_TRANSITIONS = 2**18
CACHE_SIZE = 64


def bad_words_token_ids(tokenizer: Tokenizer | None, words: list[str]) -> list[list[int]]:
    """The token sequences `words` ban, as vLLM's SamplingParams.update_from_tokenizer finds them."""
    if tokenizer is None:
        raise InvalidParam("bad_words", "bad_words need the checkpoint's tokenizer, and this checkpoint has none")
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise InvalidParam("bad_words", f"bad_words: {word!r} tokenizes to no token")
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(list(ids))
    if len(out) > MAX_BAD_WORDS:
        raise InvalidParam("bad_words", f"bad_words: {len(out)} token sequences after tokenization, more than the "
                                        f"{MAX_BAD_WORDS} allowed")
    total = sum(map(len, out))
    if total > MAX_BAD_WORD_TOKENS:
        raise InvalidParam("bad_words", f"bad_words: {total} tokens after tokenization, more than the "
                                        f"{MAX_BAD_WORD_TOKENS} allowed")
    return out


def vocabulary_automaton(key: str, vocab_size: int, allowed: list[int] | None, banned: list[list[int]],
                         ends: tuple[int, ...]) -> Automaton:
    """The automaton of outputs of `allowed` tokens (None: any) that hold none of the `banned`
    sequences. End tokens (`ends`) are no tokens of it: the caller allows those that may end the
    output (the constrained commit lets them end it in any state, each state accepting)."""
    ok = np.ones(vocab_size, dtype=bool) if allowed is None else np.zeros(vocab_size, dtype=bool)
    if allowed is not None:
        ok[np.asarray(allowed, dtype=np.int64)] = True
    ok[[t for t in ends if 0 <= t < vocab_size]] = False
    if not ok.any():
        raise InvalidParam("allowed_token_ids", "allowed_token_ids holds only end tokens (EOS, stop tokens): nothing "
                                                "could be generated")
    # The trie of the sequences; a node that completes one (or whose suffix does) is banned.
    children: list[dict[int, int]] = [{}]
    bad = [False]
    for seq in banned:
        node = 0
        for t in seq:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = len(children)
                children[node][t] = nxt
                children.append({})
                bad.append(False)
            node = nxt
        bad[node] = True
    alphabet = sorted({t for seq in banned for t in seq if 0 <= t < vocab_size and ok[t]})
    col = {t: k for k, t in enumerate(alphabet)}
    # Aho-Corasick: goto over the alphabet, every other token back to the root.
    n = len(children)
    table = np.zeros((n, len(alphabet)), dtype=np.int64)
    fail = [0] * n
    order = deque()
    for t, child in children[0].items():
        if t in col:
            table[0, col[t]] = child
        order.append(child)
    while order:
        node = order.popleft()
        bad[node] = bad[node] or bad[fail[node]]
        table[node] = table[fail[node]]
        for t, child in children[node].items():
            fail[child] = table[fail[node], col[t]] if t in col else 0
            if t in col:
                table[node, col[t]] = child
            order.append(child)
    # Atoms: tokens that every state treats alike; the tokens outside the alphabet are one.
    if alphabet:
        signatures, atom_of_col = np.unique(table, axis=1, return_inverse=True)
        atom_of_col = atom_of_col.reshape(-1)
    else:
        signatures, atom_of_col = np.zeros((n, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
    other = signatures.shape[1]
    atom_of = np.where(ok, other, -1).astype(np.int32)
    atom_of[np.asarray(alphabet, dtype=np.int64)] = atom_of_col
    has_other = bool((atom_of == other).any())
    edges = {q: [(a, int(signatures[q, a])) for a in range(other) if not bad[signatures[q, a]]]
             + ([(other, 0)] if has_other else []) for q in range(n) if not bad[q]}
    # The states: the trie's nodes that hold no banned sequence, and only those with a way on
    # forever (else an output could reach one and have no token left but an end token, which it may
    # not take before min_tokens, or at all when none is allowed). So an output that could only end
    # right after a token is not generated: bad words that ban every way on after it are contrived.
    live = set(edges)
    while True:
        stuck = {q for q in live if not any(d in live for _, d in edges[q])}
        if not stuck:
            break
        live -= stuck
    if 0 not in live:
        raise InvalidParam("bad_words", "bad_words: every output of the allowed tokens comes to a bad word")
    number = {q: i for i, q in enumerate(sorted(live))}
    src, atom, dst = [], [], []
    for q in sorted(live):
        for a, d in edges[q]:
            if d in live:
                src.append(number[q]), atom.append(a), dst.append(number[d])
    states = len(live)
    return Automaton(key=key, initial=0, final=np.ones(states, dtype=bool), distance=np.zeros(states, dtype=np.int64),
                     atom_of=atom_of, src=np.asarray(src, dtype=np.int32), atom=np.asarray(atom, dtype=np.int32),
                     dst=np.asarray(dst, dtype=np.int32))


def restricted(key: str, a: Automaton, allowed: list[int]) -> Automaton:
    """`a` with only the `allowed` tokens (a structured output under allowed_token_ids): the atoms
    that keep a token, renumbered, their transitions, and each state's distance to acceptance anew."""
    keep = np.zeros(len(a.atom_of), dtype=bool)
    ids = np.asarray([t for t in allowed if t < len(a.atom_of)], dtype=np.int64)
    keep[ids] = True
    atom_of = np.where(keep, a.atom_of, -1)
    used = np.unique(atom_of[atom_of >= 0])
    renumber = np.full(a.num_atoms + 1, -1, dtype=np.int64)
    renumber[used] = np.arange(len(used))
    atom_of = np.where(atom_of >= 0, renumber[atom_of], -1).astype(np.int32)
    t_keep = renumber[a.atom] >= 0
    src, atom, dst = a.src[t_keep], renumber[a.atom[t_keep]].astype(np.int32), a.dst[t_keep]
    return Automaton(key=key, initial=a.initial, final=a.final, distance=_distances(a.final, src, dst),
                     atom_of=atom_of, src=src, atom=atom, dst=dst)


def _distances(final: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Per state, the fewest tokens to an accepting state (UNREACHABLE: none): a breadth-first
    search back from the accepting states."""
    distance = np.where(final, 0, UNREACHABLE).astype(np.int64)
    into: dict[int, list[int]] = {}
    for s, d in zip(src.tolist(), dst.tolist()):
        into.setdefault(d, []).append(s)
    order = deque(np.flatnonzero(final).tolist())
    while order:
        q = order.popleft()
        for s in into.get(q, ()):
            if distance[s] == UNREACHABLE:
                distance[s] = distance[q] + 1
                order.append(s)
    return distance


def product(key: str, a: Automaton, b: Automaton, limit: int = MAX_PRODUCT_TRANSITIONS) -> Automaton:
    """The outputs both `a` (a structured output's) and `b` (a vocabulary restriction's, every
    state accepting) accept: their pairs of states reachable from the initial pair, accepting where
    `a` accepts; an atom per pair of atoms some token has. InvalidParam (bad_words) past `limit`
    transitions."""
    both = (a.atom_of >= 0) & (b.atom_of >= 0)
    pairs, atom_of = np.unique(np.stack((a.atom_of[both], b.atom_of[both]), axis=1), axis=0, return_inverse=True)
    atoms = np.full(len(a.atom_of), -1, dtype=np.int32)
    atoms[both] = atom_of.reshape(-1)
    by_a: dict[int, list[tuple[int, int]]] = {}
    for k, (x, y) in enumerate(pairs.tolist()):
        by_a.setdefault(x, []).append((k, y))
    out_a: dict[int, list[tuple[int, int]]] = {}
    for s, x, d in zip(a.src.tolist(), a.atom.tolist(), a.dst.tolist()):
        out_a.setdefault(s, []).append((x, d))
    table_b = b._table
    number = {(a.initial, b.initial): 0}
    order = deque([(a.initial, b.initial)])
    src, atom, dst = [], [], []
    while order:
        s, t = order.popleft()
        here = number[(s, t)]
        for x, s2 in out_a.get(s, ()):
            for k, y in by_a.get(x, ()):
                t2 = table_b.get((t, y))
                if t2 is None:
                    continue
                there = number.get((s2, t2))
                if there is None:
                    there = number[(s2, t2)] = len(number)
                    order.append((s2, t2))
                src.append(here), atom.append(k), dst.append(there)
                if len(src) > limit:
                    raise InvalidParam("bad_words", f"bad_words with this structured output make an automaton of more "
                                                    f"than {limit} transitions: fewer bad words, or a simpler constraint")
    final = np.zeros(len(number), dtype=bool)
    for (s, _), q in number.items():
        final[q] = a.final[s]
    src_a, dst_a = np.asarray(src, dtype=np.int32), np.asarray(dst, dtype=np.int32)
    return Automaton(key=key, initial=0, final=final, distance=_distances(final, src_a, dst_a), atom_of=atoms,
                     src=src_a, atom=np.asarray(atom, dtype=np.int32), dst=dst_a)


class VocabularyRules:
    """The automata of one engine's vocabulary restrictions, cached by content."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Automaton] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, key: str, build) -> Automaton:
        with self._lock:
            a = self._cache.get(key)
            if a is not None:
                self._cache.move_to_end(key)
                return a
        a = build()
        with self._lock:
            self._cache[key] = a
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return a

    def automaton(self, allowed: list[int] | None, bad_words: list[str] | None,
                  ends: set[int]) -> tuple[Automaton, tuple[int, ...]]:
        """-> (the automaton of the restriction, the end tokens that may end the output)."""
        banned = bad_words_token_ids(self.tokenizer, bad_words) if bad_words else []
        ends = {t for t in ends if allowed is None or t in set(allowed)}
        ends -= {seq[0] for seq in banned if len(seq) == 1}  # a banned one-token word is never generated
        allowed_ids = None if allowed is None else sorted(set(allowed))
        key = _digest("vocabulary", self.vocab_size, allowed_ids, banned, sorted(ends))
        a = self._cached(key, lambda: vocabulary_automaton(key, self.vocab_size, allowed_ids, banned, tuple(ends)))
        return a, tuple(sorted(ends))

    def structured(self, a: Automaton, allowed: list[int] | None, bad_words: list[str] | None,
                   ends: tuple[int, ...]) -> tuple[Automaton, tuple[int, ...]]:
        """A structured output's automaton `a` under allowed_token_ids (its tokens restricted) and
        bad_words (its product with theirs), and the end tokens left to it."""
        field = "allowed_token_ids"
        if allowed is not None:
            allowed_ids = sorted(set(allowed))
            key = _digest("restricted", a.key, allowed_ids)
            a = self._cached(key, lambda: restricted(key, a, allowed_ids))
            ends = tuple(t for t in ends if t in set(allowed_ids))
        if bad_words:
            field = "bad_words"
            banned = bad_words_token_ids(self.tokenizer, bad_words)
            ends = tuple(t for t in ends if [t] not in banned)
            words_key = _digest("vocabulary", self.vocab_size, None, banned, list(ends))
            words = self._cached(words_key, lambda: vocabulary_automaton(words_key, self.vocab_size, None, banned, ends))
            key = _digest("product", a.key, words_key)
            a = self._cached(key, lambda: product(key, a, words))
        if not ends:  # a structured output ends with an end token after its text, in an accepting state
            raise InvalidParam(field, f"{field}: the structured output needs an end token (EOS or a stop token), and "
                                      f"{field} leave none")
        if a.distance[a.initial] >= UNREACHABLE:
            raise InvalidParam(field, f"{field}: no output of the allowed tokens without a bad word satisfies the "
                                      "structured output")
        return a, ends


def _digest(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
