"""Structured outputs: JSON schemas, regexes and choices as token automata that constrain what a
canvas commits (the programme itself is blockdiff/diffusion/constrained.py; docs/structured_outputs.md)."""
