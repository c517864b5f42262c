"""Structured outputs at the real vocabulary: the automaton's build time and the constrained commit's
cost per canvas, against the unconstrained sampler step on the same logits.

A synthetic SentencePiece-style tokenizer of 262,144 tokens, laid out as Gemma's is (special tokens,
the 256 byte-fallback tokens `<0xNN>`, then pieces with "▁" for a space: words, numbers,
punctuation runs such as `":` and `},`, and non-ASCII pieces; decoder Replace("▁", " ") +
ByteFallback + Fuse), and a JSON schema of 20 fields (strings, a date, integers, numbers, booleans,
enums, an array, a nested object).

- build: `StructuredOutputs.automaton` from cold (the child process, outlines-core's index over the
  regex, the atoms and distances), --builds times with the cache cleared; and once more from the
  cache.
- per canvas: a finished canvas of 256 positions (the released model's canvas) over random logits;
  the constrained commit (diffusion/constrained.py: the atom scatter-max over the vocabulary, the
  programme over the classes, the winning tokens and their logprobs) of --canvases canvases at once,
  against one unconstrained sampler step (the entropy-bound step: distribution, argmax, draw,
  acceptance) of the same canvases. A canvas takes many denoising steps and one commit, so the
  commit's share of a canvas is at most commit / (steps x sampler step), and smaller still beside
  the forward pass, which this leaves out.

- end to end (--end-to-end): `LLM` on a random checkpoint of tiny widths but this vocabulary and
  canvas (2 layers, hidden 64), one request of --canvases-e2e canvases with max_denoising_steps 16,
  unconstrained (ignore_eos, so it runs every canvas) and constrained by the schema: seconds per
  canvas of each. The tiny forward makes the sampler's share of a step, and so the commit's
  overhead, far larger than with the real model.

    OMP_NUM_THREADS=2 python benchmarks/structured_outputs.py [--vocab 262144] [--canvases 1] [--reps 5] [--builds 3]
        [--plain] [--end-to-end]

--plain drops the length bounds and the date format of the schema (a plain 20-field object).
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time

import torch

from blockdiff.config import EngineConfig
from blockdiff.diffusion.constrained import DeviceAutomaton, constrained_tokens
from blockdiff.step import CanvasConstraint
from blockdiff.diffusion.entropy_bound import denoise_step, denoise_params
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard
from blockdiff.sampling_params import REFERENCE_DEFAULTS, SamplingParams, StructuredOutputsParams
from blockdiff.structured.compiler import StructuredOutputs
from blockdiff.structured.vocabulary import token_bytes
from blockdiff.tokenizer import Tokenizer

CANVAS = 256
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string"},
        "country": {"type": "string", "maxLength": 30},
        "born": {"type": "string", "format": "date"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "weight": {"type": "number"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "verified": {"type": "boolean"},
        "admin": {"type": "boolean"},
        "role": {"enum": ["user", "editor", "owner"]},
        "plan": {"enum": ["free", "pro", "team", "enterprise"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["street", "zip"]},
        "logins": {"type": "integer"},
        "bio": {"type": "string"},
        "referrer": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "email", "city", "country", "born", "age", "height", "weight", "score", "active",
                 "verified", "admin", "role", "plan", "tags", "address", "logins", "bio", "referrer"],
}


def synthetic_tokenizer(size: int, seed: int = 0) -> Tokenizer:
    """A SentencePiece-style vocabulary of `size` tokens in Gemma's layout (see the module docstring)."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    rng = random.Random(seed)
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    seen = set(pieces)
    punct = '{}[]":,.-_/@#()!?\'+*'
    words = string.ascii_letters + string.digits
    foreign = "éèàüößçñøåæœ" + "日本語中文字한국어" + "абвгдежзик"
    while len(pieces) < size:
        kind = rng.random()
        if kind < 0.55:
            piece = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 10)))
            if rng.random() < 0.3:
                piece = piece.capitalize()
        elif kind < 0.7:
            piece = "".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        elif kind < 0.8:
            piece = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 4)))
        elif kind < 0.9:
            piece = "".join(rng.choice(punct + words) for _ in range(rng.randint(1, 4)))
        else:
            piece = "".join(rng.choice(foreign) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.5:
            piece = "▁" + piece
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    tok = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(tok, {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}, None)


def plain(schema: dict) -> dict:
    """The schema without maxLength, maxItems and format."""
    if isinstance(schema, dict):
        return {k: plain(v) for k, v in schema.items() if k not in ("maxLength", "maxItems", "format")}
    return schema


def end_to_end(tokenizer: Tokenizer, vocab: int, spec: StructuredOutputsParams, canvases: int) -> None:
    import json
    import os
    import tempfile

    from blockdiff import LLM
    from blockdiff.model.tiny import make_tiny_model

    path = make_tiny_model(tempfile.mkdtemp(), vocab_size=vocab, canvas_length=CANVAS, hidden_size=64,
                           intermediate_size=128, num_layers=2, sliding_window=64, tokenizer=False)
    tokenizer._tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}, f)
    common = dict(seed=0, max_tokens=canvases * CANVAS, max_denoising_steps=16)
    with LLM(path, max_model_len=canvases * CANVAS + 64, structured_outputs_timeout=600) as llm:
        llm.engine.structured.automaton(spec)  # built once, before the timing
        for name, params in (("unconstrained", SamplingParams(**common, ignore_eos=True)),
                             ("constrained", SamplingParams(**common, structured_outputs=spec)),
                             ("unconstrained", SamplingParams(**common, ignore_eos=True)),
                             ("constrained", SamplingParams(**common, structured_outputs=spec))):
            t0 = time.perf_counter()
            out = llm.generate("Fill in the record:", params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            m = out.metrics
            print(f"end to end, {name}: {m['canvases']} canvases, {m['denoising_steps'] / m['canvases']:.1f} steps per "
                  f"canvas, {seconds / m['canvases']:.2f} s per canvas ({out.finish_reason})")


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--canvases", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--builds", type=int, default=3)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--end-to-end", action="store_true")
    ap.add_argument("--canvases-e2e", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; vocab {args.vocab}, canvas {CANVAS}, "
          f"{args.canvases} canvas(es) per commit")

    t0 = time.perf_counter()
    tokenizer = synthetic_tokenizer(args.vocab)
    print(f"synthetic tokenizer: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    token_bytes(tokenizer)
    print(f"token bytes of the vocabulary (once per tokenizer): {time.perf_counter() - t0:.2f} s")

    spec = StructuredOutputsParams(json=plain(SCHEMA) if args.plain else SCHEMA)
    builds = []
    for _ in range(args.builds):
        structured = StructuredOutputs(tokenizer, args.vocab, timeout=600, memory=EngineConfig.structured_outputs_memory,
                                       builds=1)
        t0 = time.perf_counter()
        a = structured.automaton(spec)
        builds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    structured.automaton(spec)
    cached = time.perf_counter() - t0
    vocab = VocabParallel(VocabShard.make(0, 1, args.vocab), TPGroup())
    device_automaton = DeviceAutomaton(a, vocab, torch.device("cpu"))
    print(f"automaton: {a.num_states} states, {a.num_atoms} atoms (token classes), {len(a.src)} atom transitions, "
          f"{device_automaton.num_classes} (state, next state) classes; shortest text {a.distance[a.initial]} tokens")
    print(f"build from cold: median {statistics.median(builds):.2f} s, best {min(builds):.2f} s ({len(builds)} builds); "
          f"from the cache: {cached * 1e6:.0f} us")

    g = torch.Generator().manual_seed(0)
    b = args.canvases
    logits = torch.randn(b, CANVAS, args.vocab, generator=g) * 4
    params = [SamplingParams(**{k: v for k, v in REFERENCE_DEFAULTS.items() if v is not None}, max_tokens=4096)] * b
    dp = denoise_params([10] * b, params, torch.rand(b, CANVAS, generator=g),
                        torch.randint(0, args.vocab, (b, CANVAS), generator=g))
    last, run = torch.full((b, CANVAS), -1), torch.zeros(b, dtype=torch.long)
    work = logits.clone()

    def sampler_step():
        work.copy_(logits)
        denoise_step(work, last, run, dp, vocab)

    d = vocab.distribution(logits.clone())
    fallback = vocab.argmax(d)
    constraints = [CanvasConstraint(i, a.key, a.initial, 1024, (1, 5)) for i in range(b)]

    def commit():
        constrained_tokens(d, fallback, constraints, device_automaton, vocab)

    copy = timed(lambda: work.copy_(logits), args.reps)
    step = [s - c for s, c in zip(timed(sampler_step, args.reps), copy)]
    cost = timed(commit, args.reps)
    tokens, _ = constrained_tokens(d, fallback, constraints, device_automaton, vocab)
    text = tokenizer.decode(tokens[0].tolist())
    print(f"sampler step (unconstrained, entropy-bound): median {statistics.median(step) * 1e3:.0f} ms, "
          f"best {min(step) * 1e3:.0f} ms")
    print(f"constrained commit: median {statistics.median(cost) * 1e3:.0f} ms, best {min(cost) * 1e3:.0f} ms "
          f"= {statistics.median(cost) / statistics.median(step):.2f} sampler steps")
    print(f"per canvas at 16 / 48 denoising steps: the commit adds {statistics.median(cost) / (16 * statistics.median(step)):.1%}"
          f" / {statistics.median(cost) / (48 * statistics.median(step)):.1%} to the sampler's time (the forward not counted)")
    print(f"under tensor parallelism the ranks exchange {b * CANVAS * ((a.num_atoms + 2) * 4 + 8 + 4):,} "
          f"bytes per commit (atom maxima, winning tokens, logprobs); the logits are {b * CANVAS * args.vocab * 4:,}")
    print(f"first committed text: {text[:120]!r}...")
    if args.end_to_end:
        end_to_end(tokenizer, args.vocab, spec, args.canvases_e2e)


if __name__ == "__main__":
    main()
