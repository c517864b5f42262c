"""`blockdiff chat`: an interactive chat in the terminal, with the model loaded here or with a
server's (`--url`), streamed a committed canvas at a time. The conversation is kept and sent whole
on every turn; `/exit` or end of input (Ctrl-D) quits; a turn that fails prints one `error:` line and
is left out of the conversation."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator

from blockdiff.arg_utils import (add_chat_template_arg, add_engine_args, add_sampling_args, engine_config,
                                        given_model, sampling_overrides)

EXIT = "/exit"
# A turn: the conversation so far -> the reply's pieces, as they arrive.
Reply = Callable[[list[dict]], Iterator[str]]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (the model loaded here, or a server's with --url)")
    p.add_argument("--url", default=None,
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (default: load the model here)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for --url (default: $OPENAI_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt, the conversation's first message")
    add_engine_args(p)
    add_chat_template_arg(p)
    add_sampling_args(p)
    # Info lines (the client's every HTTP request) would interleave with the conversation.
    p.set_defaults(func=run, log_level="warning")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_overrides(args)
    if args.url is not None:
        return converse(_server_reply(args.url, args.api_key, given_model(args), sampling), args.system)
    from blockdiff.llm import LLM
    from blockdiff.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config(args)))
    try:
        if llm.tokenizer is None or llm.tokenizer.chat_template is None:
            raise ValueError(f"{llm.engine.cfg.model} has no chat template: pass --chat-template")
        params = SamplingParams(**sampling)

        def reply(messages: list[dict]) -> Iterator[str]:
            for out in llm.stream(llm.tokenizer.encode_chat(messages), params):
                yield out.text

        return converse(reply, args.system)
    finally:
        llm.shutdown()


def _server_reply(url: str, api_key: str | None, model: str | None, sampling: dict) -> Reply:
    """Talks to the server at `url`, which must answer now: /v1/models is asked before the first
    turn (for the served model, when none is given), and a server that is not there ends the chat
    at once with the URL in the error."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=api_key or "unused")
    max_tokens = sampling.pop("max_tokens", None)

    def unreachable(e: openai.APIConnectionError) -> ConnectionError:
        return ConnectionError(f"cannot connect to {url}: {e.__cause__ or e}")

    try:
        models = client.models.list()
    except openai.APIConnectionError as e:
        raise unreachable(e) from None
    served = model or models.data[0].id

    def reply(messages: list[dict]) -> Iterator[str]:
        try:
            stream = client.chat.completions.create(model=served, messages=messages, stream=True,
                                                    max_tokens=max_tokens, extra_body=sampling or None)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
        except openai.APIConnectionError as e:  # the server went away during the chat
            raise unreachable(e) from None

    return reply


def converse(reply: Reply, system: str | None) -> int:
    """Read turns from stdin until /exit or end of input; print each reply as it streams."""
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if text == EXIT:
            break
        if not text:
            continue
        turn = [*messages, {"role": "user", "content": text}]
        pieces = []
        try:
            for piece in reply(turn):
                pieces.append(piece)
                print(piece, end="", flush=True)
        except Exception as e:  # the turn fails, the chat goes on
            if pieces:
                print()
            print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        messages = [*turn, {"role": "assistant", "content": "".join(pieces)}]
    return 0
