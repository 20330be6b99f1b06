"""How the ranks of a job are laid out: world, tensor-parallel groups, attention DP.

A job of ``world_size`` ranks is split into ``world_size // tp_size`` consecutive
tensor-parallel groups of ``tp_size`` ranks each. Inside a TP group every rank holds
one shard of every weight. With ``enable_attention_dp`` the attention layers are
data-parallel instead (each rank of the TP group owns its own requests); the LM head
is then either replicated or, with ``enable_lm_head_tp_in_adp``, vocabulary-sharded
over the TP group with the rows of all ranks stacked.
"""

from __future__ import annotations

from dataclasses import dataclass

from .validation import check_bool, check_int, is_int


@dataclass(frozen=True)
class Mapping:
    """Placement of one rank. Immutable; equal on every rank except ``rank``.

    Raises ``ValueError`` for combinations that cannot be laid out.
    """

    world_size: int = 1
    rank: int = 0
    tp_size: int | None = None
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False

    def __post_init__(self) -> None:
        if self.tp_size is None:
            object.__setattr__(self, "tp_size", self.world_size)
        for name in ("world_size", "tp_size"):
            check_int(f"Mapping.{name}", getattr(self, name), low=1)
        if not is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping.rank={self.rank!r} is out of range for world_size={self.world_size}")
        for name in ("enable_attention_dp", "enable_lm_head_tp_in_adp"):
            check_bool(f"Mapping.{name}", getattr(self, name))
        if self.world_size % self.tp_size != 0:
            raise ValueError(
                f"Mapping.tp_size={self.tp_size} does not divide world_size={self.world_size}"
            )
        if self.enable_lm_head_tp_in_adp and not self.enable_attention_dp:
            raise ValueError("enable_lm_head_tp_in_adp needs enable_attention_dp=True")

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its TP group, in ``[0, tp_size)``."""
        return self.rank % self.tp_size

    @property
    def tp_group_index(self) -> int:
        """Which TP group this rank belongs to, in ``[0, world_size // tp_size)``."""
        return self.rank // self.tp_size

    @property
    def num_tp_groups(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP-rank order."""
        base = self.tp_group_index * self.tp_size
        return list(range(base, base + self.tp_size))

    @property
    def all_tp_group_ranks(self) -> list[list[int]]:
        """Every TP group of the job (all ranks must create all groups, in this order)."""
        return [list(range(g * self.tp_size, (g + 1) * self.tp_size)) for g in range(self.num_tp_groups)]

    @property
    def lm_head_is_sharded(self) -> bool:
        """True when the LM head is vocabulary-sharded over the TP group."""
        if self.tp_size == 1:
            return False
        return (not self.enable_attention_dp) or self.enable_lm_head_tp_in_adp

    @property
    def attention_tp_size(self) -> int:
        """Number of ranks the attention heads are split over (1 under attention DP)."""
        return 1 if self.enable_attention_dp else self.tp_size

    @property
    def attention_tp_rank(self) -> int:
        return 0 if self.enable_attention_dp else self.tp_rank

