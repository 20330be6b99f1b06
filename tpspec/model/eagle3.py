"""EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

The checkpoint layout is the one the public EAGLE-3 heads ship (``config.json`` with
``hidden_size``, ``draft_vocab_size``, ``num_hidden_layers == 1``; safetensors)::

    fc.weight                                   [H, 3H]   fuses three target hidden states
    midlayer.input_layernorm.weight             [H]       normalizes the token embedding
    midlayer.hidden_norm.weight                 [H]       normalizes the hidden input
    midlayer.self_attn.{q,k,v}_proj.weight      [*, 2H]   read [norm(embedding), norm(hidden)]
    midlayer.self_attn.o_proj.weight            [H, *]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight                                 [H]
    lm_head.weight                              [draft_vocab, H]
    d2t                                         [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d                                         [vocab] bool (optional): which target ids the draft vocabulary holds

The token embedding is the target's. Draft row ``i`` pairs the target's hidden states at position
``i`` (the concatenation of the inputs of three of its layers, low, middle and high:
``eagle_aux_hidden_state_layer_ids`` of the config, default ``(2, L // 2, L - 3)`` for a target of
``L`` layers) with the embedding of token ``i + 1``, and predicts token ``i + 2``::

    x   = fc(aux)                      (aux: [N, 3H]; a chained step feeds the last output instead)
    h   = x + attn([input_layernorm(embed(token)), hidden_norm(x)])    (rotary at position i)
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))        over the draft vocabulary; ``out`` feeds the next chained step

With ``norm_before_residual`` in the config the residual is ``hidden_norm(x)`` instead of ``x``.

Sharding follows the target: q/k/v and gate/up are column-parallel, o/down and ``fc`` row-parallel
(``fc`` is whole on every rank under attention DP, where attention runs per rank). The head is split
over the draft vocabulary along the target's vocabulary shards (:class:`DraftVocabHead`): because
``d2t`` maps draft ids to strictly increasing target ids, the draft ids whose target ids fall in a
rank's target shard form one contiguous range, and that rank holds exactly those rows. Its logits are
laid out like the target's (its target columns, ``-inf`` at ids the draft vocabulary lacks), so every
selection on shards (greedy through the key exchange, sampling) picks target ids directly, and a
draft's scores sit on the same rank as the target's scores of the same token.

``deterministic=True`` runs every reduction of the head (``fc``, norms, attention, MLP, the draft
head) in the fixed order of :mod:`tpspec.model.deterministic`, like a target in that mode; the
head's shapes must then split along their trees (:meth:`Eagle3Config.check_split`).

A path ``"shape-eagle3:NAME"`` stands for a random head sized for target shape ``NAME``, built on
each rank without a file (:mod:`tpspec.model.shapes`).

``tpspec convert-eagle3 IN OUT`` (:mod:`tpspec.model.eagle3_convert`) turns a ``pytorch_model.bin``
head into this layout in safetensors (read with ``torch.load(weights_only=True)``, never a full unpickle).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..exchange.base import Channel, KeyExchange
from ..mapping import Mapping
from ..validation import check_int
from ..vocab_parallel import VocabShardedLogits, vocab_shard_bounds
from . import deterministic as det
from .attention import choose_attention_backend, make_attention_backend
from .batch import AttentionMetadata, ForwardBatch, check_paged_batch
from .config import ModelConfig, read_json
from .kv_cache import KVPages, page_bytes
from .layers import MLP, Attention, RMSNorm, RotaryEmbedding, RowParallelLinear, ShardSpec, shard_plan, split_evenly, \
    split_heads, use_fused_kernels
from .llama import StackedRowsLogits, TPLlamaForCausalLM, plan_step
from .loader import CheckpointError, CheckpointReader, check_draft_vocab_map, load_weights
from .shapes import DEFAULT_EAGLE3_DRAFT_VOCAB, eagle3_shape_config, fill_random, is_eagle3_shape_path, \
    spread_draft_ids

NUM_AUX_HIDDEN_STATES = 3


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 heads are trained on when their config names none:
    a low, a middle and a high one (``2, L // 2, L - 3``)."""
    return 2, num_target_layers // 2, num_target_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's shape, checked against its target.

    ``layer``: the decoder layer's :class:`ModelConfig` (its ``vocab_size`` is the draft vocabulary).
    ``target_vocab_size``: the target's vocabulary. ``aux_layer_ids``: the three target layers whose
    inputs are captured, in ``fc``'s order. ``norm_before_residual``: the residual of the attention
    block is the normalized hidden input.
    """

    layer: ModelConfig
    target_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    norm_before_residual: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.layer.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: ModelConfig) -> "Eagle3Config":
        """Read ``<path>/config.json`` and check it against the ``target``'s config.

        Raises :class:`CheckpointError` naming the field: no config, not one layer, a hidden size
        or vocabulary that differs from the target's, a draft vocabulary larger than it, aux layer
        ids that are not three layers of the target; ``ValueError`` for what the decoder layer
        itself cannot run (see :meth:`ModelConfig.from_dict`).
        """
        if is_eagle3_shape_path(path):
            return cls.from_shape(os.fspath(path), target)
        config_file = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_file):
            raise CheckpointError(f"no config.json in {os.fspath(path)!r}: not an EAGLE-3 head directory")
        return cls.from_dict(read_json(config_file), target, config_file)

    @classmethod
    def from_shape(cls, path: str, target: ModelConfig) -> "Eagle3Config":
        """The config of a random head ``"shape-eagle3:NAME[,draft_vocab_size=V]"``
        (:mod:`tpspec.model.shapes`) for ``target``: shape ``NAME``'s layer, the target's vocabulary
        (a shrunken shape's too), ``V`` draft tokens (default ``min(32000, vocab // 2)``, at least 1)
        and the default aux layers, or ``(0, L // 2, L - 1)`` for a target of fewer than 5 layers.
        Checked like a head directory's config (:meth:`from_dict`)."""
        raw, draft_vocab = eagle3_shape_config(path)
        vocab = target.vocab_size
        if draft_vocab is None:
            draft_vocab = max(1, min(DEFAULT_EAGLE3_DRAFT_VOCAB, vocab // 2))
        layers = target.num_layers
        aux = default_aux_layer_ids(layers) if layers >= 5 else (0, layers // 2, layers - 1)
        raw.update(num_hidden_layers=1, vocab_size=vocab, draft_vocab_size=draft_vocab,
                   eagle_aux_hidden_state_layer_ids=list(aux))
        return cls.from_dict(raw, target, path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], target: ModelConfig, where: str) -> "Eagle3Config":
        """Check a head's ``config.json`` fields ``raw`` against ``target`` (errors name ``where``);
        see :meth:`from_pretrained`."""
        config_file = where
        layers = raw.get("num_hidden_layers", 1)
        if layers != 1:
            raise CheckpointError(f"{config_file}: num_hidden_layers={layers!r}, an EAGLE-3 head has one layer")
        for name in ("hidden_size", "target_hidden_size"):
            if name in raw and raw[name] != target.hidden_size:
                raise CheckpointError(f"{config_file}: {name}={raw[name]!r} does not match the target's "
                                      f"hidden_size={target.hidden_size}")
        vocab = raw.get("vocab_size", target.vocab_size)
        if vocab != target.vocab_size:
            raise CheckpointError(f"{config_file}: vocab_size={vocab!r} does not match the target's "
                                  f"vocab_size={target.vocab_size}")
        draft_vocab = raw.get("draft_vocab_size") or vocab
        if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab:
            raise CheckpointError(f"{config_file}: draft_vocab_size={draft_vocab!r} must be an int in [1, {vocab}]")
        eagle_cfg = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        ids = default_aux_layer_ids(target.num_layers) if ids is None else ids
        if (not isinstance(ids, (list, tuple)) or len(ids) != NUM_AUX_HIDDEN_STATES
                or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in ids)):
            raise CheckpointError(f"{config_file}: eagle_aux_hidden_state_layer_ids={list(ids)!r} must be "
                                  f"{NUM_AUX_HIDDEN_STATES} layer ids of the target in [0, {target.num_layers}) "
                                  f"(name them in the config for a target this shallow)")
        layer_raw = dict(raw, architectures=["LlamaForCausalLM"], num_hidden_layers=1, vocab_size=draft_vocab)
        try:
            layer = ModelConfig.from_dict(layer_raw)
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from None
        return cls(layer, vocab, (int(ids[0]), int(ids[1]), int(ids[2])),
                   bool(raw.get("norm_before_residual", False)))

    def check_split(self, mapping: Mapping, *, deterministic: bool = False) -> None:
        """Raise ``ValueError`` naming what of the head cannot be laid out over ``mapping``'s TP group
        (attention heads, KV heads, ``fc``'s ``3 * hidden_size`` inputs, intermediate size; in
        deterministic mode also a TP size that is not a power of two, a row-parallel contraction
        (``fc``, ``o_proj``, ``down_proj``) whose split does not follow its fixed-order tree, and
        attention DP). The head's vocabulary follows the target's shards: nothing to check there.
        No communication."""
        layer = self.layer
        attn_tp = mapping.attention_tp_size
        split_heads(layer, attn_tp, mapping.attention_tp_rank)
        split_evenly("intermediate_size", layer.intermediate_size, mapping.tp_size, mapping.tp_rank)
        split_evenly("3 * hidden_size", NUM_AUX_HIDDEN_STATES * self.hidden_size, attn_tp, mapping.attention_tp_rank)
        if deterministic:
            if mapping.enable_attention_dp and mapping.tp_size > 1:
                raise ValueError("deterministic mode does not support attention DP")
            det.check_contraction_split("fc input features (3 * hidden_size)", NUM_AUX_HIDDEN_STATES * self.hidden_size,
                                        attn_tp)
            det.check_contraction_split("num_attention_heads * head_dim", layer.num_heads * layer.head_dim, attn_tp)
            det.check_contraction_split("intermediate_size", layer.intermediate_size, mapping.tp_size)


class DraftVocabHead(nn.Module):
    """An LM head over a reduced draft vocabulary, split along the target's vocabulary shards.

    ``target_ids``: ``[draft_vocab]`` strictly increasing target ids of the draft ids. This rank holds
    the rows of the draft ids whose target ids lie in its target shard (all of them when the target's
    head is not sharded): a contiguous range of draft ids, possibly empty. ``forward(hidden [R, H]) -> VocabShardedLogits``: ``[R, target shard width]`` in the target's
    layout, the draft scores at their target columns and ``-inf`` elsewhere; collective picks return
    target ids. ``deterministic``: each score is the fixed-order tree sum over ``H``
    (:class:`~tpspec.model.deterministic.FixedOrderMatmul`), so a row's scores do not depend on the
    other rows (the rows of a shard are whole: the TP size changes no sum).
    """

    def __init__(self, name: str, hidden_size: int, target_ids: torch.Tensor, target_vocab_size: int,
                 mapping: Mapping, exchange: KeyExchange, *, dtype: torch.dtype, device: Any,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.fixed_order = det.FixedOrderMatmul(det.Contraction.of(hidden_size), 1) if deterministic else None
        sharded = mapping.lm_head_is_sharded
        tp, rank = (mapping.tp_size, mapping.tp_rank) if sharded else (1, 0)
        self.vocab_offset, self.shard_width, real = vocab_shard_bounds(target_vocab_size, tp, rank)
        self.vocab_size = target_vocab_size
        self.exchange = exchange
        ids = target_ids.to(torch.int64).cpu()
        lo = int(torch.searchsorted(ids, self.vocab_offset))
        hi = int(torch.searchsorted(ids, self.vocab_offset + real))
        self.register_buffer("columns", (ids[lo:hi] - self.vocab_offset).to(device), persistent=False)
        self.weight = nn.Parameter(torch.zeros(hi - lo, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.plan = {"weight": [ShardSpec(name, (ids.numel(), hidden_size), 0, lo, hi - lo)] if hi > lo else []}

    def forward(self, hidden: torch.Tensor) -> VocabShardedLogits:
        local = torch.full((hidden.shape[0], self.shard_width), float("-inf"), dtype=hidden.dtype,
                           device=hidden.device)
        if self.fixed_order is not None:
            local[:, self.columns] = self.fixed_order.rounded(hidden, self.weight)
        else:
            local[:, self.columns] = torch.nn.functional.linear(hidden, self.weight)
        return VocabShardedLogits(local, self.vocab_offset, self.vocab_size, self.exchange)


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 head loaded for this rank, drafting for ``target`` (whose token embedding it uses).

    ``forward(batch, hidden) -> (logits, out)``: ``hidden`` is ``[N, 3H]`` target hidden states
    (``target.aux_hidden_states`` rows, one per new token of ``batch``) or ``[N, H]`` outputs of the
    previous chained step; the result is the draft's :class:`VocabShardedLogits` of ``batch.logits_rows``
    in the target's vocabulary layout (see :class:`DraftVocabHead`: picks are target ids) and the
    ``[M, H]`` layer outputs of those rows (the next step's hidden).
    Collective over the TP group like the target's forward (the same batch on every rank under plain
    TP; each rank's own, possibly a one-row dummy, under attention DP). Its KV cache is paged like the
    target's (:meth:`allocate_kv_cache`, :meth:`page_bytes`): an engine gives it the same number of
    pages and the requests' block tables, draft position ``i`` being target position ``i``. The
    constructor reads this rank's slices of the checkpoint and turns on the target's capture of the
    hidden states the head needs (:meth:`TPLlamaForCausalLM.capture_aux_hidden_states`).

    ``deterministic``: every reduction of the head in the fixed order of
    :mod:`tpspec.model.deterministic`, as the target's in that mode (``fc``, norms, attention by the
    ``"deterministic"`` backend, MLP, the vocabulary head), so each draft row is a function of its
    own sequence alone, bit for bit, at every batch and every power-of-two TP size. Pair it with a
    deterministic target (whose embedding and hidden states the head reads).

    ``path``: a head directory, or ``"shape-eagle3:NAME[,draft_vocab_size=V]"`` for a random head of
    target shape ``NAME`` (:meth:`Eagle3Config.from_shape`; its draft ids spread evenly over the
    target's vocabulary, weights drawn per rank like :func:`~tpspec.model.shapes.random_model`'s,
    ``load_stats`` None).

    Raises :class:`CheckpointError` naming a missing or misshapen tensor, a bad ``d2t``/``t2d`` or a
    config that does not fit the target; ``ValueError`` when the head cannot be split over the TP group
    (:meth:`Eagle3Config.check_split`).
    """

    def __init__(self, path: str | os.PathLike, target: TPLlamaForCausalLM, *, dtype: torch.dtype | None = None,
                 attention_backend: str = "auto", deterministic: bool = False) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.config = cfg = Eagle3Config.from_pretrained(path, target.config)
        mapping: Mapping = target.mapping
        cfg.check_split(mapping, deterministic=deterministic)
        self.deterministic = deterministic
        self.mapping = mapping
        self.device = target.device
        self.dtype = dtype or target.dtype
        self.group = target.group
        self.attention_dp = target.attention_dp
        layer = cfg.layer
        hidden = cfg.hidden_size
        attn_tp, attn_rank = mapping.attention_tp_size, mapping.attention_tp_rank
        attn_group = self.group if attn_tp > 1 else None
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        dkw: dict[str, Any] = dict(kw, deterministic=deterministic)
        self.fused = use_fused_kernels(self.device, deterministic=deterministic)
        fkw: dict[str, Any] = dict(dkw, fused=self.fused)  # the layers that have fused kernels
        # The embedding is shared with the target, not a submodule: its weights are the target's.
        object.__setattr__(self, "target_embedding", target.embed_tokens)
        self.fc_start, self.fc_len = split_evenly("3 * hidden_size", NUM_AUX_HIDDEN_STATES * hidden, attn_tp, attn_rank)
        self.fc = RowParallelLinear("fc", NUM_AUX_HIDDEN_STATES * hidden, hidden, self.fc_start, self.fc_len, False,
                                    attn_group, attn_tp, **dkw)
        self.input_layernorm = RMSNorm("midlayer.input_layernorm.weight", hidden, layer.rms_norm_eps, **fkw)
        self.hidden_norm = RMSNorm("midlayer.hidden_norm.weight", hidden, layer.rms_norm_eps, **fkw)
        self.self_attn = Attention(layer, 0, attn_tp, attn_rank, attn_group, prefix="midlayer.self_attn",
                                   in_features=2 * hidden, **fkw)
        self.post_attention_layernorm = RMSNorm("midlayer.post_attention_layernorm.weight", hidden,
                                                layer.rms_norm_eps, **fkw)
        self.mlp = MLP(layer, 0, mapping.tp_size, mapping.tp_rank, self.group, prefix="midlayer.mlp", **fkw)
        self.norm = RMSNorm("norm.weight", hidden, layer.rms_norm_eps, **fkw)
        self.rotary = RotaryEmbedding(layer, device=self.device, deterministic=deterministic)
        self.attention = make_attention_backend(
            choose_attention_backend(self.device, layer.head_dim, attention_backend, deterministic=deterministic),
            num_heads=self.self_attn.num_heads, num_kv_heads=self.self_attn.num_kv_heads, head_dim=layer.head_dim,
            scale=layer.head_dim**-0.5, dtype=self.dtype, device=self.device)
        random_head = is_eagle3_shape_path(self.path)
        if random_head:
            d2t = spread_draft_ids(cfg.draft_vocab_size, cfg.target_vocab_size) - torch.arange(cfg.draft_vocab_size)
        else:
            with CheckpointReader(path) as reader:
                d2t = check_draft_vocab_map(reader, cfg.draft_vocab_size, cfg.target_vocab_size)
        self.draft_to_target = d2t.to(self.device)
        self.lm_head = DraftVocabHead("lm_head.weight", hidden, torch.arange(cfg.draft_vocab_size) + d2t,
                                      cfg.target_vocab_size, mapping, target.exchange, **dkw)
        if random_head:
            fill_random(self, seed=1)
            self.load_stats = None
        else:
            self.load_stats = load_weights(self, path)
        target.capture_aux_hidden_states(cfg.aux_layer_ids)
        self.aux_hidden_width = NUM_AUX_HIDDEN_STATES * hidden  # what a catch-up forward reads a token
        self.caches: list[KVPages] = []  # one layer's pages (a list, like the target's)
        self.num_pages = self.page_size = 0

    # ------------------------------------------------------------------ cache
    def page_bytes(self, page_size: int) -> int:
        """Bytes one KV page of ``page_size`` tokens takes on this rank (one layer)."""
        return page_bytes(1, page_size, self.self_attn.num_kv_heads, self.config.layer.head_dim, self.dtype)

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> None:
        """(Re)allocate the head's paged cache: ``k``/``v`` ``[num_pages, page_size, kv_heads_per_rank,
        head_dim]`` (zeros). Draft position ``i`` is the target position whose hidden states it read."""
        check_int("num_pages", num_pages, low=1)
        check_int("page_size", page_size, low=1)
        self.caches = []  # free the old pages before allocating the new ones
        self.caches = [KVPages(num_pages, page_size, self.self_attn.num_kv_heads, self.config.layer.head_dim,
                               dtype=self.dtype, device=self.device)]
        self.num_pages, self.page_size = num_pages, page_size

    def build_metadata(self, batch: ForwardBatch, kv_pages: int | None = None) -> AttentionMetadata:
        """The attention metadata of ``batch`` for the head's pages."""
        return AttentionMetadata.build(batch, self.device, self.page_size, kv_pages)

    def _check_batch(self, batch: ForwardBatch) -> None:
        check_paged_batch(batch, self.num_pages if self.caches else 0, self.page_size, self.config.target_vocab_size)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                attn_meta: AttentionMetadata | None = None) -> tuple[VocabShardedLogits, torch.Tensor]:
        h = self.config.hidden_size
        layout = plan_step(batch, attn_meta, check=self._check_batch, build=self.build_metadata,
                           attention_dp=self.attention_dp, head_sharded=self.mapping.lm_head_is_sharded,
                           group=self.group, device=self.device)
        if hidden.dim() != 2 or hidden.shape[0] != batch.num_tokens or hidden.shape[1] not in (h, 3 * h):
            raise ValueError(f"hidden must be [{batch.num_tokens}, {3 * h}] (target) or [{batch.num_tokens}, {h}] "
                             f"(chained), got {tuple(hidden.shape)}")
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if hidden.shape[1] == 3 * h:
            hidden = self.fc(hidden[:, self.fc_start:self.fc_start + self.fc_len])
        embeds = self.input_layernorm(self.target_embedding(batch.token_ids.to(self.device)))
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        cos, sin = self.rotary(batch.positions.to(self.device), self.dtype)
        attend = self.attention.bind(layout.meta)
        attn_in = torch.cat([embeds, normed], dim=-1)
        x = residual + self.self_attn(attn_in, cos, sin, layout.meta, self.caches[0], attend)
        y = self.post_attention_layernorm(x)
        if layout.dp_rows is None:
            x = x + self.mlp(y)
        else:
            x = x + self.mlp(layout.dp_rows.gather(y), reduce=layout.dp_rows.reduce_scatter)
        out = x.index_select(0, layout.rows.to(self.device))
        normed_out = self.norm(out)
        if layout.head_rows is not None:
            return StackedRowsLogits(self.lm_head(layout.head_rows.gather(normed_out)), layout.head_rows), out
        return self.lm_head(normed_out), out

    def greedy_drafts(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``batch`` and return the greedy draft of every logits row as a target id (``[M]`` int64, the
        same on every rank of the TP group, picked on the draft channel) and the rows' outputs ``[M, H]``."""
        logits, out = self(batch, hidden)
        return logits.argmax(channel=Channel.DRAFT), out

    def shard_plan(self) -> list[tuple[str, nn.Parameter, list[ShardSpec]]]:
        """Every parameter with the checkpoint slices that fill it: ``(name, param, specs)``."""
        return shard_plan(self)
