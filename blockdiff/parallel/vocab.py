"""How the vocabulary is split over tensor-parallel ranks.

The vocabulary is the original one, optionally followed by added tokens. Each range is split in
contiguous, equally sized (padded) pieces, so a rank's local rows are

    [its slice of the original vocabulary | padding | its slice of the added vocabulary | padding]

and padding rows hold zero weights whose logits must never win or carry probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class VocabShard:
    org_vocab: int
    added_vocab: int
    org_start: int
    org_end: int
    added_start: int  # absolute token ids: org_vocab + offset into the added vocabulary
    added_end: int
    org_rows: int  # local rows reserved for the original vocabulary (same on every rank)
    added_rows: int

    @classmethod
    def make(cls, rank: int, size: int, org_vocab: int, added_vocab: int = 0) -> "VocabShard":
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        org_rows = _ceil_div(org_vocab, size)
        added_rows = _ceil_div(added_vocab, size) if added_vocab else 0
        org_start = min(rank * org_rows, org_vocab)
        added_off = min(rank * added_rows, added_vocab)
        return cls(
            org_vocab=org_vocab,
            added_vocab=added_vocab,
            org_start=org_start,
            org_end=min(org_start + org_rows, org_vocab),
            added_start=org_vocab + added_off,
            added_end=org_vocab + min(added_off + added_rows, added_vocab),
            org_rows=org_rows,
            added_rows=added_rows,
        )

    @property
    def vocab_size(self) -> int:
        return self.org_vocab + self.added_vocab

    @property
    def local_rows(self) -> int:
        return self.org_rows + self.added_rows

    @property
    def num_org(self) -> int:
        return self.org_end - self.org_start

    @property
    def num_added(self) -> int:
        return self.added_end - self.added_start

    def valid_rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[local_rows] bool: which local rows hold a real token."""
        rows = torch.arange(self.local_rows, device=device)
        return (rows < self.num_org) | ((rows >= self.org_rows) & (rows < self.org_rows + self.num_added))

    def global_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[local_rows] token id of each local row (-1 for padding)."""
        rows = torch.arange(self.local_rows, device=device)
        ids = torch.where(rows < self.org_rows, rows + self.org_start, rows - self.org_rows + self.added_start)
        return torch.where(self.valid_rows(device), ids, -1)

    def to_local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids -> (local row, owned-here mask); rows of tokens owned elsewhere are 0."""
        in_org = (ids >= self.org_start) & (ids < self.org_end)
        in_added = (ids >= self.added_start) & (ids < self.added_end)
        local = torch.where(in_org, ids - self.org_start, ids - self.added_start + self.org_rows)
        owned = in_org | in_added
        return torch.where(owned, local, 0), owned
