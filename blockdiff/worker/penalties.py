"""vLLM's repetition, presence and frequency penalties and OpenAI's logit_bias, per slot on each
rank, applied to the canvases' logits at every denoising step.

Where: on the model's output logits (soft-capped by the model), before the sampler divides them by
its temperature, in vLLM's v1 order: the logit bias is added, then the repetition penalty scales
(logit > 0: logit / p, else logit * p, as vLLM computes it: times 1/p or p) the tokens of the
prompt or the committed output, then frequency_penalty times each token's count in the committed
output and presence_penalty for each token in it are subtracted. Every sampler and every kernel
backend (the Triton sampler's included) sees the logits so processed: this runs in plain torch in
the one step function (worker/canvas_step.forward_step), eager and static alike.

What counts: the prompt (for the repetition penalty) and the committed output, never the canvas
being denoised. Its tokens are not committed: they are drawn afresh at each step (renoised where
not accepted), so counting them would penalise the canvas for its own current guess and make a
step depend on the previous step's random draws. Every position of a canvas sees the same counts.

Memory: a request with none of them costs nothing, and a step whose canvases have none skips the
work (so their logits are exactly the model's). The per-slot tensors are made at the first request
that has one, for every slot: the committed output's counts (int32) and the prompt's tokens (bool),
and the logit bias (float32), dense over this rank's vocabulary rows: 9 bytes per row per slot (2.4
MB a slot at a 262k vocabulary on one rank, 1/TP of it under tensor parallelism). Dense, so that a
step only gathers its slots' rows and adds: no scatter, which CUDA runs with atomics in no fixed
order. Under tensor parallelism each rank keeps and penalizes its own vocabulary rows: nothing is
gathered.
"""

from __future__ import annotations

import torch

from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.model.attention import Row
from blockdiff.parallel.vocab import VocabShard
from blockdiff.step import NewRequests, Penalties

# bytes per logit of a tile's temporaries: the penalty and its inverse gathered per position, the
# chosen factor and the sign test
_TILE_BYTES = 13


class SlotPenalties:
    def __init__(self, rows: int, shard: VocabShard, device: torch.device):
        """`rows`: the slots and the scratch slot (padded canvases), whose row stays neutral."""
        self.shard, self.device = shard, device
        self.active = [False] * rows  # host: whose request has penalties or a bias
        # host: tokens of each penalized slot's prompt + output counted; encoder rows past it are new output
        self.counted = [0] * rows
        self.rows = rows
        self.counts: torch.Tensor | None = None  # [rows, local vocab] int32: the committed output's counts

    def _allocate(self) -> None:
        if self.counts is not None:
            return
        with torch.device(self.device):
            v = self.shard.local_rows
            self.counts = torch.zeros(self.rows, v, dtype=torch.int32)
            self.prompt = torch.zeros(self.rows, v, dtype=torch.bool)  # [rows, local vocab]: in the prompt
            self.repetition = torch.ones(self.rows)
            self.presence = torch.zeros(self.rows)
            self.frequency = torch.zeros(self.rows)
            self.bias = torch.zeros(self.rows, v)  # [rows, local vocab]: what logit_bias adds

    def admit(self, new: NewRequests | None) -> None:
        """The requests that took their slots: each one's row set (a request without penalties gets
        the neutral row, which a step beside penalized canvases computes exactly: (x + 0) * 1 - 0 * 0)."""
        if new is None:
            return
        for i, slot in enumerate(new.slots):
            pen = None if new.penalties is None else new.penalties[i]
            self.active[slot] = pen is not None
            if pen is not None:
                self._allocate()
            if self.counts is not None:
                self._put(slot, pen)

    def _put(self, slot: int, pen: Penalties | None) -> None:
        if pen is None:
            self.counts[slot], self.prompt[slot], self.bias[slot] = 0, False, 0.0
            self.repetition[slot], self.presence[slot], self.frequency[slot] = 1.0, 0.0, 0.0
            return
        self.repetition[slot], self.presence[slot], self.frequency[slot] = pen.repetition, pen.presence, pen.frequency
        self.prompt[slot] = self._histogram(pen.prompt) > 0
        self.counts[slot] = self._histogram(pen.output)
        local, owned = self.shard.to_local(pen.bias_ids.to(self.device))
        # ids owned elsewhere add 0 to row 0: a sum of the same values in any order
        bias = torch.where(owned, pen.bias.to(self.device), 0.0)
        self.bias[slot] = torch.zeros_like(self.bias[slot]).index_add_(0, local, bias)
        self.counted[slot] = pen.prompt.shape[0] + pen.output.shape[0]

    def _histogram(self, ids: torch.Tensor) -> torch.Tensor:
        """[local vocab] int32: how often each of this rank's tokens is in `ids` (no host read)."""
        local, owned = self.shard.to_local(ids.to(self.device))
        zeros = torch.zeros(self.shard.local_rows, dtype=torch.int32, device=self.device)
        return zeros.index_add_(0, local, owned.to(torch.int32))

    def _count(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        local, owned = self.shard.to_local(ids.to(self.device))
        self.counts.index_put_((slots.to(self.device), local), owned.to(torch.int32), accumulate=True)

    def count(self, rows: list[Row], encoder_ids: torch.Tensor) -> None:
        """A step's encoder rows (`rows` at their starts before the step; their tokens `encoder_ids`,
        in order) past a penalized slot's counted tokens are its newly committed output."""
        slots, ids, offset = [], [], 0
        for r in rows:
            if r.decoder:
                continue
            end = r.start + r.length
            if self.active[r.slot] and end > self.counted[r.slot]:
                first = max(self.counted[r.slot], r.start)
                ids.append(encoder_ids[offset + first - r.start : offset + r.length])
                slots.append(torch.full_like(ids[-1], r.slot))
                self.counted[r.slot] = end
            offset += r.length
        if ids:
            self._count(torch.cat(slots), torch.cat(ids))

    def of(self, slots: list[int]) -> "SlotPenalties | None":
        """These penalties for a step of canvases in `slots`, or None when none of them has any."""
        return self if any(self.active[s] for s in slots) else None

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, vocab: VocabParallel) -> None:
        """Penalize the canvases' logits [canvases, CL, local vocab] float32 in place (`slots`:
        theirs). No host sync: the static step runs it as it is."""
        cl, v = logits.shape[1:]
        logits.add_(self.bias.index_select(0, slots)[:, None, :])
        counts = self.counts.index_select(0, slots)
        output = counts > 0
        seen = self.prompt.index_select(0, slots) | output
        penalty = torch.where(seen, self.repetition.index_select(0, slots)[:, None], 1.0)
        inverse = 1.0 / penalty
        flat = logits.view(-1, v)
        row_of = torch.arange(flat.shape[0], device=logits.device) // cl
        tile = vocab.tile_positions(flat, _TILE_BYTES)
        for a in range(0, flat.shape[0], tile):  # a Python int count fixed by the shapes
            x, r = flat[a : a + tile], row_of[a : a + tile]
            x.mul_(torch.where(x > 0, inverse.index_select(0, r), penalty.index_select(0, r)))
        logits.sub_((self.frequency.index_select(0, slots)[:, None] * counts)[:, None, :])
        logits.sub_((self.presence.index_select(0, slots)[:, None] * output)[:, None, :])
