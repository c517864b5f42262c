"""The trainer's attention: plain differentiable torch over whole sequences, without a paged cache.

The inference backends (model/attention_backends) read a paged cache in fixed key blocks, with
masks, so that a token's result never depends on its batch; under autograd most of a training step
went to filling those masks and copying those blocks. Training needs none of it. Here each
sequence's encoder tokens attend causally to each other, and each canvas attends to its sequence's
tokens before it and to itself both ways, which is what the inference path computes
(tests/demo/test_demo_train.py compares the hidden states of the two).

The "cache" of a layer is a pair of dense [encoder tokens, KV heads, dim] tensors: the encoder pass
copies its K/V there (autograd keeps the link), and the decoder passes of the same step read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockdiff.model.attention_layout import AttentionMetadata


@dataclass
class DenseKind:
    """One layer kind's attention for one training pass (model/attention_layout.KindAttention)."""

    sequences: list[tuple[int, int]]  # encoder pass: (first token, length) of each sequence
    canvases: list[tuple[int, int]]  # decoder pass: (its sequence's first encoder token, tokens before the canvas)
    canvas_length: int
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], scales=None) -> None:
        if self.sequences:
            cache[0].copy_(k)
            cache[1].copy_(v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
               scales=None) -> torch.Tensor:
        # Operands are cut with split, not one slice per sequence or canvas: the backward of a slice
        # writes its gradient into zeros the size of the whole tensor, so slices cost the square of
        # the batch; a split's backward concatenates its parts' gradients once.
        lengths = [n for _, n in self.sequences]
        out = ([_attention(*parts, causal=True) for parts in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
               if lengths else [])
        if self.canvases:
            cl = self.canvas_length
            # the cache in one piece per sequence a canvas reads (from its first token to the next one's)
            firsts = sorted({0} | {s for s, _ in self.canvases})
            sizes = [b - a for a, b in zip(firsts, firsts[1:] + [cache[0].shape[0]])]
            piece = {s: i for i, s in enumerate(firsts)}
            keys, values = cache[0].split(sizes), cache[1].split(sizes)
            for (s, before), qc, kc, vc in zip(self.canvases, q.split(cl), k.split(cl), v.split(cl)):
                i = piece[s]
                out.append(_attention(qc, torch.cat((keys[i][:before], kc)), torch.cat((values[i][:before], vc)),
                                      causal=False))
        return torch.cat(out).flatten(1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [n, heads, dim], k/v [m, kv heads, dim] -> [n, heads, dim], at scale 1 as the model's attention."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1).transpose(0, 1)[None] for t in (k, v))
    # 4-D operands: with a batch dimension, CPU SDPA takes its flash kernel, not the math fallback.
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=causal, scale=1.0)[0].transpose(0, 1)


def encoder_metadata(lengths: list[int]) -> AttentionMetadata:
    """The encoder pass over whole sequences of these lengths, packed one after another."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    kind = DenseKind(list(zip(starts, lengths)), [], 0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return AttentionMetadata(sum(lengths), sum(lengths), 0, positions, kind, DenseKind(kind.sequences, [], 0))


def decoder_metadata(canvases: list[tuple[int, int]], canvas_length: int) -> AttentionMetadata:
    """The decoder pass over canvases given as (their sequence's first encoder token, the position of
    the canvas's first token), each reading its sequence's encoder K/V before that position."""
    positions = torch.cat([torch.arange(p, p + canvas_length) for _, p in canvases])
    n = len(canvases) * canvas_length
    return AttentionMetadata(n, 0, n, positions, DenseKind([], canvases, canvas_length),
                             DenseKind([], canvases, canvas_length))
