"""The demo's checkable tasks.

Three text tasks: sorting digits, reversing words, upper-casing words. Beside them, agent tasks in
the Gemma 4 format of the chat template (blockdiff/demo/tokenizer.py): with the `get_weather` tool
declared, `weather in Paris` is answered with a call `get_weather{city:"Paris"}`; once the tool's
result comes back, with `Paris: 18C sunny`; a text question asked while the tool is declared is
answered as text; and with thinking on, a text answer is preceded by a thought naming the task.

Every problem has exactly one right answer. A problem belongs to the held-out set when a hash of
its conversation says so; training never draws such a problem and the evaluation draws only those,
so the two are disjoint whatever the seeds.
"""

from __future__ import annotations

import random
import string
import zlib
from dataclasses import dataclass

TASKS = ("sort", "reverse", "upper")
AGENT_TASKS = ("weather_call", "weather_answer", "tools_text", "think")
HELD_OUT_SHARE = 10  # one question in this many is held out
EVAL_SEED = 20_240_601

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITIES = (
    "Paris", "London", "Rome", "Berlin", "Madrid", "Oslo", "Tokyo", "Lima", "Cairo", "Delhi", "Seoul",
    "Sydney", "Boston", "Dublin", "Vienna", "Prague", "Athens", "Lisbon", "Warsaw", "Nairobi",
)
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
THOUGHTS = {"sort": "I sort the digits.", "reverse": "I reverse the word.", "upper": "I upper-case the word."}


@dataclass(frozen=True)
class Problem:
    task: str
    question: str
    answer: str  # the model's whole reply, in the template's format (a call, a thought, text)
    tools: bool = False  # WEATHER_TOOL is declared
    thinking: bool = False  # the template's enable_thinking
    tool_result: str | None = None  # weather_answer: the tool's reply to the earlier call

    def messages(self) -> list[dict]:
        """The conversation whose next reply is `answer`."""
        out = [{"role": "user", "content": self.question}]
        if self.tool_result is not None:
            city = self.question.removeprefix("weather in ")
            out += [
                {"role": "assistant", "content": "", "tool_calls": [weather_call(city, "call_0")]},
                {"role": "tool", "tool_call_id": "call_0", "content": self.tool_result},
            ]
        return out

    def template_kwargs(self) -> dict:
        """The chat template's variables beside the messages."""
        out: dict = {}
        if self.tools:
            out["tools"] = [WEATHER_TOOL]
        if self.thinking:
            out["enable_thinking"] = True
        return out


def weather_call(city: str, call_id: str) -> dict:
    """An assistant message's tool call of get_weather, as an OpenAI client sends it back."""
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


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
    if task == "weather_call":
        city = _city(rng)
        call = 'call:get_weather{city:<|"|>' + city + '<|"|>}'
        return Problem(task, "weather in " + city, "<|tool_call>" + call + "<tool_call|>", tools=True)
    if task == "weather_answer":
        city, report = _city(rng), f"{rng.randint(0, 35)}C {rng.choice(CONDITIONS)}"
        return Problem(task, "weather in " + city, f"{city}: {report}", tools=True, tool_result=report)
    if task == "tools_text":
        inner = make_problem(rng.choice(TASKS), rng)
        return Problem(task, inner.question, inner.answer, tools=True)
    if task == "think":
        inner = make_problem(rng.choice(TASKS), rng)
        thought = "<|channel>thought\n" + THOUGHTS[inner.task] + "<channel|>"
        return Problem(task, inner.question, thought + inner.answer, thinking=True)
    raise ValueError(f"unknown demo task {task!r}; the tasks are {', '.join(TASKS + AGENT_TASKS)}")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))


def _city(rng: random.Random) -> str:
    """A real city half the time, else a made-up name, so that the model learns to copy any name."""
    if rng.random() < 0.5:
        return rng.choice(CITIES)
    return _word(rng).capitalize()


def held_out(problem: Problem) -> bool:
    return zlib.crc32((problem.question + (problem.tool_result or "")).encode()) % HELD_OUT_SHARE == 0


def training_problems(rng: random.Random, tasks: tuple[str, ...] = TASKS + AGENT_TASKS):
    """An endless stream of training problems, the tasks in equal shares, none of them held out."""
    while True:
        problem = make_problem(rng.choice(tasks), rng)
        if not held_out(problem):
            yield problem


def heldout_problems(n: int, seed: int = EVAL_SEED, tasks: tuple[str, ...] = TASKS) -> list[Problem]:
    """n distinct held-out problems, the tasks taking turns."""
    if n < 1:
        raise ValueError(f"the number of problems must be >= 1, got {n}")
    rng = random.Random(seed)
    seen: set[tuple] = set()
    out: list[Problem] = []
    while len(out) < n:
        problem = make_problem(tasks[len(out) % len(tasks)], rng)
        key = (problem.question, problem.tool_result, problem.tools, problem.thinking)
        if held_out(problem) and key not in seen:
            seen.add(key)
            out.append(problem)
    return out


def is_correct(problem: Problem, text: str) -> bool:
    """The generated text (the template's markers kept, other special tokens removed) answers the problem."""
    return text.strip() == problem.answer
