"""A step's results applied to its requests (`update_from_output`), and requests made into
RequestOutputs. The only place where a step changes request state."""

from __future__ import annotations

from blockdiff.engine.request import Request
from blockdiff.engine.scheduler import Scheduler, SchedulerOutput
from blockdiff.outputs import RequestOutput, TokenLogprob
from blockdiff.step import StepOutput


def update_from_output(scheduler: Scheduler, sched: SchedulerOutput, out: StepOutput | None) -> list[Request]:
    """Count the encoder rows' tokens as cached, the decoder rows' step as done, and commit every
    canvas that converged; finished requests are released. -> the requests with news: a committed
    canvas, an end, or (streaming drafts) a new argmax canvas."""
    for req, n in sched.encoder:
        scheduler.cached(req, n)
    news = []
    if out is None:
        return news
    finished = out.finished.tolist()
    for i, req in enumerate(sched.decoder):
        req.denoised(out.tokens[i].tolist() if req.params.stream_drafts else None)
        if req.params.draft_details:
            req.draft_entropy, req.draft_accepted = out.entropy[i].tolist(), out.accepted[i].tolist()
        if not finished[i]:
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
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        text=text,
        token_ids=token_ids,
        finish_reason=req.finish_reason,
        finished=done,
        metrics=req.metrics.as_dict(),
        logprobs=logprobs,
        draft_token_ids=req.draft_token_ids,
        draft_entropy=req.draft_entropy,
        draft_accepted=req.draft_accepted,
        error=req.error,
        num_cached_tokens=req.num_cached_prompt_tokens,
    )


def fail(scheduler: Scheduler, requests: list[Request], error: str) -> None:
    """End requests whose step raised; the rest of the engine goes on."""
    for req in requests:
        if not req.finished:
            req.finish("error", error)
            scheduler.release(req)


