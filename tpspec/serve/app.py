"""The OpenAI-compatible routes over an :class:`~tpspec.serve.engine_loop.EngineLoop`.

``/health`` (200, or 503 once the ranks are gone), ``/metrics`` (Prometheus text: prefix-cache
queries and hits, preemptions), ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` — JSON, or server-sent events with ``"stream": true`` (one chunk
per engine step and sample, then ``data: [DONE]``). Bad requests get OpenAI-style 400
errors (the body names the problem), an unknown model 404, a dead engine 503.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..sampling.params import SamplingParams
from .engine_loop import EngineDead, EngineLoop
from .protocol import ChatCompletionRequest, CompletionRequest, error_body


def build_app(engine: EngineLoop, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine``'s LLM under the name ``model_name``."""
    app = FastAPI(title="tpspec", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid request')}", 400, param=where or None),
                            status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead:
            return JSONResponse(error_body(engine.dead, 503, kind="ServiceUnavailableError"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_prometheus(engine.llm.counters))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tpspec", "max_model_len": engine.llm.config.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        if body.model != model_name:
            return _error(f"model {body.model!r} does not exist; this server serves {model_name!r}", 404,
                          kind="NotFoundError", param="model")
        if body.best_of not in (None, 1) or body.suffix is not None:
            return _error("best_of > 1 and suffix are not supported", 400)
        prompts = _prompt_list(body.prompt)
        kwargs = body.sampling_kwargs(body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # vLLM: echoed prompt tokens carry their logprobs
            kwargs["prompt_logprobs"] = body.logprobs
        return await _serve(engine, raw, model_name, "text_completion", "cmpl", prompts, kwargs, body.stream,
                            _usage_in_stream(body), echo=body.echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        if body.model != model_name:
            return _error(f"model {body.model!r} does not exist; this server serves {model_name!r}", 404,
                          kind="NotFoundError", param="model")
        messages = [m.model_dump() for m in body.messages]
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            return _error("top_logprobs needs logprobs=true", 400, param="top_logprobs")
        if body.logprobs and top is None:
            top = 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        kwargs = body.sampling_kwargs(max_tokens, top)
        chat_prompt = _ChatPrompt(messages, body.add_generation_prompt)
        return await _serve(engine, raw, model_name, "chat.completion", "chatcmpl", [chat_prompt], kwargs,
                            body.stream, _usage_in_stream(body))

    return app


class _ChatPrompt:
    """A conversation, rendered with the chat template on the engine thread."""

    def __init__(self, messages: list[dict], add_generation_prompt: bool) -> None:
        self.messages = messages
        self.add_generation_prompt = add_generation_prompt


def _prometheus(counters: Any) -> str:
    """The LLM's :class:`~tpspec.runtime.llm.EngineCounters` in Prometheus' text format (vLLM's names,
    ``tpspec:`` for ``vllm:``)."""
    lines = []
    for name, what in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                       ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                       ("num_preemptions", "Requests preempted because KV pages ran out.")):
        lines += [f"# HELP tpspec:{name} {what}", f"# TYPE tpspec:{name} counter",
                  f"tpspec:{name}_total {getattr(counters, name)}"]
    return "\n".join(lines) + "\n"


def _error(message: str, status: int, *, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind=kind, param=param), status_code=status)


def _usage_in_stream(body: Any) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.get("include_usage"))


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def _prepare(prompt: Any, kwargs: dict[str, Any]):
    """What the engine thread runs to turn one prompt and the request's fields into the
    arguments of ``LLM.add_request`` (raises ``ValueError`` for a bad request)."""

    def prepare(llm: Any) -> tuple[Any, SamplingParams]:
        fields = dict(llm.generation_defaults)
        fields.update(kwargs)
        params = SamplingParams(**fields)
        if isinstance(prompt, _ChatPrompt):
            ids = llm.chat_prompt_ids(prompt.messages, add_generation_prompt=prompt.add_generation_prompt)
            return {"prompt_token_ids": ids}, params
        return prompt, params

    return prepare


async def _serve(engine: EngineLoop, raw: Request, model_name: str, kind: str, id_prefix: str, prompts: list[Any],
                 kwargs: dict[str, Any], stream: bool, usage_in_stream: bool, *, echo: bool = False) -> Any:
    """Submit every prompt, then answer with one JSON body or an SSE stream."""
    response_id = f"{id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    submitted: list[tuple[str, AsyncIterator[Any]]] = []
    try:
        for prompt in prompts:
            submitted.append(await engine.submit(_prepare(prompt, kwargs)))
    except ValueError as exc:
        for rid, _ in submitted:
            engine.abort(rid)
        return _error(str(exc), 400)
    except EngineDead as exc:
        return _error(str(exc), 503, kind="ServiceUnavailableError")
    n = kwargs.get("n", 1)
    tokenizer = engine.llm.get_tokenizer()
    if stream:
        return StreamingResponse(_sse(engine, submitted, n, kind, response_id, created, model_name, tokenizer,
                                      usage_in_stream, echo), media_type="text/event-stream")
    choices: dict[int, dict] = {}
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    try:
        for p, (_, outputs) in enumerate(submitted):  # noqa: B007
            echoed = _Echo(echo, tokenizer)
            async for out in outputs:
                if p * n not in choices:
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                for c in out.outputs:
                    if p * n + c.index not in choices:
                        choices[p * n + c.index] = echoed.prepend(_empty_choice(kind, p * n + c.index), out)
                    choice = choices[p * n + c.index]
                    _append(choice, c, kind, tokenizer)
                    usage["completion_tokens"] += len(c.token_ids)
    except EngineDead as exc:
        return _error(str(exc), 503, kind="ServiceUnavailableError")
    finally:
        for rid, _ in submitted:  # a cancelled request leaves the batch
            engine.abort(rid)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": response_id, "object": kind, "created": created, "model": model_name,
            "choices": [choices[i] for i in sorted(choices)], "usage": usage}


def _empty_choice(kind: str, index: int) -> dict:
    if kind == "chat.completion":
        return {"index": index, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "stop_reason": None}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}


def _append(choice: dict, c: Any, kind: str, tokenizer: Any) -> None:
    if kind == "chat.completion":
        choice["message"]["content"] += c.text
    else:
        choice["text"] += c.text
    if c.logprobs is not None:
        choice["logprobs"] = _merge_logprobs(choice["logprobs"], _logprobs(c, kind, tokenizer))
    if c.finish_reason is not None:
        choice["finish_reason"], choice["stop_reason"] = c.finish_reason, c.stop_reason


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _logprobs(c: Any, kind: str, tokenizer: Any) -> dict:
    """OpenAI's logprobs object for the tokens of one delta."""
    if kind == "chat.completion" or kind == "chat.completion.chunk":
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs):
            text = _token_text(tokenizer, tok)
            content.append({"token": text, "logprob": entry[tok].logprob,
                            "bytes": list(text.encode()),
                            "top_logprobs": [{"token": _token_text(tokenizer, t), "logprob": lp.logprob,
                                              "bytes": list(_token_text(tokenizer, t).encode())}
                                             for t, lp in _by_rank(entry) if t != tok or len(entry) > 1]})
        return {"content": content}
    return {"tokens": [_token_text(tokenizer, t) for t in c.token_ids],
            "token_logprobs": [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)],
            "top_logprobs": [{_token_text(tokenizer, t): lp.logprob for t, lp in _by_rank(entry)}
                             for entry in c.logprobs],
            "text_offset": []}


def _by_rank(entry: dict) -> list:
    """A position's ``(token id, Logprob)`` pairs, most likely first."""
    return sorted(entry.items(), key=lambda item: item[1].rank)


class _Echo:
    """``echo`` of the completions API (vLLM's shape): each sample's text starts with the prompt's,
    and with ``logprobs`` its logprobs start with the prompt tokens' (None for the first token)."""

    def __init__(self, echo: bool, tokenizer: Any) -> None:
        self.echo = echo
        self.tokenizer = tokenizer
        self.prompt_logprobs = None  # the request's, from the output that brings them

    def prepend(self, choice: dict, out: Any) -> dict:
        """``choice`` (a completion choice or chunk) with the prompt's text and logprobs in front."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if not self.echo:
            return choice
        ids = out.prompt_token_ids
        text = out.prompt
        if text is None:
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        choice["text"] = text + choice["text"]
        if choice["logprobs"] is not None or self.prompt_logprobs is not None:
            lps = self.prompt_logprobs or [None] * len(ids)
            tok = self.tokenizer
            prompt = {"tokens": [_token_text(tok, t) for t in ids],
                      "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(ids, lps)],
                      "top_logprobs": [None if e is None else {_token_text(tok, t): lp.logprob for t, lp in _by_rank(e)}
                                       for e in lps],
                      "text_offset": []}
            choice["logprobs"] = prompt if choice["logprobs"] is None else _merge_logprobs(prompt, choice["logprobs"])
        return choice


def _merge_logprobs(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {k: old[k] + new[k] for k in new}


async def _sse(engine: EngineLoop, submitted: list[tuple[str, AsyncIterator[Any]]], n: int, kind: str, response_id: str,
               created: int, model_name: str, tokenizer: Any, usage_in_stream: bool,
               echo: bool = False) -> AsyncIterator[str]:
    """One ``data:`` event per sample delta (prompts one after another), then ``[DONE]``."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def event(choices: list[dict]) -> str:
        return "data: " + json.dumps({"id": response_id, "object": chunk_kind, "created": created,
                                      "model": model_name, "choices": choices}) + "\n\n"

    try:
        if kind == "chat.completion":
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n * len(submitted))])
        for p, (_, outputs) in enumerate(submitted):
            first = True
            echoed, started = _Echo(echo, tokenizer), set()
            async for out in outputs:
                if first:
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                    first = False
                choices = []
                for c in out.outputs:
                    usage["completion_tokens"] += len(c.token_ids)
                    logprobs = None if c.logprobs is None else _logprobs(c, chunk_kind, tokenizer)
                    choice: dict[str, Any] = {"index": p * n + c.index, "logprobs": logprobs,
                                              "finish_reason": c.finish_reason}
                    if chunk_kind == "chat.completion.chunk":
                        choice["delta"] = {"content": c.text}
                    else:
                        choice["text"] = c.text
                        if c.index not in started:  # a sample's first chunk carries the echoed prompt
                            started.add(c.index)
                            echoed.prepend(choice, out)
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    choices.append(choice)
                yield event(choices)
        if usage_in_stream:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield "data: " + json.dumps({"id": response_id, "object": chunk_kind, "created": created,
                                         "model": model_name, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    except EngineDead as exc:
        yield "data: " + json.dumps(error_body(str(exc), 503, kind="ServiceUnavailableError")) + "\n\n"
    finally:
        for rid, _ in submitted:  # a client that left: abort what still runs (finished ids are ignored)
            engine.abort(rid)
