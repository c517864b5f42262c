"""Should the constraint act at every denoising step, or only on the committed canvas? A measurement.

Structured outputs commit, for a converged canvas, the best text the automaton accepts under the last
step's distributions (blockdiff/diffusion/constrained.py); the denoising itself runs unconstrained.
The alternative runs the same programme after every step of a constrained canvas and uses its tokens
as the step's argmax canvas: the entropy-bound sampler's stability test then compares constrained
canvases (`argmax`), and, further (`input`), the positions the step accepts take the constrained
tokens instead of the sampled candidates, so that the next step's input (and the self-conditioning
that follows from it) is valid text.

Measured on the bundled demo model, greedy, on its held-out problems:
- json: the answer inside {"answer": string} (the model never saw JSON), right when the string is
  the task's answer;
- regex: the answer constrained to its task's shape (digits and spaces, or letters), right when equal;
- weather: get_weather named (tool_choice), right when the city is the question's.
Per mode: accuracy and denoising steps per canvas.

    OMP_NUM_THREADS=2 python benchmarks/structured_denoising.py [--problems 30]

The alternative is a subclass of the entropy-bound sampler defined here (it reads the step's
constraints through a wrapper of the runner), not product code: it is measured to decide.
"""

from __future__ import annotations

import argparse
import json

import torch

from blockdiff import LLM, SamplingParams
from blockdiff.demo.tasks import WEATHER_TOOL, heldout_problems
from blockdiff.diffusion import registry
from blockdiff.diffusion.constrained import constrained_tokens
from blockdiff.diffusion.entropy_bound import EntropyBound
from blockdiff.diffusion.strategy import StepResult
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.worker import model_runner

ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
SHAPES = {"sort": r"[0-9]( [0-9])*", "reverse": "[a-z]+", "upper": "[A-Z]+"}


class _EveryStep(EntropyBound):
    """The entropy-bound sampler whose constrained canvases take the programme's tokens every step."""

    mode = "argmax"
    runner = None  # the ModelRunner whose step runs now (set by the wrapper below)

    def step(self, logits, state, slots, params, vocab) -> StepResult:
        res = super().step(logits, state, slots, params, vocab)
        plan = self.runner.current_plan
        if not plan.constraints:
            return res
        tokens, canvas = res.tokens.clone(), res.updates["canvas"].clone()
        for key in dict.fromkeys(c.automaton for c in plan.constraints):
            group = [c for c in plan.constraints if c.automaton == key]
            rows = torch.tensor([c.row for c in group])
            new, _ = constrained_tokens(res.dist, tokens[rows], group, self.runner.automata[key], vocab)
            tokens[rows] = new
            if self.mode == "input":
                canvas[rows] = torch.where(res.accepted[rows], new, canvas[rows])
        last, run = state.last_argmax.index_select(0, slots), state.run.index_select(0, slots)
        run = torch.where((tokens == last).all(-1), run + 1, torch.zeros_like(run))
        stable = run >= params.stability_threshold
        confident = res.dist.entropy.mean(-1) < params.confidence_threshold
        finished = (stable & confident) | (params.step <= 1)
        return StepResult(updates={"canvas": canvas, "last_argmax": tokens, "run": run}, tokens=tokens,
                          logprob=res.logprob, accepted=res.accepted, finished=finished, dist=res.dist)


class _EveryStepInput(_EveryStep):
    mode = "input"


_original = model_runner.ModelRunner.execute


def _execute(self, plan):
    self.current_plan = plan
    self.sampler.runner = self
    return _original(self, plan)


def run(mode: str, problems, tasks) -> dict:
    sampler = {"commit": None, "argmax": "every_step_argmax", "input": "every_step_input"}[mode]
    out = {}
    with LLM(diffusion_sampler=sampler) as llm:
        for task, (params_of, right) in tasks.items():
            chosen = problems[task]
            kwargs = {"tools": [WEATHER_TOOL]} if task == "weather" else {}
            results = llm.chat([p.messages() for p in chosen], [params_of(p) for p in chosen], use_tqdm=False, **kwargs)
            canvases = sum(r.metrics["canvases"] for r in results)
            steps = sum(r.metrics["denoising_steps"] for r in results)
            out[task] = (sum(right(p, r) for p, r in zip(chosen, results)) / len(chosen), steps / canvases)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=30)
    args = ap.parse_args()
    registry.SAMPLERS.update({"every_step_argmax": type("A", (_EveryStep,), {"name": "every_step_argmax"}),
                              "every_step_input": type("B", (_EveryStepInput,), {"name": "every_step_input"})})
    model_runner.ModelRunner.execute = _execute
    text = heldout_problems(args.problems)
    weather = heldout_problems(args.problems, tasks=("weather_call",))
    problems = {"json": text, "regex": text, "weather": weather}
    greedy = dict(temperature=0, seed=0, max_tokens=48)

    def json_right(p, r):
        try:
            return json.loads(r.text)["answer"] == p.answer
        except ValueError:
            return False

    def weather_right(p, r):
        city = p.question.removeprefix("weather in ")
        return r.text.replace("<|\"|>", '"').strip() == f'<|tool_call>call:get_weather{{city:"{city}"}}<tool_call|>'

    from blockdiff.entrypoints.openai.structured import tool_call_constraint
    from blockdiff.entrypoints.openai.protocol import Tool

    call = tool_call_constraint([Tool.model_validate(WEATHER_TOOL)], frozenset({"get_weather"}), parallel=False)
    tasks = {
        "json": (lambda p: SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(json=ANSWER)), json_right),
        "regex": (lambda p: SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(regex=SHAPES[p.task])),
                  lambda p, r: r.text == p.answer),
        "weather": (lambda p: SamplingParams(**greedy, structured_outputs=call, skip_special_tokens=False), weather_right),
    }
    print(f"{args.problems} held-out problems per task, greedy; accuracy, denoising steps per canvas")
    for mode in ("commit", "argmax", "input"):
        result = run(mode, problems, tasks)
        print(f"{mode:>7}: " + "; ".join(f"{task} {acc:.0%}, {spc:.1f} steps/canvas"
                                         for task, (acc, spc) in result.items()))


if __name__ == "__main__":
    main()
