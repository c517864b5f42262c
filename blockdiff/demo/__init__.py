"""The demo model bundled with blockdiff: a small DiffusionGemma trained here on checkable tasks
(`blockdiff train-demo`, docs/demo.md), used when no model is given."""

from __future__ import annotations

# Where the checkpoint lives is the hub's to know (it is the default model); the demo's code sits above it.
from blockdiff.hub import DEMO_CHECKPOINT as CHECKPOINT_DIR, demo_checkpoint

__all__ = ["CHECKPOINT_DIR", "demo_checkpoint"]
