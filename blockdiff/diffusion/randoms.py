"""Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC'11; the generator behind cuRAND and torch's CUDA RNG), in plain int64 torch ops whose
values never leave 32 bits (no overflow), so the same bits come out on the CPU and on CUDA, eagerly,
compiled and inside CUDA graphs, and on every tensor-parallel rank without any communication.

A request's random numbers are a pure function of its seed (the key) and a counter: (position in
the canvas, denoising step n, canvas index, purpose). Nothing is drawn on the host and there is no
state to keep, copy or rewind: a request draws the same numbers alone, in any batch, after a
preemption and on every rank.
"""

from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # the multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # the key schedule's increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10

# What a counter's fourth word says the numbers are for.
STEP = 0  # a denoising step's numbers: word 0 a uniform for the candidate draw, word 1 a renoise token
START = 1  # a canvas's starting noise: word 0 a token per position


def _signed(c: int) -> int:
    """c mod 2^32 as a number below 2^31 in magnitude: x * it stays inside int64 for any 32-bit x."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _mulhilo(c: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of c * x for 32-bit x, without a product past 2^63: the high half
    from c's 16-bit halves, the low half from c mod 2^32 taken below 2^31."""
    low = (x * _signed(c)) & MASK
    high = torch.add((x * (c & 0xFFFF)) >> 16, x, alpha=c >> 16) >> 16
    return high, low


def philox(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of four 32-bit counter words under a two-word key (int64 tensors holding values
    in [0, 2^32), broadcast together) -> four 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        high0, low0 = _mulhilo(_M0, c0)
        high1, low1 = _mulhilo(_M1, c2)
        round_k0 = k0 if r == 0 else (k0 + r * _W0) & MASK
        round_k1 = k1 if r == 0 else (k1 + r * _W1) & MASK
        c0, c1, c2, c3 = high1 ^ c1 ^ round_k0, low1, high0 ^ c3 ^ round_k1, low0
    return c0, c1, c2, c3


def seed_words(seed: int) -> tuple[int, int]:
    """A request's seed (any Python int) as the key: its two 32-bit words mod 2^64."""
    seed %= 1 << 64
    return seed & MASK, seed >> 32


def canvas_words(seed: torch.Tensor, canvas: torch.Tensor, step: torch.Tensor, purpose: int,
                 length: int) -> tuple[torch.Tensor, ...]:
    """Four words per canvas position: seed [n, 2] (seed_words), canvas [n] index of the canvas in
    its request, step [n] the denoising step n (0 for a canvas's start) -> 4 x [n, length] int64."""
    position = torch.arange(length, dtype=torch.long, device=seed.device)
    per_canvas = [t.long().unsqueeze(-1) for t in (step, canvas)]
    counter = (position, per_canvas[0], per_canvas[1], torch.full_like(per_canvas[1], purpose))
    key = (seed[:, 0:1], seed[:, 1:2])
    words = philox(counter, key)
    return tuple(w.expand(seed.shape[0], length) for w in words)


def uniform(word: torch.Tensor) -> torch.Tensor:
    """A word as a float32 in [0, 1): its top 24 bits, exactly representable."""
    return (word >> 8).float() * (1.0 / (1 << 24))


def below(word: torch.Tensor, n: int) -> torch.Tensor:
    """A word as an integer in [0, n) (n < 2^31): the high part of word * n (Lemire), bias < n / 2^32."""
    return (word * n) >> 32
