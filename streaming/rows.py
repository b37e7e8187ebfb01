"""KV-row bookkeeping: which session owns which cache row, with decoding sessions packed at rows [0, A).

Pure bookkeeping (no tensors): `activate`/`deactivate` return the row swaps the caller must apply to the device
state, so the decode step only ever needs rows [0, A) rounded up to a batch bucket. The last row is kept free as
the scratch row that swaps go through.
"""

from __future__ import annotations


class RowTable:
    def __init__(self, n_rows: int) -> None:
        if n_rows < 2:
            raise ValueError("need at least 2 rows (one is the swap scratch row)")
        self.n_rows = n_rows
        self.spare = n_rows - 1
        self.owner: list[int | None] = [None] * n_rows  # row → session
        self.row: dict[int, int] = {}  # session → row
        self.active = 0  # rows [0, active) are decoding

    @property
    def capacity(self) -> int:
        return self.n_rows - 1

    def free_rows(self) -> int:
        return self.capacity - len(self.row)

    def open(self, session: int) -> int:
        if session in self.row:
            raise KeyError(f"session {session!r} already has a row")
        for r in range(self.active, self.capacity):  # rows below `active` are taken by definition
            if self.owner[r] is None:
                self.owner[r] = session
                self.row[session] = r
                return r
        raise OverflowError("no free KV row")

    def close(self, session: int) -> list[tuple[int, int]]:
        """Release a session's row; deactivates it first if needed (returns those swaps)."""
        swaps = self.deactivate(session) if self.is_active(session) else []
        r = self.row.pop(session)
        self.owner[r] = None
        return swaps

    def is_active(self, session: int) -> bool:
        return self.row[session] < self.active

    def activate(self, session: int) -> list[tuple[int, int]]:
        """Make `session` decode: it moves to row `active` (swapping with that row's holder); returns swaps."""
        r = self.row[session]
        if r < self.active:
            return []
        target = self.active
        self.active += 1
        return self._swap(r, target)

    def deactivate(self, session: int) -> list[tuple[int, int]]:
        """Stop decoding `session`: the last active row takes its place; returns swaps."""
        r = self.row[session]
        if r >= self.active:
            return []
        last = self.active - 1
        self.active -= 1
        return self._swap(r, last)

    def _swap(self, a: int, b: int) -> list[tuple[int, int]]:
        if a == b:
            return []
        sa, sb = self.owner[a], self.owner[b]
        self.owner[a], self.owner[b] = sb, sa
        if sa is not None:
            self.row[sa] = b
        if sb is not None:
            self.row[sb] = a
        return [(a, b)]

    def check(self) -> None:
        """Invariant check (tests): maps agree, active rows are all owned, the spare row is free."""
        assert self.owner[self.spare] is None
        for s, r in self.row.items():
            assert self.owner[r] == s
        assert sum(o is not None for o in self.owner) == len(self.row)
        assert all(self.owner[r] is not None for r in range(self.active))
