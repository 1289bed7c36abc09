"""SeqShards: how a sequence of N tokens is split over P ranks (balanced, sizes differ by at most one)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeqShards:
    total: int
    sizes: tuple[int, ...]

    @classmethod
    def balanced(cls, total: int, degree: int) -> "SeqShards":
        if degree < 1 or total < 0:
            raise ValueError(f"cannot split {total} tokens over {degree} ranks")
        base, extra = divmod(total, degree)
        return cls(total, tuple(base + (rank < extra) for rank in range(degree)))

    @classmethod
    def union(cls, *parts: "SeqShards") -> "SeqShards":
        """Several split sequences as one: rank r holds its shard of each part, in part order (Z-Image's joint
        caption + image sequence)."""
        sizes = tuple(sum(sizes) for sizes in zip(*(part.sizes for part in parts)))
        return cls(sum(sizes), sizes)

    @property
    def degree(self) -> int:
        return len(self.sizes)

    @property
    def chunk(self) -> int:
        """Largest shard: every shard is padded to this length for the all-to-all."""
        return max(self.sizes)

    @property
    def even(self) -> bool:
        return all(size == self.chunk for size in self.sizes)

    def offset(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def range(self, rank: int) -> tuple[int, int]:
        """Tokens [lo, hi) held by a rank."""
        lo = self.offset(rank)
        return lo, lo + self.sizes[rank]

    def block(self, first: int, count: int) -> "SeqShards":
        """The shards first..first+count-1 as a sequence of their own (one Ulysses group inside a ring block)."""
        sizes = self.sizes[first:first + count]
        return SeqShards(sum(sizes), sizes)
