"""The links a run's layout decision is priced on, measured at start-up on the run's own backend.

:func:`probe_links` is collective: every rank calls it. Rank 0 times a few transfers with the first rank of the
next group (the node link) and with its neighbour in its own group (the link inside a node), each on a process
group of the two alone: a few round trips of a few bytes for the latency, then messages growing fourfold from
256 KiB until one takes 50 ms, 64 MiB is reached or the time budget is spent, then that message twice more,
the rate being its size over its fastest transfer less a round trip. What rank 0 measured is broadcast, so every
rank decides on the same figures. A probe that fails or runs past its budget gives the stated default and says why; the
transfers of a failed probe wait at most the budget (``Work.wait`` with a timeout), so it never hangs.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_tawpipe.distributed import groups as process_groups

#: the first message of the rate measurement, the largest, and the time one should take to stop growing
FIRST_BYTES, MAX_BYTES, ENOUGH_S = 256 * 1024, 64 * 1024 * 1024, 0.05
ROUND_TRIPS = 5
REPEATS = 3   # transfers of the largest message


@dataclass(frozen=True)
class LinkMeasure:
    bandwidth: float          # bytes/s per direction
    latency: float            # s per message
    seconds: float = 0.0      # what measuring it took
    source: str = "measured"  # measured | the flag that gave it | default (why)

    def describe(self) -> str:
        rate = f"{self.bandwidth * 8 / 1e6:.0f} Mbit/s" if self.bandwidth < 1.25e9 else \
            f"{self.bandwidth / 1e9:.2f} GB/s"
        text = f"{rate}, {self.latency * 1e6:.0f} us"
        if self.source == "measured":
            return text + f" (measured in {self.seconds:.2f} s)"
        return text + f" ({self.source})"


class _ProbeFailed(RuntimeError):
    pass


def _wait(work, deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left <= 0:
        raise _ProbeFailed("ran past its time budget")
    if not work.wait(timeout=datetime.timedelta(seconds=left)):
        raise _ProbeFailed("ran past its time budget")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(me: int, peer: int, leader: bool, group, device: torch.device, deadline: float) -> tuple:
    """(bandwidth, latency) between global ranks ``me`` and ``peer`` on ``group``; ``leader`` chooses the sizes."""
    tiny = torch.zeros(1, dtype=torch.int64, device=device)

    def exchange(payload: Optional[torch.Tensor]) -> float:
        """The leader sends the size, then the payload, and waits for the peer's reply; the time from the size's
        send to the reply. The peer answers every size until size 0."""
        start = time.perf_counter()
        _wait(dist.isend(tiny if payload is None else torch.tensor([payload.numel()], device=device), peer,
                         group=group), deadline)
        if payload is not None and payload.numel():
            _wait(dist.isend(payload, peer, group=group), deadline)
        _wait(dist.irecv(tiny, peer, group=group), deadline)
        _sync(device)
        return time.perf_counter() - start

    if not leader:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        while True:
            _wait(dist.irecv(size, peer, group=group), deadline)
            n = int(size.item())
            if n < 0:
                return 0.0, 0.0
            if n:
                buffer = torch.empty(n, dtype=torch.uint8, device=device)
                _wait(dist.irecv(buffer, peer, group=group), deadline)
            _wait(dist.isend(tiny, peer, group=group), deadline)
    # a zero-size message: a round trip of the control messages alone
    trips = [exchange(torch.empty(0, dtype=torch.uint8, device=device)) for _ in range(ROUND_TRIPS)]
    rtt = min(trips)
    n = FIRST_BYTES
    while True:
        payload = torch.ones(n, dtype=torch.uint8, device=device)
        t = exchange(payload)
        if t >= ENOUGH_S or n >= MAX_BYTES or time.perf_counter() + 4 * t > deadline:
            break
        n *= 4
    # the largest message again, the fastest of its transfers counted: a rank that the machine's other work
    # keeps off its core for a while slows one transfer, not the link
    times = [t] + [exchange(payload) for _ in range(REPEATS - 1) if time.perf_counter() + 2 * t < deadline]
    rate = n / max(min(times) - rtt, 1e-9)
    _wait(dist.isend(torch.tensor([-1], device=device), peer, group=group), deadline)
    return rate, rtt / 2


def probe_links(groups: int, ranks_per_group: int, device: torch.device, budget_s: float = 3.0,
                default_inter: LinkMeasure = LinkMeasure(12.5e9, 20e-6, 0.0, "default"),
                default_intra: LinkMeasure = LinkMeasure(200e9, 5e-6, 0.0, "default"),
                measure_intra: bool = True) -> tuple:
    """(node link, link inside a node) as :class:`LinkMeasure`; collective over every rank of the default group.
    Ranks are consecutive in groups of ``ranks_per_group``. The node link is measured only with two or more groups,
    the link inside a node only with two or more ranks per group (and ``measure_intra``); the defaults stand for
    what is not measured, or fails."""
    rank = dist.get_rank()
    started = time.perf_counter()
    results = []
    pairs = []
    if groups >= 2:
        pairs.append(("inter", 0, ranks_per_group, default_inter))
    if measure_intra and ranks_per_group >= 2:
        pairs.append(("intra", 0, 1, default_intra))
    for _, a, b, default in pairs:
        # every rank creates the pair's group (new_group is collective); only the two use it
        group = process_groups.new_group([a, b])
        budget = budget_s / len(pairs)
        begun = time.perf_counter()
        ok, why = 1.0, ""
        bandwidth = latency = 0.0
        if rank in (a, b):
            try:
                # the peer waits a little longer than the leader, which ends the exchange
                bandwidth, latency = _measure(rank, b if rank == a else a, rank == a, group, device,
                                              begun + budget + (0.0 if rank == a else 1.0))
            except (_ProbeFailed, RuntimeError) as exc:
                ok, why = 0.0, str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        results.append((bandwidth, latency, time.perf_counter() - begun, ok, why, default))
    # rank 0's figures to every rank
    flat = torch.tensor([x for r in results for x in r[:4]] or [0.0], dtype=torch.float64, device=device)
    dist.broadcast(flat, 0)
    values = flat.tolist()
    measures = {}
    for i, (name, _, _, default) in enumerate(pairs):
        bandwidth, latency, seconds, ok = values[4 * i:4 * i + 4]
        why = results[i][4] if rank == 0 else ""
        if ok and bandwidth > 0:
            measures[name] = LinkMeasure(bandwidth, latency, seconds, "measured")
        else:
            measures[name] = LinkMeasure(default.bandwidth, default.latency, seconds,
                                         f"default: the probe failed{': ' + why if why else ''}")
    inter = measures.get("inter", default_inter)
    intra = measures.get("intra", default_intra)
    return inter, intra, time.perf_counter() - started
