"""``tpspec serve``: an OpenAI-compatible HTTP server over :class:`tpspec.LLM`.

* :mod:`.protocol` — the request bodies (pydantic) and their sampling parameters;
* :mod:`.structured` — ``response_format``, ``structured_outputs`` and ``logit_bias`` as
  ``SamplingParams`` takes them;
* :mod:`.engine_loop` — one thread that owns the ``LLM`` and steps it, taking new requests
  between steps (continuous batching across HTTP requests);
* :mod:`.app` — the FastAPI routes: ``/health``, ``/metrics``, ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions`` (JSON or server-sent events), OpenAI's error objects;
* :mod:`.limits` — what one client may cost: body size, body and header deadlines;
* :mod:`.cli` — the ``tpspec serve MODEL`` command (uvicorn; Ctrl-C / SIGTERM stop it and its ranks).

Needs the ``serve`` extra (FastAPI, uvicorn).
"""
