"""Layer 7: the tensor-parallel Llama-family model, its checkpoint loader and the drafters.

Public interface (what the runtime codes against)::

    from tpspec.model import (ModelConfig, TPLlamaForCausalLM, ForwardBatch, load_model,
                              make_tiny_checkpoint, NgramDrafter, DraftModel)

    cfg = ModelConfig.from_pretrained(path)    # config.json: .vocab_size .hidden_size .num_layers .num_heads
                                               # .num_kv_heads .head_dim .eos_token_id (int | list | None)
                                               # .max_position_embeddings (.eos_token_ids: always a list)
    model = load_model(path, mapping, device="cpu", dtype=torch.float32, exchange=None,
                       attention_backend="auto")  # path may be "shape:NAME[,num_layers=N]": random weights
    model.allocate_kv_cache(num_pages, page_size)    # paged; (re)allocates
    batch = ForwardBatch(token_ids, positions, block_tables, cache_lens, query_lens, logits_rows=None)
    logits = model(batch)                      # tpspec.VocabShardedLogits for batch.logits_rows, in order
    logits = model(batch, attn_meta)           # with prebuilt AttentionMetadata (CUDA graphs: a fixed
                                               # page-table width, refreshed in place with attn_meta.copy_(new)
                                               # and model.attention.plan(attn_meta, graph=True))

* ``load_model`` is collective over the TP group (it may build the key exchange); each
  rank reads only its slices of the safetensors files (``model.load_stats``).
* ``ForwardBatch``: ``token_ids``/``positions`` ``[N]`` int64 (every new token of every
  sequence, in sequence order); per sequence ``block_tables`` (its KV pages, in order),
  ``cache_lens`` (tokens already cached), ``query_lens`` (new tokens: a context chunk, or
  ``1 + D`` drafts); ``logits_rows`` ``[M]`` int64 into ``[0, N)`` (default: each sequence's
  last token). New token ``i`` of a sequence is written at cache index ``cache_len + i`` (page
  ``table[idx // page_size]``) and attends to ``[0, cache_len + i]``. Rewind = lower your
  ``cache_len``: stale entries are overwritten by the next write. Models that serve the same
  requests (target, draft) allocate the same pages and take the same block tables.
* Plain TP: every rank passes the same batch. Attention DP (``mapping.enable_attention_dp``):
  every rank passes its own (possibly empty) batch and all ranks call forward equally
  often; the logits rows are this rank's. With ``enable_lm_head_tp_in_adp`` the result is a
  :class:`StackedRowsLogits` whose ``argmax``/``sample``/``gather`` are collective and
  return this rank's rows.
* ``make_tiny_checkpoint(path, *, seed=0, ..., draft=False)`` writes a small random
  Llama in HF format (``draft=True``: its matching draft, the target's first layer);
  CLI: ``tpspec make-tiny-model DIR [--draft DRAFT_DIR]``.
* ``NgramDrafter(num_draft_tokens=K, max_ngram=3, min_ngram=1).propose(history) -> list[int]`` (<= K);
  ``.draft(history)``: exactly K, padded; ``.draft_on_device(history [B, W], lengths [B]) -> [B, K]``: the
  same for a batch of histories on their device, without a host sync.
* ``DraftModel(path, mapping, device=, dtype=, exchange=, target_config=None)``: the draft,
  TP-sharded, same API as the target; greedy drafts with ``draft(batch).argmax(channel=Channel.DRAFT)``.
"""

from ..lazy import lazy_exports

# Imported on first use: the ``tpspec`` commands that live in this package (make-tiny-model,
# convert-eagle3) answer ``--help`` without importing torch.
_EXPORTS = {
    "AttentionMetadata": "batch",
    "CheckpointError": "loader",
    "CheckpointReader": "loader",
    "DraftModel": "drafters",
    "ForwardBatch": "batch",
    "KVPages": "kv_cache",
    "LoadStats": "loader",
    "LocalKeyExchange": "comm",
    "MODEL_SHAPES": "shape_table",
    "ModelConfig": "config",
    "NgramDrafter": "drafters",
    "SUPPORTED_ARCHITECTURES": "config",
    "StackedRowsLogits": "llama",
    "TPLlamaForCausalLM": "llama",
    "check_split": "llama",
    "choose_attention_backend": "attention",
    "eagle3_shape_path": "shapes",
    "load_model": "loader",
    "load_weights": "loader",
    "make_tiny_checkpoint": "tiny",
    "pages_needed": "batch",
    "random_model": "shapes",
    "shape_config": "shapes",
    "shape_path": "shapes",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
