"""The tensor-parallel Llama-family decoder (Llama, Mistral without sliding window, Qwen2).

Plain TP: every rank of a TP group runs the same :class:`ForwardBatch`; attention heads,
MLP features and the vocabulary (embedding and LM head) are split over the group.

Attention DP (``mapping.enable_attention_dp``): every rank runs its OWN batch with full
attention weights and its own KV cache; the MLP stays TP. Before each MLP the ranks
stack their tokens (counts swapped once per step, so ranks with different or zero
tokens stay in lock-step), and a reduce-scatter hands each rank its rows back. The LM
head is replicated (tokens picked locally), or with ``enable_lm_head_tp_in_adp``
vocabulary-sharded over the stacked rows of all ranks (:class:`StackedRowsLogits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .. import distributed as D
from ..exchange.base import Channel, KeyExchange
from ..exchange.factory import make_key_exchange
from ..mapping import Mapping
from ..validation import check_int
from ..vocab_parallel import VocabParallelHead, VocabShardedLogits, vocab_shard_bounds
from . import deterministic as det
from .attention import AttendFn, choose_attention_backend, make_attention_backend
from .batch import AttentionMetadata, ForwardBatch, check_paged_batch
from .comm import LocalKeyExchange, VarlenRows, exchange_counts
from .config import ModelConfig
from .kv_cache import KVPages, page_bytes
from .linear import linear
from .layers import MLP, Attention, RMSNorm, RotaryEmbedding, ShardSpec, VocabParallelEmbedding, shard_plan, \
    split_evenly, split_heads, use_fused_kernels


def check_split(config: ModelConfig, mapping: Mapping, *, deterministic: bool = False) -> None:
    """Raise ``ValueError`` naming the size that cannot be laid out over ``mapping``'s TP group
    (vocabulary, attention heads, KV heads, intermediate size; in deterministic mode also a TP
    size that is not a power of two, a row-parallel contraction whose split does not follow its
    fixed-order tree, and attention DP). No communication."""
    tp, rank = mapping.tp_size, mapping.tp_rank
    vocab_shard_bounds(config.vocab_size, tp, rank)
    split_heads(config, mapping.attention_tp_size, mapping.attention_tp_rank)
    split_evenly("intermediate_size", config.intermediate_size, tp, rank)
    if deterministic:
        if mapping.enable_attention_dp and tp > 1:
            raise ValueError("deterministic mode does not support attention DP")
        det.check_contraction_split("num_attention_heads * head_dim", config.num_heads * config.head_dim,
                                    mapping.attention_tp_size)
        det.check_contraction_split("intermediate_size", config.intermediate_size, tp)

@dataclass
class StepLayout:
    """How one forward lays out its rows: ``rows`` (the token rows that need logits), the
    attention metadata, and under attention DP the stacked token rows of the MLP (``dp_rows``)
    and of a vocabulary-sharded head (``head_rows``; None when the head is replicated)."""

    rows: torch.Tensor
    meta: AttentionMetadata
    dp_rows: VarlenRows | None = None
    head_rows: VarlenRows | None = None


def plan_step(batch: ForwardBatch, attn_meta: AttentionMetadata | None, *, check: Callable[[ForwardBatch], None],
              build: Callable[[ForwardBatch], AttentionMetadata], attention_dp: bool, head_sharded: bool,
              group: Any, device: torch.device) -> StepLayout:
    """The :class:`StepLayout` of ``batch`` for a model of the TP group ``group`` (the target or a
    drafter): ``attn_meta``, or ``build(batch)`` without it. Under plain TP every rank checks the same
    batch with ``check``. Under attention DP
    each rank checks its own and the verdict travels with the row counts (one all-gather), so a
    bad batch on one rank makes every rank raise (``RuntimeError`` on the others) instead of
    leaving them waiting in a later collective."""
    if not attention_dp:
        check(batch)
        rows = batch.logits_rows if batch.logits_rows is not None else batch.default_logits_rows()
        meta = attn_meta if attn_meta is not None else build(batch)
        return StepLayout(rows, meta)
    error: Exception | None = None
    try:
        check(batch)
        rows = batch.logits_rows if batch.logits_rows is not None else batch.default_logits_rows()
        meta = attn_meta if attn_meta is not None else build(batch)
        mine = [batch.num_tokens, int(rows.shape[0]), 1]
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
        error, mine = exc, [0, 0, 0]
    counts = exchange_counts(mine, group, device)
    if error is not None:
        raise error
    bad = [r for r, c in enumerate(counts) if c[2] == 0]
    if bad:
        raise RuntimeError(f"the forward batch of rank(s) {bad} of the attention-DP group is invalid")
    dp_rows = VarlenRows([c[0] for c in counts], group, device)
    head_rows = VarlenRows([c[1] for c in counts], group, device) if head_sharded else None
    return StepLayout(rows, meta, dp_rows, head_rows)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``. ``fused``: the layers'
    elementwise work in :mod:`tpspec.model.fused_triton`'s kernels, run through :meth:`fused_forward`
    (the residual adds inside the norms' kernels)."""

    def __init__(self, config: ModelConfig, layer: int, mapping: Mapping, group: Any,
                 *, dtype: torch.dtype, device: Any, deterministic: bool = False, fused: bool = False) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        attn_group = group if mapping.attention_tp_size > 1 else None
        self.fused = fused and not deterministic
        kw: dict[str, Any] = {"dtype": dtype, "device": device, "deterministic": deterministic, "fused": self.fused}
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", config.hidden_size, config.rms_norm_eps,
                                       **kw)
        self.self_attn = Attention(config, layer, mapping.attention_tp_size, mapping.attention_tp_rank, attn_group,
                                   **kw)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", config.hidden_size,
                                                config.rms_norm_eps, **kw)
        self.mlp = MLP(config, layer, mapping.tp_size, mapping.tp_rank, group, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                pages: KVPages, attend: AttendFn, dp_rows: VarlenRows | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, pages, attend)
        return h + self._mlp(self.post_attention_layernorm(h), dp_rows)

    def fused_forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      meta: AttentionMetadata, pages: KVPages, attend: AttendFn,
                      dp_rows: VarlenRows | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` with the residual adds inside the norms' kernels (``fused`` layers), and
        each norm inside the q/k/v or gate/up GEMV where the rule of
        :func:`~tpspec.model.linear.use_triton_norm_linear` takes it (one-row steps): the layer's
        input is ``x + residual`` (``x`` alone when ``residual`` is None, the first layer), its
        output ``mlp + h``. Returns ``(mlp, h, input)``: the next layer's ``x`` and ``residual``, and
        this layer's input (what :meth:`forward` would have received)."""
        attn = self.self_attn
        qkv, x_in = attn.qkv.norm_forward(self.input_layernorm, x, residual)
        a = attn.attend_projected(qkv, cos, sin, meta, pages, attend)
        if dp_rows is None:
            y, h = self.mlp.norm_forward(self.post_attention_layernorm, a, x_in)
            return y, h, x_in
        y, h = self.post_attention_layernorm.add_forward(a, x_in)
        return self._mlp(y, dp_rows), h, x_in

    def _mlp(self, y: torch.Tensor, dp_rows: VarlenRows | None) -> torch.Tensor:
        if dp_rows is None:
            return self.mlp(y)
        # Attention DP: the MLP runs over the tokens of every rank of the group.
        return self.mlp(dp_rows.gather(y), reduce=dp_rows.reduce_scatter)


class StackedRowsLogits(VocabShardedLogits):
    """Logits of attention DP with a vocabulary-sharded LM head: the rows of every rank of
    the TP group are stacked (rank-major) and each rank holds its vocab slice of all of them.

    ``argmax``/``sample``/``gather`` are collective over the group and return only THIS
    rank's rows (``num_rows`` of them); per-row ``temperature``/``seeds``/``offsets`` are
    this rank's rows too (stacked internally). ``local`` is the stacked ``[total, shard]``
    slice and ``stacked`` the plain :class:`VocabShardedLogits` over all rows.
    ``tpspec.sampling.select_tokens`` works through these methods (its filtered rows gather);
    like them it needs every rank of the group to take the same path (AND the all-greedy flag
    across the group).
    """

    def __init__(self, stacked: VocabShardedLogits, rows: VarlenRows) -> None:
        super().__init__(stacked.local, stacked.vocab_offset, stacked.vocab_size, stacked.exchange)
        self.stacked = stacked
        self.rows = rows

    @property
    def num_rows(self) -> int:
        return self.rows.local

    def argmax(self, *, channel: int = Channel.TARGET) -> torch.Tensor:
        return self.rows.take_local(self.stacked.argmax(channel=channel))

    def sample(self, temperature: torch.Tensor | float, seeds: torch.Tensor | None = None,
               offsets: torch.Tensor | None = None, *, channel: int = Channel.TARGET, check_values: bool = True) -> torch.Tensor:
        # Values are checked after the gather, on the stacked (replicated) temperatures: a
        # rank-local check before the gather would leave the other ranks waiting in it.
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.full((self.num_rows,), float(temperature), dtype=torch.float32,
                                     device=self.local.device)
        temperature = self.rows.gather(temperature)
        if seeds is not None and offsets is not None:
            seeds, offsets = self.rows.gather(seeds), self.rows.gather(offsets)
        return self.rows.take_local(self.stacked.sample(temperature, seeds, offsets, channel=channel,
                                                      check_values=check_values))

    def gather(self) -> torch.Tensor:
        return self.rows.take_local(self.stacked.gather())


class TPLlamaForCausalLM(nn.Module):
    """A Llama-family causal LM holding one rank's shard of every weight.

    Build with :func:`tpspec.model.load_model` (reads a checkpoint) or directly from a
    :class:`ModelConfig` (zero weights, for tests). ``mapping.tp_size > 1`` needs the TP
    process group (:func:`tpspec.distributed.init_distributed`) before the first forward.
    ``exchange``: the key exchange of the vocab-sharded LM head (default: the best one for
    the TP group); an unsharded head always picks locally. ``attention_backend``: ``"auto"``,
    ``"torch"``, ``"triton"`` or ``"flashinfer"`` (:func:`~tpspec.model.attention.choose_attention_backend`
    says what ``"auto"`` runs and when a forced one raises ``ValueError``). ``deterministic``: every
    reduction in the fixed order of :mod:`tpspec.model.deterministic` (attention by its
    ``"deterministic"`` backend), so each logits row is a function of its own sequence alone, bit
    for bit, at every batch and every power-of-two TP size. ``fused`` (set here, not an argument):
    whether the layers run the fused Triton kernels (:func:`~tpspec.model.layers.use_fused_kernels`).

    Raises ``ValueError`` at construction when the vocabulary, heads or MLP cannot be split,
    and ``RuntimeError`` when ``tp_size > 1`` but the TP process group does not exist.
    """

    def __init__(self, config: ModelConfig, mapping: Mapping | None = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, exchange: KeyExchange | None = None,
                 attention_backend: str = "auto", deterministic: bool = False) -> None:
        super().__init__()
        mapping = mapping or Mapping()
        check_split(config, mapping, deterministic=deterministic)
        self.deterministic = deterministic
        self.config = config
        self.mapping = mapping
        self.device = torch.device(device)
        self.fused = use_fused_kernels(self.device, deterministic=deterministic)
        self.dtype = dtype
        tp = mapping.tp_size
        self.group = D.tp_group() if tp > 1 else None
        if tp > 1 and (self.group is None or D.group_size(self.group) != tp):
            raise RuntimeError(
                f"mapping.tp_size={tp} but the TP process group is not initialized "
                f"(call tpspec.distributed.init_distributed first)"
            )
        self.attention_dp = mapping.enable_attention_dp and tp > 1
        embed_tp, embed_rank = (1, 0) if self.attention_dp else (tp, mapping.tp_rank)
        self.embed_tokens = VocabParallelEmbedding("model.embed_tokens.weight", config.vocab_size, config.hidden_size,
                                                   embed_tp, embed_rank, self.group, dtype=dtype, device=device,
                                                   deterministic=deterministic, fused=self.fused)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, mapping, self.group, dtype=dtype, device=device, deterministic=deterministic,
                         fused=self.fused)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device,
                            deterministic=deterministic, fused=self.fused)
        self.rotary = RotaryEmbedding(config, device=device, deterministic=deterministic, fused=self.fused)
        self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, mapping,
                                         self._head_exchange(exchange), dtype=dtype, device=device)
        self.lm_head.weight.requires_grad_(False)
        self.head_fixed_order = det.FixedOrderMatmul(det.Contraction.of(config.hidden_size), 1) if deterministic \
            else None
        if not deterministic:
            self.lm_head.linear = linear  # the decoder's linears' rule (Triton GEMV or F.linear)
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head.plan = {"weight": [ShardSpec(head_name, (config.vocab_size, config.hidden_size), 0,
                                                  self.lm_head.vocab_offset, self.lm_head.real_width)]}
        attn = self.layers[0].self_attn if len(self.layers) else None
        backend = choose_attention_backend(self.device, config.head_dim, attention_backend,
                                           deterministic=deterministic)
        self.attention = make_attention_backend(
            backend, num_heads=attn.num_heads if attn else 1, num_kv_heads=attn.num_kv_heads if attn else 1,
            head_dim=config.head_dim, scale=config.head_dim**-0.5, dtype=dtype, device=self.device)
        self.caches: list[KVPages] = []
        self.num_pages = 0
        self.page_size = 0
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def _head_exchange(self, exchange: KeyExchange | None) -> KeyExchange:
        if not self.mapping.lm_head_is_sharded:
            if exchange is not None and exchange.world_size == 1:
                return exchange
            return LocalKeyExchange(self.device)
        if exchange is None:
            exchange = make_key_exchange(self.group, device=self.device)
        elif exchange.world_size != self.mapping.tp_size:
            raise ValueError(f"the exchange spans {exchange.world_size} ranks, the TP group {self.mapping.tp_size}")
        return exchange

    @property
    def exchange(self) -> KeyExchange:
        """The key exchange the LM head's logits pick tokens with."""
        return self.lm_head.exchange

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].self_attn.num_kv_heads if len(self.layers) else 0

    def page_bytes(self, page_size: int) -> int:
        """Bytes one KV page of ``page_size`` tokens takes on this rank, over all layers."""
        return page_bytes(self.config.num_layers, page_size, self.num_kv_heads_per_rank, self.config.head_dim,
                          self.dtype)

    def kv_cache_bytes(self, num_pages: int, page_size: int) -> int:
        """Bytes :meth:`allocate_kv_cache` takes on this rank for ``num_pages`` pages."""
        return num_pages * self.page_bytes(page_size)

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> None:
        """(Re)allocate the paged cache: per layer ``k``/``v`` of shape
        ``[num_pages, page_size, kv_heads_per_rank, head_dim]`` (zeros, model dtype). Which
        pages a sequence uses is the caller's choice, passed as block tables in each
        :class:`ForwardBatch`; models that serve the same requests allocate the same pages."""
        check_int("num_pages", num_pages, low=1)
        check_int("page_size", page_size, low=1)
        self.caches = []  # free the old cache before allocating the new one
        self.caches = [
            KVPages(num_pages, page_size, self.num_kv_heads_per_rank, self.config.head_dim,
                    dtype=self.dtype, device=self.device)
            for _ in range(self.config.num_layers)
        ]
        self.num_pages, self.page_size = num_pages, page_size

    def _check_batch(self, batch: ForwardBatch) -> None:
        check_paged_batch(batch, self.num_pages if self.caches else 0, self.page_size, self.config.vocab_size)

    def build_metadata(self, batch: ForwardBatch, kv_pages: int | None = None) -> AttentionMetadata:
        """The attention metadata of ``batch`` for this model's pages (see
        :meth:`AttentionMetadata.build`; ``kv_pages``: a fixed page-table width for CUDA graphs)."""
        return AttentionMetadata.build(batch, self.device, self.page_size, kv_pages)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, attn_meta: AttentionMetadata | None = None) -> VocabShardedLogits:
        """Run one step; return the logits of ``batch.logits_rows`` (default: each sequence's last token).

        Writes the new tokens' K/V into their slots (see :mod:`tpspec.model.batch`). Collective
        over the TP group: under plain TP every rank passes the same batch; under attention DP
        every rank passes its own (possibly empty) batch, and all ranks call forward equally often.
        Returns a :class:`VocabShardedLogits` with one row per requested row (under attention DP
        with an LM-head TP, a :class:`StackedRowsLogits`). A bad batch raises ``ValueError``; under
        attention DP the other ranks then raise ``RuntimeError`` instead of waiting for it.

        ``attn_meta``: prebuilt :class:`AttentionMetadata` of this batch (default: built here). A
        CUDA graph of plain TP captures a forward with static device tensors (``token_ids``,
        ``positions``, ``logits_rows``, and metadata built with a fixed, bucketed ``kv_pages``),
        refreshes them in place and plans the attention (``model.attention.plan(meta, graph=True)``)
        before each replay; nothing in the plain-TP forward synchronizes with the host.
        After :meth:`capture_aux_hidden_states`, ``aux_hidden_states`` holds this call's captured rows.
        """
        layout = plan_step(batch, attn_meta, check=self._check_batch, build=self.build_metadata,
                           attention_dp=self.attention_dp, head_sharded=self.mapping.lm_head_is_sharded,
                           group=self.group, device=self.device)
        x = self.embed_tokens(batch.token_ids.to(self.device))
        cos, sin = self.rotary(batch.positions.to(self.device), self.dtype)
        attend = self.attention.bind(layout.meta)
        captured: dict[int, torch.Tensor] = {}
        residual: torch.Tensor | None = None  # fused layers: the hidden state is x + residual
        for i, (layer, pages) in enumerate(zip(self.layers, self.caches)):
            if self.fused:
                x, residual, layer_input = layer.fused_forward(x, residual, cos, sin, layout.meta, pages, attend,
                                                               layout.dp_rows)
                if i in self.aux_layer_ids:
                    captured[i] = layer_input
                continue
            if i in self.aux_layer_ids:
                captured[i] = x
            x = layer(x, cos, sin, layout.meta, pages, attend, layout.dp_rows)
        if self.aux_layer_ids:
            self.aux_hidden_states = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        rows = layout.rows.to(self.device)
        if residual is not None:
            x = self.norm.add_forward(x.index_select(0, rows), residual.index_select(0, rows))[0]
        else:
            x = self.norm(x.index_select(0, rows))
        if layout.head_rows is not None:
            return StackedRowsLogits(self.lm_head(layout.head_rows.gather(x)), layout.head_rows)
        if self.head_fixed_order is not None:
            head = self.lm_head
            local = self.head_fixed_order.rounded(x, head.weight)
            if head.bias is not None:
                local = local + head.bias
            return VocabShardedLogits(local, head.vocab_offset, head.vocab_size, head.exchange)
        return self.lm_head(x)

    def capture_aux_hidden_states(self, layer_ids: tuple[int, ...] | list[int]) -> None:
        """From now on every forward keeps, in ``aux_hidden_states``, the ``[N, len(layer_ids) * hidden]``
        concatenation (in ``layer_ids`` order) of the hidden states entering each listed layer, for
        every new token of the batch (this rank's tokens under attention DP). Layer 0's input is the
        embedding. An empty list turns capturing off. Raises ``ValueError`` for an id outside
        ``[0, num_layers)``."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"aux hidden-state layer ids {bad} are outside [0, {self.config.num_layers})")
        self.aux_layer_ids = ids
        self.aux_hidden_states = None

    def shard_plan(self) -> list[tuple[str, nn.Parameter, list[ShardSpec]]]:
        """Every parameter with the checkpoint slices that fill it: ``(name, param, specs)``."""
        return shard_plan(self)
