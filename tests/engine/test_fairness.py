"""Fair scheduling: a request that finds every slot held still starts within a bounded number of
steps (docs/server.md, "Fairness"), and preemption changes no output."""

from __future__ import annotations

import threading

import httpx
import openai

from blockdiff import LLM, SamplingParams
from blockdiff.engine.request import State
from server_process import ServerProcess, fixture_value, serve

GREEDY = dict(t_min=1e-6, t_max=2e-6)


def _hog(steps: int, max_tokens: int) -> SamplingParams:
    # ignore_eos and a stability threshold no canvas reaches: every canvas takes all its steps
    return SamplingParams(max_tokens=max_tokens, max_denoising_steps=steps, stability_threshold=steps, ignore_eos=True,
                          seed=1, **GREEDY)


def test_preemption_lets_a_waiting_request_in_and_changes_no_output(tiny):
    """One slot, held by a long request: a short one arriving later finishes first, within the bound,
    and the long one, preempted and recomputed, commits the same tokens as alone."""
    steps, canvas = 6, 8
    with LLM(tiny, max_num_seqs=1, preempt_after_canvases=1) as llm:
        [alone] = llm.generate([5, 6, 7], _hog(steps, 6 * canvas), use_tqdm=False)
        engine = llm.engine
        hog = engine.add_request([5, 6, 7], _hog(steps, 6 * canvas))
        engine.step()  # the hog is admitted and prefilled
        small = engine.add_request([8, 9], SamplingParams(max_tokens=canvas, max_denoising_steps=steps, **GREEDY))
        waited = 0
        while not small.finished:
            engine.step()
            waited += 1
        # The hog's canvas (steps), then the small request's prefill and canvas (1 + steps).
        assert waited <= steps + 1 + steps
        assert not hog.finished and hog.metrics.preemptions == 1
        while engine.has_unfinished():
            engine.step()
        assert hog.output.token_ids == alone.token_ids and hog.finish_reason == "length"


def test_another_clients_request_takes_a_slot_from_a_canvas_being_denoised(tiny):
    """Client a's two requests hold both slots, denoising canvases at the steps limit: client b's
    request starts at the next step, not when a canvas commits (every choice of one call, admitted
    together, commits at the same step: a newcomer waited for the whole canvas). The request that
    gave its slot denoises its canvas again from the same random numbers: its output is as alone."""
    steps, canvas = 12, 8
    with LLM(tiny, max_num_seqs=2) as llm:
        [alone] = llm.generate([5, 6, 7], _hog(steps, 2 * canvas), use_tqdm=False)
        engine = llm.engine
        hogs = [engine.add_request([5, 6, 7], _hog(steps, 2 * canvas)) for _ in range(2)]
        for hog in hogs:
            hog.client = "a"
        for _ in range(3):  # admitted and prefilled, then into their first canvas
            engine.step()
        assert all(h.state == State.DENOISE and h.steps_left < steps for h in hogs)
        small = engine.add_request([8, 9], SamplingParams(max_tokens=canvas, max_denoising_steps=steps, **GREEDY))
        small.client = "b"
        engine.step()
        assert small.slot is not None
        assert sum(h.metrics.preemptions for h in hogs) == 1
        while engine.has_unfinished():
            engine.step()
        assert [h.output.token_ids for h in hogs] == [alone.token_ids] * 2
        assert all(h.finish_reason == "length" for h in hogs)


def test_while_two_clients_run_each_denoises_at_most_its_part_of_the_slots_per_step(tiny):
    """Client a's canvases fill the slots but one, client b's small request the last: each step
    denoises at most two of a's (half the four slots), those that ran longest ago first, so b's
    steps are small; a's canvases take turns, and their output is as alone. Alone, a client's
    canvases all run every step."""
    steps, canvas = 40, 8
    with LLM(tiny, max_num_seqs=4, num_scheduler_steps=1) as llm:  # a step at a time, to be watched
        [alone] = llm.generate([5, 6, 7], _hog(steps, 2 * canvas), use_tqdm=False)
        engine = llm.engine
        hogs = [engine.add_request([5, 6, 7], _hog(steps, 2 * canvas)) for _ in range(4)]
        for hog in hogs:
            hog.client = "a"
        for _ in range(3):
            engine.step()
        done = [h.metrics.denoising_steps for h in hogs]
        engine.step()
        assert [h.metrics.denoising_steps for h in hogs] == [d + 1 for d in done]  # one client: no cap
        small = engine.add_request([8, 9], SamplingParams(max_tokens=4 * canvas, max_denoising_steps=steps, **GREEDY))
        small.client = "b"
        engine.step()
        assert small.slot is not None  # it took a slot from one of a's
        runs = []
        for _ in range(6):
            before = [h.metrics.denoising_steps for h in hogs]
            engine.step()
            runs.append([h for h, b in zip(hogs, before) if h.metrics.denoising_steps > b])
        assert not small.finished
        assert all(len(ran) <= 2 for ran in runs) and max(map(len, runs)) == 2
        running = [h for h in hogs if h.slot is not None]
        assert all(sum(h in ran for ran in runs) >= 3 for h in running)  # turns: none waits for the others
        while engine.has_unfinished():
            engine.step()
        assert [h.output.token_ids for h in hogs] == [alone.token_ids] * 4


server = serve(fixture_value("tiny"), "--max-num-seqs", "2", "--preempt-after-canvases", "2", "--max-model-len", "256",
               "--max-request-cost", str(10**8))


def test_a_small_request_completes_while_one_client_holds_every_slot(server):
    """A client holding both slots with the largest requests the server allows (the steps limit,
    a threshold never reached, no EOS) cannot keep a small request out for more than the bound in
    docs/server.md: preempt_after x (steps limit + 1) steps, then the small request's own."""
    limit = 48  # the tiny checkpoint: max(4 x canvas length 8, the default 48 steps)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    hog_done = threading.Event()

    def hog():
        client.completions.create(model=server_model(server), prompt=[5, 6, 7], n=2, max_tokens=40, seed=0,
                                  extra_body={"max_denoising_steps": limit, "stability_threshold": limit, "ignore_eos": True})
        hog_done.set()

    thread = threading.Thread(target=hog, daemon=True)
    thread.start()
    while server.metrics().total("vllm:num_requests_running") < 2:
        pass
    before = server.metrics()["blockdiff:step_duration_seconds_count"]
    r = client.chat.completions.create(model=server_model(server), messages=[{"role": "user", "content": "sort: 2 1"}],
                                       max_tokens=8, extra_body={"max_denoising_steps": 8})
    steps = server.metrics()["blockdiff:step_duration_seconds_count"] - before
    assert r.choices[0].finish_reason in ("stop", "length")
    assert not hog_done.is_set()  # the hog still holds its work: the small request did not wait it out
    # The bound, plus the steps the hog runs while the response and the scrape travel (a few).
    assert steps <= 2 * (limit + 1) + 1 + 8 + 20, steps
    thread.join(300)
    assert hog_done.is_set()


def test_one_call_of_many_prompts_does_not_hold_back_another_client(server):
    """Fairness counts engine requests per client. One call of 32 prompts from
    one address (32 engine requests of 5 canvases at the steps limit) and then a small chat request
    from another: the chat request starts within the same bound as above, not behind the 32
    (before: 38 s behind 512 prompts). The call of many keeps its place: it is still running."""
    limit = 48
    hog = {"prompt": [[5, 6, i] for i in range(32)], "max_tokens": 40, "seed": 0, "max_denoising_steps": limit,
           "stability_threshold": limit, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=hog, timeout=300) as hogging:
        lines = hogging.iter_lines()  # kept: a collected iterator would close the stream
        next(line for line in lines if line.startswith("data: "))  # its first canvas is committed
        assert server.metrics().total("vllm:num_requests_waiting") >= 30  # the rest of the call waits
        before = server.metrics()["blockdiff:step_duration_seconds_count"]
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=300) as other:
            r = other.post(server.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "sort: 2 1"}], "max_tokens": 8, "max_denoising_steps": 8})
        steps = server.metrics()["blockdiff:step_duration_seconds_count"] - before
        assert r.status_code == 200, r.text
        assert server.metrics().total("vllm:num_requests_waiting") >= 28  # the call of many is far from done
    # The bound of the test above.
    assert steps <= 2 * (limit + 1) + 1 + 8 + 20, steps
    server.wait_idle(30)  # the call's requests are aborted with its stream


def server_model(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_request_scoring_its_prompt_counts_twice_for_its_client(tiny):
    """Client a runs a request that scores its prompt (a canvas-sized piece each step beside its own
    row), client b a plain one; with one slot left, b's waiting request goes first although a's was
    queued before it (with every request counting once, the tie would go to a's, the older)."""
    with LLM(tiny, max_num_seqs=3) as llm:
        engine = llm.engine
        scoring = engine.add_request(list(range(3, 63)), SamplingParams(max_tokens=8, prompt_logprobs=0, **GREEDY))
        scoring.client = "a"
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY)).client = "b"
        engine.step()
        assert scoring.share == 2 and len(engine.scheduler.running) == 2
        later_a = engine.add_request([8, 9], SamplingParams(max_tokens=8, **GREEDY))
        later_a.client = "a"
        later_b = engine.add_request([10, 11], SamplingParams(max_tokens=8, **GREEDY))
        later_b.client = "b"
        engine.step()
        assert later_b.slot is not None and later_a.slot is None
        while engine.has_unfinished():
            engine.step()
        assert scoring.share == 1 and len(scoring.prompt_scores) == 59
