"""What one client may cost the server: the size of a request body, the time its headers and
its body may take to arrive.

* :class:`RequestLimits` — ASGI middleware: a body above ``max_body_bytes`` gets 413 (at once
  when ``Content-Length`` says so, else as soon as the bytes read pass the limit), a body not
  complete ``body_timeout_s`` after its headers gets 408, one still arriving when the server
  shuts down gets 503. A request still running when the server's shutdown grace ends (uvicorn
  then cancels it) is answered too, rather than logged as a traceback: 503 when its response has
  not started, and a stream ends with an error event and ``data: [DONE]``. The errors are
  OpenAI-shaped.
* :func:`header_timeout_protocol` — the HTTP protocol class for uvicorn with a deadline on the
  headers: a connection whose request headers are not complete ``header_timeout_s`` after it
  opened (or after its previous response) is closed. ASGI only sees a request once its headers
  are in, so this lives one level down, in the protocol.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from .protocol import error_body

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0


class BodyRejected(Exception):
    """The body broke a limit (raised from ``receive`` into the app, answered by the middleware)."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class RequestLimits:
    """ASGI middleware bounding each HTTP request body in size and in time (see the module)."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = self._too_large()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _answer(send, too_large)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received = 0
        body_done = started = event_stream = False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done:  # later receives wait for a disconnect, however long the response takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyRejected(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                   "RequestTimeoutError") from None
            except asyncio.CancelledError:  # the server is shutting down: answer, rather than log a traceback
                raise _shutting_down() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise too_large
                body_done = not message.get("more_body", False)
            return message

        async def tracked_send(message: dict) -> None:
            nonlocal started, event_stream
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                event_stream = content_type.startswith(b"text/event-stream")
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyRejected as exc:
            if not started:
                await _answer(send, exc)
        except asyncio.CancelledError:  # the shutdown's grace is over: end the request, no traceback
            if not started:
                await _answer(send, _shutting_down())
            elif event_stream:
                exc = _shutting_down()
                error = json.dumps(error_body(exc.message, exc.status, kind=exc.kind))
                await send({"type": "http.response.body", "body": f"data: {error}\n\ndata: [DONE]\n\n".encode(),
                            "more_body": False})

    def _too_large(self) -> BodyRejected:
        return BodyRejected(413, f"the request body is larger than {self.max_body_bytes} bytes (the server's "
                                 f"--max-body-bytes)", "RequestTooLargeError")


def _shutting_down() -> BodyRejected:
    return BodyRejected(503, "the server is shutting down", "ServiceUnavailableError")


async def _answer(send: Callable[[dict], Awaitable[None]], exc: BodyRejected) -> None:
    body = json.dumps(error_body(exc.message, exc.status, kind=exc.kind)).encode()
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(base: type, header_timeout_s: float) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` that closes a connection whose request
    headers (up to the blank line that ends them) are not all in ``header_timeout_s`` after the
    connection opened or its previous response completed."""

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _header_tail = b""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None:
                seen = self._header_tail + data
                if b"\r\n\r\n" in seen:
                    self._stop_header_timer()
                else:
                    self._header_tail = seen[-3:]
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()  # the next request on this connection (uvicorn's keep-alive comes first)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._stop_header_timer()
            self._header_tail = b""
            self._header_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
