"""``tpspec serve MODEL``: start the ranks, then serve the OpenAI API with uvicorn.

Binds to 127.0.0.1 unless ``--host`` says otherwise. Ctrl-C / SIGTERM stop the server and
its rank processes within a few seconds, whatever the clients do: requests still running
get ``SHUTDOWN_GRACE_S`` to finish, then the connections are dropped and the engine stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

SHUTDOWN_GRACE_S = 2.0
"""After SIGTERM / Ctrl-C: how long running requests may take before their connections are cut."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="tiny", help="Hugging Face checkpoint directory, or 'tiny'")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--speculative-config", default=None, help="JSON of LLM(speculative_config=...)")
    parser.add_argument("--generation-config", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--attention-backend", default="auto",
                        help="paged attention backend (see tpspec generate --help)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV pages of cached prompt prefixes (default on)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--max-body-bytes", type=int, default=32 * 2**20,
                        help="largest request body accepted (default 32 MiB); larger ones get 413")
    parser.add_argument("--header-timeout-s", type=float, default=10.0,
                        help="seconds a client may take to send a request's headers (default 10)")
    parser.add_argument("--body-timeout-s", type=float, default=60.0,
                        help="seconds a client may take to send a request's body after its headers (default 60); "
                             "then 408")


def run(args: argparse.Namespace) -> int:
    for name in ("max_body_bytes", "header_timeout_s", "body_timeout_s"):
        if getattr(args, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        import uvicorn
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from .app import build_app
        from .engine_loop import EngineLoop
        from .limits import header_timeout_protocol
    except ImportError as exc:
        print(f"error: tpspec serve needs the 'serve' extra (pip install 'tpspec[serve]'): {exc}", file=sys.stderr)
        return 2
    from ..runtime import LLM, WorkerError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = json.loads(args.speculative_config) if args.speculative_config else None
        llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
                  distributed_executor_backend=args.distributed_executor_backend, device=args.device,
                  dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  gpu_memory_utilization=args.gpu_memory_utilization, speculative_config=spec,
                  generation_config=args.generation_config, enforce_eager=args.enforce_eager,
                  attention_backend=args.attention_backend,
                  enable_prefix_caching=args.enable_prefix_caching)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    engine = EngineLoop(llm)
    app = build_app(engine, args.served_model_name or args.model, max_body_bytes=args.max_body_bytes,
                    body_timeout_s=args.body_timeout_s)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=header_timeout_protocol(AutoHTTPProtocol, args.header_timeout_s),
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    # uvicorn handles SIGTERM / SIGINT itself (a graceful shutdown, whose lifespan stops the
    # engine), then raises the signal again for the handler it found. Exit normally there: a
    # process killed by the signal skips the exit handlers, and multiprocessing's, which unlink
    # the rank queues' semaphores, must run.
    previous = {sig: signal.signal(sig, _exit_normally) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run()
    except SystemExit as stopped:
        if stopped.code != 0:
            raise
    finally:
        engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _exit_normally(signum: int, frame: object) -> None:
    raise SystemExit(0)
