"""The server's engine thread: it alone steps the :class:`~tpspec.LLM`, and takes new
requests and aborts between steps — so requests that arrive while others run join the
running batch at the next step, and every rank sees the same commands in the same order.
Requests reach it tokenized and validated (the handlers do that work on other threads, so a
big prompt never holds up the steps of the others).

HTTP handlers talk to it through :meth:`EngineLoop.submit` (an async iterator of the
request's :class:`~tpspec.RequestOutput` deltas) and :meth:`EngineLoop.abort`. A dead or
hung rank ends the loop: every running request and every later one gets
:class:`EngineDead` (the server answers 503), and the cause is logged once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

log = logging.getLogger("tpspec.serve")

IDLE_CHECK_S = 1.0  # how often an idle loop checks that the ranks are alive


class EngineDead(RuntimeError):
    """The ranks are gone; the server cannot generate any more."""


@dataclass
class _Submission:
    prompt: Any  # as LLM.add_request takes it (the handlers pass token ids)
    params: Any  # its SamplingParams
    accepted: concurrent.futures.Future  # -> request id, or the ValueError
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    request_id: str | None = None
    done: bool = field(default=False)


class EngineLoop:
    """Runs ``llm`` on a daemon thread until :meth:`stop`. ``llm``: a started :class:`~tpspec.LLM`
    (mp or ray executor)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.dead: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Submission] = {}
        self._stopping = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tpspec-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handlers' side
    async def submit(self, prompt: Any, params: Any) -> tuple[str, AsyncIterator[Any]]:
        """Queue a request (``LLM.add_request(prompt, params)`` on the engine thread). Returns
        ``(request_id, outputs)`` once the engine accepted it; raises the ``ValueError`` of a bad
        request, or :class:`EngineDead`."""
        if self.dead:
            raise EngineDead(self.dead)
        sub = _Submission(prompt, params, concurrent.futures.Future(), asyncio.Queue(), asyncio.get_running_loop())
        self._commands.put(("add", sub))
        accepted = asyncio.wrap_future(sub.accepted)
        while True:  # the loop may die after the check above: never wait on it forever
            done, _ = await asyncio.wait({accepted}, timeout=IDLE_CHECK_S)
            if done:
                return accepted.result(), self._outputs(sub)
            if self.dead:
                raise EngineDead(self.dead)

    async def _outputs(self, sub: _Submission) -> AsyncIterator[Any]:
        try:
            while True:
                item = await sub.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not sub.done:  # the client went away: free the request's place in the batch
                self.abort(sub.request_id)

    def abort(self, request_id: str | None) -> None:
        if request_id is not None:
            self._commands.put(("abort", request_id))

    def stop(self) -> None:
        """End the loop and shut the LLM down (its ranks exit). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout=30.0)
        self.llm.shutdown()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        from ..runtime import WorkerError

        try:
            while not self._stopping.is_set():
                self._take_commands(block=not self.llm.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.llm.has_unfinished_requests():
                    for out in self.llm.step():
                        self._deliver(out)
        except (WorkerError, RuntimeError) as exc:
            self._die(exc)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the clients
            self._die(exc)
            raise

    def _take_commands(self, *, block: bool) -> None:
        from ..runtime import WorkerError

        try:
            cmd, arg = self._commands.get(timeout=IDLE_CHECK_S) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:  # idle: notice a dead rank now rather than at the next request
                try:
                    self.llm.check_health()
                except WorkerError as exc:
                    self._die(exc)
                    self._stopping.set()
            return
        while True:
            if cmd == "add":
                self._add(arg)
            elif cmd == "abort":
                sub = self._streams.pop(arg, None)
                if sub is not None:
                    sub.done = True
                    self.llm.abort_request(arg)
            elif cmd == "stop":
                self._stopping.set()
                return
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, sub: _Submission) -> None:
        from ..runtime import WorkerError

        try:
            sub.request_id = self.llm.add_request(sub.prompt, sub.params)
        except ValueError as exc:
            sub.done = True
            sub.accepted.set_exception(exc)
            return
        except (WorkerError, RuntimeError):
            raise  # the ranks are gone: the loop ends and every request hears it
        except Exception as exc:  # noqa: BLE001 - a bad request the validation let through
            sub.done = True
            sub.accepted.set_exception(ValueError(f"{type(exc).__name__}: {exc}"))
            return
        self._streams[sub.request_id] = sub
        sub.accepted.set_result(sub.request_id)

    def _deliver(self, out: Any) -> None:
        sub = self._streams.get(out.request_id)
        if sub is None:
            return
        if out.finished:
            sub.done = True
            del self._streams[out.request_id]
        sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, out)

    def _die(self, exc: BaseException) -> None:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.dead = f"the engine's ranks are gone: {first}"
        log.error("tpspec serve: %s; every request now gets 503 (restart the server)", self.dead)
        error = EngineDead(self.dead)
        for sub in list(self._streams.values()):
            sub.done = True
            sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, error)
        self._streams.clear()
        while True:  # requests that never reached the engine
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd == "add" and not arg.accepted.done():
                arg.accepted.set_exception(error)
