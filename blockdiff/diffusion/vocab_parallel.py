"""Statistics of a distribution whose logits are split over ranks by vocabulary.

Every function works on this rank's logits [..., local_rows] and returns full-vocabulary answers
using collectives over [...]-sized statistics only: the max, Σexp and Σexp·(x - max) give log Z
and the entropy; argmax and sampling reduce per-rank candidates. With one rank there is no
collective and no masking: the same code is the plain single-device computation.

Memory: the logits are shifted in place and are the only [..., vocabulary] tensor the sampler keeps
beyond its workspace. exp(x - max) exists only a tile of positions at a time (`workspace_bytes`
bounds the tile), so the sampler's extra memory does not grow with the batch. The statistics run
their tiles last to first, so the tile buffer ends holding the first tile's exp, which the
self-conditioning product takes as it is (`Distribution.probs`) before it reuses the buffer for the
other tiles: where one tile covers the step, the exp is computed once, and never more than one
tile of it is held. The tile count is a Python int fixed by the shapes, every tile runs the same ops
on its rows, and the results do not depend on the tiling.

Kernels: the passes over a shard's logits (`ReferenceKernels` here: torch ops, the exact CPU
reference; Triton kernels for CUDA in diffusion/sampler_kernels.py) are the sampler's seam.
VocabParallel holds the collectives, the bisections and the tiling, and calls one backend's passes
in the same order on one rank and on many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from blockdiff.config import LOGPROBS_MODES
from blockdiff.ops.sampler_weights import weights_exp
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard

CHUNK = 128  # argmax and inverse-CDF sampling search per-chunk statistics first, then one chunk
# Without a budget, the sampler's workspace is this share of the device's free memory at start...
_FREE_MEMORY_SHARE = 8
_MAX_DEFAULT_WORKSPACE = 2**30  # ...at most this: larger tiles no longer run faster


def workspace_bytes(memory_gb: float | None, device: torch.device) -> int:
    """The sampler's workspace: `memory_gb` (GB, 10^9 bytes), else a share of the free memory."""
    if memory_gb is not None:
        return int(memory_gb * 1e9)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(_MAX_DEFAULT_WORKSPACE, free // _FREE_MEMORY_SHARE)


@dataclass
class Distribution:
    shifted: torch.Tensor  # [..., local_rows] x - max: log-probabilities up to log_z below; exp() of
    # it are the unnormalised local probabilities, recomputed a tile at a time where needed
    chunk_max: torch.Tensor  # [..., chunks] maxima of `shifted` per chunk: 0 where the max is
    chunk_cumsum: torch.Tensor  # [..., chunks] cumulative sums of `exp` per chunk
    rank_bounds: torch.Tensor | None  # [ranks + 1, ...] Σ exp over the ranks before each (sharded)
    total: torch.Tensor  # [...] Σ exp over the whole vocabulary
    entropy: torch.Tensor  # [...]
    max: torch.Tensor  # [..., 1] the max of the logits over the whole vocabulary, as `shifted` was shifted by
    # [..., 1]-broadcastable, what the model's logits were divided by before (None: 1); the statistics
    # above are those of the divided logits
    temperature: torch.Tensor | None
    # [first tile's positions, local_rows] exp(shifted) of the first positions, in the tile buffer
    # that the self-conditioning product reuses (None once it has: the buffer holds other rows then)
    probs: torch.Tensor | None = None

    @property
    def local_sum(self) -> torch.Tensor:
        """[...] Σ exp over this rank's rows: the total the inverse-CDF search runs over."""
        return self.chunk_cumsum[..., -1]

    @property
    def log_total(self) -> torch.Tensor:
        return self.total.log()


@dataclass
class Draw:
    """What the candidate draw runs over: the weights exp(shifted), cut to 0 below `threshold` where
    top-k, top-p or min-p restrict it (None: the whole distribution), their cumulative sums per chunk,
    the rank bounds and the total."""

    threshold: torch.Tensor | None  # [...] on exp(shifted); a token is kept where its weight >= it
    chunk_cumsum: torch.Tensor
    rank_bounds: torch.Tensor | None
    total: torch.Tensor


_ONE_BITS = 0x3F800000  # float32 1.0 as an int32: weights exp(shifted) lie in [0, 1], their bits in [0, this]
_BISECTIONS = 31  # halvings of [0, _ONE_BITS + 1): enough to land on one float32 exactly


class ReferenceKernels:
    """The sampler's passes over this rank's logits as torch ops: the exact reference, on any device.
    `weights` are what the top-k/top-p/min-p bisections count and add: exp(shifted) of a tile."""

    name = "reference"
    restrict_bytes = 9  # per value of a restricted tile: its weights, a float32 and a bool temporary
    search_ways, search_steps = 2, _BISECTIONS  # bisection: one threshold per pass over a tile

    def chunk_max(self, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """[..., chunks] maxima per chunk of x, its `padding` columns first set to -1e30 in place."""
        if padding is not None:
            x.masked_fill_(padding, -1e30)  # finite: exp gives 0 and 0 * x stays 0
        return per_chunk(x, torch.amax)

    def exp_statistics(self, x: torch.Tensor, m: torch.Tensor,
                       tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x shifted in place by m, cumulative chunk sums of its exp, Σexp·y, exp of the first
        positions kept for the self-conditioning product or None): `exp_statistics` below."""
        return exp_statistics(x, m, tile)

    def first_argmax(self, y: torch.Tensor, chunk_max: torch.Tensor) -> torch.Tensor:
        return first_argmax(y, chunk_max)

    def inverse_cdf(self, y: torch.Tensor, cum: torch.Tensor, target: torch.Tensor,
                    threshold: torch.Tensor | None) -> torch.Tensor:
        return inverse_cdf(y, cum, target, threshold)

    def weights(self, y: torch.Tensor) -> torch.Tensor:
        return weights_exp(y)

    def count_at_least(self, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[positions, thresholds] float32 count of the weights >= each threshold t [positions, thresholds]."""
        return (w.unsqueeze(1) >= t.unsqueeze(-1)).sum(-1, dtype=torch.float32)

    def at_least(self, w: torch.Tensor, floor: torch.Tensor):
        """The weights >= floor [positions] (the others 0), which `mass_above` adds up."""
        return torch.where(w >= floor.unsqueeze(-1), w, 0.0)

    def mass_above(self, kept, t: torch.Tensor | None) -> torch.Tensor:
        """[positions, thresholds] Σ of the `at_least` weights > each t [positions, thresholds]
        (thresholds >= 0, where a weight cut to 0 is never above); t None: [positions] Σ of them all."""
        return kept.sum(-1) if t is None else torch.where(kept.unsqueeze(1) > t.unsqueeze(-1), kept.unsqueeze(1), 0.0).sum(-1)

    def kept_cumsum(self, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[positions, chunks] the cumulative chunk sums of the weights >= t."""
        return per_chunk(torch.where(w >= t.unsqueeze(-1), w, 0.0), torch.sum).cumsum(-1)

    def probs_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the self-conditioning probabilities are made in for a model of `dtype`."""
        return torch.float32

    def exp_rows(self, flat: torch.Tensor, start: int, index: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """out = exp(flat[index]) (None: the rows from `start` on that fit out)."""
        if index is None:
            return weights_exp(flat[start : start + out.shape[0]], out=out)
        return weights_exp(torch.index_select(flat, 0, index, out=out), out=out)

    def cumsum(self, x: torch.Tensor) -> torch.Tensor:
        """Running float32 sums along the last dimension (CUDA's torch.cumsum of floats is not
        deterministic: the Triton backend scans in a fixed order)."""
        return torch.cumsum(x, dim=-1)

    def gather(self, y: torch.Tensor, local: torch.Tensor, owned: torch.Tensor | None) -> torch.Tensor:
        """[...] y at the columns `local` [...] where `owned` (None: everywhere), else 0."""
        value = y.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        return value if owned is None else torch.where(owned, value, 0.0)

    def scaled_exp_sum(self, flat: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[rows] Σ exp(scale · flat[index]) per row of flat [positions, local vocab], for the
        positions `index` [rows] and their `scale` [rows]: a [rows, local vocab] temporary."""
        scaled = torch.index_select(flat, 0, index).mul_(scale.unsqueeze(-1))
        return weights_exp(scaled, out=scaled).sum(-1)


class VocabParallel:
    """The vocabulary layout of this rank and the collectives over it."""

    def __init__(self, shard: VocabShard, group: TPGroup, device: torch.device | str = "cpu",
                 workspace_bytes: int | None = None, kernels: ReferenceKernels | None = None,
                 logprobs_mode: str = LOGPROBS_MODES[0]):
        """kernels: the passes over the shard's logits (sampler_kernels.sampler_kernels); None: the
        reference. logprobs_mode: what `reported` turns logprobs into (EngineConfig.logprobs_mode)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs mode {logprobs_mode!r}: choose one of {', '.join(LOGPROBS_MODES)}")
        self.logprobs_mode = logprobs_mode
        self.kernels = kernels or ReferenceKernels()
        self.shard = shard
        self.group = group
        self.sharded = group.size > 1
        self.workspace_bytes = workspace_bytes  # the sampler's temporaries per tile; None: one tile
        # From the shard's sizes, not its rows: no device read at start-up either.
        full = shard.num_org == shard.org_rows and shard.num_added == shard.added_rows
        self.padding = None if full else ~shard.valid_rows(device)
        self.global_ids = shard.global_ids(device)

    def distribution(self, x: torch.Tensor, temperature: torch.Tensor | None = None) -> Distribution:
        """softmax statistics of logits x (float32, modified in place into x / temperature - max)
        divided by `temperature` ([..., 1]-broadcastable; None: as they are)."""
        if temperature is not None:
            x.div_(temperature)
        # The vocabulary is reduced per chunk, once for the maxima and once for the sums, which
        # argmax and sampling reuse to scan a single chunk each.
        chunk_max = self.kernels.chunk_max(x, self.padding)
        m = chunk_max.amax(dim=-1, keepdim=True)
        if self.sharded:
            self.group.all_reduce(m, op="max")
        y, cum, dot, probs = self.kernels.exp_statistics(x, m, self.exp_tile(x))
        local_sum = cum[..., -1]
        bounds = None
        if self.sharded:
            # Gathered rather than all-reduced: every rank adds the same rows in the same order, so
            # all hold the same total, and sampling cuts it at the same rank bounds.
            sums, dots = self.group.all_gather(torch.stack((local_sum, dot))).unbind(1)
            bounds = rank_bounds(sums)
            dot = dots.sum(0)
        total = local_sum if bounds is None else bounds[-1]
        entropy = total.log() - dot / total
        return Distribution(y, chunk_max.sub_(m), cum, bounds, total, entropy, m, temperature, probs)

    def tile_positions(self, x: torch.Tensor, bytes_per_value: int) -> int:
        """Positions per tile such that a [tile, local vocab] temporary of `bytes_per_value` per
        entry fits the workspace (at least one position): a Python int from the shapes alone."""
        positions = x[..., 0].numel()
        if self.workspace_bytes is None or bytes_per_value == 0:
            return max(1, positions)
        return max(1, min(positions, self.workspace_bytes // (bytes_per_value * x.shape[-1])))

    def exp_tile(self, x: torch.Tensor) -> int:
        """Positions per tile of exp(shifted): its float32 buffer and, beside it, the probabilities
        as the model's dtype (up to 4 bytes more) in the self-conditioning product."""
        return self.tile_positions(x, 8)

    def argmax(self, d: Distribution) -> torch.Tensor:
        """Global token ids of the maxima (ties to the lowest id, like torch.argmax); sharded, in
        one collective."""
        argmax = self.kernels.first_argmax(d.shifted, d.chunk_max)
        if not self.sharded:
            return argmax
        return -self.group.all_reduce(-self._argmax_candidate(d, argmax), op="max")

    def _argmax_candidate(self, d: Distribution, argmax: torch.Tensor) -> torch.Tensor:
        # Shifted by the global max, the maximum is exactly 0 where it is: a rank's candidate is its
        # first such token, and the lowest candidate id wins.
        return torch.where(d.chunk_max.amax(dim=-1) == 0, self.global_ids[argmax], torch.iinfo(torch.long).max)

    def argmax_and_sample(self, d: Distribution, u: torch.Tensor, draw: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`argmax(d)` and one token per position drawn by inverse CDF for u ~ U[0, 1) [...] from
        `draw` (None: the whole distribution); sharded, in one collective for both."""
        argmax = self.kernels.first_argmax(d.shifted, d.chunk_max)
        draw = draw or Draw(None, d.chunk_cumsum, d.rank_bounds, d.total)
        # The target is cut from the total of the very sums the search runs over: any other sum of
        # the same weights can round above them and send the search past the last token with mass.
        if not self.sharded:
            return argmax, self.kernels.inverse_cdf(d.shifted, draw.chunk_cumsum, u.to(draw.total.dtype) * draw.total, draw.threshold)
        candidate = self._argmax_candidate(d, argmax)
        # Every rank cuts [0, total) at the same rank bounds, so exactly one rank owns each target.
        bounds, r = draw.rank_bounds, self.group.rank
        target = u.to(bounds.dtype) * bounds[-1]
        mine = (target >= bounds[r]) & (target < bounds[r + 1])
        # A u just below 1 can round the target onto the total: the last rank with mass takes it.
        ranks = torch.arange(self.group.size, device=bounds.device).view(-1, *([1] * target.dim()))
        mine |= (target >= bounds[-1]) & (torch.where(bounds[1:] > bounds[:-1], ranks, -1).amax(0) == r)
        local = self.kernels.inverse_cdf(d.shifted, draw.chunk_cumsum, target - bounds[r], draw.threshold)
        sample = torch.where(mine, self.global_ids[local], -1)
        both = self.group.all_reduce(torch.stack((-candidate, sample)), op="max")
        return -both[0], both[1]

    def restricted_draw(self, d: Distribution, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> Draw:
        """The draw over the tokens that min-p, then top-k, then top-p (over what min-p and top-k
        keep) leave, as vLLM applies them, for per-canvas top_k (<= 0: off), top_p (1: off) and
        min_p (0: off) [canvases]. Each cut is a threshold on the weights e = exp(shifted) (the
        most likely token has e = 1, so min-p is e >= min_p); top-k's and top-p's are found exactly
        by bisection on the float32 bits of the threshold, each step counting tokens or adding
        weights over the whole vocabulary (gathered from every rank and added in rank order, so all
        ranks take the same branch). A fixed number of steps: no data-dependent control flow."""
        v, cl = d.shifted.shape[-1], d.shifted.shape[1]
        flat = d.shifted.view(-1, v)
        per_position = [x.repeat_interleave(cl) for x in (top_k.float(), top_p, min_p)]
        threshold = flat.new_empty(flat.shape[0])
        cum = flat.new_empty(flat.shape[0], d.chunk_cumsum.shape[-1])
        tile = self.tile_positions(d.shifted, self.kernels.restrict_bytes)
        for a in range(0, flat.shape[0], tile):
            k, p, lowest = (x[a : a + tile] for x in per_position)
            e = self.kernels.weights(flat[a : a + tile])
            t = torch.maximum(lowest, torch.where(k > 0, self._kth_largest(e, k), 0.0))
            kept_total = self._global_sum(self.kernels.mass_above(self.kernels.at_least(e, t), None))
            t = torch.where(p < 1, torch.maximum(t, self._top_p_threshold(e, t, p * kept_total)), t)
            threshold[a : a + tile] = t
            cum[a : a + tile] = self.kernels.kept_cumsum(e, t)
            del e  # before the next tile's exp
        lead = d.shifted.shape[:-1]
        cum = cum.view(*lead, -1)
        local_sum, bounds = cum[..., -1], None
        if self.sharded:
            bounds = rank_bounds(self.group.all_gather(local_sum))
        return Draw(threshold.view(lead), cum, bounds, local_sum if bounds is None else bounds[-1])

    def _global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks in rank order: the same bits on every rank."""
        return self.group.all_gather(x).sum(0) if self.sharded else x

    def _search(self, e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, ok_below: bool, value) -> tuple[torch.Tensor, torch.Tensor]:
        """Narrow [lo, hi) (float32 bits, [positions]) around the point where ok = value(e, t)
        changes, `ways - 1` thresholds a pass (the backend's `search_ways`, `search_steps`): ok holds
        below it (`ok_below`) or above it. The answer is the one exact float, whatever the ways."""
        ways, steps = self.kernels.search_ways, self.kernels.search_steps
        parts = torch.arange(1, ways, device=e.device)
        lo, hi = lo.long(), hi.long()
        for _ in range(steps):
            mids = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * parts // ways
            ok = value(mids.to(torch.int32).view(torch.float32))
            below, above = (ok, ok.logical_not()) if ok_below else (ok.logical_not(), ok)
            lo = torch.where(below, mids, lo.unsqueeze(-1)).amax(-1)
            hi = torch.where(above, mids, hi.unsqueeze(-1)).amin(-1)
        return lo.to(torch.int32), hi.to(torch.int32)

    def _kth_largest(self, e: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[positions] the k-th largest weight over the whole vocabulary: the largest t with
        count(e >= t) >= k (0 when k exceeds the vocabulary)."""
        lo = torch.zeros(e.shape[0], dtype=torch.int32, device=e.device)  # count(e >= 0) is everything
        hi = torch.full_like(lo, _ONE_BITS + 1)  # count(e >= just above 1) is nothing
        # counts are exact integers in float32 (vocabularies under 2^24)
        lo, _ = self._search(e, lo, hi, True, lambda t: self._global_sum(self.kernels.count_at_least(e, t)) >= k.unsqueeze(-1))
        return lo.view(torch.float32)

    def _top_p_threshold(self, e: torch.Tensor, floor: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """[positions] the smallest t with Σ{e > t, e >= floor} e < mass: a token is kept when the
        weight of the kept tokens more likely than it is below top_p of their total (vLLM's rule)."""
        lo = torch.full((e.shape[0],), -1, dtype=torch.int32, device=e.device)  # never evaluated
        hi = torch.full_like(lo, _ONE_BITS)  # nothing lies above 1
        kept = self.kernels.at_least(e, floor)
        _, hi = self._search(e, lo, hi, False,
                             lambda t: self._global_sum(self.kernels.mass_above(kept, t)) < mass.unsqueeze(-1))
        return hi.view(torch.float32)

    def soft_embed(self, d: Distribution, rows: torch.Tensor | None, embed, dtype: torch.dtype) -> torch.Tensor:
        """embed(probs, totals) [rows, CL, hidden] of canvases `rows` (int64 [rows]; None: all of
        them): `embed` (the model's soft_embed) takes unnormalised probabilities exp(shifted)
        [positions, local vocab], which exist a tile of positions at a time, in float32 and as
        `dtype`, and their totals."""
        canvases, cl = d.shifted.shape[:2]
        flat, total = d.shifted.view(-1, d.shifted.shape[-1]), d.total.flatten()
        tile = self.exp_tile(d.shifted)
        positions = None if rows is None else (rows.unsqueeze(-1) * cl + torch.arange(cl, device=rows.device)).flatten()
        n = flat.shape[0] if positions is None else positions.shape[0]
        kept, d.probs = d.probs, None  # the buffer is overwritten below
        # one buffer for every tile
        buffer = kept if kept is not None else flat.new_empty(min(tile, n), flat.shape[1],
                                                              dtype=self.kernels.probs_dtype(dtype))
        out = []
        for a in range(0, n, tile):
            index = None if positions is None else positions[a : a + tile]  # None: contiguous, no gathered copy
            tile_total = total[a : a + tile] if index is None else total.index_select(0, index)
            if index is None and a == 0 and kept is not None:
                probs = kept  # the first tile's exp, in the buffer already (exp_statistics ran it last): the same bits
            else:
                probs = self.kernels.exp_rows(flat, a, index, buffer[: tile_total.shape[0]])
            out.append(embed(probs, tile_total))
        return torch.cat(out).view(canvases if rows is None else rows.shape[0], cl, -1)

    def token_logprob(self, d: Distribution, ids: torch.Tensor) -> torch.Tensor:
        """[...] the log-probability of token `ids` [...] (global ids): each rank reads the ids its
        shard holds, and one all-reduce of [...] values adds them up."""
        local, owned = self.shard.to_local(ids)
        value = self.kernels.gather(d.shifted, local, owned if self.sharded else None)
        if self.sharded:
            self.group.all_reduce(value)
        return value - d.log_total

    def top_logprobs(self, d: Distribution, k: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely tokens per position of canvases `rows`: (logprobs [rows, CL, k], ids)."""
        # A tile of canvases at a time: shifted[rows] is a copy.
        per_tile = max(1, self.tile_positions(d.shifted, 4) // d.shifted[0, ..., 0].numel())
        tops = [d.shifted.index_select(0, rows[a : a + per_tile]).topk(k, dim=-1) for a in range(0, rows.shape[0], per_tile)]
        value, ids = torch.cat([t.values for t in tops]), torch.cat([t.indices for t in tops])
        if self.sharded:
            ids = self.global_ids[ids]
            value = self.group.all_gather(value).movedim(0, -2).flatten(-2)
            ids = self.group.all_gather(ids).movedim(0, -2).flatten(-2)
            value, pick = value.topk(k, dim=-1)
            ids = ids.gather(-1, pick)
        return value - d.log_total[rows].unsqueeze(-1), ids

    def reported(self, d: Distribution, logprob: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The values `logprobs_mode` reports for tokens of canvases `rows` [n] whose log-probabilities
        under d (the distribution the sampler drew from) are `logprob` [n, CL, k]: the same for
        processed_logprobs; the logits themselves (divided by the temperature: processed_logits),
        or the log-probabilities before the temperature (raw_logprobs), from the shifted values
        lp + log Z. The sampling never reads these: only what is reported changes."""
        if self.logprobs_mode == "processed_logprobs":
            return logprob
        shifted = logprob + d.log_total[rows].unsqueeze(-1)
        t = None if d.temperature is None else d.temperature.expand(*d.max.shape)[rows]
        if self.logprobs_mode.endswith("_logits"):
            logits = shifted + d.max[rows]
            return logits if self.logprobs_mode == "processed_logits" or t is None else logits * t
        if t is None:
            return logprob
        return shifted * t - self._raw_log_total(d, rows, t).unsqueeze(-1)

    def _raw_log_total(self, d: Distribution, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[n, CL] log Σ exp(x - max) of the model's own logits x = (shifted + max) · t of canvases
        `rows` [n] at temperature t [n, CL, 1]: the shift by the (all-reduced) max carries over, so
        no weight exceeds 1, and each rank's sums are added in rank order, the same bits on all."""
        flat, cl = d.shifted.view(-1, d.shifted.shape[-1]), d.shifted.shape[1]
        positions = (rows.unsqueeze(-1) * cl + torch.arange(cl, device=rows.device)).flatten()
        scale = t.flatten()
        tile = self.tile_positions(d.shifted, 4)  # the reference's [tile, local vocab] float32 temporary
        sums = torch.cat([self.kernels.scaled_exp_sum(flat, positions[a : a + tile], scale[a : a + tile])
                          for a in range(0, positions.shape[0], tile)])
        return self._global_sum(sums).log().view(rows.shape[0], cl)


def rank_bounds(sums: torch.Tensor) -> torch.Tensor:
    """[ranks + 1, ...] the sums [ranks, ...] of the ranks before each, added in rank order one rank
    at a time (a Python loop over the ranks: no float cumsum, which CUDA runs nondeterministically),
    in float64 as the CPU's cumsum accumulates float32: the same bits."""
    total = torch.zeros_like(sums[0], dtype=torch.float64)
    bounds = [total.to(sums.dtype)]
    for s in sums.unbind(0):
        total = total + s
        bounds.append(total.to(sums.dtype))
    return torch.stack(bounds)


def per_chunk(x: torch.Tensor, reduce) -> torch.Tensor:
    """[..., chunks] `reduce` (torch.amax, torch.sum) of [..., V] over chunks of the vocabulary;
    the last chunk may be short."""
    v = x.shape[-1]
    full = v // CHUNK * CHUNK
    out = reduce(x[..., :full].unflatten(-1, (full // CHUNK, CHUNK)), -1)
    if full < v:
        out = torch.cat((out, reduce(x[..., full:], -1, keepdim=True)), dim=-1)
    return out


def exp_statistics(x: torch.Tensor, m: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x shifted by the max m in place (y), the cumulative sums per chunk of e = exp(y), Σ e·y, and
    the tile buffer, which holds e of the first tile's positions: `tile` positions at a time, the
    last tile first, so e exists for one tile only."""
    y = x.sub_(m)
    rows, lead = y.reshape(-1, y.shape[-1]), y.shape[:-1]
    chunks = -(-y.shape[-1] // CHUNK)
    cum = y.new_empty(rows.shape[0], chunks)
    dot = y.new_empty(rows.shape[0])
    # One buffer for every tile: a heap that keeps freed memory (worker/cpu_heap.py) can split a
    # freed tile for small allocations, and the next tile would then take fresh memory.
    buffer = y.new_empty(min(tile, rows.shape[0]), rows.shape[1])
    # The first tile's e·y goes through an eighth of a tile at a time, so that its e stays.
    part = max(1, tile // 8)
    product = y.new_empty(min(part, rows.shape[0]), rows.shape[1])
    for a in reversed(range(0, rows.shape[0], tile)):
        e = weights_exp(rows[a : a + tile], out=buffer[: min(tile, rows.shape[0] - a)])
        cum[a : a + tile] = per_chunk(e, torch.sum).cumsum(-1)
        # Σ e·y: one elementwise pass and a sum beat a batched [1, V] @ [V, 1] matmul ~3x on CPU.
        if a:
            dot[a : a + tile] = e.mul_(rows[a : a + tile]).sum(dim=-1)
            continue
        for b in range(0, e.shape[0], part):
            n = min(part, e.shape[0] - b)
            dot[b : b + n] = torch.mul(e[b : b + n], rows[b : b + n], out=product[:n]).sum(dim=-1)
    return y, cum.view(*lead, chunks), dot.view(lead), buffer


def first_argmax(x: torch.Tensor, chunk_max: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (ties to the lowest index) given x's per-chunk maxima: only the first
    chunk that holds the maximum is scanned for the index, ~4x faster than argmax's indexed
    reduction over the whole vocabulary on CPU."""
    v = x.shape[-1]
    chunk = chunk_max.argmax(dim=-1, keepdim=True)
    offsets = chunk * CHUNK + torch.arange(CHUNK, device=x.device)
    values = x.gather(-1, offsets.clamp(max=v - 1)).masked_fill(offsets >= v, float("-inf"))
    return (chunk * CHUNK).squeeze(-1) + values.argmax(dim=-1)


def inverse_cdf(log_weights: torch.Tensor, cum: torch.Tensor, target: torch.Tensor,
                threshold: torch.Tensor | None = None) -> torch.Tensor:
    """The first index i with cumsum(weights)[i] > target, per row of weights = exp([..., V]
    log_weights) (0 where below `threshold` [...], if given) with `cum` their cumulative sums per
    chunk, never one of weight 0 (a target at or past the total takes the last index with weight).

    The chunk sums locate the chunk, then one chunk is scanned (and exponentiated), so the cost is
    one read of a chunk instead of a full cumulative sum.
    """
    v = log_weights.shape[-1]
    mass = cum[..., -1:]
    # Strictly below the total, the chunk found holds mass...
    target = torch.minimum(target.unsqueeze(-1), mass.nextafter(torch.zeros_like(mass)))
    chunk = torch.searchsorted(cum, target, right=True).clamp(max=cum.shape[-1] - 1)
    before = torch.where(chunk > 0, cum.gather(-1, (chunk - 1).clamp(min=0)), torch.zeros_like(target))
    inside = chunk * CHUNK + torch.arange(CHUNK, device=log_weights.device)
    values = log_weights.gather(-1, inside.clamp(max=v - 1))
    values = weights_exp(values, out=values) * (inside < v)
    if threshold is not None:
        values = torch.where(values >= threshold.unsqueeze(-1), values, 0.0)
    pos = torch.searchsorted(values.cumsum(-1), target - before, right=True)
    # ...but the scan sums it in another order, which can run past its last index with weight.
    last = torch.where(values > 0, torch.arange(CHUNK, device=log_weights.device), 0).amax(-1, keepdim=True)
    return (chunk * CHUNK + torch.minimum(pos, last)).squeeze(-1)
