"""What an emulated cluster's links carry: one TCP stream between two nodes, timed.

:func:`measure_throughput` runs a receiver script in one node and a sender script in another
(plain Python sockets, no torch) and returns the rate the receiver saw, in **bits** per second as
tc's rates are written; :func:`measure_messages` times single messages sent after the link was
idle (what htb's burst speeds up); :func:`format_rate` prints such a rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

from tawpipe_lab.netns import tc_size_bytes
from megatron_tawpipe.bench.subprocesses import terminate_all
from megatron_tawpipe.common.errors import ClusterError

if TYPE_CHECKING:
    from tawpipe_lab.emulated_cluster import EmulatedCluster

# The probes' server side: listen on (host, port), print "ready", accept one connection as ``conn``.
_LISTEN = r"""
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
"""

# argv: host port skip. Prints "ready", accepts one connection, reads to its end, then prints the
# bytes and seconds in all and after the first ``skip`` bytes, as JSON.
_RECEIVER = r"""
import json, socket, sys, time
host, port, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
""" + _LISTEN + r"""buf = bytearray(1 << 20)
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

# The probes' client side: connect to (host, port), retrying for 10 s while the server starts.
_CONNECT = r"""
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((host, port))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
"""

# argv: host port nbytes. Connects (retrying for 10 s) and sends nbytes zeros.
_SENDER = r"""
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
""" + _CONNECT + r"""chunk = b"\0" * (1 << 20)
left = nbytes
while left > 0:
    s.sendall(chunk[:min(left, len(chunk))])
    left -= min(left, len(chunk))
s.close()
"""


def measure_throughput(cluster: "EmulatedCluster", src: int, dst: int, nbytes: int,
                       skip: Optional[int] = None, port: int = 29400,
                       timeout: float = 120.0, wrap: Sequence[str] = ()) -> Dict[str, float]:
    """Send ``nbytes`` over one TCP connection from node ``src`` to node ``dst``.

    Plain Python sockets, no torch.  ``src == dst`` measures the intra-node
    path (the node's own address, i.e. ``lo``).  The rate is taken over the
    bytes after the first ``skip`` (default: the htb burst in effect plus 1 MB, as
    the first ``burst`` bytes after an idle period pass at full speed).  ``wrap``
    goes before both scripts' argv (``["chrt", "-f", "50"]``: at real-time
    priority).  Returns ``{"bits_per_s", "bytes", "seconds", "total_bits_per_s"}``.
    """
    if skip is None:
        bucket = tc_size_bytes(cluster.burst) if cluster.rate_bits_per_s is not None else 0
        skip = min(nbytes // 2, bucket + (1 << 20))
    host = cluster.node(dst).address
    receiver = cluster.popen(dst, [*wrap, sys.executable, "-c", _RECEIVER, host, str(port), str(skip)],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = receiver.stdout.readline()
        if line.strip() != "ready":
            raise ClusterError(f"throughput receiver did not start: {line!r}")
        cluster.exec(src, [*wrap, sys.executable, "-c", _SENDER, host, str(port), str(nbytes)],
                     timeout=timeout, check=True)
        out, _ = receiver.communicate(timeout=timeout)
    finally:
        terminate_all([receiver], grace=1.0)
    r = json.loads(out.strip().splitlines()[-1])
    return {"bits_per_s": 8 * r["steady_bytes"] / max(r["steady_seconds"], 1e-9),
            "total_bits_per_s": 8 * r["bytes"] / max(r["seconds"], 1e-9),
            "bytes": r["bytes"], "seconds": r["seconds"]}


# argv: host port. Prints "ready", accepts one connection, then answers each message (an 8-byte
# length, then that many bytes) with one byte once it has all of it; a length of 0 ends it.
_ECHO = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
""" + _LISTEN + r"""conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20)
def read(n):
    while n > 0:
        got = conn.recv_into(buf, min(n, len(buf)))
        if not got:
            raise SystemExit("connection closed mid-message")
        n -= got
while True:
    head = bytearray(8)
    view, n = memoryview(head), 0
    while n < 8:
        got = conn.recv_into(view[n:])
        if not got:
            raise SystemExit(0)
        n += got
    size = int.from_bytes(head, "big")
    if size == 0:
        break
    read(size)
    conn.sendall(b"k")
"""

# argv: host port idle_s size... Connects (retrying for 10 s); for each size: sleeps idle_s, sends
# the message and waits for the one-byte answer; prints the seconds each took, as JSON.
_TIMER = r"""
import json, socket, sys, time
host, port, idle = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sizes = [int(x) for x in sys.argv[4:]]
""" + _CONNECT + r"""s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.sendall((8).to_bytes(8, "big") + bytes(8))
s.recv(1)  # connection warmed up; every message below follows idle_s of silence
seconds = []
for size in sizes:
    payload = size.to_bytes(8, "big") + bytes(size)
    time.sleep(idle)
    t0 = time.perf_counter()
    s.sendall(payload)
    if s.recv(1) != b"k":
        raise SystemExit("no answer")
    seconds.append(time.perf_counter() - t0)
s.sendall(bytes(8))
s.close()
print(json.dumps(seconds), flush=True)
"""


def measure_messages(cluster: "EmulatedCluster", src: int, dst: int, sizes: Sequence[int],
                     idle_s: float = 1.0, port: int = 29401,
                     timeout: Optional[float] = None) -> List[float]:
    """Seconds each message of ``sizes`` bytes takes from node ``src`` to node ``dst``.

    One TCP connection; before each message the link is idle for ``idle_s`` seconds (so htb's
    bucket is full and TCP restarts from its initial window, as after a pipeline's compute), then
    the message is sent and the time taken until the receiver has all of it and its one-byte
    answer is back.  ``8 * size / seconds`` is the rate the message saw.
    """
    host = cluster.node(dst).address
    if timeout is None:
        slow = 8 * sum(sizes) / max(cluster.rate_bits_per_s or 1e9, 1e6)
        timeout = 30.0 + len(sizes) * idle_s + 4 * slow
    server = cluster.popen(dst, [sys.executable, "-c", _ECHO, host, str(port)],
                           stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if line.strip() != "ready":
            raise ClusterError(f"message receiver did not start: {line!r}")
        done = cluster.exec(src, [sys.executable, "-c", _TIMER, host, str(port), repr(float(idle_s)),
                                  *[str(int(n)) for n in sizes]],
                            timeout=timeout, capture_output=True, check=True)
        server.wait(timeout=10)
    finally:
        terminate_all([server], grace=1.0)
    return [float(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def format_rate(bits_per_s: Optional[float]) -> str:
    """``bits_per_s`` for people: ``'100 Mbit/s'``, ``'1.5 Gbit/s'``; None is ``'unshaped'``."""
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"
