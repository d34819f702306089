"""The symbolic executor's rules for the replicated parameters' collectives: their gradients' all-reduce (one per
part, after the last compute that writes the part), or with their optimizer sharded its reduce-scatter and, at the
iteration's start, the weights' all-gather, waited before the first compute that reads them."""

from __future__ import annotations

from megatron_tawpipe.plan import actions as A


class ReplicatedRules:
    """Mixed into :class:`plan.symbolic.SymbolicExecutor` (its plan, state, ``sharded_replicated``, ``_err`` and
    ``_post``)."""

    def _check_gathered(self, r, i, a) -> None:
        """With the replicated parts' optimizer sharded: compute of shard 0 reads the embedding, of the last shard
        the head; both after their all-gather was waited."""
        if not self.sharded_replicated:
            return
        gathered = self.state[r].gathered
        for part, shard in (("embedding", 0), ("head", self.S - 1)):
            if a.shard == shard and part not in gathered and "all" not in gathered:
                self._err(f"compute of shard {shard} before the replicated {part} weights were all-gathered "
                          "(the replicated parts' optimizer is sharded)", r, i, a)

    def _replicated(self, r, st, i, a):
        if a.part not in A.REPLICATED_PARTS:
            self._err(f"unknown replicated part {a.part!r}; known: {', '.join(A.REPLICATED_PARTS)}",
                      r, i, a)
        if a.mode not in A.REPLICATED_MODES:
            self._err(f"unknown replicated mode {a.mode!r}; known: {', '.join(A.REPLICATED_MODES)}", r, i, a)
        if self.sharded_replicated and a.mode == "sum":
            self._err("an all-reduce of the replicated gradients in a plan that shards their optimizer "
                      "(reduce-scatter and all-gather)", r, i, a)
        if a.mode == "gather":
            posted = {b.part for _, b, _ in st.pending.values()
                      if type(b) is A.ReplicatedAllReduceStart and b.mode == "gather"}
            if {a.part, "all"} & (st.gathered | posted) or (a.part == "all" and (st.gathered or posted)):
                self._err("these replicated weights are all-gathered twice", r, i, a)
            if st.compute_closed:
                self._err("all-gather of replicated weights after their gradients' reduction started", r, i, a)
            st.pending[a.tag] = (i, a, None)
            self._post(r, a.tag, None)
            return
        if a.part in st.compute_closed or "all" in st.compute_closed or \
                (a.part == "all" and st.compute_closed):
            self._err("these replicated gradients are all-reduced twice", r, i, a)
        st.compute_closed = st.compute_closed | {a.part}
        st.pending[a.tag] = (i, a, None)
        self._post(r, a.tag, None)
