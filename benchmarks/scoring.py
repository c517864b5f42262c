"""What scoring a prompt costs (SamplingParams.prompt_logprobs; the server's echo with logprobs, which
lm-evaluation-harness sends for every multiple-choice option), beside generating the same text.

    .venv/bin/python benchmarks/scoring.py [--model MODEL] [--questions 40] [--canvas-length N]

For the demo's sort task as multiple choice (the chat prompt, then the sorted digits or a shuffle of
them), it times, one request at a time after a warm-up, median of three passes over the questions:
- scoring each option (max_tokens 0): prefill of the prompt up to its last piece, and one decoder
  forward per piece of the prompt (docs/architecture.md, "Scoring");
- what lm-eval asks for, scoring and one generated token (max_tokens 1): a whole canvas denoised more;
- generating the option instead, from the chat prompt (max_tokens = the option's tokens).
It prints the decoder forwards and the time per request of each, their ratios, the time per request
of scoring every option in one call (continuous batching), and the accuracy of ranking the sorted
digits first by the summed scores of the option's tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from blockdiff import LLM, SamplingParams


def questions(tok, n: int, seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
        right, wrong = sorted(digits), list(digits)
        while wrong == right:
            rng.shuffle(wrong)
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "sort: " + " ".join(map(str, digits))}]),
                            add_special_tokens=False)
        out.append((prompt, [tok.encode(" ".join(map(str, o)), add_special_tokens=False) for o in (right, wrong)]))
    return out


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    outs, times = [], []
    for prompt, p in zip(prompts, params):
        t = time.perf_counter()
        outs.append(llm.generate([prompt], p, use_tqdm=False)[0])
        times.append(time.perf_counter() - t)
    return statistics.median(times), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo)")
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--canvas-length", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, canvas_length=args.canvas_length)
    tok, cl = llm.get_tokenizer(), llm.engine.canvas_length
    qs = questions(tok, args.questions)
    scored = [p + o for p, opts in qs for o in opts]
    runs = {
        "score (max_tokens 0)": (scored, [SamplingParams(max_tokens=0, prompt_logprobs=0)] * len(scored)),
        "score + 1 token (lm-eval)": (scored, [SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)] * len(scored)),
        "generate the option": ([p for p, opts in qs for _ in opts],
                                [SamplingParams(max_tokens=len(o), temperature=0, ignore_eos=True) for _, opts in qs for o in opts]),
    }
    timed(llm, *[x[:4] for x in runs["score + 1 token (lm-eval)"]])  # warm-up
    results = {}
    for name, (prompts, params) in runs.items():
        passes = [timed(llm, prompts, params) for _ in range(3)]
        results[name] = (statistics.median(t for t, _ in passes), passes[0][1])
    _, outs = results["score (max_tokens 0)"]
    right = 0
    for i, (prompt, _) in enumerate(qs):
        sums = [sum(lp.logprob for lp in outs[2 * i + j].prompt_token_logprobs[len(prompt) - 1 :]) for j in range(2)]
        right += sums[0] > sums[1]
    base = results["score (max_tokens 0)"][0]
    print(f"model {llm.engine.cfg.model}, canvas {cl}, {len(qs)} questions x 2 options, one request at a time")
    print(f"{'':28} {'decoder forwards':>17} {'ms / request':>13} {'x score':>8}")
    for name, (t, outs) in results.items():
        forwards = statistics.mean(o.metrics["denoising_steps"] + len(_pieces(o, cl)) for o in outs)
        print(f"{name:28} {forwards:17.1f} {t * 1e3:13.2f} {t / base:8.2f}")
    t = time.perf_counter()
    llm.generate(scored, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    batched = (time.perf_counter() - t) / len(scored)
    print(f"{'score, all in one batch':28} {'':17} {batched * 1e3:13.2f} {batched / base:8.2f}")
    print(f"ranking by the scores of the option's tokens: {right}/{len(qs)} = {right / len(qs):.3f} (chance 0.5)")
    llm.shutdown()


def _pieces(out, cl: int) -> list:
    if out.prompt_token_logprobs is None:
        return []
    return [None] * -(-(len(out.prompt_token_ids) - 1) // cl)


if __name__ == "__main__":
    main()
