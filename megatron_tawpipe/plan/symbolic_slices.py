"""The symbolic executor's rules for shards kept in slices (``Plan.ownership`` "spread", the TawPipe layout in
which each node group keeps one slice of every shard): a holder never loads or back-propagates into its slice
of a shard, it gathers the shard from all holders (``AllGatherStart``); a group's gradient of the shard is
reduce-scattered to the holders (``ReduceScatterStart``), after which the buffer holds only the rank's slice
and may only be accumulated into ``main`` (its slice) or zeroed."""

from __future__ import annotations


class SliceRules:
    """Mixed into :class:`plan.symbolic.SymbolicExecutor` (``self.plan``, ``self.S``, its locking and posting
    helpers)."""

    def _sliced(self, shard: int) -> bool:
        """Whether ``shard`` is kept in slices by its holders (the spread layout)."""
        return self.plan.spread and len(self.plan.holders(shard)) > 1

    def _whole(self, st, buf, r, i, a) -> None:
        if buf in st.scattered:
            self._err(f"gradient buffer {buf!r} holds only this rank's slice of a reduce-scatter: only "
                      "AccumulateToOwner may use it (or ZeroGrad)", r, i, a)

    def _slice_members(self, r, i, a, kind: str, what: str) -> None:
        if a.kind != kind:
            self._err(f"only {kind}s can be {what}", r, i, a)
        if not 0 <= a.shard < self.S or not self._sliced(a.shard) or \
                tuple(sorted(self.plan.holders(a.shard))) != a.ranks:
            self._err(f"{what} shard {a.shard} over ranks {list(a.ranks)}: only a shard kept in slices (spread "
                      f"ownership) is, over its holders", r, i, a)

    def _all_gather(self, r, st, i, a):
        self._slice_members(r, i, a, "weight", "all-gathered")
        self._unlocked(st, a.buf, r, i, a)
        st.w.pop(a.buf, None)
        self._lock(st, a.buf, a.tag, "w")
        st.pending[a.tag] = (i, a, a.shard)
        self._post(r, a.tag, a.shard)

    def _reduce_scatter(self, r, st, i, a):
        self._slice_members(r, i, a, "grad", "reduce-scattered")
        entry = self._grad_target(st, a.buf, a.shard, r, i, a)
        self._lock(st, a.buf, a.tag, "w")
        st.pending[a.tag] = (i, a, entry[1])
        self._post(r, a.tag, entry[1])

