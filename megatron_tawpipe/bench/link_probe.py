"""What an emulated cluster's links carry: one TCP stream between two nodes, timed.

:func:`measure_throughput` runs a receiver script in one node and a sender script in another
(plain Python sockets, no torch) and returns the rate the receiver saw, in **bits** per second as
tc's rates are written; :func:`format_rate` prints such a rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Dict, Optional

from megatron_tawpipe.bench.netns import tc_size_bytes
from megatron_tawpipe.bench.subprocesses import terminate_all
from megatron_tawpipe.common.errors import ClusterError

if TYPE_CHECKING:
    from megatron_tawpipe.bench.emulated_cluster import EmulatedCluster

# argv: host port skip. Prints "ready", accepts one connection, reads to its end, then prints the
# bytes and seconds in all and after the first ``skip`` bytes, as JSON.
_RECEIVER = r"""
import json, socket, sys, time
host, port, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
buf = bytearray(1 << 20)
got, t_first, t_skip = 0, None, None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    now = time.perf_counter()
    if t_first is None:
        t_first = now
    got += n
    if t_skip is None and got >= skip:
        t_skip, at_skip = now, got
    t_last = now
print(json.dumps({"bytes": got, "seconds": t_last - t_first,
                  "steady_bytes": got - at_skip, "steady_seconds": t_last - t_skip}), flush=True)
"""

# argv: host port nbytes. Connects (retrying for 10 s) and sends nbytes zeros.
_SENDER = r"""
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((host, port))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
chunk = b"\0" * (1 << 20)
left = nbytes
while left > 0:
    s.sendall(chunk[:min(left, len(chunk))])
    left -= min(left, len(chunk))
s.close()
"""


def measure_throughput(cluster: "EmulatedCluster", src: int, dst: int, nbytes: int,
                       skip: Optional[int] = None, port: int = 29400,
                       timeout: float = 120.0) -> Dict[str, float]:
    """Send ``nbytes`` over one TCP connection from node ``src`` to node ``dst``.

    Plain Python sockets, no torch.  ``src == dst`` measures the intra-node
    path (the node's own address, i.e. ``lo``).  The rate is taken over the
    bytes after the first ``skip`` (default: the htb burst plus 1 MB, as the
    first ``burst`` bytes after an idle period pass at full speed).  Returns
    ``{"bits_per_s", "bytes", "seconds", "total_bits_per_s"}``.
    """
    if skip is None:
        skip = min(nbytes // 2, tc_size_bytes(cluster.burst) + (1 << 20))
    host = cluster.node(dst).address
    receiver = cluster.popen(dst, [sys.executable, "-c", _RECEIVER, host, str(port), str(skip)],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = receiver.stdout.readline()
        if line.strip() != "ready":
            raise ClusterError(f"throughput receiver did not start: {line!r}")
        cluster.exec(src, [sys.executable, "-c", _SENDER, host, str(port), str(nbytes)],
                     timeout=timeout, check=True)
        out, _ = receiver.communicate(timeout=timeout)
    finally:
        terminate_all([receiver], grace=1.0)
    r = json.loads(out.strip().splitlines()[-1])
    return {"bits_per_s": 8 * r["steady_bytes"] / max(r["steady_seconds"], 1e-9),
            "total_bits_per_s": 8 * r["bytes"] / max(r["seconds"], 1e-9),
            "bytes": r["bytes"], "seconds": r["seconds"]}


def format_rate(bits_per_s: Optional[float]) -> str:
    """``bits_per_s`` for people: ``'100 Mbit/s'``, ``'1.5 Gbit/s'``; None is ``'unshaped'``."""
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"
