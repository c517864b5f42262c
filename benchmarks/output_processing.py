"""Output processing per committed canvas (detokenize, stop checks, the streamed delta output) at the
start of a long output and at its end: the cost must not grow with the output length.

    .venv/bin/python benchmarks/output_processing.py

Each run feeds one request 64 canvases of 256 random token ids of the demo tokenizer (16,384
output tokens), with two stop strings that never match, and times `Request.commit` plus
`make_output` (output_kind "delta", as the server streams) for every canvas. It prints the median
per canvas over the first four canvases (256-1,024 tokens) and the last four (15,616-16,384
tokens), median of 5 runs, beside the time of one decode of the whole output so far, which the
engine did (at least twice) per canvas before it decoded incrementally.
"""

from __future__ import annotations

import random
import statistics
import time

from blockdiff.demo import demo_checkpoint
from blockdiff.engine.detokenizer import IncrementalDetokenizer
from blockdiff.engine.output_processor import make_output
from blockdiff.engine.request import Request, State
from blockdiff.diffusion.entropy_bound import EntropyBound
from blockdiff.sampling_params import REFERENCE_DEFAULTS, SamplingParams
from blockdiff.tokenizer import Tokenizer

CANVAS, CANVASES = 256, 64


def one_run(tok: Tokenizer, seed: int) -> list[float]:
    rng = random.Random(seed)
    params = EntropyBound().resolve(SamplingParams(max_tokens=CANVAS * CANVASES, stop=["<never>", "\x00\x00"],
                                                   output_kind="delta", ignore_eos=True), REFERENCE_DEFAULTS)
    out = IncrementalDetokenizer(tok, params.max_tokens, set(), params.stop, False)
    req = Request("bench", None, [1, 2, 3], params, CANVAS, seed, out)
    req.admit(0, 0)
    req.cached(3)
    times, full = [], []
    for _ in range(CANVASES):
        canvas = [rng.randrange(4, tok.vocab_size) for _ in range(CANVAS)]
        t = time.perf_counter()
        reason = req.commit(canvas, None)
        if reason is not None:
            req.finish(reason)
        make_output(req)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        tok.decode(out.token_ids)
        full.append(time.perf_counter() - t)
        if req.state == State.COMMIT:
            req.cached(CANVAS)
    return times, full


def main() -> None:
    tok = Tokenizer.from_pretrained(demo_checkpoint())
    runs = [one_run(tok, seed) for seed in range(5)]

    def median(which: int, part: slice) -> float:
        return statistics.median(statistics.median(r[which][part]) for r in runs) * 1e3

    print(f"{'output tokens':>16} {'ms per canvas':>14} {'full decode ms':>15}")
    for label, part in (("256-1,024", slice(0, 4)), ("15,616-16,384", slice(-4, None))):
        print(f"{label:>16} {median(0, part):14.3f} {median(1, part):15.3f}")
    print(f"ratio end/start: {median(0, slice(-4, None)) / median(0, slice(0, 4)):.2f} (per canvas), "
          f"{median(1, slice(-4, None)) / median(1, slice(0, 4)):.2f} (full decode)")


if __name__ == "__main__":
    main()
