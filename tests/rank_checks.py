"""Functions the tensor-parallel tests run on every rank of a real process group
(`RankProcesses.run`). They live apart from the test modules so a spawned rank imports only this."""

from __future__ import annotations

import os
import signal

import torch

from blockdiff.parallel.self_conditioning import soft_embedding
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.parallel.ranks import RankContext
from blockdiff.parallel.vocab import VocabShard


def local_rows(shard: VocabShard, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows (dim 0) of a full-vocabulary tensor, padding rows zero."""
    out = full.new_zeros((shard.local_rows, *full.shape[1:]))
    out[: shard.num_org] = full[shard.org_start : shard.org_end]
    out[shard.org_rows : shard.org_rows + shard.num_added] = full[shard.added_start : shard.added_end]
    return out


def local_columns(shard: VocabShard, full: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary columns (last dim) of a full-vocabulary tensor, padding zero."""
    return local_rows(shard, full.movedim(-1, 0)).movedim(0, -1).contiguous()


def vocab_statistics(ctx: RankContext, logits: torch.Tensor, u: torch.Tensor, k: int) -> dict:
    """The sampler's statistics of full-vocabulary `logits` [..., V], computed from this rank's
    shard of them; on a group of one rank, the single-device computation."""
    shard = VocabShard.make(ctx.rank, ctx.size, logits.shape[-1])
    vocab = VocabParallel(shard, ctx.group)
    ctx.group.counter.reset()
    d = vocab.distribution(local_columns(shard, logits))
    argmax, sample = vocab.argmax_and_sample(d, u)
    step = (ctx.group.counter.calls, ctx.group.counter.bytes)  # what the sampler's step moves
    top_lp, top_ids = vocab.top_logprobs(d, k, torch.arange(logits.shape[0]))
    alone = vocab.argmax(d)  # what a sampler that only takes the argmax reduces (confidence-threshold)
    return {
        "argmax_alone": alone,
        "entropy": d.entropy,
        "argmax": argmax,
        "sample": sample,
        "top_logprobs": top_lp,
        "top_ids": top_ids,
        "local_probs": d.shifted.exp() / d.total.unsqueeze(-1),  # this rank's P_r, the self-conditioning input
        "global_ids": shard.global_ids(),
        "step_collectives": step[0],
        "step_bytes": step[1],
        "bytes": ctx.group.counter.bytes,
    }


def sharded_soft_embedding(ctx: RankContext, probs, weight, scale, org_vocab, added_vocab, local_probs: bool):
    """soft_embedding on this rank's rows of `weight`, from full-vocabulary or local probabilities."""
    shard = VocabShard.make(ctx.rank, ctx.size, org_vocab, added_vocab)
    p = local_columns(shard, probs) if local_probs else probs
    return soft_embedding(p, local_rows(shard, weight), scale, shard, ctx.group)


def fail_on_rank(ctx: RankContext, rank: int) -> int:
    if ctx.rank == rank:
        raise ArithmeticError(f"deliberate failure on rank {rank}")
    ctx.group.all_reduce(torch.zeros(1))
    return ctx.rank


def pid(ctx: RankContext) -> int:
    return os.getpid()


def die_on_rank(ctx: RankContext, rank: int) -> int:
    """Rank `rank` is killed while the others wait for it in a collective."""
    if ctx.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.group.all_reduce(torch.zeros(1))
    return ctx.rank


def image_prompt_logits(ctx: RankContext, path: str, ids, per_image, spans, canvas) -> torch.Tensor:
    """Full-vocabulary logits of `canvas` after a prompt with images, from this rank's shard of the
    model (every rank encodes the images with its replicated vision tower)."""
    from helpers import Harness

    from blockdiff.model.loader import load_model
    from blockdiff.step import ImageInputs

    model = load_model(path, group=ctx.group)
    index = torch.tensor([i for i, t in enumerate(ids) if t == model.config.vision.image_token_id])
    images = ImageInputs([p for p, _ in per_image], [q for _, q in per_image], torch.arange(len(index)), index)
    harness = Harness(model)
    harness.encode(ids, images, tuple(spans))
    local = harness.decode(canvas)
    full = local.new_zeros(local.shape[0], model.config.vocab_size)
    owned = model.shard.global_ids() >= 0
    full[:, model.shard.global_ids()[owned]] = local[:, owned]
    return ctx.group.all_reduce(full) if ctx.size > 1 else full


def tiled_sampler(ctx: RankContext, logits: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, workspace: int | None,
                  all_rows: bool = False) -> dict:
    """The sampler's outputs from this rank's shard of full-vocabulary `logits` [canvases, CL, V]
    with a workspace of `workspace` bytes (None: one tile), and the self-conditioning input over
    `weight` [V, hidden]: what must not change with the tiling."""
    shard = VocabShard.make(ctx.rank, ctx.size, logits.shape[-1])
    vocab = VocabParallel(shard, ctx.group, workspace_bytes=workspace)
    ctx.group.counter.reset()
    d = vocab.distribution(local_columns(shard, logits))
    argmax, sample = vocab.argmax_and_sample(d, u)
    step = (ctx.group.counter.calls, ctx.group.counter.bytes)
    # all canvases (None), or a subset out of order, as the runner passes the canvases that go on
    rows = None if all_rows else torch.tensor([2, 0])
    seen = []

    def embed(probs: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        seen.append(probs.shape[0])
        return soft_embedding(probs, local_rows(shard, weight), (1.0 / total).unsqueeze(-1), shard, ctx.group)

    soft = vocab.soft_embed(d, rows, embed, torch.float32)
    top_lp, top_ids = vocab.top_logprobs(d, 3, torch.tensor([2, 0]))
    return {
        "entropy": d.entropy, "argmax": argmax, "sample": sample, "total": d.total,
        "probs": d.shifted.exp(), "soft": soft, "top_logprobs": top_lp, "top_ids": top_ids,
        "tile_positions": seen, "step_collectives": step[0], "step_bytes": step[1],
    }


def restricted_draw(ctx: RankContext, logits: torch.Tensor, u: torch.Tensor, top_k, top_p, min_p, workspace: int | None = None) -> dict:
    """The candidate draw under per-canvas top_k, top_p and min_p from this rank's shard of `logits`
    [canvases, CL, V]: the kept-token thresholds and the draws."""
    shard = VocabShard.make(ctx.rank, ctx.size, logits.shape[-1])
    vocab = VocabParallel(shard, ctx.group, workspace_bytes=workspace)
    kept = _keep_kept_masks(vocab.kernels)
    d = vocab.distribution(local_columns(shard, logits))
    draw = vocab.restricted_draw(d, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    argmax, sample = vocab.argmax_and_sample(d, u, draw)
    return {"threshold": draw.threshold, "argmax": argmax, "sample": sample, "total": draw.total,
            "kept": torch.cat(kept).view(d.shifted.shape)}


def _keep_kept_masks(kernels) -> list[torch.Tensor]:
    """From now on `kernels` (an instance of the reference kernels) appends to the returned list,
    per tile of a restricted draw, which of this rank's tokens the draw keeps [positions, local
    rows]: the mask its kept_cumsum applies to the weights it computed itself (a mask recomputed
    from the threshold could differ at the boundary token, whose exp may round 1 ulp apart when
    computed in a tensor of another shape)."""
    masks, kept_cumsum = [], kernels.kept_cumsum

    def recording_kept_cumsum(w, t):
        masks.append(w >= t.unsqueeze(-1))
        return kept_cumsum(w, t)

    kernels.kept_cumsum = recording_kept_cumsum
    return masks


def compile_steps_with(ctx: RankContext, backend: str) -> None:
    """This rank's static step compiled with the engine's options but dynamo backend `backend`
    ("aot_eager": the graphs AOTAutograd makes, no generated code), counting the graphs made."""
    from blockdiff.worker.canvas_step import COMPILE_OPTIONS, canvas_step

    steps = ctx.state["runner"].canvas_steps
    graphs = ctx.state["graphs"] = []

    def counting(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if "_c10d_functional" in str(n.target)))
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    steps.fn = torch.compile(canvas_step, backend=counting, **COMPILE_OPTIONS)


def compiled_graphs(ctx: RankContext) -> list[int]:
    """Per graph compiled on this rank, the functional collectives in it."""
    return ctx.state["graphs"]


def backend_step(ctx: RankContext, logits: torch.Tensor, weight: torch.Tensor, params, backend: str, added: int = 0,
                 mask_padding: bool = True) -> dict:
    """One entropy-bound denoising step of full-vocabulary `logits` [canvases, CL, V] (the last
    `added` ids an added vocabulary) from this rank's shard, through the sampler backend `backend`,
    with its self-conditioning product over `weight` [V, hidden], the drawn tokens' logprobs, and
    the raw logprobs of the argmax and the top 3 tokens (with their ids).
    The shard's padding columns hold a logit above every real one, so a sampler that does not mask
    them (`mask_padding` False: the mask broken on purpose) draws and weighs them."""
    from blockdiff.diffusion.entropy_bound import denoise_step
    from blockdiff.diffusion.sampler_kernels import sampler_kernels

    shard = VocabShard.make(ctx.rank, ctx.size, logits.shape[-1] - added, added)
    vocab = VocabParallel(shard, ctx.group, kernels=sampler_kernels(backend))
    x = local_columns(shard, logits)
    x[..., ~shard.valid_rows()] = logits.max() + 10
    if not mask_padding:
        vocab.padding = None
    canvases, cl = logits.shape[:2]
    res = denoise_step(x, torch.full((canvases, cl), -1), torch.zeros(canvases, dtype=torch.long), params, vocab)

    def embed(probs: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return soft_embedding(probs.float(), local_rows(shard, weight), (1.0 / total).unsqueeze(-1), shard, ctx.group)

    # The raw logprobs (--logprobs-mode's default) of the argmax and of the 3 most likely tokens.
    rows = torch.arange(canvases)
    top, top_ids = vocab.top_logprobs(res.dist, 3, rows)
    raw_argmax = vocab.reported(res.dist, vocab.token_logprob(res.dist, res.argmax).unsqueeze(-1), rows).squeeze(-1)
    return {"argmax": res.argmax, "canvas": res.canvas, "accepted": res.accepted, "entropy": res.entropy,
            "total": res.dist.total, "logprob": vocab.token_logprob(res.dist, res.canvas),
            "raw_argmax": raw_argmax, "raw_top": vocab.reported(res.dist, top, rows), "top_ids": top_ids,
            "soft": vocab.soft_embed(res.dist, None, embed, torch.float32)}


def record_restricted_draws(ctx: RankContext) -> None:
    """From now on this rank's sampler (the engine's runner, reference kernels) keeps, for every step
    whose draw is restricted (top_k, top_p, min_p), what its draw ran on and what it drew: the
    shifted logits of its shard (with their token ids), the per-canvas top_k, top_p and min_p, the
    uniforms, the kept-token threshold and mask, the argmax and the candidates (`recorded_draws`)."""
    vocab = ctx.state["runner"].vocab
    log = ctx.state["draws"] = []
    restricted, argmax_and_sample = vocab.restricted_draw, vocab.argmax_and_sample
    ids = vocab.shard.global_ids()
    kept = _keep_kept_masks(vocab.kernels)

    def recording_restricted_draw(d, top_k, top_p, min_p):
        kept.clear()
        draw = restricted(d, top_k, top_p, min_p)
        log.append({"shifted": d.shifted.clone(), "ids": ids, "top_k": top_k.clone(), "top_p": top_p.clone(),
                    "min_p": min_p.clone(), "threshold": draw.threshold.clone(),
                    "kept": torch.cat(kept).view(d.shifted.shape)})
        return draw

    def recording_argmax_and_sample(d, u, draw=None):
        argmax, sample = argmax_and_sample(d, u, draw)
        if draw is not None:
            log[-1].update(u=u.clone(), argmax=argmax.clone(), sample=sample.clone())
        return argmax, sample

    vocab.restricted_draw, vocab.argmax_and_sample = recording_restricted_draw, recording_argmax_and_sample


def recorded_draws(ctx: RankContext) -> list[dict]:
    return ctx.state["draws"]


def record_penalized_logits(ctx: RankContext) -> None:
    """From now on this rank keeps, for every step whose canvases have penalties or a logit bias,
    the logits of its shard before and after they are penalized (worker/penalties.py), the slots
    (padded canvases: the scratch slot), each slot's canvas index in its request, and the shard's
    token ids (`recorded_penalties`)."""
    runner = ctx.state["runner"]
    log = ctx.state["penalized"] = []
    penalties, ids = runner.penalties, runner.vocab.shard.global_ids()
    apply = penalties.apply

    def recording_apply(logits, slots, vocab):
        before = logits.clone()
        apply(logits, slots, vocab)
        log.append({"before": before, "after": logits.clone(), "slots": slots.clone(), "ids": ids,
                    "scratch": penalties.rows - 1, "canvas": runner.requests.params.canvas.index_select(0, slots).clone()})

    penalties.apply = recording_apply


def recorded_penalties(ctx: RankContext) -> list[dict]:
    return ctx.state["penalized"]
