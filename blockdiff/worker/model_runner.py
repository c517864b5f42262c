"""Runs one engine step on one rank: a forward over the step's rows, then the sampler.

Per-slot denoising state (the canvas, and the sampler's own: for the entropy-bound sampler the last
argmax canvas, its run length and the self-conditioning input) lives in preallocated device tensors
indexed by the request's slot, made by the sampler (one more, a scratch slot, takes the writes of
padded canvases). Each slot's position and sampler parameters live there too
(worker/request_slots.py), as its block tables do (worker/block_tables.py): a plan names the slots
that run. Every step runs one step function (worker/canvas_step.forward_step): a step whose rows
are all canvases being denoised runs it with static shapes (a padded bucket, compiled or replayed as
a CUDA graph, several steps per launch) where the runner has them; every other step (prompt chunks,
committed canvases, scored pieces beside canvases) runs it eagerly over the rows as they are. What
the host reads of a step is made in one place for both (`_finish`). Every rank runs the same
`execute` on the same `StepPlan`; with tensor parallelism the collectives inside keep them equal,
and rank 0 returns the results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from blockdiff.config import LOGPROBS_MODES
from blockdiff.diffusion.constrained import DeviceAutomaton, constrained_tokens
from blockdiff.diffusion.strategy import DiffusionSampler
from blockdiff.diffusion.sampler_kernels import choose_sampler_backend, sampler_kernels
from blockdiff.diffusion.vocab_parallel import Distribution, VocabParallel, workspace_bytes
from blockdiff.ops.kernels import step_modes, target
from blockdiff.model.attention import AttentionMetadata, build_metadata, calculate_kv_scales, keep_kv, run_active_rows
from blockdiff.model.attention_backends import choose_attention_backend
from blockdiff.model.interface import BlockDiffusionModel, layer_kinds
from blockdiff.model.lora_worker import WorkerLoRA
from blockdiff.step import AdapterPool, CacheConfig, MinTokens, ScorePlan, StepOutput, StepPlan
from blockdiff.worker.block_tables import BlockTables
from blockdiff.worker.canvas_step import CanvasOutputs, CanvasSteps, all_canvases, forward_step
from blockdiff.worker.cpu_heap import keep_freed_memory
from blockdiff.worker.kv_cache import allocate, geometry
from blockdiff.worker.penalties import SlotPenalties
from blockdiff.worker.request_slots import RequestSlots


@dataclass(frozen=True)
class RunnerSettings:
    """How a ModelRunner runs its steps: the executor makes it once from the EngineConfig."""

    tune_cpu_heap: bool = False  # keep freed memory in the heap (worker/cpu_heap.py), on the CPU
    sampler_memory_gb: float | None = None  # the sampler's workspace
    # All-canvas steps as the static step, compiled / replayed as CUDA graphs (the model needs
    # static shapes, `model.static_shapes`); compile None: the device's default.
    compile: bool | None = False
    cuda_graphs: bool = False
    steps_per_launch: int = 1  # denoising steps a steady-state step may run back to back (static step)
    attention_backend: str | None = None  # a name of model/attention_backends; None / "auto": the device's
    logprobs_mode: str = LOGPROBS_MODES[0]  # what committed tokens' logprobs report (VocabParallel.reported)
    adapters: AdapterPool | None = None  # --enable-lora's pool of adapter slots (model/lora_worker.py); None: no LoRA


class ModelRunner:
    def __init__(self, model: BlockDiffusionModel, cache: CacheConfig, device: torch.device | str,
                 sampler: DiffusionSampler, settings: RunnerSettings = RunnerSettings()):
        """sampler: how canvases are denoised (diffusion/registry.py). LoRA slots are filled by
        plans (StepPlan.adapter_loads) and named by requests (NewRequests.adapters)."""
        self.model = model
        self.sampler = sampler
        self.device = torch.device(device)
        if sampler.self_conditioning and not hasattr(model, "soft_embed"):
            raise ValueError(f"the {sampler.name} sampler self-conditions, which {type(model).__name__} cannot")
        if settings.logprobs_mode not in sampler.logprobs_modes:
            raise ValueError(f"--logprobs-mode {settings.logprobs_mode}: the {sampler.name} sampler reports "
                             f"{' or '.join(sampler.logprobs_modes)} only")
        if settings.tune_cpu_heap and self.device.type == "cpu":  # in every process that runs a model, each rank's included
            keep_freed_memory()
        self.cache_config = cache
        pool = settings.adapters  # with LoRA, the model's adapter-capable layers are replaced here
        self.lora = None if pool is None else WorkerLoRA(model, pool.slots, pool.max_rank, pool.host_cache,
                                                          cache.num_slots + 1, self.device)
        self.kv = allocate(model, cache, self.device)
        if cache.calculate_kv_scales and cache.kv_cache_dtype != "auto":
            calculate_kv_scales(model)
        backend = choose_attention_backend(self.device, model.dtype, settings.attention_backend, cache.kv_cache_dtype != "auto")
        self.geometry = replace(geometry(model, cache), backend=backend)
        self.kinds = layer_kinds(model)
        self.tables = BlockTables(cache, self.kinds, self.device)
        kernels = sampler_kernels(choose_sampler_backend(self.device))
        self.vocab = VocabParallel(model.shard, model.group, self.device, workspace_bytes(settings.sampler_memory_gb, self.device),
                                   kernels, settings.logprobs_mode)
        self.canvas_length = model.config.canvas_length
        self.state = sampler.new_state(cache.num_slots + 1, self.canvas_length, model.config.hidden_size, model.dtype,
                                       self.device)
        self.requests = RequestSlots(sampler, cache.num_slots + 1, self.device)
        self.penalties = SlotPenalties(cache.num_slots + 1, model.shard, self.device)
        self.automata: dict[str, DeviceAutomaton] = {}  # structured outputs' automata, by key (StepPlan.automata)
        # The fast denoising mode's: each slot's settled positions as the last step left them, on
        # the host (read back with the step's results), which choose the next step's rows; and each
        # layer's K/V of the canvases' positions as last computed (made at the first fast step).
        self.settled = np.zeros((cache.num_slots + 1, self.canvas_length), dtype=bool)
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.canvas_steps = None
        # Models whose step is not static (their experts read group sizes on the host) run eagerly.
        static = model.static_shapes(self.device)
        modes = step_modes(target(self.device), static, settings.compile, settings.cuda_graphs)
        self.steps_per_launch = settings.steps_per_launch if static else 1
        if modes.compile or modes.cuda_graphs or self.steps_per_launch > 1:
            self.canvas_steps = CanvasSteps(model, sampler, self.vocab, self.kv, self.geometry, self.tables.tables,
                                            self.state, self.requests, self.device, modes.compile, modes.cuda_graphs,
                                            self.steps_per_launch, self.penalties, self.lora)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput | None:
        self.tables.apply(plan.tables)
        if self.lora is not None:
            self.lora.load(plan.adapter_loads)
            if plan.new_requests is not None:
                self.lora.admit(plan.new_requests.slots, plan.new_requests.adapters)
        self.requests.admit(plan.new_requests)
        self.penalties.admit(plan.new_requests)
        rows = self.requests.rows(plan.rows)
        self.requests.advance(plan.rows)  # the rows above start where their slots stood before the step
        self.penalties.count(rows, plan.encoder_ids)  # committed canvases count before the next one denoises
        for key in plan.forget_automata:
            self.automata.pop(key, None)
        for key, automaton in plan.automata.items():
            self.automata[key] = DeviceAutomaton(automaton, self.vocab, self.device)
        # Decoder rows: the pieces of prompts scored this step first, then the canvases.
        scored = 0 if plan.score is None else len(plan.score.lengths)
        dec_rows = [r for r in rows if r.decoder][scored:]
        slots = torch.tensor([r.slot for r in dec_rows], dtype=torch.long, device=self.device)
        if plan.new_canvas_rows:
            self._start_canvases(plan, slots)
            self.settled[[dec_rows[i].slot for i in plan.new_canvas_rows]] = False
        score = {}
        fast = bool(plan.denoise and plan.denoise.get("fast"))
        evaluated = None
        if self.canvas_steps is not None and plan.score is None and all_canvases(rows) and not fast:
            # The step function with static shapes (a padded bucket), compiled or graphed.
            out = self.canvas_steps(rows, plan.denoise, plan.steps)[1].head(len(dec_rows))
        else:
            if plan.steps > 1:
                raise ValueError(f"{plan.steps} steps per launch need a step of canvases only, run as the static step")
            ids = plan.encoder_ids.to(self.device)
            scored_tokens = 0
            if plan.score is not None:
                ids = torch.cat((ids, plan.score.ids.to(self.device)))
                scored_tokens = plan.score.ids.shape[0]
            meta = build_metadata(rows, self.geometry, self.kinds, self.device, self.tables.tables)
            params = self.requests.step_params(slots, plan.denoise) if dec_rows else None
            images = None if plan.images is None else plan.images.to(self.device)
            if fast:
                evaluated = self._run_active_rows(meta, [r.slot for r in dec_rows], scored_tokens)
            if self.lora is not None:  # one mapping per step, on every LoRA layer, over the rows that run
                self.lora.set_rows(plan.rows, meta)
            score_logits, out = forward_step(self.model, self.sampler, self.vocab, self.kv, meta, self.state, slots,
                                             params, ids, scored_tokens, images,
                                             penalties=self.penalties.of([r.slot for r in dec_rows]))
            if plan.score is not None:
                score = self._score(score_logits, plan.score)
            if out is None:
                if not score:
                    return None
                return StepOutput(finished=torch.zeros(0, dtype=torch.bool), tokens=torch.zeros(
                    0, self.canvas_length, dtype=torch.long), logprob=None, top_logprobs=None, top_ids=None, **score)
        return self._finish(plan, slots, out, score, evaluated, [r.slot for r in dec_rows])

    def _run_active_rows(self, meta: AttentionMetadata, slots: list[int], scored: int) -> list[int]:
        """`meta` narrowed to the rows that run: every scored token and every canvas position not
        settled (decided on the host from what the last step read back); -> the rows each canvas runs."""
        if self.kept is None:
            self.kept = keep_kv(self.kv, self.settled.size, self.model.dtype, self.device)
        running = ~self.settled[slots]
        run_active_rows(meta, running, slots, scored, self.settled.shape[0] - 1, self.kept)
        return running.sum(-1).tolist()

    def _finish(self, plan: StepPlan, slots: torch.Tensor, out: CanvasOutputs, score: dict,
                evaluated: list[int] | None = None, host_slots: list[int] | None = None) -> StepOutput:
        """The canvases' new state kept, and what the host reads of the step: which finished, what
        they commit (min_tokens and structured outputs applied) and the logprobs asked for."""
        self.state.put(slots, out.updates)
        self.requests.stepped(slots, plan.steps)
        finished = out.finished.cpu()  # the only host sync the control flow below needs
        settled = None
        if "settled" in out.updates and evaluated is not None:  # read back with the step's results
            settled = out.updates["settled"].cpu()
            self.settled[host_slots] = np.array(settled.tolist(), dtype=bool).reshape(len(host_slots), -1)
        tokens, logprob, dist = out.tokens, out.logprob, out.dist
        if plan.steps > 1 and (plan.min_tokens is not None or plan.constraints or plan.top_logprobs >= 0):
            # they read the finishing step's distribution; `dist` is the last step's (engine._steps_per_launch)
            raise ValueError(f"{plan.steps} steps per launch cannot apply min_tokens, constraints or logprobs")
        if plan.min_tokens is not None:
            tokens, logprob = self._no_early_stops(tokens, logprob, dist, finished, plan.min_tokens)
        # Last: a constrained canvas commits what its automaton accepts, whatever came before.
        tokens, logprob = self._constrain(plan, finished, dist, tokens, logprob)
        top_lp = top_ids = None
        if plan.top_logprobs < 0:
            logprob = None
        elif bool(finished.any()):
            # Only a finished canvas's logprobs are read: top-k over the vocabulary for those alone,
            # and the tokens' and their alternatives' values reported together (one pass for raw).
            # `finished` is on the host already: its indices cost no device read.
            done = torch.tensor([i for i, f in enumerate(finished.tolist()) if f], dtype=torch.long, device=self.device)
            done_lp = logprob[done].unsqueeze(-1)
            if plan.top_logprobs > 0:
                top, done_ids = self.vocab.top_logprobs(dist, plan.top_logprobs, done)
                done_lp = torch.cat((done_lp, top), dim=-1)
            done_lp = self.vocab.reported(dist, done_lp, done)
            logprob = logprob.index_copy(0, done, done_lp[..., 0])
            if plan.top_logprobs > 0:
                top_lp = done_lp.new_zeros(*tokens.shape, plan.top_logprobs).index_copy_(0, done, done_lp[..., 1:])
                top_ids = done_ids.new_zeros(*tokens.shape, plan.top_logprobs).index_copy_(0, done, done_ids)
        return StepOutput(
            finished=finished,
            tokens=tokens.cpu(),
            logprob=None if logprob is None else logprob.cpu(),
            top_logprobs=None if top_lp is None else top_lp.cpu(),
            top_ids=None if top_ids is None else top_ids.cpu(),
            entropy=out.entropy.cpu() if plan.draft_details else None,
            accepted=out.accepted.cpu() if plan.draft_details else None,
            steps=out.steps.cpu() if plan.steps > 1 else None,
            settled=settled,
            rows_evaluated=evaluated,
            **score,
        )

    def _start_canvases(self, plan: StepPlan, slots: torch.Tensor) -> None:
        """The canvases that start this step take their steps n and canvas index, and the sampler's
        noise, counted from their request's seed and canvas index, where their draft has no token."""
        starting = slots[torch.tensor(plan.new_canvas_rows, device=self.device)]
        self.requests.start_canvases(starting, plan.new_canvas_steps, plan.new_canvas_index)
        params = self.requests.params
        noise = self.sampler.start_canvas(params.seed[starting], params.canvas[starting], self.canvas_length,
                                          self.vocab.shard.vocab_size)
        draft = plan.new_canvases.to(self.device)
        self.state.start(starting, torch.where(draft >= 0, draft, noise))

    def _score(self, logits: torch.Tensor, plan: ScorePlan) -> dict[str, torch.Tensor]:
        """The log-probability of each scored token under the model's distribution (temperature 1) at
        its own position, and its top alternatives: the logits stay sharded."""
        dist = self.vocab.distribution(logits.unsqueeze(0))
        out = {"score_logprob": self.vocab.token_logprob(dist, plan.ids.to(self.device).unsqueeze(0))[0].cpu()}
        if plan.top > 0:
            lp, ids = self.vocab.top_logprobs(dist, plan.top, torch.zeros(1, dtype=torch.long, device=self.device))
            out.update(score_top_logprobs=lp[0].cpu(), score_top_ids=ids[0].cpu())
        return out

    def _no_early_stops(self, tokens: torch.Tensor, logprob: torch.Tensor, dist: Distribution, finished: torch.Tensor,
                        rule: MinTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Finished canvases that would commit a banned token before their row's `before` position
        take the most likely token that is not banned there instead (SamplingParams.min_tokens)."""
        rows = (finished & (rule.before > 0)).nonzero().squeeze(1)
        if rows.numel() == 0:
            return tokens, logprob
        rows_d = rows.to(self.device)
        banned = rule.banned.to(self.device)[rows_d]  # [n, K]
        lp, ids = self.vocab.top_logprobs(dist, banned.shape[1] + 1, rows_d)  # [n, CL, K + 1]
        allowed = ~(ids.unsqueeze(-1) == banned[:, None, None, :]).any(-1)
        first = allowed.int().argmax(-1, keepdim=True)  # K + 1 candidates hold at least one allowed token
        alt_ids, alt_lp = ids.gather(-1, first).squeeze(-1), lp.gather(-1, first).squeeze(-1)
        early = torch.arange(self.canvas_length, device=self.device) < rule.before.to(self.device)[rows_d, None]
        sub = tokens[rows_d]
        bad = early & (sub.unsqueeze(-1) == banned[:, None, :]).any(-1)
        tokens, logprob = tokens.clone(), logprob.clone()
        tokens[rows_d] = torch.where(bad, alt_ids, sub)
        logprob[rows_d] = torch.where(bad, alt_lp, logprob[rows_d])
        return tokens, logprob

    def _constrain(self, plan: StepPlan, finished: torch.Tensor, dist: Distribution, tokens: torch.Tensor,
                   logprob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens` and `logprob` [canvases, CL] with those of the finished constrained canvases
        replaced by their constrained commits (diffusion/constrained.py); the others as they are."""
        done = [c for c in plan.constraints if finished[c.row]]
        if not done:
            return tokens, logprob
        tokens, logprob = tokens.clone(), logprob.clone()
        for key in dict.fromkeys(c.automaton for c in done):  # the same order on every rank
            group = [c for c in done if c.automaton == key]
            rows = torch.tensor([c.row for c in group], device=tokens.device)
            new, lp = constrained_tokens(dist, tokens[rows], group, self.automata[key], self.vocab)
            tokens[rows], logprob[rows] = new, lp
        return tokens, logprob
