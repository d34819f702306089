"""The symbolic executor's end of a run: a deadlock named rank by rank, or what an iteration left undone
(micro-batches not run through every shard, weight passes never run, undelivered or missing gradient
contributions, no single final optimizer step)."""

from __future__ import annotations

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.errors import PlanError


class EndChecks:
    """Mixed into :class:`plan.symbolic.SymbolicExecutor` (its plan, state and ``_describe_mask``)."""

    def _deadlock(self, unfinished) -> None:
        lines = []
        for r in unfinished:
            st = self.state[r]
            i = st.pc
            a = self.plan.actions[r][i]
            if type(a) is A.Wait:
                _, start, _ = st.pending[a.tag]
                posted = self.posted.get(a.tag, {})
                missing = [x[0] for x in self.starts[a.tag] if x[0] not in posted]
                lines.append((r, i, a, f"waits for {A.describe(start)}; rank(s) {missing} "
                              "have not posted their side"))
            else:
                lines.append((r, i, a, "cannot proceed"))
        r, i, a, why = lines[0]
        more = "; ".join(f"rank {rr} step {ii} {A.short(aa)}: {ww}"
                         for rr, ii, aa, ww in lines[1:6])
        raise PlanError(f"deadlock: {why}" + (f". Also blocked: {more}" if more else ""),
                        r, i, a)

    def _final_checks(self) -> None:
        S, N = self.S, self.N
        for stream in self.stream_index:
            for m in range(N):
                key = (stream, m)
                fwd, bwd = self.fwd_next.get(key, 0), S - 1 - self.bwd_next.get(key, S - 1)
                if fwd != S or bwd != S:
                    raise PlanError(f"micro-batch {m} of stream {stream} ran {fwd} of {S} forward "
                                    f"and {bwd} of {S} backward shards")
        if self.bi_open:
            (stream, mb, shard), rank = next(iter(self.bi_open.items()))
            raise PlanError(f"rank {rank}: the BackwardInput of (mb {mb}, shard {shard}) of stream {stream} "
                            "has no BackwardWeight")
        for r, st in enumerate(self.state):
            for buf, (shard, mask) in st.g.items():
                if mask:
                    raise PlanError(f"rank {r}: gradient buffer {buf!r} ends holding undelivered "
                                    f"contributions {self._describe_mask(mask)} of shard {shard}")
            for shard, mask in st.main.items():
                if mask != self.full:
                    raise PlanError(f"rank {r}: gradient of owned shard {shard} is missing "
                                    f"contributions {self._describe_mask(self.full & ~mask)}")
            acts = self.plan.actions[r]
            if not acts or type(acts[-1]) is not A.OptimizerStep or \
                    sum(type(x) is A.OptimizerStep for x in acts) != 1:
                raise PlanError(f"rank {r} must end with exactly one OptimizerStep")
