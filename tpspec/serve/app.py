"""The OpenAI-compatible routes over an :class:`~tpspec.serve.engine_loop.EngineLoop`.

``/health`` (200, or 503 once the ranks are gone), ``/metrics`` (Prometheus text: prefix-cache
queries and hits, preemptions), ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` — JSON, or server-sent events with ``"stream": true`` (one chunk
per engine step and sample, then ``data: [DONE]``; a stream that fails sends an error event,
then ``[DONE]``). Every error body is OpenAI's error object: 400 for a bad request (the
message names the problem: bad JSON, bad UTF-8, an unknown field, a prompt too long for
``max_model_len``, ...), 404 for an unknown model or route, 405 for a wrong method, 408/413
for a body too slow or too big (:mod:`.limits`), 503 once the engine is dead.

Each request body is parsed, validated and tokenized (chat template included) on a worker
thread; the engine thread only adds the ready request to the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling.params import SamplingParams
from .engine_loop import EngineDead, EngineLoop
from .limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, RequestLimits
from .protocol import ChatCompletionRequest, CompletionRequest, error_body


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, *, kind: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param


def build_app(engine: EngineLoop, model_name: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving ``engine``'s LLM under the name ``model_name``. Its shutdown
    (uvicorn's lifespan, after SIGTERM or Ctrl-C) stops the engine and its ranks."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="tpspec", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    created = int(time.time())
    llm = engine.llm

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            kind = "NotFoundError"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            kind = "MethodNotAllowedError"
        else:
            message, kind = str(exc.detail), "BadRequestError" if exc.status_code < 500 else "InternalServerError"
        return _error(ApiError(message, exc.status_code, kind=kind), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(ApiError(f"{type(exc).__name__}: {exc}", 500, kind="InternalServerError"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead:
            return _error(ApiError(engine.dead, 503, kind="ServiceUnavailableError"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_prometheus(engine.llm.counters, *engine.llm.num_requests()))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tpspec", "max_model_len": llm.config.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        body = await _parse(raw, CompletionRequest)
        _check_model(body.model, model_name)
        if body.best_of not in (None, 1) or body.suffix is not None:
            raise ApiError("best_of > 1 and suffix are not supported")
        prompts = _prompt_list(body.prompt)
        kwargs = body.sampling_kwargs(body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # vLLM: echoed prompt tokens carry their logprobs
            kwargs["prompt_logprobs"] = body.logprobs
        what = ["prompt" if len(prompts) == 1 else f"prompt {i}" for i in range(len(prompts))]
        ready = await asyncio.to_thread(lambda: [_prepare(llm, p, kwargs, w) for p, w in zip(prompts, what)])
        return await _serve(engine, model_name, "text_completion", "cmpl", ready, kwargs.get("n", 1), body.stream,
                            _usage_in_stream(body), echo=bool(body.echo))

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        body = await _parse(raw, ChatCompletionRequest)
        _check_model(body.model, model_name)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        kwargs = body.sampling_kwargs(max_tokens, top)
        messages = [m.model_dump() for m in body.messages]
        ready = await asyncio.to_thread(_prepare, llm, _ChatPrompt(messages, body.add_generation_prompt), kwargs,
                                        "the conversation")
        return await _serve(engine, model_name, "chat.completion", "chatcmpl", [ready], kwargs.get("n", 1),
                            body.stream, _usage_in_stream(body))

    return app


class _ChatPrompt:
    """A conversation, rendered with the chat template off the event loop."""

    def __init__(self, messages: list[dict], add_generation_prompt: bool) -> None:
        self.messages = messages
        self.add_generation_prompt = add_generation_prompt


def _error(exc: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, kind=exc.kind, param=exc.param), status_code=exc.status,
                        headers=headers)


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(f"model {requested!r} does not exist; this server serves {served!r}", 404,
                       kind="NotFoundError", param="model")


async def _parse(raw: Request, model: type[pydantic.BaseModel]) -> Any:
    """The request body as ``model``, parsed on a worker thread; :class:`ApiError` (400) with a
    readable message for a body that is not UTF-8, not JSON, nested too deeply or invalid."""
    data = await raw.body()
    return await asyncio.to_thread(_parse_body, data, model)


def _parse_body(data: bytes, model: type[pydantic.BaseModel]) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
                       f"(character {exc.pos})") from None
    except RecursionError:
        raise ApiError("the request body nests JSON arrays or objects too deeply") from None
    try:
        return model.model_validate(obj)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = first.get("msg", "invalid request")
        raise ApiError(f"{where}: {message}" if where else message, param=where or None) from None
    except RecursionError:
        raise ApiError("the request body nests JSON arrays or objects too deeply") from None


def _prometheus(counters: Any, running: int, waiting: int) -> str:
    """The LLM's :class:`~tpspec.runtime.llm.EngineCounters` and its running and waiting requests
    (:meth:`~tpspec.runtime.llm.LLM.num_requests`) in Prometheus' text format (vLLM's names,
    ``tpspec:`` for ``vllm:``)."""
    lines = []
    for name, value, what in (("num_requests_running", running, "Requests generating (a token out, not finished)."),
                              ("num_requests_waiting", waiting, "Requests queued or in their prompt's prefill.")):
        lines += [f"# HELP tpspec:{name} {what}", f"# TYPE tpspec:{name} gauge", f"tpspec:{name} {value}"]
    for name, what in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                       ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                       ("num_preemptions", "Requests preempted because KV pages ran out."),
                       ("prompt_tokens", "Prompt tokens of the requests started."),
                       ("generation_tokens", "Tokens generated.")):
        lines += [f"# HELP tpspec:{name} {what}", f"# TYPE tpspec:{name} counter",
                  f"tpspec:{name}_total {getattr(counters, name)}"]
    return "\n".join(lines) + "\n"


def _usage_in_stream(body: Any) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.get("include_usage"))


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError("prompt is empty: give a string, a list of strings, a list of token ids or a list of those",
                       param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


def _prepare(llm: Any, prompt: Any, kwargs: dict[str, Any], what: str) -> tuple[dict, SamplingParams]:
    """``LLM.add_request``'s arguments for one prompt (text, token ids or a conversation) and the
    request's fields (errors name the prompt as ``what``): tokenized, with the checkpoint's
    defaults under the request's fields.
    A ``max_tokens`` the request set must fit ``max_model_len`` beside the prompt (vLLM's
    400); a default one is cut to the room left. Runs on a worker thread; :class:`ApiError`
    for a bad request."""
    from ..runtime.llm import check_context_length

    try:
        if isinstance(prompt, _ChatPrompt):
            text, ids = llm.render_chat(prompt.messages, add_generation_prompt=prompt.add_generation_prompt)
        elif isinstance(prompt, str):
            text, ids = prompt, llm.tokenize(prompt, what)
        else:
            text, ids = None, list(prompt)
        max_len = llm.config.max_seq_len
        llm.config.check_prompt_len(len(ids), what)
        fields = dict(llm.generation_defaults)
        fields.update(kwargs)
        if "max_tokens" in kwargs:
            check_context_length(len(ids), kwargs["max_tokens"], max_len)
        elif fields.get("max_tokens") is not None:
            fields["max_tokens"] = min(fields["max_tokens"], max_len - len(ids))
        return {"prompt_token_ids": ids, "prompt": text}, SamplingParams(**fields)
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects the conversation
        raise ApiError(f"{type(exc).__name__}: {exc}") from None


async def _serve(engine: EngineLoop, model_name: str, kind: str, id_prefix: str,
                 ready: list[tuple[dict, SamplingParams]], n: int, stream: bool, usage_in_stream: bool, *,
                 echo: bool = False) -> Any:
    """Submit every prepared prompt, then answer with one JSON body or an SSE stream. ``echo``
    (completions): each sample's text and logprobs start with the prompt's (:class:`_Echo`)."""
    response_id = f"{id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    submitted: list[tuple[str, AsyncIterator[Any]]] = []
    try:
        for prompt, params in ready:
            submitted.append(await engine.submit(prompt, params))
    except ValueError as exc:
        for rid, _ in submitted:
            engine.abort(rid)
        raise ApiError(str(exc)) from None
    except EngineDead as exc:
        raise ApiError(str(exc), 503, kind="ServiceUnavailableError") from None
    token_text = _token_texts(engine.llm.get_tokenizer())
    if stream:
        return StreamingResponse(_sse(engine, submitted, n, kind, response_id, created, model_name, token_text,
                                      usage_in_stream, echo), media_type="text/event-stream")
    choices: dict[int, dict] = {}
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    try:
        for p, (_, outputs) in enumerate(submitted):
            echoed = _Echo(echo, token_text)
            async for out in outputs:
                if p * n not in choices:
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                echoed.see(out)
                for c in out.outputs:
                    if p * n + c.index not in choices:
                        choice = _empty_choice(kind, p * n + c.index)
                        if kind == "text_completion":
                            choice["text"], choice["logprobs"] = echoed.prompt_part(out)
                        choices[p * n + c.index] = choice
                    _append(choices[p * n + c.index], c, kind, token_text)
                    usage["completion_tokens"] += len(c.token_ids)
    except EngineDead as exc:
        raise ApiError(str(exc), 503, kind="ServiceUnavailableError") from None
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


def _append(choice: dict, c: Any, kind: str, token_text: Callable[[int], str]) -> None:
    if kind == "chat.completion":
        choice["message"]["content"] += c.text
    else:
        choice["text"] += c.text
    if c.logprobs is not None:
        old = choice["logprobs"]
        offset = 0 if old is None or kind == "chat.completion" else _end_offset(old)
        choice["logprobs"] = _merge_logprobs(old, _logprobs(c, kind, token_text, offset))
    if c.finish_reason is not None:
        choice["finish_reason"], choice["stop_reason"] = c.finish_reason, c.stop_reason


def _token_texts(tokenizer: Any) -> Callable[[int], str]:
    if tokenizer is None:
        return str
    return lambda token_id: tokenizer.decode([token_id])


def _end_offset(logprobs: dict) -> int:
    """Where the next token's text starts, after the tokens ``logprobs`` already holds."""
    if not logprobs["text_offset"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _logprobs(c: Any, kind: str, token_text: Callable[[int], str], offset: int = 0) -> dict:
    """OpenAI's logprobs object for the tokens of one delta; ``offset``: the character where the
    delta's first token starts in the sample's text (completions' ``text_offset``)."""
    if kind == "chat.completion" or kind == "chat.completion.chunk":
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs):
            text = token_text(tok)
            content.append({"token": text, "logprob": entry[tok].logprob,
                            "bytes": list(text.encode()),
                            "top_logprobs": [{"token": token_text(t), "logprob": lp.logprob,
                                              "bytes": list(token_text(t).encode())}
                                             for t, lp in _by_rank(entry) if t != tok or len(entry) > 1]})
        return {"content": content}
    return _completion_logprobs(c.token_ids, c.logprobs, token_text, offset)


def _completion_logprobs(token_ids: list[int], entries: list[dict | None], token_text: Callable[[int], str],
                         offset: int) -> dict:
    """The completions API's logprobs of ``token_ids`` (an entry of None: no logprobs there, as
    the first prompt token's), their text offsets counted from ``offset``."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(token_ids, entries)],
            "top_logprobs": [None if e is None else {token_text(t): lp.logprob for t, lp in _by_rank(e)}
                             for e in entries],
            "text_offset": offsets}


def _by_rank(entry: dict) -> list:
    """A position's ``(token id, Logprob)`` pairs, most likely first."""
    return sorted(entry.items(), key=lambda item: item[1].rank)


class _Echo:
    """``echo`` of the completions API (vLLM's shape): each sample's text starts with the prompt's,
    and when the request asked for logprobs its logprobs start with the prompt tokens' (None for
    the first token; the prompt logprobs come with the request's first output)."""

    def __init__(self, echo: bool, token_text: Callable[[int], str]) -> None:
        self.echo = echo
        self.token_text = token_text
        self.prompt_logprobs = None

    def see(self, out: Any) -> None:
        """Keep the request's prompt logprobs when ``out`` brings them."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs

    def prompt_part(self, out: Any) -> tuple[str, dict | None]:
        """``(text, logprobs)`` a sample's choice starts with: the prompt's text and, with prompt
        logprobs, the prompt tokens' logprobs (text offsets from 0); ``("", None)`` without echo."""
        if not self.echo:
            return "", None
        ids = out.prompt_token_ids
        text = out.prompt if out.prompt is not None else "".join(self.token_text(t) for t in ids)
        if self.prompt_logprobs is None:
            return text, None
        return text, _completion_logprobs(ids, self.prompt_logprobs, self.token_text, 0)


def _merge_logprobs(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {k: old[k] + new[k] for k in new}


async def _sse(engine: EngineLoop, submitted: list[tuple[str, AsyncIterator[Any]]], n: int, kind: str,
               response_id: str, created: int, model_name: str, token_text: Callable[[int], str],
               usage_in_stream: bool, echo: bool = False) -> AsyncIterator[str]:
    """One ``data:`` event per sample delta (prompts one after another), then ``[DONE]``; a
    failure mid-stream sends an OpenAI error event, then ``[DONE]``."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    offsets: dict[int, int] = {}  # completions: text_offset of each choice's next token

    def event(choices: list[dict]) -> str:
        return "data: " + json.dumps({"id": response_id, "object": chunk_kind, "created": created,
                                      "model": model_name, "choices": choices}) + "\n\n"

    try:
        if kind == "chat.completion":
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n * len(submitted))])
        for p, (_, outputs) in enumerate(submitted):
            first = True
            echoed = _Echo(echo, token_text)
            async for out in outputs:
                if first:
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                    first = False
                echoed.see(out)
                choices = []
                for c in out.outputs:
                    index = p * n + c.index
                    usage["completion_tokens"] += len(c.token_ids)
                    prefix, logprobs = "", None
                    if chunk_kind == "text_completion" and index not in offsets:  # the sample's first chunk
                        prefix, logprobs = echoed.prompt_part(out)
                        offsets[index] = 0 if logprobs is None else _end_offset(logprobs)
                    if c.logprobs is not None:
                        logprobs = _merge_logprobs(logprobs, _logprobs(c, chunk_kind, token_text,
                                                                       offsets.get(index, 0)))
                        if chunk_kind == "text_completion" and logprobs["tokens"]:
                            offsets[index] = _end_offset(logprobs)
                    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason}
                    if chunk_kind == "chat.completion.chunk":
                        choice["delta"] = {"content": c.text}
                    else:
                        choice["text"] = prefix + c.text
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    choices.append(choice)
                yield event(choices)
        if usage_in_stream:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield "data: " + json.dumps({"id": response_id, "object": chunk_kind, "created": created,
                                         "model": model_name, "choices": [], "usage": usage}) + "\n\n"
    except EngineDead as exc:
        yield "data: " + json.dumps(error_body(str(exc), 503, kind="ServiceUnavailableError")) + "\n\n"
    except Exception as exc:  # noqa: BLE001 - the client hears of any failure, then the stream ends properly
        yield "data: " + json.dumps(error_body(f"{type(exc).__name__}: {exc}", 500,
                                               kind="InternalServerError")) + "\n\n"
    finally:
        for rid, _ in submitted:  # a client that left: abort what still runs (finished ids are ignored)
            engine.abort(rid)
    yield "data: [DONE]\n\n"
