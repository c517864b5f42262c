"""A step's results applied to its requests (`update_from_output`), and requests made into
RequestOutputs. The only place where a step changes request state."""

from __future__ import annotations

from blockdiff.engine.request import Request, State
from blockdiff.engine.scheduler import Scheduler, SchedulerOutput
from blockdiff.outputs import CompletionOutput, RequestOutput, TokenLogprob
from blockdiff.step import StepOutput


def update_from_output(scheduler: Scheduler, sched: SchedulerOutput, out: StepOutput | None) -> list[Request]:
    """Count the encoder rows' tokens as cached, the decoder rows' step as done, and commit every
    canvas that converged; finished requests are released. A request that ended while the step
    ran (aborted) takes nothing from it. -> the requests with news: a committed canvas, an end, or
    (streaming drafts) a new argmax canvas."""
    news = []
    gone = {r for r in [*(r for r, _ in sched.encoder), *(r for r, _ in sched.score), *sched.decoder] if r.finished}
    for req, n in sched.encoder:
        if req in gone:
            continue
        scheduler.cached(req, n)
        if req.params.max_tokens == 0 and req.state == State.DENOISE:  # a prompt with nothing to score, no output
            req.finish("length")
            scheduler.release(req)
            news.append(req)
    if out is None:
        return news
    offset = 0
    for req, (start, end) in sched.score:
        n = end - start
        if req in gone:
            offset += n
            continue
        if req.add_scores(req.output.with_texts(_scores(req, req.tokens(start, end), out, offset))):  # it asked for no output: done
            req.finish("length")
            scheduler.release(req)
            news.append(req)
        offset += n
    finished = out.finished.tolist()
    steps = [1] * len(sched.decoder) if out.steps is None else out.steps.tolist()
    for i, req in enumerate(sched.decoder):
        if req in gone:
            continue
        req.denoised(out.tokens[i].tolist() if req.params.stream_drafts else None, steps[i],
                     None if out.rows_evaluated is None else out.rows_evaluated[i])
        if req.params.draft_details:
            req.draft.entropy, req.draft.accepted = out.entropy[i].tolist(), out.accepted[i].tolist()
        if not finished[i]:
            if out.settled is not None and req.streams_settled:
                before = len(req.output.token_ids)
                reason = req.settled(out.tokens[i].tolist(), out.settled[i].tolist())
                if reason is not None:  # an EOS, a stop string or max_tokens in the settled prefix
                    req.finish(reason)
                    scheduler.release(req)
                    news.append(req)
                    continue
                if len(req.output.token_ids) > before:
                    news.append(req)
                    continue
            if req.params.stream_drafts:
                news.append(req)
            continue
        reason = req.commit(out.tokens[i].tolist(), _logprobs(req, out, i))
        if reason is not None:
            req.finish(reason)
            scheduler.release(req)
        news.append(req)
    return news


def _logprobs(req: Request, out: StepOutput, row: int) -> list[TokenLogprob] | None:
    k = req.params.logprobs
    if k is None:
        return None
    ids, lps = out.tokens[row].tolist(), out.logprob[row].tolist()
    if not k or out.top_ids is None:
        return [TokenLogprob(t, lp) for t, lp in zip(ids, lps)]
    tops = zip(out.top_ids[row, :, :k].tolist(), out.top_logprobs[row, :, :k].tolist())
    return [TokenLogprob(t, lp, dict(zip(ti, tl))) for t, lp, (ti, tl) in zip(ids, lps, tops)]


def _scores(req: Request, ids: list[int], out: StepOutput, offset: int) -> list[TokenLogprob]:
    n = len(ids)
    lps = out.score_logprob[offset : offset + n].tolist()
    k = req.params.prompt_logprobs
    if not k:
        return [TokenLogprob(t, lp) for t, lp in zip(ids, lps)]
    tops = zip(out.score_top_ids[offset : offset + n, :k].tolist(), out.score_top_logprobs[offset : offset + n, :k].tolist())
    return [TokenLogprob(t, lp, dict(zip(ti, tl))) for t, lp, (ti, tl) in zip(ids, lps, tops)]


def _prompt_scores(req: Request, kind: str) -> list[TokenLogprob] | None:
    """The prompt's scores once all are in: in every output, or (delta) in the first one."""
    if req.prompt_scores is None or req.next_score_start is not None or (kind == "delta" and req.sent_prompt_scores):
        return None
    req.sent_prompt_scores = True
    return req.prompt_scores


def make_output(req: Request) -> RequestOutput | None:
    """The request's output in its params' output_kind; None when that kind reports nothing now
    (final_only before the end)."""
    kind, o, done = req.params.output_kind, req.output, req.finished
    if kind == "final_only" and not done:
        return None
    text = None
    if o.tokenizer is not None:
        if done:  # the pending tail is final now
            o.pieces.append(o.pending)
            o.pending = ""
        text = "".join(o.pieces[req.sent_pieces :] if kind == "delta" else o.pieces)
    if kind == "delta":
        token_ids, logprobs = o.token_ids[req.sent_tokens :], None if o.logprobs is None else o.logprobs[req.sent_tokens :]
        req.sent_tokens, req.sent_pieces = len(o.token_ids), len(o.pieces)
    elif done:  # the request is gone after this: its lists are handed over, not copied
        token_ids, logprobs = o.token_ids, o.logprobs
    else:
        token_ids, logprobs = list(o.token_ids), None if o.logprobs is None else list(o.logprobs)
    stop = o.stop_reason if isinstance(o.stop_reason, str) or o.stop_reason in (req.params.stop_token_ids or ()) else None
    # The sum over the whole output, once it is final for a stream of deltas (each delta would re-add it).
    cumulative = None if logprobs is None or (kind == "delta" and not done) else sum(lp.logprob for lp in o.logprobs)
    completion = CompletionOutput(0, text, token_ids, cumulative, logprobs, req.finish_reason, stop if done else None)
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[completion],
        finished=done,
        metrics=req.metrics.as_dict(),
        prompt_token_logprobs=_prompt_scores(req, kind),
        draft_token_ids=req.draft.token_ids,
        draft_entropy=req.draft.entropy,
        draft_accepted=req.draft.accepted,
        error=req.error,
        num_cached_tokens=req.num_cached_prompt_tokens,
    )


def fail(scheduler: Scheduler, requests: list[Request], error: str) -> None:
    """End requests whose step raised; the rest of the engine goes on."""
    for req in requests:
        if not req.finished:
            req.finish("error", error)
            scheduler.release(req)


