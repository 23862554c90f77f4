"""`IntSet`: a set of integers in ``[0, limit]`` as a two-level bitset, for the packers' inner loops.

Words of 64 bits (Python ints in a list) hold the members; one more Python int has bit ``w`` set when
word ``w`` is non-empty. "Smallest member >= v" and "largest member <= v" are then a few integer
operations whatever the set's size. Best fit uses it over bin residuals, the refinement over the lengths
in its pool.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["IntSet"]


class IntSet:
    """Integers in ``[0, limit]``; ``add`` / ``discard`` / ``next_at_least`` / ``last_at_most``."""

    __slots__ = ("limit", "summary", "words")

    def __init__(self, limit: int, members: list[int] | None = None) -> None:
        self.limit = limit
        self.words = [0] * ((limit >> 6) + 1)
        self.summary = 0
        for v in members or ():
            self.add(v)

    def add(self, v: int) -> None:
        self.words[v >> 6] |= 1 << (v & 63)
        self.summary |= 1 << (v >> 6)

    def discard(self, v: int) -> None:
        w = v >> 6
        self.words[w] &= ~(1 << (v & 63))
        if not self.words[w]:
            self.summary &= ~(1 << w)

    def next_at_least(self, v: int) -> int:
        """Smallest member ``>= v``, or -1 (``0 <= v <= limit``)."""
        w = v >> 6
        x = self.words[w] >> (v & 63)
        if x:
            return v + (x & -x).bit_length() - 1
        y = self.summary >> (w + 1)
        if not y:
            return -1
        w += (y & -y).bit_length()
        x = self.words[w]
        return (w << 6) + (x & -x).bit_length() - 1

    def last_at_most(self, v: int) -> int:
        """Largest member ``<= v``, or -1 (any ``v``; values above ``limit`` are clamped)."""
        if v < 0:
            return -1
        v = min(v, self.limit)
        w = v >> 6
        x = self.words[w] & ((2 << (v & 63)) - 1)
        if x:
            return (w << 6) + x.bit_length() - 1
        y = self.summary & ((1 << w) - 1)
        if not y:
            return -1
        w = y.bit_length() - 1
        return (w << 6) + self.words[w].bit_length() - 1

    def ascending_upto(self, v: int) -> Iterator[int]:
        """Members ``<= v`` in increasing order (a generator: callers may stop early)."""
        v = min(v, self.limit)
        summary = self.summary & ((2 << (v >> 6)) - 1)
        while summary:
            low = summary & -summary
            w = low.bit_length() - 1
            summary ^= low
            x = self.words[w]
            while x:
                bit = x & -x
                u = (w << 6) + bit.bit_length() - 1
                if u > v:
                    return
                yield u
                x ^= bit
