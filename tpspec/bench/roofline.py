"""The roofline table of ``tpspec bench step``: the runtime's own decode and verification steps
beside the floor that the bytes they must read set.

On every rank (the rank processes of ``tpspec bench step``), for each attention backend of
``--attention-backends`` (default ``auto``: what the runtime picks), this builds the runtime's
:class:`~tpspec.runtime.engine.Engine` (its KV pages, its CUDA graphs, its token selection), starts
``B`` requests whose prompts of ``C`` tokens count as cached, and times ``Engine.step()`` — the
host's scheduling, the graph replay or the eager forward, token selection, acceptance and the
copy of the tokens back to the host — as the runtime runs it for ``LLM.generate``: consecutive
calls, with no device synchronization between them (a call returns once its tokens are on the
host; a graphed decode step may have launched the next one, whose GPU time the next call then
waits for while the host's work of this one overlaps it). Nothing is
prefilled: the requests' KV pages hold zeros or an earlier cell's entries, and attention reads
the same bytes whatever they hold.

Per context ``C`` (``--contexts``) and batch ``B`` (``--roofline-batch``):

* ``decode`` rows: one new token a request, in three columns: ``greedy``; ``defaults`` (every
  request on Qwen2.5-Instruct's sampling defaults, :data:`QWEN25_DEFAULTS`, its prompt counted
  for the repetition penalty); ``logprobs`` (greedy with ``logprobs=5``);
* ``verify`` rows (``--verify-batch``): greedy verification of ``--draft-len`` n-gram drafts,
  ``K + 1`` rows a request (an engine with n-gram speculation).

Each cell reports the median ``Engine.step()`` time after ``--warmup`` untimed steps (the first
step of a new shape captures its CUDA graph), and whether the runtime ran the timed steps in its
CUDA graph (``graph``) or eagerly (``eager``). With ``--profile`` each cell then runs
:data:`PROFILE_STEPS` more steps under ``torch.profiler`` (never among the timed ones) and every
rank writes where their device time went (:func:`profile_rows`, :func:`exposed_device_time`,
:func:`write_profile`). The floor of a step is
``(weight bytes of the rank, embedding table left out + KV bytes the step reads) / copy bandwidth``:
a decode step reads only the embedding rows of its tokens; every request reads its cached entries
plus the rows it writes, in K and V of every layer; the bandwidth is a device-to-device copy
timed in the same process (read + write bytes). Targets (:func:`roofline_checks`): a greedy decode
step within 1.12x its floor at batch 1 and 1.3x at batch 8, 32 and 64; a verification step
within 1.2x at batch 1 and 8; at batch 64 the ``defaults`` and ``logprobs`` steps at most 5 %
slower than the greedy one. Each row says PASS, FAIL, or ``-`` where no target applies.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import TYPE_CHECKING, Any, Sequence

from . import report

if TYPE_CHECKING:
    import torch

PAGE_SIZE = 16
ROOFLINE_BATCHES = (1, 8, 32, 64)
ROOFLINE_CONTEXTS = (1024, 4096)
VERIFY_BATCHES = (1, 8)
QUICK_ROOFLINE_BATCHES = (1, 4)
QUICK_ROOFLINE_CONTEXTS = (32, 64)
QUICK_VERIFY_BATCHES = (1,)
COLUMNS = ("greedy", "defaults", "logprobs")
LOGPROBS = 5
PROFILE_STEPS = 5  # --profile: steps a cell runs under torch.profiler after its timed ones
PROFILE_TOP = 25  # --profile: kernels (operators on CPU) the text summary lists
# Qwen2.5-Instruct's generation_config.json: every request of the ``defaults`` column samples with it.
QWEN25_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}

# Targets: a step's time over its floor (greedy), and the sampled columns' time over greedy's.
DECODE_TARGETS = {1: 1.12, 8: 1.3, 32: 1.3, 64: 1.3}
VERIFY_TARGETS = {1: 1.2, 8: 1.2}
SAMPLING_TARGET_BATCH = 64
SAMPLING_TARGET = 1.05

TABLE_COLUMNS = ["attention", "step", "context", "batch", "rows", "weight_MB", "kv_read_MB", "copy_GBps", "floor_ms",
                 "greedy_ms", "ratio", "defaults_ms", "defaults_vs_greedy", "logprobs_ms", "logprobs_vs_greedy",
                 "paths", "verdict", "checks"]


# ------------------------------------------------------------------------ pure rules

def column_params(column: str, index: int) -> Any:
    """The ``SamplingParams`` of request ``index`` in ``column`` (``greedy``, ``defaults``, ``logprobs``)."""
    from ..sampling.params import SamplingParams

    if column == "greedy":
        return SamplingParams(temperature=0.0)
    if column == "defaults":
        return SamplingParams(**QWEN25_DEFAULTS, seed=1000 + index)
    if column == "logprobs":
        return SamplingParams(temperature=0.0, logprobs=LOGPROBS)
    raise ValueError(f"unknown roofline column {column!r} (known: {', '.join(COLUMNS)})")


def kv_bytes_read(cached_tokens: Sequence[int], rows: int, bytes_per_token: int) -> int:
    """KV bytes one step reads: every request its ``cached`` entries plus the ``rows`` it writes
    (``bytes_per_token``: K and V of every layer on this rank)."""
    return sum(cached + rows for cached in cached_tokens) * bytes_per_token


def floor_ms(weight_bytes: float, kv_bytes: float, bandwidth: float) -> float:
    """The step's floor in ms: the bytes it must read at ``bandwidth`` bytes/s."""
    return (weight_bytes + kv_bytes) / bandwidth * 1e3


def roofline_checks(step: str, batch: int, ratio: float | None,
                    vs_greedy: dict[str, float | None]) -> list[tuple[str, bool]]:
    """The targets that apply to a row, each ``(what, passed)``: ``step`` is ``"decode"`` or
    ``"verify"``, ``ratio`` the greedy step over its floor (None: not measured), ``vs_greedy`` the
    ``defaults`` / ``logprobs`` steps over the greedy one (None: not measured)."""
    out: list[tuple[str, bool]] = []
    limit = (DECODE_TARGETS if step == "decode" else VERIFY_TARGETS).get(batch)
    if limit is not None and ratio is not None:
        out.append((f"greedy <= {limit:g}x floor", ratio <= limit))
    if step == "decode" and batch == SAMPLING_TARGET_BATCH:
        for column, value in vs_greedy.items():
            if value is not None:
                out.append((f"{column} <= {SAMPLING_TARGET:g}x greedy", value <= SAMPLING_TARGET))
    return out


def verdict(checks: Sequence[tuple[str, bool]]) -> str:
    """``PASS`` when every check passed, ``FAIL`` when one failed, ``-`` when none applies."""
    if not checks:
        return "-"
    return "PASS" if all(ok for _, ok in checks) else "FAIL"


def path_of(graphed_steps: int, timed_steps: int) -> str:
    """``graph`` when the runtime replayed a CUDA graph for every timed step, ``eager`` for none."""
    if graphed_steps == timed_steps:
        return "graph"
    return "eager" if graphed_steps == 0 else f"graph {graphed_steps}/{timed_steps}"


# ------------------------------------------------------------------------ arguments

def attention_backend_error(name: str, device: str) -> str | None:
    """Why the runtime's config refuses ``attention_backend=name`` on ``device``, or None when it
    accepts it (the runtime validates; this only asks it before any rank starts)."""
    from ..runtime.config import EngineConfig

    try:
        EngineConfig(model_path="-", tp_size=1, device=device, dtype="float32", attention_backend=name)
    except ValueError as exc:
        return str(exc)
    return None


def accepted_attention_backends(names: Sequence[str], device: str = "cuda") -> list[str]:
    """The ``names`` the runtime accepts as ``attention_backend`` (``launch/gpu_run.sh`` asks it
    which backends its quick roofline can put side by side)."""
    return [name for name in names if attention_backend_error(name, device) is None]


# ------------------------------------------------------------------------ on each rank

def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Measured bytes/s of a device-to-device copy (read + write counted), the floor's bandwidth."""
    import torch

    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cell_steps(cfg: dict) -> int:
    """The steps a cell runs: ``warmup + iters``, and :data:`PROFILE_STEPS` more with a profile."""
    return cfg["warmup"] + cfg["iters"] + (PROFILE_STEPS if cfg.get("profile_dir") else 0)


def roofline_cells(rank: int, world_size: int, cfg: dict, device: torch.device) -> list[dict]:
    """Every cell of the table on this rank (collective: every rank runs the same engines and
    steps). ``cfg``: model, device, dtype, exchange, graphs, attention_backends, contexts,
    roofline_batches, verify_batches, columns, draft_len, warmup, iters, and ``profile_dir``
    (optional: where each cell's profile goes, :func:`write_profile`)."""
    bandwidth = copy_bandwidth(device)
    _free(device)
    out: list[dict] = []
    for backend in cfg["attention_backends"]:
        plans = [(0, cfg["roofline_batches"], cfg["columns"])]
        if cfg["verify_batches"]:
            plans.append((cfg["draft_len"], cfg["verify_batches"], ("greedy",)))
        for num_draft, batches, columns in plans:
            engine = _build_engine(rank, world_size, cfg, backend, num_draft, max(batches), device)
            try:
                out += _engine_cells(engine, cfg, backend, batches, columns, bandwidth, device)
            finally:
                engine.close()
                del engine
                _free(device)
    return out


def _build_engine(rank: int, world_size: int, cfg: dict, backend: str, num_draft: int, max_batch: int,
                  device: torch.device) -> Any:
    from ..mapping import Mapping
    from ..runtime.config import EngineConfig, SpeculativeConfig
    from ..runtime.engine import Engine

    spec = SpeculativeConfig("ngram", num_speculative_tokens=num_draft) if num_draft else None
    steps = cell_steps(cfg)
    config = EngineConfig(
        model_path=cfg["model"], tp_size=world_size, device=cfg["device"], dtype=cfg["dtype"], speculative=spec,
        max_batch_size=max_batch, max_seq_len=max(cfg["contexts"]) + _new_tokens(steps, num_draft) + num_draft + 1,
        max_num_tokens=max(512, max_batch * (num_draft + 1)), use_cuda_graphs=cfg["graphs"],
        exchange=cfg["exchange"], page_size=PAGE_SIZE, attention_backend=backend)
    return Engine(config, Mapping(world_size, rank), device)


def _new_tokens(steps: int, num_draft: int) -> int:
    """A request's token budget: more than ``steps`` steps can emit, so none ends inside a cell."""
    return 2 + (steps + 1) * (num_draft + 1)


def _engine_cells(engine: Any, cfg: dict, backend: str, batches: Sequence[int], columns: Sequence[str],
                  bandwidth: float, device: torch.device) -> list[dict]:
    import torch

    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for name, p, _ in model.shard_plan()
                       if not name.startswith("embed_tokens"))
    per_token = model.page_bytes(PAGE_SIZE) // PAGE_SIZE
    counter = _GraphedSteps(engine)
    gen = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    step_kind = "verify" if engine.num_draft else "decode"
    next_id = 0
    out = []
    for context in cfg["contexts"]:
        for column in columns:
            for batch in batches:
                prompts = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
                ids = list(range(next_id, next_id + batch))
                next_id += batch
                cell = _time_cell(engine, counter, ids, prompts, column, cfg, per_token, device)
                kv = cell.pop("kv_bytes")
                profile = cell.pop("profile", None)
                if profile is not None:
                    write_profile(cfg["profile_dir"], f"rank{engine.mapping.tp_rank}-{backend}-{step_kind}-c{context}"
                                  f"-b{batch}-{column}", profile, PROFILE_STEPS, device)
                out.append(dict(cell, kind="roofline", attention=backend, resolved=model.attention.name,
                                step=step_kind, column=column, context=context, batch=batch,
                                rows=engine.num_draft + 1, weight_bytes=weight_bytes, kv_bytes=kv,
                                bandwidth=bandwidth, floor_ms=floor_ms(weight_bytes, kv, bandwidth)))
    return out


def _time_cell(engine: Any, counter: "_GraphedSteps", ids: list[int], prompts: list[list[int]], column: str,
               cfg: dict, per_token: int, device: torch.device) -> dict:
    """Start the requests, time ``Engine.step()`` (median over the timed steps), profile
    :data:`PROFILE_STEPS` more where ``cfg["profile_dir"]`` is set (``"profile"``: :func:`profile_rows`),
    drop them."""
    from ..runtime.config import Request

    k = engine.num_draft
    steps = cfg["warmup"] + cfg["iters"]
    requests = [Request(rid, tuple(p), column_params(column, i), max_new_tokens=_new_tokens(cell_steps(cfg), k))
                for i, (rid, p) in enumerate(zip(ids, prompts))]
    start_generating(engine, requests)
    preempted = engine.num_preemptions
    length = {rid: len(p) + 1 for rid, p in zip(ids, prompts)}  # the prompt and the context step's token
    times, kv, graphed = [], [], 0
    _sync(device)
    try:
        # No device synchronization between steps: a call returns once its tokens are on the host,
        # and a graphed decode step may have launched the next one (the host's work overlaps it).
        for it in range(steps):
            cached = [length[rid] - 1 for rid in ids]
            counter.reset()
            t0 = time.perf_counter()
            updates = engine.step()
            elapsed = (time.perf_counter() - t0) * 1e3
            for u in updates:
                if u.finish_reason is not None:
                    raise RuntimeError(f"request {u.request_id} finished inside a roofline cell ({u.finish_reason})")
                length[u.request_id] += len(u.new_token_ids)
            if it >= cfg["warmup"]:
                times.append(elapsed)
                kv.append(kv_bytes_read(cached, k + 1, per_token))
                graphed += counter.graphed
        profile = _profiled_steps(engine, device) if cfg.get("profile_dir") else None
    finally:
        engine.abort(ids)
    if engine.num_preemptions != preempted:  # start_generating checked the pages: not expected
        raise RuntimeError("a request was preempted inside a roofline cell: its KV pages ran out")
    out = {"step_ms": statistics.median(times), "kv_bytes": statistics.mean(kv), "path": path_of(graphed, len(times))}
    if profile is not None:
        out["profile"] = profile
    return out


def _profiled_steps(engine: Any, device: torch.device) -> list[dict]:
    """:data:`PROFILE_STEPS` steps of ``engine`` under ``torch.profiler`` (the device synchronized
    before and after them): :func:`profile_rows` of the trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            for u in engine.step():
                if u.finish_reason is not None:
                    raise RuntimeError(f"request {u.request_id} finished inside a roofline cell's profile")
        _sync(device)
    on_cuda = device.type == "cuda"
    return profile_rows(prof.key_averages(), on_cuda, exposed_device_time(prof.events()) if on_cuda else None)


def exposed_device_time(events: Any) -> dict[str, float]:
    """Microseconds by name that each of the device's events (kernels, copies: ``torch.profiler``'s
    events whose ``device_type`` is CUDA, with their ``time_range``) moved the device's busy time on:
    taken in the order they started, an event counts from where the ones before it had ended (its
    start, if later) to its end, and nothing if they outlast it. A kernel launched dependently that
    waits on the one before counts only its time after that one; the counts add up to the time the
    device was busy. Totals over the events given."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if "CUDA" in str(getattr(e, "device_type", "")))
    exposed: dict[str, float] = {}
    reached = float("-inf")
    for start, end, name in spans:
        exposed[name] = exposed.get(name, 0.0) + max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return exposed


def profile_rows(events: Any, on_cuda: bool, exposed: dict[str, float] | None = None) -> list[dict]:
    """``[{"name", "calls", "us"}]`` from ``torch.profiler``'s ``key_averages()``, the largest
    first: on CUDA every kernel and copy the device ran (its device time), elsewhere every operator
    (its own CPU time, children excluded). Totals over the profiled steps. ``exposed``
    (:func:`exposed_device_time`): each row gets its name's ``exposed_us`` too."""
    rows = []
    for e in events:
        if on_cuda:
            if "CUDA" not in str(getattr(e, "device_type", "")):
                continue
            us = e.device_time_total
        else:
            us = e.self_cpu_time_total
        if us > 0:
            row = {"name": e.key, "calls": int(e.count), "us": float(us)}
            if exposed is not None:
                row["exposed_us"] = float(exposed.get(e.key, 0.0))
            rows.append(row)
    return sorted(rows, key=lambda r: -r["us"])


def write_profile(out_dir: str, name: str, rows: list[dict], steps: int, device: torch.device) -> None:
    """``<out_dir>/<name>.json`` (``steps`` and every row of :func:`profile_rows` with ``calls``, ``us``
    and, where the rows have it, ``exposed_us`` per step) and ``<name>.txt`` (the :data:`PROFILE_TOP`
    largest, and the totals)."""
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    per_step = [{"name": r["name"], "calls_per_step": r["calls"] / steps, "us_per_step": r["us"] / steps,
                 **({"exposed_us_per_step": r["exposed_us"] / steps} if "exposed_us" in r else {})} for r in rows]
    exposed = bool(per_step) and all("exposed_us_per_step" in r for r in per_step)
    what = "kernels and copies, device time" if device.type == "cuda" else "operators, own CPU time"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"steps": steps, "device": str(device), "what": what, "rows": per_step}, f, indent=1)
    total = sum(r["us_per_step"] for r in per_step)
    lines = [f"{name}: {steps} steps under torch.profiler; {what}: {total:.1f} us a step in all"]
    if exposed:
        busy = sum(r["exposed_us_per_step"] for r in per_step)
        lines[0] += (f"; exposed (each one's time past the end of those started before it, so kernels launched "
                     f"dependently count only after the one they wait on): {busy:.1f} us a step, the device busy")
    lines += [f"{r['us_per_step']:10.1f} us" + (f" {r['exposed_us_per_step']:10.1f} exposed" if exposed else "")
              + f" {r['calls_per_step']:7.1f} calls  {r['name'][:120]}" for r in per_step[:PROFILE_TOP]]
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def start_generating(engine: Any, requests: list[Any]) -> None:
    """Queue ``requests`` on ``engine`` and turn them into generation requests at once, as if
    their prompts had been prefilled and the context step had emitted one token (a copy of the
    last prompt token): ``Engine.add_requests(..., prompt_cached=True)``. ``RuntimeError`` when
    the KV pages cannot hold them all to their last token (a request preempted inside a cell
    would time its recomputation)."""
    k = engine.num_draft
    longest = engine.config.max_seq_len
    need = sum(engine.pages.pages_for(min(len(r.prompt) + r.max_new_tokens, longest) - 1 + k) for r in requests)
    if need > engine.pages.num_free:
        raise RuntimeError(f"the engine's KV cache ({engine.kv.num_pages} pages of {engine.kv.page_size} tokens, "
                           f"{engine.pages.num_free} free) cannot hold these {len(requests)} requests to their end "
                           f"({need} pages): use fewer or shorter ones")
    engine.add_requests(requests, prompt_cached=True)


class _GraphedSteps:
    """How many of the engine's target steps since :meth:`reset` came from a CUDA-graph replay
    (``GenerationGraphs.num_replayed``; a step run eagerly, or repeated eagerly because a
    filtered row was undecided, does not count). Without graphs every step is eager."""

    def __init__(self, engine: Any) -> None:
        self.graphs = engine.graphs
        self.start = 0
        self.reset()

    def reset(self) -> None:
        self.start = 0 if self.graphs is None else self.graphs.num_replayed

    @property
    def graphed(self) -> int:
        return 0 if self.graphs is None else self.graphs.num_replayed - self.start


# --------------------------------------------------------------------------- table

def roofline_rows(per_rank: list[list[dict]]) -> list[list[Any]]:
    """One row per (attention backend, step, context, batch): the slowest rank's step times beside
    the largest floor, the ratios, the path each column ran, and the verdict."""
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for records in per_rank:
        for rec in records:
            if rec.get("kind") == "roofline":
                key = (rec["attention"], rec["step"], rec["context"], rec["batch"])
                cells.setdefault(key, {}).setdefault(rec["column"], []).append(rec)
    rows = []
    for (attention, step, context, batch), by_column in cells.items():
        first = next(iter(by_column.values()))
        resolved = first[0]["resolved"]
        label = attention if resolved == attention else f"{attention}->{resolved}"
        step_ms = {c: max(r["step_ms"] for r in recs) for c, recs in by_column.items()}
        floor = max(r["floor_ms"] for r in by_column.get("greedy", first))
        worst = max(by_column.get("greedy", first), key=lambda r: r["floor_ms"])
        greedy = step_ms.get("greedy")
        ratio = greedy / floor if greedy is not None else None
        vs_greedy = {c: (step_ms[c] / greedy if greedy and c in step_ms else None) for c in ("defaults", "logprobs")}
        checks = roofline_checks(step, batch, ratio, vs_greedy)
        paths = "/".join(_worst_path([r["path"] for r in by_column[c]]) if c in by_column else "-" for c in COLUMNS)

        def num(value: float | None, digits: int) -> Any:
            return "-" if value is None else round(value, digits)

        rows.append([label, step, context, batch, worst["rows"], round(worst["weight_bytes"] / 1e6, 1),
                     round(worst["kv_bytes"] / 1e6, 2), round(min(r["bandwidth"] for recs in by_column.values() for r in recs) / 1e9, 1),
                     round(floor, 4), num(greedy, 4), num(ratio, 3), num(step_ms.get("defaults"), 4),
                     num(vs_greedy["defaults"], 3), num(step_ms.get("logprobs"), 4), num(vs_greedy["logprobs"], 3),
                     paths, verdict(checks), "; ".join(f"{what}: {'PASS' if ok else 'FAIL'}" for what, ok in checks)])
    return rows


def _worst_path(paths: list[str]) -> str:
    """The ranks' paths of one cell: the same on every rank (the runtime decides from replicated state)."""
    return paths[0] if len(set(paths)) == 1 else ",".join(paths)


def write_roofline_report(out_dir: str, rows: list[list[Any]], meta: dict) -> None:
    def draw(ax: Any) -> None:
        labels = [f"{r[0]}\n{r[1]} {r[2]}\nB={r[3]}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[9] if r[9] != "-" else 0 for r in rows], width=0.4, color="tab:blue",
               label="greedy step (Engine.step)")
        ax.bar([i + 0.2 for i in x], [r[8] for r in rows], width=0.4, color="lightgray", label="roofline floor")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("ms per step (median, slowest rank)")
        ax.set_title("runtime step vs (weights / tp + KV read) / copy bandwidth")
        ax.legend(fontsize=8)

    note = ("Engine.step() as LLM.generate runs it (CUDA graph where the runtime graphs the step: paths greedy/"
            "defaults/logprobs); floor = (rank's weight bytes without the embedding + KV bytes read) / measured "
            "device copy bandwidth; ratio = greedy step / floor; *_vs_greedy = column step / greedy step. "
            "On CPU only ratios mean something.")
    targets = {"decode_greedy_vs_floor": DECODE_TARGETS, "verify_greedy_vs_floor": VERIFY_TARGETS,
               "sampled_vs_greedy": {SAMPLING_TARGET_BATCH: SAMPLING_TARGET}}
    report.write_report(out_dir, "step_roofline", columns=TABLE_COLUMNS, rows=rows,
                        meta=dict(meta, note=note, targets=targets), plot=draw)
