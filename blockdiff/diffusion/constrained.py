"""Constrained commits: the best canvas a token automaton accepts, under the last step's distributions.

DINGO's dynamic programme (arXiv 2505.23061) on a canvas of P positions with per-position scores
L[p, v] (the step's shifted logits: log-probabilities up to a per-position constant, which every
path pays once per position and so changes nothing) and a deterministic token automaton δ:

    best[p + 1][δ(q, v)] = max over (q, v) of best[p][q] + L[p, v],   best[0] = {q0: 0}

from the state q0 the previous canvas ended in. An end token (EOS, a stop token) is allowed only in
an accepting state and leads to DONE, where every later position takes any token (its text is
dropped; it scores the position's maximum, 0, so a canvas the automaton accepts as it is commits
unchanged). With R tokens left before max_tokens, the canvas must stop in an accepting state or DONE
at position R when R <= P, else in a state from which acceptance is at most R - P tokens away.

Cost. Tokens that every state treats alike form one *atom* (automaton.atom_of); the transitions of a
state are over atoms, and (state, next state) pairs group them into *classes*. Per canvas, one pass
over the vocabulary takes each atom's maximum score (a scatter-max over [P, local vocab]), the
class maxima follow from the atoms' (a gather and scatter-max over the atom transitions), and the
programme runs over the classes: P vectorised steps over [classes]. String states that allow almost
every token cost their few atoms, not the vocabulary.

Tensor parallelism: each rank takes its shard's atom maxima; one all-reduce (max) of
[canvases, P, atoms + 1] makes them global, and every rank runs the same programme on the same
numbers. The winning tokens are found after it: per position, the lowest id whose score equals
its class's maximum among the class's atoms (one pass, an all-reduce min of [canvases, P]), and
their logprobs (an all-reduce max of [canvases, P]). The logits are never gathered.
"""

from __future__ import annotations


import numpy as np
import torch

from blockdiff.diffusion.vocab_parallel import Distribution, VocabParallel
from blockdiff.step import Automaton, CanvasConstraint

_BIG = torch.iinfo(torch.long).max


class DeviceAutomaton:
    """An Automaton on one rank's device, over its vocabulary shard: atoms of the local rows, the
    classes and the edges of the programme (classes, then one end edge per accepting state, then
    DONE's self-loop; DONE is state `num_states`)."""

    def __init__(self, a: Automaton, vocab: VocabParallel, device: torch.device):
        s, atoms = a.num_states, a.num_atoms
        self.done = s
        ids = vocab.global_ids
        atom_of = torch.from_numpy(a.atom_of.astype(np.int64)).to(device)
        local = torch.where((ids >= 0) & (ids < len(a.atom_of)), atom_of[ids.clamp(0, len(a.atom_of) - 1)], -1)
        self.atoms = atoms
        self.atom_local = torch.where(local < 0, atoms, local)  # column `atoms` collects the tokens no state allows
        pair = a.src.astype(np.int64) * (s + 1) + a.dst
        classes, t_class = np.unique(pair, return_inverse=True)
        self.num_classes = len(classes)
        self.t_atom = torch.from_numpy(a.atom.astype(np.int64)).to(device)
        self.t_class = torch.from_numpy(t_class.astype(np.int64)).to(device)
        finals = np.flatnonzero(a.final)
        src = np.concatenate((classes // (s + 1), finals, [s]))
        dst = np.concatenate((classes % (s + 1), np.full(len(finals), s), [s]))
        self.edge_src = src  # a host copy, for the backtrack
        self.src = torch.from_numpy(src).to(device)
        self.dst = torch.from_numpy(dst).to(device)
        self.num_edges = len(src)
        self.num_final = len(finals)
        # The atoms of each class, for finding the winning token: CSR over classes.
        order = np.argsort(t_class, kind="stable")
        self.class_atoms = a.atom[order].astype(np.int64)
        self.class_start = np.searchsorted(t_class[order], np.arange(self.num_classes + 1))
        self.final = np.append(a.final, False)
        self.distance = np.append(a.distance, 0)


def constrained_tokens(d: Distribution, fallback: torch.Tensor, constraints: list[CanvasConstraint],
                       automaton: DeviceAutomaton, vocab: VocabParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed tokens [B, P] and their logprobs [B, P] of the canvases `constraints` (rows of
    `d`, all of them constrained by `automaton`). `fallback` [B, P]: what a position whose text is
    dropped (after the end token, past max_tokens) keeps. Same result on every rank."""
    device = d.shifted.device
    rows = [c.row for c in constraints]
    b, p = len(rows), d.shifted.shape[1]
    scores = _atom_scores(d, rows, [c.ends for c in constraints], automaton, vocab)  # [B, P, atoms + 2]
    for i, c in enumerate(constraints):
        if c.ends_from > 0:
            scores[i, : c.ends_from, -1] = float("-inf")
    # Edge weights: class maxima, end-token scores, DONE's self-loop (0: the position's maximum).
    atom_max = scores[..., : automaton.atoms]
    classes = atom_max.new_full((b, p, automaton.num_classes), float("-inf"))
    classes.scatter_reduce_(-1, automaton.t_class.expand(b, p, -1), atom_max[..., automaton.t_atom], "amax")
    ends = scores[..., -1:].expand(b, p, automaton.num_final)
    weights = torch.cat((classes, ends, torch.zeros_like(scores[..., :1])), dim=-1)  # [B, P, E]
    steps = min(p, max(c.remaining for c in constraints))
    history, back = _viterbi(weights, steps, [c.state for c in constraints], automaton)
    edges, taken = _backtrack(history, back, constraints, automaton, p)
    tokens = _winning_tokens(d, rows, weights, edges, taken, constraints, automaton, vocab)
    tokens = torch.where(torch.from_numpy(taken).to(device), tokens, fallback)
    return tokens, _logprobs(d, rows, tokens, vocab)


def _atom_scores(d: Distribution, rows: list[int], ends: list[tuple[int, ...]], automaton: DeviceAutomaton,
                 vocab: VocabParallel) -> torch.Tensor:
    """[B, P, atoms + 2]: each atom's maximum score over the whole vocabulary, the no-state column,
    and the best end token's score; one all-reduce under tensor parallelism."""
    p, v = d.shifted.shape[1:]
    out = d.shifted.new_full((len(rows), p, automaton.atoms + 2), float("-inf"))
    index = automaton.atom_local.expand(p, v)
    # A canvas may have no end token (a vocabulary restriction that allows none: only max_tokens
    # ends the output); its end column stays -inf, so no end edge is ever taken.
    width = max(map(len, ends))
    if width:
        end_ids = torch.tensor([list(e) + [0] * (width - len(e)) for e in ends], device=d.shifted.device)
        real = torch.tensor([[k < len(e) for k in range(width)] for e in ends], device=d.shifted.device)
        local, owned = vocab.shard.to_local(end_ids)  # [B, width]
        owned = owned & real
    for i, r in enumerate(rows):
        out[i, :, : automaton.atoms + 1].scatter_reduce_(-1, index, d.shifted[r], "amax")
        if width:
            e = d.shifted[r].index_select(-1, local[i])  # [P, width]
            out[i, :, -1] = torch.where(owned[i], e, float("-inf")).amax(-1)
    if vocab.sharded:
        vocab.group.all_reduce(out, op="max")
    return out


def _viterbi(weights: torch.Tensor, steps: int, starts: list[int],
             automaton: DeviceAutomaton) -> tuple[np.ndarray, np.ndarray]:
    """The programme's `steps` steps from `starts`, on the device; -> on the host, the best score of
    every state after each step [steps + 1, B, states + 1] (-inf: unreachable) and the edge that
    reached it [steps, B, states + 1] (the lowest edge on ties)."""
    b, s1 = weights.shape[0], automaton.done + 1
    device = weights.device
    best = weights.new_full((b, s1), float("-inf"))
    best[torch.arange(b, device=device), torch.tensor(starts, device=device)] = 0.0
    dst = automaton.dst.expand(b, -1)
    none = automaton.num_edges
    edge_ids = torch.arange(none, device=device).expand(b, -1)
    history, pointers = [best], []
    for k in range(steps):
        cand = best[:, automaton.src] + weights[:, k]  # [B, E]
        best = weights.new_full((b, s1), float("-inf")).scatter_reduce_(1, dst, cand, "amax")
        hit = (cand == best.gather(1, dst)) & (cand > float("-inf"))
        pointers.append(torch.full((b, s1), none, device=device).scatter_reduce_(1, dst, torch.where(hit, edge_ids, none),
                                                                                   "amin"))
        history.append(best)
    scores = torch.stack(history).cpu().numpy()
    back = torch.stack(pointers).cpu().numpy() if pointers else np.zeros((0, b, s1), dtype=np.int64)
    return scores, back


def _backtrack(history: np.ndarray, pointers: np.ndarray, constraints: list[CanvasConstraint],
               automaton: DeviceAutomaton, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Per canvas and position, the edge taken (-1 past the canvas's stop) and whether the
    position's token is the programme's (False: the fallback's, whose text is dropped)."""
    edges = np.full((len(constraints), p), -1, dtype=np.int64)
    for b, c in enumerate(constraints):
        stop = min(c.remaining, p)
        if c.remaining <= p:
            allowed = automaton.final.copy()
        else:
            allowed = automaton.distance <= c.remaining - p
        allowed[automaton.done] = True
        score = np.where(allowed, history[stop, b], -np.inf)
        state = int(np.argmax(score))
        if not score[state] > -np.inf:
            raise RuntimeError(f"no canvas satisfies the constraint from state {c.state} with {c.remaining} tokens "
                               "left (the engine admits only requests that can finish)")
        for k in range(stop - 1, -1, -1):
            e = int(pointers[k, b, state])
            edges[b, k] = e
            state = int(automaton.edge_src[e])
        assert state == c.state
    # Positions on DONE's self-loop, and past the stop, keep the fallback's token.
    taken = (edges >= 0) & (edges < automaton.num_edges - 1)
    return edges, taken


def _winning_tokens(d: Distribution, rows: list[int], weights: torch.Tensor, edges: np.ndarray, taken: np.ndarray,
                    constraints: list[CanvasConstraint], automaton: DeviceAutomaton,
                    vocab: VocabParallel) -> torch.Tensor:
    """[B, P] the lowest token id of each taken edge whose score is the edge's weight: among the
    class's atoms for a class edge, among the end tokens for an end edge; one all-reduce (min)."""
    device = d.shifted.device
    b, p = edges.shape
    members = np.zeros((b, p, automaton.atoms + 2), dtype=bool)  # the atoms (or the end column) each position may take
    end_edge = (edges >= automaton.num_classes) & taken
    for i in range(b):
        for k in np.flatnonzero(taken[i] & ~end_edge[i]):
            c = edges[i, k]
            members[i, k, automaton.class_atoms[automaton.class_start[c] : automaton.class_start[c + 1]]] = True
    members_t = torch.from_numpy(members).to(device)
    safe = torch.from_numpy(np.where(taken, edges, 0)).to(device)
    target = weights.gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # [B, P]
    out = torch.full((b, p), _BIG, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        # The tokens scoring the target (one, unless logits tie), then those of the class's atoms.
        pos, row = (d.shifted[r] == target[i].unsqueeze(-1)).nonzero(as_tuple=True)
        ok = members_t[i, pos, automaton.atom_local[row]]
        ids = torch.where(ok, vocab.global_ids[row], _BIG)
        out[i] = torch.full((p,), _BIG, dtype=torch.long, device=device).scatter_reduce_(0, pos, ids, "amin")
        if not constraints[i].ends:  # no end edge could be taken
            continue
        ends = torch.tensor(sorted(constraints[i].ends), device=device)
        local, owned = vocab.shard.to_local(ends)
        e = d.shifted[r].index_select(-1, local)  # [P, ends]
        hit = owned & (e == target[i].unsqueeze(-1))
        first_end = torch.where(hit.any(-1), ends[hit.to(torch.uint8).argmax(-1)], _BIG)
        out[i] = torch.where(torch.from_numpy(end_edge[i]).to(device), first_end, out[i])
    if vocab.sharded:
        out = -vocab.group.all_reduce(-out, op="max")  # min over the ranks
    return out


def _logprobs(d: Distribution, rows: list[int], tokens: torch.Tensor, vocab: VocabParallel) -> torch.Tensor:
    """[B, P] log-probability of each token under its position's distribution."""
    local, owned = vocab.shard.to_local(tokens)
    rows_t = torch.tensor(rows, device=tokens.device)
    picked = torch.stack([d.shifted[r].gather(-1, local[i].unsqueeze(-1)).squeeze(-1) for i, r in enumerate(rows)])
    value = torch.where(owned, picked, float("-inf"))
    if vocab.sharded:
        vocab.group.all_reduce(value, op="max")
    return value - d.log_total[rows_t]
