"""Automatic prefix caching and preemption: the allocator's rules (key chains, references, LRU
eviction that never touches a referenced page), and through ``LLM``: outputs identical with the
cache on and off (greedy and seeded sampled tokens, logprobs bit for bit in deterministic mode)
for prompts sharing all but their last token, fully cached prompts, a conversation's next turn
and after evictions, with every drafter (the EAGLE-3 head's keys include the token after each
page; a drafter's pages are cached only once it wrote them); requests starting in the same step
sharing a prefix; prompt logprobs and penalties beside cached prefixes; TP 2 and attention DP
equal to TP 1 with every rank taking the same decisions; 32 requests under page pressure each
equal to its run alone, preemptions counted, no page leaked; the counters the server exposes, a
request that can never fit, and ``tpspec generate``'s flags."""

from __future__ import annotations

import random

import pytest

from tpspec import LLM, SamplingParams
from tpspec.runtime.pages import PageAllocator, page_keys, root_key

PAGE = 4
MAX_LEN = 64
ROOT = root_key("test")


def _engine(llm):
    return llm._executor.ctx.state["engine"]  # noqa: SLF001 (an in-process rank: external_launcher)


def _llm(*, pages: int | None = None, spec: dict | None = None, **kwargs) -> LLM:
    """The tiny model (float32) on one in-process rank, pages of 4 tokens; ``pages``: request pages
    the cache holds."""
    base = dict(distributed_executor_backend="external_launcher", tensor_parallel_size=1, device="cpu",
                dtype="float32", page_size=PAGE, max_model_len=MAX_LEN, speculative_config=spec, max_num_seqs=8)
    if pages is not None:
        per_page = {None: 2048, "ngram": 2048, "draft_model": 3072, "eagle3": 3072}[spec and spec["method"]]
        kwargs["kv_cache_bytes"] = (pages + 1) * per_page  # one scratch page (K + 1 <= 4 tokens)
    llm = LLM("tiny", **{**base, **kwargs})
    if pages is not None:
        assert llm.num_kv_pages == pages and _engine(llm).kv.page_bytes == per_page
    return llm


# ---------------------------------------------------------------------------- the allocator

def test_page_keys_name_the_whole_prefix():
    toks = list(range(10, 30))
    keys = page_keys(toks, 4, ROOT)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert page_keys(toks[:11], 4, ROOT) == keys[:2]  # only full pages get keys
    assert page_keys(toks, 4, ROOT, start=2, parent=keys[1]) == keys[2:]  # extended page by page
    changed = page_keys([99] + toks[1:], 4, ROOT)  # an earlier token changes every later key
    assert all(a != b for a, b in zip(changed, keys))
    later = page_keys(toks[:8] + [99] + toks[9:], 4, ROOT)
    assert later[:2] == keys[:2] and all(a != b for a, b in zip(later[2:], keys[2:]))
    assert page_keys(toks, 4, root_key("other model")) != keys  # the root names the engine
    # With a lookahead of one token (an EAGLE-3 head), a page's key also covers the next token.
    ahead = page_keys(toks, 4, ROOT, lookahead=1)
    assert len(ahead) == 4  # the last page has no next token yet
    next_changed = toks[:12] + [99] + toks[13:]  # the token after page 2
    assert page_keys(next_changed, 4, ROOT, lookahead=1)[:3] == ahead[:2] + [page_keys(next_changed, 4, ROOT,
                                                                                       lookahead=1)[2]]
    assert page_keys(next_changed, 4, ROOT, lookahead=1)[2] != ahead[2]  # page 2's head KV reads token 12
    assert page_keys(next_changed, 4, ROOT)[:3] == keys[:3]  # without the lookahead page 2 keeps its key
    with pytest.raises(ValueError, match="parent"):
        page_keys(toks, 4, ROOT, start=1)


def test_allocator_shares_cached_pages_by_reference():
    pool = PageAllocator(8, 4, enable_caching=True)
    toks = list(range(100, 112))  # 3 full pages
    keys = page_keys(toks, 4, ROOT)
    assert pool.match(keys) == []
    assert pool.start("a", [], 12) and pool.table("a") == [0, 1, 2]  # lowest pages first
    pool.cache("a", keys[:2])  # the KV of the first two pages is final
    assert pool.num_cached == 2 and pool.match(keys) == [0, 1]
    hit = pool.match(keys[:2])
    assert pool.start("b", hit, 10) and pool.table("b") == [0, 1, 3]
    assert [pool.refs(p) for p in range(4)] == [2, 2, 1, 1] and pool.num_free == 4
    pool.cache("b", keys)  # b's page 3 gets keys[2] first...
    pool.cache("a", keys)  # ...so a's twin page 2 stays without a key
    assert pool.num_cached == 3 and pool.match(keys) == [0, 1, 3]
    pool.free("a")
    assert pool.refs(0) == 1 and pool.num_free == 5 and pool.num_cached_free == 0  # page 2: no key, plainly free
    pool.free("b")
    assert pool.num_free == 8 and pool.num_cached_free == 3 and pool.match(keys) == [0, 1, 3]
    pool.check()
    pool.free("nobody")  # no-op
    with pytest.raises(RuntimeError, match="holds no pages"):
        pool.grow("nobody", 4)
    assert pool.start("c", [], 4)
    with pytest.raises(RuntimeError, match="already holds pages"):
        pool.start("c", [], 4)


def test_allocator_evicts_least_recently_used_never_a_referenced_page():
    pool = PageAllocator(6, 2, enable_caching=True)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ka, kb = page_keys(a, 2, ROOT), page_keys(b, 2, ROOT)
    assert pool.start("a", [], 4) and pool.start("b", [], 4)  # a: pages 0 1, b: pages 2 3
    pool.cache("a", ka)
    pool.cache("b", kb)
    pool.free("a")  # used before b: evicted first, its last page first
    pool.free("b")
    assert pool.start("c", [], 4) and pool.table("c") == [4, 5]  # pages without a key go first
    assert pool.match(ka) == [0, 1] and pool.match(kb) == [2, 3]
    assert pool.grow("c", 6) and pool.table("c")[-1] == 1  # then the least recently used: a's tail
    assert pool.match(ka) == [0] and pool.match(kb) == [2, 3]
    assert pool.start("d", pool.match(kb), 4)  # b's pages in use again: now the most recent
    assert pool.grow("c", 8) and pool.table("c")[-1] == 0  # a's head, not b's referenced pages
    assert pool.match(ka) == [] and pool.num_free == 0
    # Nothing free: growth fails and takes nothing; a referenced cached page is never taken.
    assert not pool.grow("c", 10) and not pool.start("e", [], 1)
    assert pool.table("c") == [4, 5, 1, 0] and pool.match(kb) == [2, 3]
    pool.free("d")
    assert not pool.start("e", [], 6) and pool.num_free == 2  # 3 pages: no change when they do not fit
    assert pool.start("e", pool.match(kb), 4) and pool.table("e") == [2, 3] and pool.num_free == 0
    pool.check()


def test_allocator_without_caching_and_its_accounting_check():
    pool = PageAllocator(4, 4)
    toks = list(range(8))
    assert pool.start("a", [], 8)
    pool.cache("a", page_keys(toks, 4, ROOT))
    assert pool.num_cached == 0 and pool.match(page_keys(toks, 4, ROOT)) == []
    assert pool.grow("a", 16) and not pool.grow("a", 17)
    with pytest.raises(ValueError, match="holds 4 pages"):
        pool.check_fits(17)
    pool.free("a")
    assert pool.num_free == 4
    pool.check()
    pool._refs[0] = 1  # noqa: SLF001 (break it on purpose)
    with pytest.raises(RuntimeError, match="reference counts"):
        pool.check()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_pages"):
            PageAllocator(bad, 4)


# ---------------------------------------------------------------------------- through LLM

SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2},
    "eagle3": {"method": "eagle3", "model": "tiny", "num_speculative_tokens": 2},
}
_rng = random.Random(7)
P0 = [_rng.randrange(3, 500) for _ in range(32)]  # 8 full pages
OTHERS = [[_rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
NEW = 16
TURN = 8  # tokens of a first answer a next turn repeats: 32 + 8 + 3 prompt tokens + NEW fit MAX_LEN


def _params(seed: int | None) -> SamplingParams:
    """Greedy (``seed=None``) or seeded sampled, with logprobs."""
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=NEW, ignore_eos=True, logprobs=2)


def _scenario(llm: LLM, seed: int | None) -> tuple[list, list, list[int]]:
    """Calls that hit, share, extend and evict cached prefixes; (tokens, logprobs, cached tokens) of every output."""
    outs = llm.generate([P0], _params(seed))
    first = outs[0].outputs[0].token_ids
    # A conversation's next turn (the first turn's output cut to fit max_model_len with the next answer).
    outs += llm.generate([P0 + first[:TURN] + [9, 10, 11]], _params(seed))
    # All but the last token shared; the whole prompt again; the first 28 tokens shared (the 29th differs).
    outs += llm.generate([P0[:31] + [7], P0, P0[:28] + [5, 6, 7, 8]], _params(seed))
    outs += llm.generate(OTHERS, _params(seed))  # they take every page: P0's pages are evicted
    outs += llm.generate([P0[:30] + [1, 2]], _params(seed))
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            [o.num_cached_tokens for o in outs])


@pytest.mark.parametrize("method", SPECS)
def test_prefix_cache_on_equals_off_deterministic(method):
    """Deterministic mode: a cached page holds the bits a fresh prefill writes, so tokens and logprobs
    are bit-identical with the cache on and off, greedy and seeded sampled, under page pressure
    (24 pages of 4 tokens: evictions and preemptions)."""
    spec = SPECS[method]
    runs = {}
    for caching in (True, False):
        with _llm(pages=24, spec=spec, deterministic=True, enable_prefix_caching=caching) as llm:
            runs[caching] = [_scenario(llm, seed) for seed in (None, 11)]
            engine = _engine(llm)
            engine.pages.check()
            assert engine.pages.num_free == 24
            counters = llm.counters
        if caching:
            assert counters.prefix_cache_hits > 0 and counters.num_preemptions > 0
        else:
            assert counters.prefix_cache_queries == counters.prefix_cache_hits == 0
    for (tokens_on, lp_on, _), (tokens_off, lp_off, cached_off) in zip(runs[True], runs[False]):
        assert tokens_on == tokens_off
        assert lp_on == lp_off  # every Logprob bit for bit
        assert set(cached_off) == {0}
    # The first (greedy) scenario on a cold cache. P0 alone: nothing cached; the next turn (43 tokens)
    # reads the first turn's generated pages too: 10 pages (with an EAGLE-3 head 9: the tenth page's
    # key covers the token after it, where the turns differ); then 7 pages (the last token, and with it its page, is
    # computed), with an EAGLE-3 head 6 for the prompt that differs right after page 7 (the head's KV
    # at position 27 reads token 28); after the other prompts took every page, little or nothing.
    cached = runs[True][0][2]
    assert cached[0] == 0 and cached[1] == (36 if method == "eagle3" else 40), cached
    assert cached[2:5] == [28, 28, 24 if method == "eagle3" else 28], cached
    assert cached[-1] < 28, cached


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["plain", "eagle3"])
def test_prefix_cache_and_preemption_on_cuda(method):
    """The same on one GPU, with CUDA graphs (generation steps over shared and recomputed pages)."""
    runs = {}
    for caching in (True, False):
        with _llm(pages=24, spec=SPECS[method], device="cuda", deterministic=True,
                  enable_prefix_caching=caching) as llm:
            runs[caching] = [_scenario(llm, seed)[:2] for seed in (None, 11)]
            _check_no_page_leaked(llm)
            assert caching == (llm.counters.prefix_cache_hits > 0)
    assert runs[True] == runs[False]


def test_prefix_cache_on_equals_off_default_mode():
    """The default mode: a cached page's KV may differ from a fresh prefill's in its last bits, but
    the tiny model's tokens are far from ties: greedy and seeded sampled tokens are the same."""
    runs = {}
    for caching in (True, False):
        with _llm(pages=24, enable_prefix_caching=caching) as llm:
            runs[caching] = [_scenario(llm, seed)[0] for seed in (None, 11)]
    assert runs[True] == runs[False]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_drafters_read_their_own_valid_kv_from_cached_pages(method):
    """A cached page holds the drafter's KV too (its pages are keyed only once the drafter has
    written them; an EAGLE-3 head's keys include the token after the page). Under rejection
    sampling a seeded request's tokens depend on the drafts, so with a roomy cache (no preemption)
    tokens, logprobs and the drafts accepted each step are the same with the cache on and off."""
    spec = dict(SPECS[method], acceptance="rejection")
    runs = {}
    for caching in (True, False):
        with _llm(spec=spec, deterministic=True, enable_prefix_caching=caching) as llm:
            params = _params(5)
            outs = llm.generate([P0], params)
            outs += llm.generate([P0 + outs[0].outputs[0].token_ids[:TURN] + [9, 10, 11]], params)
            outs += llm.generate([P0[:31] + [7], P0, P0[:28] + [5, 6, 7, 8]], params)
            # A request that ends at its context step never drafts: the drafter's KV of its prompt
            # was never written, so its pages are not cached for the next one.
            short = OTHERS[0][:20]
            outs += llm.generate([short], SamplingParams(temperature=0.0, max_tokens=1))
            outs += llm.generate([short], params)
            runs[caching] = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].stats.accepted_drafts_per_step,
                              o.num_cached_tokens) for o in outs]
            assert llm.counters.num_preemptions == 0
    assert [r[:3] for r in runs[True]] == [r[:3] for r in runs[False]]
    assert [r[3] for r in runs[True]][2:] == [28, 28, 24 if method == "eagle3" else 28, 0, 0]
    assert sum(sum(r[2]) for r in runs[True]) > 0  # drafts were accepted: they matter


def test_prompt_logprobs_and_penalties_beside_cached_prefixes():
    """A request asking prompt logprobs reads nothing from the cache (its prompt rows' logits are
    needed) and gets the same prompt logprobs; a penalised request whose prefix is cached still
    counts its whole prompt (the occurrence counts come from its tokens, not from the KV)."""
    penalised = SamplingParams(temperature=0.7, seed=2, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.5, presence_penalty=0.3, logprobs=1)
    scored = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3, logprobs=1)
    runs, cached, counters = {}, {}, {}
    for caching in (True, False):
        with _llm(deterministic=True, enable_prefix_caching=caching) as llm:
            llm.generate([P0], _params(None))
            outs = llm.generate([P0, P0[:30] + P0[:2]], [scored, penalised])
            runs[caching] = [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            cached[caching] = [o.num_cached_tokens for o in outs]
            counters[caching] = (llm.counters.prefix_cache_queries, llm.counters.prefix_cache_hits)
    assert runs[True] == runs[False]
    assert runs[True][0][0] is not None and len(runs[True][0][0]) == len(P0)
    assert cached == {True: [0, 28], False: [0, 0]}
    # Queries: P0, then the penalised prompt (the scored one does not look); nothing with the cache off.
    assert counters == {True: (64, 28), False: (0, 0)}


def test_prefix_cache_counters_and_metrics_text():
    from tpspec.serve.app import _prometheus

    with _llm(deterministic=False) as llm:
        first_outs = llm.generate([P0], _params(None))
        outs = llm.generate([P0, P0[:31] + [3]], [_params(None), SamplingParams(max_tokens=2, prompt_logprobs=1)])
        assert [o.num_cached_tokens for o in outs] == [28, 0]
        c = llm.counters
        assert (c.prefix_cache_queries, c.prefix_cache_hits, c.num_preemptions) == (64, 28, 0)
        assert c.prefix_cache_hit_rate == 28 / 64
        assert llm.last_stats.num_cached_tokens == 28
        generated = sum(len(o.outputs[0].token_ids) for o in first_outs + outs)
        assert (c.prompt_tokens, c.generation_tokens) == (3 * len(P0), generated)
        assert llm.num_requests() == (0, 0)
        # Step by step (streams and the server): counted as the samples start.
        rid = llm.add_request({"prompt_token_ids": P0}, _params(None))
        assert llm.num_requests() == (0, 1)  # waiting
        first = llm.step()
        assert [o.num_cached_tokens for o in first] == [28] and first[0].request_id == rid
        generated += len(first[0].outputs[0].token_ids)
        assert not first[0].finished and llm.num_requests() == (1, 0)  # running
        while llm.has_unfinished_requests():
            generated += sum(len(o.outputs[0].token_ids) for o in llm.step())
        assert (llm.counters.prefix_cache_queries, llm.counters.prefix_cache_hits) == (96, 56)
        assert (llm.counters.prompt_tokens, llm.counters.generation_tokens) == (4 * len(P0), generated)
        assert llm.num_requests() == (0, 0)
        text = _prometheus(llm.counters, 2, 3)
    assert "tpspec:prefix_cache_queries_total 96\n" in text and "tpspec:prefix_cache_hits_total 56\n" in text
    assert "# TYPE tpspec:num_preemptions counter\ntpspec:num_preemptions_total 0\n" in text
    assert "# TYPE tpspec:num_requests_running gauge\ntpspec:num_requests_running 2\n" in text
    assert "tpspec:num_requests_waiting 3\n" in text and f"tpspec:generation_tokens_total {generated}\n" in text


def test_a_request_that_can_never_fit_is_refused_clearly():
    """The pool always holds one request of max_model_len (checked at start-up), so the only request
    that can never fit is a prompt of max_model_len tokens or more: a ValueError before it runs, and
    the LLM stays usable. A pool smaller than max_model_len is refused when the LLM is made."""
    with _llm(pages=17) as llm:  # 63 tokens + 3 drafts would need 17 pages: just fits without drafts
        with pytest.raises(ValueError, match="max_model_len=64 leaves no room to generate"):
            llm.generate([list(range(3, 3 + MAX_LEN))], SamplingParams(max_tokens=1))
        out = llm.generate([list(range(3, 3 + MAX_LEN - 1))], SamplingParams(max_tokens=1, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 1 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="a request of max_model_len=64 needs 16"):
        _llm(pages=15)


# ---------------------------------------------------------------------------- page pressure

def _pressure_requests(count: int, new: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """``count`` prompts of 4..20 random tokens (some sharing a prefix) and their parameters: greedy,
    seeded sampled (some with top-k), penalised, asking logprobs."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(8)]
    prompts = [([] if i % 4 else prefix) + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 13))]
               for i in range(count)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=20 if i % 5 == 1 else 0, seed=i, max_tokens=new,
                             ignore_eos=True, repetition_penalty=1.2 if i % 3 == 0 else 1.0,
                             logprobs=1 if i % 4 == 1 else None) for i in range(count)]
    return prompts, params


def _check_no_page_leaked(llm: LLM) -> None:
    engine = _engine(llm)
    engine.pages.check()  # every page free or held by the tables that hold it
    assert engine.pages.num_free == engine.pages.num_pages  # nothing runs: every page free (cached ones too)


def test_32_requests_under_page_pressure_each_equal_alone():
    """32 requests of 40 new tokens, n-gram speculation, against 40 pages of 4 tokens (a handful
    of requests' worth): all start as their prompts fit, the newest is preempted when pages run out
    and is recomputed later; every request finishes with the tokens it has alone (greedy, seeded
    sampled, penalised: the counts rebuilt in its new slot), preemptions are counted, and no page
    is left held."""
    prompts, params = _pressure_requests(32, 40)
    spec = SPECS["ngram"]
    with _llm(spec=spec) as llm:
        alone = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    for caching in (True, False):
        with _llm(pages=40, spec=spec, max_num_seqs=32, enable_prefix_caching=caching) as llm:
            engine = _engine(llm)
            preempt, at = engine._preempt, []  # noqa: SLF001

            def spy(seq):
                at.append((seq.num_generated, seq.req.sampling))
                preempt(seq)

            engine._preempt = spy
            outs = llm.generate(prompts, params)
            # Requests were preempted mid-generation: sampled and penalised ones among them.
            assert any(n > 0 and not sp.is_greedy for n, sp in at) and any(n > 0 and sp.has_penalties for n, sp in at)
            got = [o.outputs[0] for o in outs]
            assert [g.token_ids for g in got] == [a.token_ids for a in alone]
            for g, a in zip(got, alone):
                assert (g.logprobs is None) == (a.logprobs is None)
                for step_g, step_a in zip(g.logprobs or [], a.logprobs or []):
                    assert step_g.keys() == step_a.keys()
                    assert [x.logprob for x in step_g.values()] == pytest.approx([x.logprob for x in step_a.values()],
                                                                                   abs=1e-5)
            preempted = sum(g.stats.num_preemptions for g in got)
            assert preempted > 0 and llm.counters.num_preemptions == llm.last_stats.num_preemptions == preempted
            assert _engine(llm).num_preemptions == preempted
            _check_no_page_leaked(llm)


def test_preempted_requests_keep_their_bits_in_deterministic_mode():
    """Deterministic mode with an EAGLE-3 head: requests preempted and recomputed (their prompt and
    what they generated prefilled again, the head's state rebuilt) emit the tokens and logprobs they
    emit alone, bit for bit."""
    prompts, params = _pressure_requests(8, 24, seed=1)
    spec = SPECS["eagle3"]
    with _llm(spec=spec, deterministic=True) as llm:
        alone = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    with _llm(pages=17, spec=spec, deterministic=True) as llm:
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.counters.num_preemptions > 0
        _check_no_page_leaked(llm)
    assert [(g.token_ids, g.logprobs) for g in got] == [(a.token_ids, a.logprobs) for a in alone]


def _rank_facts(ctx) -> tuple:
    """What a rank's scheduler decided: preemptions, and which pages hold which keys."""
    engine = ctx.state["engine"]
    engine.pages.check()
    return engine.num_preemptions, engine.pages.num_free, sorted(engine.pages._page_of.items())  # noqa: SLF001


@pytest.mark.parametrize("attention_dp", [False, True], ids=["tp2", "tp2-adp"])
def test_tp2_and_attention_dp_equal_tp1_and_ranks_decide_alike(attention_dp, monkeypatch):
    """TP 2 (one scheduler state replicated on both ranks) and attention DP (each rank caches and
    preempts its own requests) under page pressure with the cache on emit the tokens of TP 1 with it
    off; plain TP ranks end with the same preemptions and the same cached pages."""
    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    prompts, params = _pressure_requests(12, 24, seed=2)
    params = [SamplingParams(**{k: getattr(p, k) for k in ("temperature", "top_k", "seed", "max_tokens",
                                                           "ignore_eos")}) for p in params]  # no penalties (DP)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    calls = [([P0], greedy), ([P0[:31] + [7], P0], greedy), (prompts, params)]
    with _llm(enable_prefix_caching=False) as llm:
        ref = [[o.outputs[0].token_ids for o in llm.generate(*c)] for c in calls]
    per_page = 2048 if attention_dp else 1024  # 2 layers, K and V, 4 tokens, 16 wide heads: 2 (DP) or 1 a rank
    with LLM("tiny", tensor_parallel_size=2, attention_dp=attention_dp, device="cpu", page_size=PAGE,
             max_model_len=MAX_LEN, max_num_seqs=12, kv_cache_bytes=41 * per_page,
             speculative_config=SPECS["ngram"]) as llm:
        assert llm.num_kv_pages == 40
        outs = [llm.generate(*c) for c in calls]
        got = [[o.outputs[0].token_ids for o in out] for out in outs]
        cached = [o.num_cached_tokens for o in outs[1]]
        facts = llm._executor.call(_rank_facts)  # noqa: SLF001
    assert got == ref
    # Attention DP: request i runs on rank i % 2 (its admission number): P0 ran on rank 0, the next two
    # on ranks 1 (nothing cached there) and 0.
    assert cached == ([0, 28] if attention_dp else [28, 28])
    assert all(f[1] == 40 for f in facts) and sum(f[0] for f in facts) > 0
    if not attention_dp:
        assert facts[0] == facts[1]


@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_requests_starting_together_share_a_prefix_without_a_drafter(method):
    """Without a drafter a page is keyed as soon as the step that writes it is planned, so requests
    starting in the same step (another prompt, or the other sample of ``n = 2``) reuse it: every layer
    writes the batch's KV before any row attends. With chunked prefill (16 tokens a step) the second
    request starts only in a step with budget left for it, after the first one's prefill: it finds
    all 7 pages. A drafter writes its KV later (at the first generation step), so then nothing is
    shared within the step. Tokens and logprobs as with the cache off."""
    spec = SPECS[method]
    two = SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=8, ignore_eos=True, logprobs=1)
    runs, cached = {}, {}
    for caching in (True, False):
        with _llm(spec=spec, deterministic=True, enable_prefix_caching=caching) as llm:
            outs = llm.generate([P0, P0[:31] + [7]], _params(None))
            outs += llm.generate([OTHERS[0]], two)
        with _llm(spec=spec, deterministic=True, enable_prefix_caching=caching, max_num_batched_tokens=16,
                  max_num_seqs=4) as llm:
            outs += llm.generate([P0, P0[:31] + [7]], _params(None))
        runs[caching] = [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]
        cached[caching] = [o.num_cached_tokens for o in outs]
    assert runs[True] == runs[False]
    assert cached[True] == ([0, 28, 36, 0, 28] if method == "plain" else [0] * 5)


@pytest.mark.parametrize("flag, cached", [(None, 32), ("--enable-prefix-caching", 32),
                                          ("--no-enable-prefix-caching", 0)])
def test_generate_cli_prefix_caching_flag(flag, cached, capsys, monkeypatch):
    """``tpspec generate``: prefix caching on by default, vLLM's flags turn it on and off; the JSON
    summary counts the cached prompt tokens (two equal prompts of 40 tokens: the second reuses 2 pages)."""
    import json

    from tpspec.cli import main

    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    prompt = ",".join(str(t) for t in P0 + P0[:8])
    args = ["generate", "-tp", "1", "--device", "cpu", "--prompt", prompt, "--prompt", prompt, "--max-tokens", "2",
            "--json", "--progress", "off"] + ([flag] if flag else [])
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["num_cached_tokens"] == cached
