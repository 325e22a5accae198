"""A keyed pseudo-random permutation of range(n), evaluated one position at a time.

Each epoch visits a corpus's samples in a different order. Materialising a permutation costs 8
bytes per sample in every rank and loader worker (hundreds of MB for a large corpus); a
4-round Feistel network over the next power of two, with cycle-walking back into range(n),
gives a bijection computed in O(1) memory from (key, position) alone.
"""
from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class FeistelPermutation:
    def __init__(self, n: int, key: int, rounds: int = 4):
        if n < 1:
            raise ValueError(f"cannot permute {n} items")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        self.round_keys = [_mix64((key & _MASK64) ^ _mix64(r + 1)) for r in range(rounds)]

    def __call__(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside range({self.n})")
        x = position
        while True:  # cycle-walk: the domain is < 4n, so this repeats < 4 times on average
            left, right = x >> self.half, x & self.mask
            for k in self.round_keys:
                left, right = right, left ^ (_mix64(right ^ k) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x
