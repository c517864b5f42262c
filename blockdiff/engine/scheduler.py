"""Which requests run this step, and on what resources. The scheduler owns the queues, the slots
and, through the KV cache manager, the cache blocks; it changes a request only to admit or preempt it.

Every step each running request, oldest admission first, contributes one row: its uncached tokens
(PREFILL: a prompt chunk, at most `max_prefill_tokens` per step across requests; COMMIT: its
finished canvas) or its canvas being denoised (DENOISE). Blocks are taken as rows need them; when
the pool runs out, the newest running requests are preempted (in any state) until the row fits, and
recomputed from their tokens when readmitted, as vLLM v1 does. Then waiting requests are admitted,
first come first served, while a slot is free and the cache holds their first chunk after the
prefix they find cached: admission asks for what a request needs now, not its worst case. A request
whose cached prefix stops at a block that a running request is prefilling (the choices of one
prompt) waits until it is registered, rather than computing it again beside it; the requests
queued after it go first.

Fairness is per client (`Request.client`; the server's is the caller's address): every engine
request counts, so one API call's choices and prompts count as many, and a request scoring its
prompt counts twice while it does (`Request.share`: the piece it scores each step is a decoder row
beside its own). The next request admitted (the head) is the first waiting one of the client with
the smallest running share. When the head
cannot be admitted, running requests that have committed `preempt_after` canvases since their
admission give up their slot and blocks at their canvas boundary (COMMIT) and go to the back of the
queue: those of the client with the most requests running first (oldest admission first among
them), and only requests of the head's own client or of clients running more than it. The head
therefore starts within one canvas of some running request, at most the engine's denoising-steps
limit plus a commit step once the running requests have had `preempt_after` canvases each; a
client's waiting request is behind the heads of the clients running fewer requests, not behind
every request queued before it. Before its canvas boundary, in any state, a running request gives
its slot at once to another client's head whose client runs less even once the swap is made (so two
clients never trade a slot back and forth), where prefix caching keeps what it prefilled for its
readmission: a call of many long or scored prompts does not hold every slot for as many steps as
its prompts take, nor do a call's choices, admitted together and so committing at the same step,
hold every slot for a whole canvas (up to the steps limit). Those that lose nothing give first (a
prompt being prefilled or scored, a canvas boundary), then canvases being denoised, the fewest
steps run first: such a canvas starts again from the same random numbers. So while a client runs
more requests than another by more than one (share), the other's head starts at the next step.

A step's rows are a share too: while more than one client has requests running, each
client's canvases denoised in a step are at most its even part of the slots (`num_slots` / the
clients, rounded up), those that ran longest ago first (`Request.denoised_at`), the others waiting
their turn with their slot and canvas kept; prompt chunks, commits and scored pieces are not held
back. A step's time grows with its rows (16 canvases on a 1,000-token context took 2-5 x one), so
one client's many canvases would otherwise set the length of every step of another client's
request. A canvas's random numbers are counted by its own steps, so turns change no output; alone,
a client's canvases all run every step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from blockdiff.engine.kv_cache_manager import KVCacheManager
from blockdiff.engine.request import Request, State


@dataclass
class SchedulerOutput:
    encoder: list[tuple[Request, int]]  # requests with uncached tokens, and how many run this step
    decoder: list[Request]  # requests whose canvas is denoised this step
    preempted: list[Request]
    # Requests scoring a piece [start, end) of their prompt this step: the decoder over the piece, which
    # reads the cache before it; the same step may prefill the piece (the cache is written after reads)
    score: list[tuple[Request, tuple[int, int]]] = field(default_factory=list)


class Scheduler:
    def __init__(self, num_slots: int, kv: KVCacheManager, max_prefill_tokens: int, preempt_after: int | None):
        self.kv = kv
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.preempt_after = preempt_after
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in order of admission
        self.num_preemptions = 0
        self.num_steps = 0  # steps scheduled: when each canvas last ran (Request.denoised_at)
        # the adapters' device slots, a resource like the slots (set by the engine where adapters are enabled):
        # available(request), acquire(request) as it is admitted, release(request) as it leaves
        self.adapters = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, request: Request) -> None:
        """Give back the slot and cache blocks of a request that finished or was aborted."""
        if request.slot is not None:  # admitted: it holds a slot until now
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def cached(self, request: Request, n: int) -> None:
        """n more tokens of `request` went through the encoder."""
        request.cached(n)
        self.kv.cached(request)

    def _free(self, request: Request) -> None:
        if self.adapters is not None:
            self.adapters.release(request)
        self.free_slots.append(request.slot)
        self.kv.free(request)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.preempt()
        self.waiting.append(req)
        self.num_preemptions += 1

    def _fits(self, req: Request) -> bool:
        return bool(self.free_slots) and self.kv.can_admit(req, self.max_prefill_tokens)

    def _shares(self) -> Counter:
        """Each client's share of the running requests (Request.share)."""
        running = Counter()
        for req in self.running:
            running[req.client] += req.share
        return running

    def _head(self, running: Counter, deferred: frozenset | set = frozenset()) -> Request | None:
        """The waiting request to admit next: the first of the client with the smallest running share,
        passing over the requests `deferred` this step."""
        firsts: dict[str | None, int] = {}
        for i, req in enumerate(self.waiting):
            if req not in deferred:
                firsts.setdefault(req.client, i)
        if not firsts:
            return None
        i = min(firsts.values(), key=lambda i: (running[self.waiting[i].client], i))
        return self.waiting[i]

    def _preempt_for_waiting(self) -> list[Request]:
        """Make room for the head from requests at a canvas boundary that had their share."""
        preempted = []
        if self.preempt_after is None or not self.waiting:
            return preempted
        running = self._shares()
        head = self._head(running)
        # The busiest clients give first; a client running no more than the head's keeps its slots.
        # Within a client, those that lose nothing (at a canvas boundary, or prefilling into the
        # prefix cache) before those that lose the denoising steps of their canvas, fewest first.
        for req in sorted(self.running, key=lambda r: (-running[r.client], r.state == State.DENOISE,
                                                       r.canvas_steps_done)):
            if self._fits(head):
                break
            if not self._yields(req, head, running):
                continue
            running[req.client] -= req.share
            self._preempt(req)
            preempted.append(req)
        return preempted

    def _yields(self, req: Request, head: Request, running: Counter) -> bool:
        """Whether `req` gives its slot to `head` now: at a canvas boundary once it has had its
        canvases (its own client's head, or one of a client running less); or, in any other state,
        to another client's head whose client runs less even once the swap is made (so two clients
        never trade a slot back and forth): a long prompt, a scoring request's piece after piece,
        or a canvas at the steps limit would otherwise hold it for as many steps, and one client's
        choices, admitted together, hold every slot until they all commit at once. What it
        prefilled stays in the prefix cache, which its readmission finds; a canvas being denoised
        starts again from the same random numbers, which costs the steps it had run."""
        if req.state == State.COMMIT and req.canvases_since_admitted >= self.preempt_after:
            return req.client == head.client or running[req.client] > running[head.client]
        return (req.client != head.client and self.kv.full.caching
                and running[req.client] - req.share > running[head.client])

    def schedule(self) -> SchedulerOutput | None:
        """-> this step's requests, or None if nothing can run."""
        preempted = self._preempt_for_waiting()
        out_of_memory = False
        encoder, decoder, score = [], [], []
        budget = self.max_prefill_tokens
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.state == State.DENOISE:
                decoder.append(req)
                i += 1
                continue
            n = req.num_tokens - req.num_cached
            piece = req.piece_to_score() if req.state == State.PREFILL else None
            if req.state == State.PREFILL:
                n = min(n, budget) if piece is None or req.prefills_after_scoring(piece) else 0
                if n > 0:
                    n = req.chunk(req.num_cached, n)
                if n <= 0:
                    if piece is not None:
                        score.append((req, piece))
                    i += 1
                    continue
            while not self.kv.grow(req, req.num_cached + n):  # out of blocks: the newest request goes
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                out_of_memory = True
                if victim is req:
                    break
            if req.state == State.WAITING:  # it was the newest: nothing after it runs either
                break
            encoder.append((req, n))
            if piece is not None:
                score.append((req, piece))
            if req.state == State.PREFILL:
                budget -= n
            i += 1
        running = self._shares()
        deferred = set()  # requests that wait for a prefix being prefilled
        while self.waiting and self.free_slots and not out_of_memory:
            req = self._head(running, deferred)
            if req is None:
                break
            if self.adapters is not None and not self.adapters.available(req):  # it waits for an adapter slot
                break
            if self.kv.computing(req, self.running):
                deferred.add(req)
                continue
            hit = self.kv.admit(req, budget)
            if hit is None:
                break
            self.waiting.remove(req)
            req.admit(self.free_slots.pop(), hit)
            if self.adapters is not None:
                self.adapters.acquire(req)
            self.running.append(req)
            running[req.client] += req.share
            if req.state == State.DENOISE:  # everything was cached
                decoder.append(req)
                continue
            piece = req.piece_to_score()  # the cache holds the prompt before its next piece to score
            if piece is not None:
                score.append((req, piece))
            if piece is None or req.prefills_after_scoring(piece):
                n = req.chunk(req.num_cached, min(req.num_tokens - req.num_cached, budget))
                if n > 0:
                    encoder.append((req, n))
                    budget -= n
        decoder = self._canvases(decoder)
        if not encoder and not decoder and not score:
            return None
        self.num_steps += 1
        return SchedulerOutput(encoder, decoder, preempted, score)

    def _canvases(self, decoder: list[Request]) -> list[Request]:
        """The canvases denoised this step: while more than one client has requests running, each
        client's at most its even part of the slots, those that ran longest ago first. A client's
        many canvases would otherwise make every step, and so every step of another client's
        request, as long as theirs. (A client whose requests only wait has no step to speed up:
        holding back the others' canvases would make it wait longer for their slots.)"""
        clients = {r.client for r in self.running}
        if len(clients) < 2:
            return decoder
        cap = -(-self.num_slots // len(clients))
        by_client: dict[str | None, list[Request]] = {}
        for req in decoder:
            by_client.setdefault(req.client, []).append(req)
        skipped = set()
        for reqs in by_client.values():
            skipped.update(sorted(reqs, key=lambda r: r.denoised_at)[cap:])  # stable: oldest admission first
        decoder = [r for r in decoder if r not in skipped]
        for req in decoder:
            req.denoised_at = self.num_steps
        return decoder
