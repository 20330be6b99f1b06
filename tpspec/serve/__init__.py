"""``tpspec serve``: an OpenAI-compatible HTTP server over :class:`tpspec.LLM`.

* :mod:`.protocol` — the request bodies (pydantic) and their sampling parameters;
* :mod:`.engine_loop` — one thread that owns the ``LLM`` and steps it, taking new requests
  between steps (continuous batching across HTTP requests);
* :mod:`.app` — the FastAPI routes: ``/health``, ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions`` (JSON or server-sent events);
* :mod:`.cli` — the ``tpspec serve MODEL`` command (uvicorn).

Needs the ``serve`` extra (FastAPI, uvicorn).
"""
