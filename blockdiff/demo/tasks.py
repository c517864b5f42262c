"""The demo's checkable tasks: sorting digits, reversing words, upper-casing words.

Every problem is a one-line question with exactly one right answer. A problem belongs to the
held-out set when a hash of its question says so; training never draws such a problem and the
evaluation draws only those, so the two are disjoint whatever the seeds.
"""

from __future__ import annotations

import random
import string
import zlib
from dataclasses import dataclass

TASKS = ("sort", "reverse", "upper")
HELD_OUT_SHARE = 10  # one question in this many is held out
EVAL_SEED = 20_240_601


@dataclass(frozen=True)
class Problem:
    task: str
    question: str
    answer: str


def make_problem(task: str, rng: random.Random) -> Problem:
    if task == "sort":
        digits = [rng.choice(string.digits) for _ in range(rng.randint(3, 8))]
        return Problem(task, "sort: " + " ".join(digits), " ".join(sorted(digits)))
    if task == "reverse":
        word = _word(rng)
        return Problem(task, "reverse: " + word, word[::-1])
    if task == "upper":
        word = _word(rng)
        return Problem(task, "upper: " + word, word.upper())
    raise ValueError(f"unknown demo task {task!r}; the tasks are {', '.join(TASKS)}")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))


def held_out(problem: Problem) -> bool:
    return zlib.crc32(problem.question.encode()) % HELD_OUT_SHARE == 0


def training_problems(rng: random.Random):
    """An endless stream of training problems, the tasks in equal shares, none of them held out."""
    while True:
        problem = make_problem(rng.choice(TASKS), rng)
        if not held_out(problem):
            yield problem


def heldout_problems(n: int, seed: int = EVAL_SEED) -> list[Problem]:
    """n distinct held-out problems, the tasks taking turns."""
    if n < 1:
        raise ValueError(f"the number of problems must be >= 1, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < n:
        problem = make_problem(TASKS[len(out) % len(TASKS)], rng)
        if held_out(problem) and problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    return out


def is_correct(problem: Problem, text: str) -> bool:
    """The generated text (special tokens removed) answers the problem."""
    return text.strip() == problem.answer
