"""The network of an emulated cluster: nodes as network namespaces on one bridge, links shaped.

Each emulated node is a network namespace with a loopback and one ``eth0``.
Every ``eth0`` is one end of a veth pair whose other end (``v<k>``) is attached
to a bridge ``br0`` living in a separate *switch* namespace, so the nodes talk
to each other on ``<subnet>.0/24`` (node ``k`` has address ``<subnet>.<k+1>``)
and nothing is connected to the root namespace: no interface, route, address
or qdisc of the machine itself is created or changed, and no traffic leaves
the machine.  All interfaces are created directly inside the emulated
namespaces (``ip -n SWITCH link add v<k> type veth peer name eth0 netns
NODE``).

Shaping: an htb root qdisc with a single class (``rate R ceil R burst B
cburst B quantum 200000``) on each node's ``eth0`` limits what the node sends,
and the same on the switch-side ``v<k>`` limits what it receives, so each
node has a full-duplex link of rate ``R``, shared by all of its ranks like
one NIC.  ``R`` is a tc rate, handed to tc as written and read the way tc reads
it (:func:`megatron_tawpipe.common.units.parse_tc_rate`).  The kernel on the
machines this was built on has no netem, so only bandwidth can be emulated,
not latency.

The bucket ``B``: htb lets a link that has been idle send ``B`` bytes at once
before the rate applies, so a bucket of megabytes sends a pipeline's 1-3 MB
boundary messages faster than the link's rate.  Unless a burst is given,
``B`` is :func:`default_burst` of the rate: the bytes the link sends in
``BURST_TIME_S`` at its rate, at least ``MIN_BURST_BYTES``: 4x the smallest
bucket (131 us) that kept 1 and 2 gbit at full rate, and it kept 200mbit-1gbit
within 2% on a 2-core machine busy with other work, measured by
``tools/emulated_cluster.py burst-sweep`` (:mod:`.link_burst`;
``examples/results/link_burst.json``).  A smaller bucket falls short of the
rate: htb's timer wakes up late and the tokens the bucket cannot hold
meanwhile are lost.

Intra-node traffic: ranks are told to use ``eth0`` (``GLOO_SOCKET_IFNAME=eth0``;
gloo binds one interface per device and advertises its address).  Two ranks
of the same node then both have the node's address; the kernel routes a
packet addressed to one of the namespace's own addresses through its
``local`` routing table, i.e. over ``lo`` (``ip route get 10.77.0.1`` inside
node 0 prints ``local 10.77.0.1 dev lo``), so it never reaches ``eth0``'s qdisc
and is not shaped.  Only packets to other nodes' addresses leave by ``eth0``.

:class:`NodeNetwork` builds and deletes that network; the processes running in
it are :class:`tawpipe_lab.emulated_cluster.EmulatedCluster`'s.  No torch.
"""

from __future__ import annotations

import atexit
import itertools
import json
import math
import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple, Union

from tawpipe_lab.netns import (NAME_PREFIX, NETNS_ETC, add_namespace, check_prerequisites,
                               check_tc_size, delete_namespace, htb_commands,
                               kill_namespace_processes, list_namespaces, run, unshape)
from megatron_tawpipe.common.errors import ClusterError
from megatron_tawpipe.common.units import parse_tc_rate

DEFAULT_SUBNET = "10.77.0"
# The default htb bucket (default_burst): the bytes the link sends in BURST_TIME_S, at least
# MIN_BURST_BYTES (a few 1514-byte frames); see the module docstring and .link_burst.
BURST_TIME_S = 500e-6
MIN_BURST_BYTES = 8 << 10
DEFAULT_BURST_RULE = (f"{BURST_TIME_S * 1e6:g} us at the link rate, at least {MIN_BURST_BYTES // 1024}k: "
                      "4x the smallest bucket that kept the rate")
NODE_IFNAME = "eth0"

_counter = itertools.count()


def default_burst(rate_bits_per_s: Optional[float]) -> str:
    """The htb burst/cburst a link of ``rate_bits_per_s`` (bits/s, as tc reads the rate) gets when
    none is given, as a tc size in whole KiB (``"62k"`` at 1gbit): the bytes it sends in ``BURST_TIME_S``
    at that rate, at least ``MIN_BURST_BYTES``.  None (an unshaped link, which has no bucket)
    gives ``MIN_BURST_BYTES``."""
    nbytes = MIN_BURST_BYTES
    if rate_bits_per_s is not None:
        if not rate_bits_per_s > 0:
            raise ValueError(f"rate must be positive, not {rate_bits_per_s!r}")
        nbytes = max(nbytes, rate_bits_per_s / 8 * BURST_TIME_S)
    return f"{math.ceil(nbytes / 1024)}k"


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    address: str


class NodeNetwork:
    """``nodes`` node namespaces joined by a bridge, each node's link shaped to ``rate``.

    Args:
        nodes: number of node namespaces (1..253).
        rate: tc rate of each node's link in each direction (``"100mbit"``,
            ``"1gbit"``); None or ``"none"`` leaves the links unshaped.
        burst: htb burst/cburst (bytes a link may send at once after being idle), a tc size
            (``"64k"``); None (default): :func:`default_burst` of the rate.
        shape_ingress: also shape the switch-side veth toward each node, so the
            node's incoming traffic is limited too (default True).
        subnet: first three octets of the /24 the nodes live on.
        prefix: namespace name prefix; default ``twp<pid>`` (``twp<pid>c<i>`` for
            the i-th further network of the same process).
        term_grace: seconds processes left in the namespaces get between SIGTERM
            and SIGKILL when they are deleted.
        verbose: print every ip/tc command to stderr.
    """

    def __init__(self, nodes: int, rate: Optional[str] = "1gbit", *, burst: Optional[str] = None,
                 shape_ingress: bool = True, subnet: str = DEFAULT_SUBNET, prefix: Optional[str] = None,
                 term_grace: float = 5.0, verbose: bool = False):
        if not 1 <= int(nodes) <= 253:
            raise ValueError("nodes must be between 1 and 253")
        octets = subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet must be three octets such as 10.77.0, not {subnet!r}")
        self.nodes = int(nodes)
        self.rate_bits_per_s = parse_tc_rate(rate)  # bits/s, as tc reads the rate; None: unshaped
        self.rate = None if self.rate_bits_per_s is None else str(rate).strip()
        self.burst = burst
        self.shape_ingress = shape_ingress
        self.subnet = subnet
        if prefix is None:
            i = next(_counter)
            prefix = f"{NAME_PREFIX}{os.getpid()}" + (f"c{i}" if i else "")
        if not re.match(r"^[A-Za-z0-9_-]{1,40}$", prefix):
            raise ValueError(f"bad namespace prefix {prefix!r}")
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.node_list = [Node(k, f"{prefix}n{k}", f"{subnet}.{k + 1}") for k in range(self.nodes)]
        self.term_grace = float(term_grace)
        self.verbose = verbose
        self._created: List[str] = []
        self._up = False

    # ------------------------------------------------------------------ names
    @property
    def namespaces(self) -> List[str]:
        """Node namespaces, then the switch namespace."""
        return [n.namespace for n in self.node_list] + [self.switch]

    @property
    def addresses(self) -> List[str]:
        return [n.address for n in self.node_list]

    @property
    def master_addr(self) -> str:
        return self.node_list[0].address

    def node(self, node: Union[int, Node]) -> Node:
        return node if isinstance(node, Node) else self.node_list[int(node)]

    @property
    def burst(self) -> str:
        """The htb burst/cburst of the links: the one given, else :func:`default_burst` of the rate."""
        return self._burst if self._burst is not None else default_burst(self.rate_bits_per_s)

    @burst.setter
    def burst(self, burst: Optional[str]) -> None:
        """A tc size (checked), or None for :func:`default_burst`; :meth:`set_rate` applies it."""
        self._burst = None if burst is None else check_tc_size(burst)

    @property
    def burst_is_default(self) -> bool:
        return self._burst is None

    # ------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Create the namespaces, veth pairs, bridge and shaping."""
        if self._up:
            return
        check_prerequisites()
        existing = set(list_namespaces())
        clash = [n for n in self.namespaces if n in existing]
        if clash:
            raise ClusterError(f"network namespaces already exist: {', '.join(clash)}")
        atexit.register(self.teardown)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise

    def teardown(self) -> None:
        """Delete the namespaces (after stopping what still runs in them); idempotent."""
        self._delete_namespaces()

    def _delete_namespaces(self) -> None:
        if self._created:
            kill_namespace_processes(self._created, self.term_grace)
        for name in reversed(self._created):
            delete_namespace(name)
        left = set(list_namespaces()) & set(self._created) if self._created else set()
        self._created = [n for n in self._created if n in left]
        self._up = False
        atexit.unregister(self.teardown)
        if left:
            print(f"emulated_cluster: could not delete network namespaces "
                  f"{', '.join(sorted(left))}", file=sys.stderr)

    def _ip(self, *args: str) -> None:
        self._cmd(["ip", *args])

    def _cmd(self, argv: List[str]) -> None:
        if self.verbose:
            print("+ " + shlex.join(argv), file=sys.stderr, flush=True)
        run(argv)

    def _build(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("-n", sw, "link", "set", "br0", "up")
        for node in self.node_list:
            ns, port = node.namespace, f"v{node.index}"
            self._add_namespace(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", sw, "link", "add", port, "type", "veth",
                     "peer", "name", NODE_IFNAME, "netns", ns)
            self._ip("-n", sw, "link", "set", port, "master", "br0")
            self._ip("-n", sw, "link", "set", port, "up")
            self._ip("-n", ns, "addr", "add", f"{node.address}/24", "dev", NODE_IFNAME)
            self._ip("-n", ns, "link", "set", NODE_IFNAME, "up")
            self._write_hosts(node)
        self._apply_rate(self.rate, first=True)

    def _write_hosts(self, node: Node) -> None:
        """/etc/netns/NODE/hosts, which ``ip netns exec`` bind-mounts on /etc/hosts.

        The machine's hostname resolves to the node's own address and the
        nodes' namespace names to theirs, so that reverse lookups of peers
        (c10d logs them) and lookups of the hostname need no DNS, which is
        unreachable from the namespaces.
        """
        path = os.path.join(NETNS_ETC, node.namespace)
        os.makedirs(path, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for n in self.node_list:
            names = [n.namespace] + ([socket.gethostname()] if n is node else [])
            lines.append(f"{n.address} {' '.join(names)}")
            # Dual-stack sockets (c10d's) see peers as IPv4-mapped IPv6 addresses.
            lines.append(f"::ffff:{n.address} {n.namespace}")
        with open(os.path.join(path, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _add_namespace(self, name: str) -> None:
        add_namespace(name)
        self._created.append(name)

    # --------------------------------------------------------------- shaping
    def _links(self) -> Iterator[Tuple[str, str]]:
        for node in self.node_list:
            yield node.namespace, NODE_IFNAME
            if self.shape_ingress:
                yield self.switch, f"v{node.index}"

    def _apply_rate(self, rate: Optional[str], first: bool = False) -> None:
        for ns, dev in self._links():
            if not first:
                unshape(ns, dev)
            if rate is not None:
                for argv in htb_commands(ns, dev, rate, self.burst):
                    self._cmd(argv)

    def set_rate(self, rate: Optional[str]) -> None:
        """Change the rate of every node link (a tc rate; None or "none": unshaped), with the burst
        given (or, if none was, :func:`default_burst` of the new rate)."""
        bits = parse_tc_rate(rate)
        self.rate = None if bits is None else str(rate).strip()
        self.rate_bits_per_s = bits
        if self._up:
            self._apply_rate(self.rate)

    # ------------------------------------------------------------ statistics
    def link_bytes(self, node: Union[int, Node]) -> Dict[str, Dict[str, int]]:
        """rx/tx byte counters of ``eth0`` (between nodes) and ``lo`` (inside) of ``node``."""
        ns = self.node(node).namespace
        proc = run(["ip", "-n", ns, "-s", "-j", "link", "show"])
        out = {}
        for link in json.loads(proc.stdout):
            stats = link.get("stats64") or link.get("stats") or {}
            out[link["ifname"]] = {"rx_bytes": int(stats.get("rx", {}).get("bytes", 0)),
                                   "tx_bytes": int(stats.get("tx", {}).get("bytes", 0))}
        return out

    def describe(self) -> str:
        """The links' rate and each namespace, several lines."""
        rate = self.rate or "unshaped"
        burst = f"{self.burst}, " + (f"default: {DEFAULT_BURST_RULE}" if self.burst_is_default else "as given")
        lines = [f"links {rate}" + (f" (htb burst {burst})" if self.rate else "")
                 + ("" if self.shape_ingress or not self.rate else ", egress only")]
        for n in self.node_list:
            lines.append(f"  node {n.index}: namespace {n.namespace}, {NODE_IFNAME} {n.address}/24")
        lines.append(f"  switch: namespace {self.switch}, bridge br0")
        return "\n".join(lines)
