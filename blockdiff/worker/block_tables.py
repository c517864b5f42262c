"""Each rank's block tables: one per layer kind, a row per slot, on the device.

The engine sends only what changed (`step.TableDelta`): a request's new blocks as it grows, and a
slot cleared when another request takes it. Mixed steps build their attention metadata from these
tables at the rows' slots, and the static step reads them inside its graph, so no step sends or
copies a whole table, whatever the context.
"""

from __future__ import annotations

import torch

from blockdiff.step import CacheConfig, TableDelta


class BlockTables:
    def __init__(self, cache: CacheConfig, kinds: set[bool], device: torch.device):
        """A row per slot and one more, the scratch slot's (padded canvases), which stays empty (-1)."""
        width = max(1, -(-cache.max_model_len // cache.block_size))
        self.tables = {sliding: torch.full((cache.num_slots + 1, width), -1, dtype=torch.long, device=device)
                       for sliding in sorted(kinds)}
        self.device = device

    def apply(self, delta: TableDelta | None) -> None:
        if delta is None:
            return
        if delta.reset:
            slots = torch.tensor(delta.reset, dtype=torch.long, device=self.device)
            for table in self.tables.values():
                table.index_fill_(0, slots, -1)
        for sliding, entries in ((False, delta.full), (True, delta.sliding)):
            if sliding in self.tables and entries.shape[0]:
                e = entries.to(self.device)
                self.tables[sliding][e[:, 0], e[:, 1]] = e[:, 2]
