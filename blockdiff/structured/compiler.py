"""Token automata for an engine's vocabulary: built once per constraint, in a child process bounded
in time and memory (builds.py), and cached; and a request's constraint as the engine carries it
from canvas to canvas.

A cached automaton is returned at once (`cached`), without waiting for any build. A new one is
built by a small pool, fair across clients (`start`, then wait on the build's future); requests
for one constraint share its build, and a build whose requests have all left (`leave`) is killed.
A constraint that could not be built is refused again, without building, for FAILURE_TTL seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import pickle
import threading
import time
from collections import OrderedDict

import numpy as np

from blockdiff.step import UNREACHABLE, Automaton, CanvasConstraint
from blockdiff.sampling_params import InvalidParam, StructuredOutputsParams
from blockdiff.structured.builds import Build, BuildPool
from blockdiff.structured.regexes import MAX_REGEX_CHARS, regex_job
from blockdiff.structured.vocabulary import token_bytes
from blockdiff.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CACHE_SIZE = 64  # automata kept (each holds an int32 per vocabulary token)
FAILURE_TTL = 300.0  # seconds a constraint that could not be built is refused without building again
# A byte DFA of more states is refused (its table takes 2 KiB a state, and every walk grows with it).
MAX_STATES = 2**18


class StructuredOutputs:
    """Builds and caches the token automata of one tokenizer and model vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, timeout: float, memory: int, builds: int,
                 cache_size: int = CACHE_SIZE):
        """timeout, memory, builds: each build's seconds and bytes of address space, and the builds
        at once (EngineConfig's structured_outputs_* flags)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.pool = BuildPool(builds, timeout, memory, self._finish)
        self._cache: OrderedDict[str, Automaton] = OrderedDict()
        self._failed: dict[str, tuple[float, InvalidParam]] = {}  # key -> (until, the refusal)
        self._building: dict[str, Build] = {}
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, ...], list[bytes | None]] = {}
        self._vocabulary = hashlib.sha256(tokenizer._tok.to_str().encode() + str(vocab_size).encode()).hexdigest()[:16]

    def key(self, spec: StructuredOutputsParams) -> str:
        return hashlib.sha256((self._vocabulary + spec.key()).encode()).hexdigest()[:24]

    def cached(self, key: str) -> Automaton | None:
        """The automaton of `key` if it is built; raises the refusal of a recent failed build."""
        with self._lock:
            automaton = self._cache.get(key)
            if automaton is not None:
                self._cache.move_to_end(key)
                return automaton
            failed = self._failed.get(key)
            if failed is not None:
                if failed[0] > time.monotonic():
                    raise failed[1]
                del self._failed[key]
        return None

    def start(self, key: str, spec: StructuredOutputsParams, client: str) -> Build:
        """The build of `key`, joined if one runs or waits, else queued against `client`; the
        caller waits on its future, and calls `leave` if it stops waiting. InvalidParam for a
        constraint refused before any build (its keywords, its special tokens)."""
        with self._lock:
            build = self._building.get(key)
            if build is not None and not build.cancelled:
                build.waiters += 1
                return build
        if importlib.util.find_spec("outlines_core") is None:
            raise InvalidParam("structured_outputs", "structured outputs need the outlines-core package, which this "
                                                     "server lacks: pip install outlines-core")
        job = (regex_job(spec), self._token_bytes(spec.special_tokens), self.vocab_size, MAX_REGEX_CHARS, MAX_STATES)
        build = Build(key, client, pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        with self._lock:
            running = self._building.get(key)
            if running is not None and not running.cancelled:  # another thread queued it meanwhile
                running.waiters += 1
                return running
            self._building[key] = build
        self.pool.submit(build)
        return build

    def leave(self, build: Build) -> None:
        """One request stopped waiting for `build`; the last one cancels it."""
        with self._lock:
            build.waiters -= 1
            last = build.waiters == 0 and not build.future.done()
            if last and self._building.get(build.key) is build:
                del self._building[build.key]
        if last:
            self.pool.cancel(build)

    def automaton(self, spec: StructuredOutputsParams, client: str = "") -> Automaton:
        """The automaton of `spec`, from the cache or built now (blocking); InvalidParam when the
        constraint cannot be served."""
        key = self.key(spec)
        automaton = self.cached(key)
        if automaton is not None:
            return automaton
        return self.start(key, spec, client).future.result()

    def close(self) -> None:
        """Kill the running builds (the engine is stopping)."""
        self.pool.close()

    def _finish(self, build: Build, outcome: dict | BaseException) -> Automaton:
        """(In the build's thread) the automaton, or the refusal, cached (a refusal for FAILURE_TTL)."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            a = Automaton(key=build.key, **outcome)
            log.info("structured output %s: automaton of %d states, %d atoms, %d transitions", build.key, a.num_states,
                     a.num_atoms, len(a.src))
            if a.distance[a.initial] >= UNREACHABLE:
                raise InvalidParam("structured_outputs", "no output of this vocabulary satisfies the constraint")
        except InvalidParam as e:
            with self._lock:
                self._failed[build.key] = (time.monotonic() + FAILURE_TTL, e)
            raise
        finally:
            with self._lock:
                if self._building.get(build.key) is build:
                    del self._building[build.key]
        with self._lock:
            self._cache[build.key] = a
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return a

    def _token_bytes(self, symbols: tuple[str, ...]) -> list[bytes | None]:
        with self._lock:
            tokens = self._tokens.get(symbols)
        if tokens is None:
            try:
                tokens = token_bytes(self.tokenizer, symbols)
            except ValueError as e:
                raise InvalidParam("structured_outputs", f"structured_outputs.special_tokens: {e}") from None
            tokens += [None] * (self.vocab_size - len(tokens))
            with self._lock:
                self._tokens[symbols] = tokens
        return tokens[: self.vocab_size]


class OutputConstraint:
    """A request's constraint: its automaton, the tokens that end the output, and the state its
    committed output has reached."""

    def __init__(self, automaton: Automaton, ends: tuple[int, ...], min_tokens: int = 0, max_tokens: int = 0):
        """min_tokens, max_tokens: the request's, where no end token may come before min_tokens
        (an automaton whose every state goes on: vocabulary restrictions); 0: no such rule."""
        self.automaton = automaton
        self.ends = ends
        self.state = automaton.initial
        self.min_tokens, self.max_tokens = min_tokens, max_tokens

    def commit(self, tokens: list[int]) -> None:
        """A canvas's committed tokens (the output cut at its end already) move the state on."""
        cut = next((i for i, t in enumerate(tokens) if t in self.ends), len(tokens))
        self.state = self.automaton.walk(self.state, tokens[:cut])

    @property
    def complete(self) -> bool:
        """The text is accepted and nothing may follow it: as if the model had ended it."""
        return bool(self.automaton.final[self.state]) and self.state not in self.automaton.sources

    def canvas(self, row: int, remaining: int) -> CanvasConstraint:
        # remaining: what max_tokens leaves after the output so far
        ends_from = max(0, self.min_tokens - (self.max_tokens - remaining)) if self.min_tokens else 0
        return CanvasConstraint(row, self.automaton.key, self.state, remaining, self.ends, ends_from)


def check_ends(automaton: Automaton, ends: set[int]) -> tuple[int, ...]:
    """The end tokens of a constrained request: at least one, none that the automaton may emit as text."""
    if not ends:
        raise InvalidParam("structured_outputs", "a structured output needs a token that ends it (EOS, or "
                                                 "stop_token_ids); ignore_eos leaves none")
    content = sorted(t for t in ends if 0 <= t < len(automaton.atom_of) and automaton.atom_of[t] >= 0)
    if content:
        raise InvalidParam("stop_token_ids", f"stop_token_ids {content[:4]} are tokens a structured output may contain: "
                                             "only special tokens may end it")
    return tuple(sorted(ends))


def tokens_needed(automaton: Automaton) -> int:
    """The fewest tokens any accepted output has."""
    return int(np.asarray(automaton.distance)[automaton.initial])
