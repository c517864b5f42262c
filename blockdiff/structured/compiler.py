"""Token automata for an engine's vocabulary: built once per constraint, in a child process with a
time bound, and cached; and a request's constraint as the engine carries it from canvas to canvas.

A build runs `index.py` as a fresh interpreter (outlines-core releases the GIL, but a thread could
not be stopped at the bound): past `timeout` seconds the process is ended and the request refused.
Callers that must not block (the server's event loop) call `automaton` from a worker thread
(`EngineClient.prepare`); concurrent requests for one constraint wait for the same build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
import numpy as np

from blockdiff.diffusion.constrained import UNREACHABLE, Automaton, CanvasConstraint
from blockdiff.sampling_params import InvalidParam, StructuredOutputsParams
from blockdiff.structured.regexes import to_regex
from blockdiff.structured.vocabulary import token_bytes
from blockdiff.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_INDEX_SCRIPT = os.path.join(os.path.dirname(__file__), "index.py")
DEFAULT_TIMEOUT = 60.0  # seconds a build may take
CACHE_SIZE = 64  # automata kept (each holds an int32 per vocabulary token)


class StructuredOutputs:
    """Builds and caches the token automata of one tokenizer and model vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout: float = DEFAULT_TIMEOUT,
                 cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout = timeout
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Automaton] = OrderedDict()
        self._building: dict[str, Future] = {}
        self._lock = threading.Lock()
        # One build at a time: each takes a core and its own copy of the vocabulary for up to
        # `timeout` s, so many new schemas at once queue here instead of starting a process each.
        self._one_build = threading.Lock()
        self._tokens: dict[tuple[str, ...], list[bytes | None]] = {}
        self._vocabulary = hashlib.sha256(tokenizer._tok.to_str().encode() + str(vocab_size).encode()).hexdigest()[:16]

    def key(self, spec: StructuredOutputsParams) -> str:
        return hashlib.sha256((self._vocabulary + spec.key()).encode()).hexdigest()[:24]

    def automaton(self, spec: StructuredOutputsParams) -> Automaton:
        """The automaton of `spec`, from the cache or built now (blocking, at most `timeout` s);
        InvalidParam when the constraint cannot be served."""
        key = self.key(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._building.get(key)
            owner = future is None
            if owner:
                future = self._building[key] = Future()
        if not owner:
            return future.result()
        try:
            automaton = self._build(key, spec)
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                self._building.pop(key, None)
        with self._lock:
            self._cache[key] = automaton
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.set_result(automaton)
        return automaton

    def _build(self, key: str, spec: StructuredOutputsParams) -> Automaton:
        if importlib.util.find_spec("outlines_core") is None:
            raise InvalidParam("structured_outputs", "structured outputs need the outlines-core package, which this "
                                                     "server lacks: pip install outlines-core")
        regex = to_regex(spec)
        tokens = self._token_bytes(spec.special_tokens)
        job = pickle.dumps((regex, tokens, self.vocab_size), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._one_build:
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, _INDEX_SCRIPT], input=job, capture_output=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise InvalidParam("structured_outputs", f"the constraint's automaton took longer than {self.timeout:g} s "
                                                     "to build for this vocabulary: simplify the schema") from None
        if proc.returncode != 0:
            reason = proc.stderr.decode(errors="replace").strip().splitlines()
            raise InvalidParam("structured_outputs", f"the constraint cannot be built: {reason[-1] if reason else 'exit ' + str(proc.returncode)}")
        arrays = pickle.loads(proc.stdout)
        a = Automaton(key=key, **arrays)
        log.info("structured output %s: automaton of %d states, %d atoms, %d transitions built in %.2f s", key,
                 a.num_states, a.num_atoms, len(a.src), time.perf_counter() - t0)
        if a.distance[a.initial] >= UNREACHABLE:
            raise InvalidParam("structured_outputs", "no output of this vocabulary satisfies the constraint")
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

    def __init__(self, automaton: Automaton, ends: tuple[int, ...]):
        self.automaton = automaton
        self.ends = ends
        self.state = automaton.initial

    def commit(self, tokens: list[int]) -> None:
        """A canvas's committed tokens (the output cut at its end already) move the state on."""
        cut = next((i for i, t in enumerate(tokens) if t in self.ends), len(tokens))
        self.state = self.automaton.walk(self.state, tokens[:cut])

    @property
    def complete(self) -> bool:
        """The text is accepted and nothing may follow it: as if the model had ended it."""
        return bool(self.automaton.final[self.state]) and self.state not in self.automaton.sources

    def canvas(self, row: int, remaining: int) -> CanvasConstraint:
        return CanvasConstraint(row, self.automaton.key, self.state, remaining, self.ends)


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
