"""How big htb's bucket must be: a sweep of rates x bursts over one emulated two-node link.

For each rate and burst, :func:`sweep` shapes the link of a two-node :class:`.EmulatedCluster` and
measures (a) the steady throughput of a long TCP transfer (:func:`.link_probe.measure_throughput`,
after the bucket has drained): a bucket too small for the delay of htb's timer wakeups loses tokens
and falls short of the rate; and (b) single 1 MB and 3 MB messages after the link was idle
(:func:`.link_probe.measure_messages`): the bucket, full after the idle time, sends their start at
once, so they see more than the rate.  Rates are relative to the shaped rate; TCP's payload is at
most ``PAYLOAD_SHARE`` of the Ethernet frames htb counts, so a link that keeps its rate moves
payload at that share, and a message that sees more came (partly) out of the bucket.

On a busy machine a small bucket also falls short because the sending or receiving process waits
for a CPU and the link idles meanwhile (a real link loses that time too; a big bucket catches it
up).  ``realtime_rates`` measures the steady throughput again with both probe processes at
real-time priority (``chrt -f 50``), which takes them out of that wait: what is still short then
is htb's own timer.

:func:`machine_facts` records where it ran; :func:`format_table` prints the result.  The rule the
links use unless a burst is given is :func:`.node_network.default_burst`.  Needs root.  No torch.
"""

from __future__ import annotations

import datetime
import gzip
import os
import platform
import shutil
import statistics
from typing import Callable, Dict, Optional, Sequence

from tawpipe_lab.emulated_cluster import EmulatedCluster
from tawpipe_lab.link_probe import measure_messages, measure_throughput
from tawpipe_lab.netns import tc_size_bytes
from tawpipe_lab.node_network import BURST_TIME_S, DEFAULT_BURST_RULE, MIN_BURST_BYTES, default_burst
from megatron_tawpipe.common.units import parse_tc_rate

DEFAULT_RATES = ("200mbit", "500mbit", "1gbit", "2gbit")
# 1600: what tc picks itself at these rates (rate / psched hz + its mtu of 1600, psched hz being
# 1e9 with high-resolution timers), the smallest bucket worth trying; 2m: the old default.
# "default": the links' default bucket at that rate (node_network.default_burst).
DEFAULT_BURSTS = ("1600", "8k", "16k", "32k", "64k", "128k", "256k", "2m", "default")
MESSAGE_SIZES = (1_000_000, 3_000_000)
# TCP payload per frame htb counts: MSS 1448 (MTU 1500 less IP, TCP and timestamp headers) of 1514
# bytes (with the 14-byte Ethernet header).
PAYLOAD_SHARE = 1448 / 1514
REALTIME = ("chrt", "-f", "50")
# A burst sustains the rate when the steady payload rate is at least this share of PAYLOAD_SHARE.
SUSTAINED = 0.98


def _read(path: str) -> Optional[str]:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            return f.read()
    except OSError:
        return None


def kernel_hz() -> Optional[int]:
    """CONFIG_HZ of the running kernel, from /proc/config.gz or /boot/config-RELEASE (None if neither)."""
    for path in ("/proc/config.gz", f"/boot/config-{platform.release()}"):
        for line in (_read(path) or "").splitlines():
            if line.startswith("CONFIG_HZ="):
                return int(line.split("=", 1)[1])
    return None


def machine_facts() -> Dict[str, object]:
    """Kernel, HZ, packet scheduler clock, CPUs, load and date of this machine."""
    psched = (_read("/proc/net/psched") or "").split()
    cpu = [line.split(":", 1)[1].strip() for line in (_read("/proc/cpuinfo") or "").splitlines()
           if line.startswith("model name")]
    sysctl = (_read("/proc/sys/net/ipv4/tcp_slow_start_after_idle") or "").strip()
    return {
        "kernel": platform.release(),
        "config_hz": kernel_hz(),
        # /proc/net/psched: its 3rd and 4th fields are the clock resolution (1e6: high-resolution
        # timers) and the hz tc divides a rate by for its default burst.
        "psched": [int(x, 16) for x in psched] if len(psched) == 4 else None,
        "cpus": os.cpu_count(),
        "cpu_model": cpu[0] if cpu else None,
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "tcp_slow_start_after_idle": int(sysctl) if sysctl.isdigit() else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _steady(cluster: EmulatedCluster, rate: str, burst: str, repeats: int, steady_s: float,
            wrap: Sequence[str] = ()) -> dict:
    """Shape the link to ``rate`` and ``burst`` ("default": the rule) and measure its steady rate."""
    is_default = burst == "default"
    cluster.burst = None if is_default else burst
    cluster.set_rate(rate)
    bits, burst = cluster.rate_bits_per_s, cluster.burst
    skip = tc_size_bytes(burst) + (1 << 20)  # past the bucket and TCP's start
    runs = [measure_throughput(cluster, 0, 1, skip + int(bits * steady_s / 8), skip=skip, wrap=wrap)["bits_per_s"]
            / bits for _ in range(repeats)]
    over_rate = statistics.median(runs)
    return {"rate": rate, "rate_bits_per_s": bits, "burst": burst, "default": is_default,
            "burst_bytes": tc_size_bytes(burst), "burst_us_at_rate": round(8e6 * tc_size_bytes(burst) / bits, 1),
            "steady": {"over_rate": round(over_rate, 4), "over_payload_limit": round(over_rate / PAYLOAD_SHARE, 4),
                       "runs": [round(r, 4) for r in runs]}}


def _point(cluster: EmulatedCluster, rate: str, burst: str, repeats: int, idle_s: float,
           steady_s: float, sizes: Sequence[int]) -> dict:
    point = _steady(cluster, rate, burst, repeats, steady_s)
    bits = point["rate_bits_per_s"]
    order = [size for _ in range(repeats) for size in sizes]
    seconds = measure_messages(cluster, 0, 1, order, idle_s=idle_s)
    messages = {}
    for size in sizes:
        runs = [8 * size / s / bits for n, s in zip(order, seconds) if n == size]
        messages[f"{size / 1e6:g}MB"] = {"over_rate": round(statistics.median(runs), 4),
                                         "runs": [round(r, 4) for r in runs]}
    return {**point, "messages_after_idle": messages}


def sweep(rates: Sequence[str] = DEFAULT_RATES, bursts: Sequence[str] = DEFAULT_BURSTS, repeats: int = 3,
          idle_s: float = 1.0, steady_s: float = 0.5, sizes: Sequence[int] = MESSAGE_SIZES,
          realtime_rates: Sequence[str] = (), progress: Optional[Callable[[str], None]] = None) -> dict:
    """Measure every rate x burst on node 0 -> node 1 of a two-node cluster (medians of ``repeats``
    runs; ``steady_s`` seconds of transfer at the rate, each message after ``idle_s`` idle), then
    the steady rate of ``realtime_rates`` x bursts with the probes at real-time priority."""
    if realtime_rates and shutil.which(REALTIME[0]) is None:
        raise ValueError(f"{REALTIME[0]} not found: it runs the real-time measurements")
    for rate in [*rates, *realtime_rates]:
        if parse_tc_rate(rate) is None:
            raise ValueError(f"the sweep needs shaped rates, not {rate!r}")
    for burst in bursts:
        if burst != "default":
            tc_size_bytes(burst)
    facts = machine_facts()
    points, realtime = [], []
    with EmulatedCluster(2, 1, rates[0]) as cluster:
        for rate in rates:
            for burst in bursts:
                points.append(_point(cluster, rate, burst, repeats, idle_s, steady_s, sizes))
                if progress:
                    progress(format_table({"points": points[-1:]}, header=not points[:-1]))
        for rate in realtime_rates:
            for burst in bursts:
                realtime.append(_steady(cluster, rate, burst, repeats, steady_s, wrap=REALTIME))
                if progress:
                    progress(format_table({"points": realtime[-1:]}, header=False) + "  (real-time probes)")
    facts["loadavg_1min_after"] = round(os.getloadavg()[0], 2)

    def smallest(measured, rates):
        out = {}
        for rate in rates:
            ok = [p for p in measured if p["rate"] == rate and p["steady"]["over_payload_limit"] >= SUSTAINED]
            out[rate] = min(ok, key=lambda p: p["burst_bytes"])["burst"] if ok else None
        return out

    return {"machine": facts,
            "settings": {"rates": list(rates), "bursts": list(bursts), "repeats": repeats, "idle_s": idle_s,
                         "steady_s": steady_s, "message_bytes": list(sizes), "payload_share": round(PAYLOAD_SHARE, 4),
                         "sustained": SUSTAINED, "shape_ingress": True, "realtime_wrap": list(REALTIME)},
            "points": points,
            "realtime_steady": realtime,
            "smallest_sustaining_burst": smallest(points, rates),
            "smallest_sustaining_burst_realtime": smallest(realtime, realtime_rates),
            "default_rule": {"burst_time_s": BURST_TIME_S, "min_burst_bytes": MIN_BURST_BYTES,
                             "why": DEFAULT_BURST_RULE,
                             "bursts": {rate: default_burst(parse_tc_rate(rate)) for rate in rates}}}


def format_table(result: dict, header: bool = True) -> str:
    """One line per point: rate, burst (``*``: the default), the microseconds the link needs to send
    it, the steady rate over the shaped rate and over the payload limit, and each message's rate."""
    lines = []
    for p in result["points"]:
        names = list(p.get("messages_after_idle", {}))
        if header and not lines:
            lines.append(f"{'rate':>8} {'burst':>6} {'us':>7} {'steady':>7} {'/limit':>7} "
                         + " ".join(f"{n:>7}" for n in names))
        burst = p["burst"] + ("*" if p.get("default") else "")
        lines.append((f"{p['rate']:>8} {burst:>6} {p['burst_us_at_rate']:>7.1f} "
                      f"{p['steady']['over_rate']:>7.3f} {p['steady']['over_payload_limit']:>7.3f} "
                      + " ".join(f"{p['messages_after_idle'][n]['over_rate']:>7.3f}" for n in names)).rstrip())
    return "\n".join(lines)
