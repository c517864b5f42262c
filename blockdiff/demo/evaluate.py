"""Task accuracy of a model on held-out demo problems, and the tokens it commits per denoising step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from blockdiff.demo.tasks import AGENT_TASKS, TASKS, Problem, is_correct
from blockdiff.llm import LLM
from blockdiff.outputs import RequestOutput
from blockdiff.sampling_params import SamplingParams


@dataclass
class EvalResult:
    correct: dict[str, int] = field(default_factory=dict)  # task -> problems answered right
    total: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # tokens committed, EOS included, nothing after it
    denoising_steps: int = 0
    rows: int = 0  # canvas positions the model evaluated (usage's canvas_positions_evaluated)

    def add(self, problem: Problem, right: bool, tokens: int, steps: int, rows: int = 0) -> None:
        self.correct[problem.task] = self.correct.get(problem.task, 0) + int(right)
        self.total[problem.task] = self.total.get(problem.task, 0) + 1
        self.tokens += tokens
        self.denoising_steps += steps
        self.rows += rows

    @property
    def accuracy(self) -> float:
        return sum(self.correct.values()) / max(1, sum(self.total.values()))

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.denoising_steps)

    def lines(self) -> list[str]:
        """The report `blockdiff eval` prints; the last line is `accuracy: X.XXX`."""
        out = [
            f"{task}: {self.correct[task] / self.total[task]:.3f} ({self.correct[task]}/{self.total[task]})"
            for task in TASKS + AGENT_TASKS
            if task in self.total
        ]
        out.append(f"tokens per denoising step: {self.tokens_per_step:.3f} ({self.tokens} tokens, {self.denoising_steps} steps)")
        out.append(f"rows evaluated per token: {self.rows / max(1, self.tokens):.3f} ({self.rows} canvas positions)")
        out.append(f"accuracy: {self.accuracy:.3f}")
        return out


def per_problem_params(params: SamplingParams, n: int, seed: int) -> list[SamplingParams]:
    """Problem i samples with seed `seed + i`, so a run is reproducible and independent of batching."""
    return [replace(params, seed=seed + i) for i in range(n)]


def score(problems: Sequence[Problem], outputs: Sequence[RequestOutput]) -> EvalResult:
    result = EvalResult()
    for problem, out in zip(problems, outputs, strict=True):
        result.add(problem, is_correct(problem, out.text), len(out.token_ids), out.metrics["denoising_steps"],
                   out.metrics["canvas_positions_evaluated"])
    return result


def evaluate(llm: LLM, problems: Sequence[Problem], params: SamplingParams, seed: int = 0) -> EvalResult:
    """Every problem as a chat, one batched generate call per set of template variables (tools,
    thinking). Agent problems are scored on text that keeps the format's markers."""
    all_params = per_problem_params(params, len(problems), seed)
    groups: dict[tuple, list[int]] = {}
    for i, problem in enumerate(problems):
        groups.setdefault((problem.tools, problem.thinking), []).append(i)
    outputs: list = [None] * len(problems)
    for indices in groups.values():
        first = problems[indices[0]]
        kwargs = first.template_kwargs()
        group_params = [replace(all_params[i], skip_special_tokens=not kwargs) for i in indices]
        done = llm.chat([problems[i].messages() for i in indices], group_params, tools=kwargs.pop("tools", None),
                        chat_template_kwargs=kwargs)
        for i, out in zip(indices, done):
            outputs[i] = out
    return score(problems, outputs)
