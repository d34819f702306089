"""An emulated multi-node cluster inside one Linux machine.

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
one NIC.  The kernel on the machines this was built on has no netem, so only
bandwidth can be emulated, not latency.

Intra-node traffic: ranks are told to use ``eth0`` (``GLOO_SOCKET_IFNAME=eth0``;
gloo binds one interface per device and advertises its address).  Two ranks
of the same node then both have the node's address; the kernel routes a
packet addressed to one of the namespace's own addresses through its
``local`` routing table, i.e. over ``lo`` (``ip route get 10.77.0.1`` inside
node 0 prints ``local 10.77.0.1 dev lo``), so it never reaches ``eth0``'s qdisc
and is not shaped.  Only packets to other nodes' addresses leave by ``eth0``.

Use::

    with EmulatedCluster(nodes=2, ranks_per_node=2, rate="100mbit") as cluster:
        rc = cluster.run_torchrun(["pretrain_llama.py", "--train-iters", "3", "--lr", "1e-4", "--mock-data",
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])
        cluster.exec(1, ["python", "-c", "print('hello from node 1')"])

Everything is torn down in ``__exit__`` (also after an exception, SIGINT or
SIGTERM while inside the ``with`` block): processes still running in the
node namespaces are terminated, then the namespaces (and with them the veths
and the bridge) are deleted.  ``cleanup_stale()`` removes what a killed
(SIGKILL) invocation may have left behind.

Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` and ``tc``
programs.  This module does not import torch.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from megatron_tawpipe.common.errors import ClusterError

__all__ = [
    "ClusterError",
    "EmulatedCluster",
    "Node",
    "check_prerequisites",
    "cleanup_stale",
    "format_rate",
    "list_namespaces",
    "measure_throughput",
    "namespaces_available",
    "parse_rate",
]

NAME_PREFIX = "twp"
DEFAULT_SUBNET = "10.77.0"
DEFAULT_MASTER_PORT = 29500
DEFAULT_BURST = "2m"
HTB_QUANTUM = 200000
NODE_IFNAME = "eth0"
NETNS_ETC = "/etc/netns"
ROOT_MESSAGE = "needs root (CAP_NET_ADMIN) to create network namespaces"

Command = Union[str, Sequence[str]]

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)\s*$", re.IGNORECASE)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_STALE_RE = re.compile(r"^%s(\d+)(?:c\d+)?(?:n\d+|sw|probe)$" % NAME_PREFIX)
_counter = itertools.count()


def parse_rate(rate: Optional[str]) -> Optional[float]:
    """Bits per second of a tc rate string (``100mbit``, ``1gbit``, ``10mbps``).

    ``None``, ``"none"``, ``"unlimited"`` and ``"0"`` mean unshaped and give None.
    As in tc, ``bit`` units are bits/s and ``bps`` units are bytes/s; k/m/g/t are
    powers of 1000.
    """
    if rate is None or str(rate).strip().lower() in ("", "none", "unlimited", "unshaped", "0"):
        return None
    m = _RATE_RE.match(str(rate))
    if not m:
        raise ValueError(f"bad rate {rate!r}: use a tc rate such as 100mbit, 1gbit, 500kbit "
                         "or 'none' for an unshaped link")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if m.group(3).lower() == "bps":
        value *= 8
    if value <= 0:
        raise ValueError(f"bad rate {rate!r}: must be positive")
    return value


def _check_size(size: str) -> str:
    if not _SIZE_RE.match(str(size)):
        raise ValueError(f"bad size {size!r}: use a tc size such as 2m, 64k or 15000")
    return str(size).strip()


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def check_prerequisites() -> None:
    """Raise ClusterError unless we are root and ``ip`` and ``tc`` are installed."""
    if os.geteuid() != 0:
        raise ClusterError(f"{ROOT_MESSAGE}; run as root (e.g. with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: install iproute2")


def list_namespaces() -> List[str]:
    """Names of the network namespaces registered under /var/run/netns."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def namespaces_available() -> "tuple[bool, str]":
    """Whether network namespaces can be created here, and why not if they cannot."""
    try:
        check_prerequisites()
    except ClusterError as e:
        return False, str(e)
    name = f"{NAME_PREFIX}{os.getpid()}probe"
    proc = _run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
        return False, (f"`ip netns add` failed: {proc.stderr.strip()} ({ROOT_MESSAGE}, "
                       "and a writable /var/run/netns)")
    _run(["ip", "netns", "delete", name], check=False)
    return True, ""


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _netns_pids(name: str) -> List[int]:
    proc = _run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def _kill_namespace_processes(names: Sequence[str], grace: float) -> None:
    """SIGTERM, then after ``grace`` seconds SIGKILL, every process inside ``names``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = [pid for name in names for pid in _netns_pids(name)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(_netns_pids(name) for name in names):
                return
            time.sleep(0.05)


def cleanup_stale(prefix: str = NAME_PREFIX, grace: float = 2.0) -> List[str]:
    """Delete namespaces left by earlier invocations that were killed with SIGKILL.

    Only namespaces named like ours (``twp<pid>n<k>``, ``twp<pid>sw``, optionally
    with ``c<i>`` after the pid) whose creating process no longer exists are
    touched.  Processes still running inside them are killed first.  Returns
    the deleted names.
    """
    stale = []
    for name in list_namespaces():
        m = _STALE_RE.match(name)
        if m and name.startswith(prefix) and not _pid_alive(int(m.group(1))):
            stale.append(name)
    _kill_namespace_processes(stale, grace)
    for name in stale:
        _run(["ip", "netns", "delete", name], check=False)
        _remove_etc(name)
    return stale


def _remove_etc(name: str) -> None:
    """Remove /etc/netns/NAME (the per-namespace hosts file) and /etc/netns if left empty."""
    path = os.path.join(NETNS_ETC, name)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.rmdir(NETNS_ETC)
        except OSError:
            pass


def _set_pdeathsig() -> None:
    """In the child before exec: get SIGTERM if the launching thread dies (e.g. SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _exit_code(returncode: int) -> int:
    """A shell-style exit status: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    address: str


class EmulatedCluster:
    """``nodes`` emulated nodes of ``ranks_per_node`` ranks, links shaped to ``rate``.

    Args:
        nodes: number of node namespaces (1..253).
        ranks_per_node: processes per node that ``run_torchrun`` starts.
        rate: tc rate of each node's link in each direction (``"100mbit"``,
            ``"1gbit"``); None or ``"none"`` leaves the links unshaped.
        burst: htb burst/cburst (bytes a link may send at once after being idle).
        shape_ingress: also shape the switch-side veth toward each node, so the
            node's incoming traffic is limited too (default True).
        subnet: first three octets of the /24 the nodes live on.
        master_port: port of torchrun's rendezvous store on node 0.
        prefix: namespace name prefix; default ``twp<pid>`` (``twp<pid>c<i>`` for
            the i-th further cluster of the same process).
        handle_signals: while the cluster exists, SIGINT raises KeyboardInterrupt
            and SIGTERM/SIGHUP raise SystemExit(128+signum) in the main thread,
            so that ``__exit__`` tears everything down.
        term_grace: seconds processes get between SIGTERM and SIGKILL at teardown.
        verbose: print every ip/tc command to stderr.
    """

    def __init__(self, nodes: int, ranks_per_node: int = 1, rate: Optional[str] = "1gbit", *,
                 burst: str = DEFAULT_BURST, shape_ingress: bool = True,
                 subnet: str = DEFAULT_SUBNET, master_port: int = DEFAULT_MASTER_PORT,
                 prefix: Optional[str] = None, handle_signals: bool = True,
                 term_grace: float = 5.0, verbose: bool = False):
        if not 1 <= int(nodes) <= 253:
            raise ValueError("nodes must be between 1 and 253")
        if int(ranks_per_node) < 1:
            raise ValueError("ranks_per_node must be >= 1")
        octets = subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet must be three octets such as 10.77.0, not {subnet!r}")
        self.nodes = int(nodes)
        self.ranks_per_node = int(ranks_per_node)
        self.rate = None if parse_rate(rate) is None else str(rate).strip()
        self.rate_bps = parse_rate(rate)
        self.burst = _check_size(burst)
        self.shape_ingress = shape_ingress
        self.subnet = subnet
        self.master_port = int(master_port)
        if prefix is None:
            i = next(_counter)
            prefix = f"{NAME_PREFIX}{os.getpid()}" + (f"c{i}" if i else "")
        if not re.match(r"^[A-Za-z0-9_-]{1,40}$", prefix):
            raise ValueError(f"bad namespace prefix {prefix!r}")
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.node_list = [Node(k, f"{prefix}n{k}", f"{subnet}.{k + 1}") for k in range(self.nodes)]
        self.handle_signals = handle_signals
        self.term_grace = float(term_grace)
        self.verbose = verbose
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._old_handlers: Dict[int, object] = {}
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

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node(self, node: Union[int, Node]) -> Node:
        return node if isinstance(node, Node) else self.node_list[int(node)]

    # ------------------------------------------------------------- lifecycle
    def __enter__(self) -> "EmulatedCluster":
        self._install_signal_handlers()
        try:
            self.setup()
        except BaseException:
            self.teardown()  # also restores the signal handlers
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.teardown()

    def _ip(self, *args: str) -> None:
        self._cmd(["ip", *args])

    def _cmd(self, argv: List[str]) -> None:
        if self.verbose:
            print("+ " + shlex.join(argv), file=sys.stderr, flush=True)
        _run(argv)

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
        proc = _run(["ip", "netns", "add", name], check=False)
        if proc.returncode != 0:
            raise ClusterError(f"`ip netns add {name}` failed: {proc.stderr.strip()} "
                               f"({ROOT_MESSAGE})")
        self._created.append(name)

    def _links(self):
        for node in self.node_list:
            yield node.namespace, NODE_IFNAME
            if self.shape_ingress:
                yield self.switch, f"v{node.index}"

    def _apply_rate(self, rate: Optional[str], first: bool = False) -> None:
        for ns, dev in self._links():
            if not first:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is None:
                continue
            self._cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                       "htb", "default", "10"])
            self._cmd(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid",
                       "1:10", "htb", "rate", rate, "ceil", rate, "burst", self.burst,
                       "cburst", self.burst, "quantum", str(HTB_QUANTUM)])

    def set_rate(self, rate: Optional[str]) -> None:
        """Change the rate of every node link (None or "none": unshaped)."""
        bps = parse_rate(rate)
        self.rate = None if bps is None else str(rate).strip()
        self.rate_bps = bps
        if self._up:
            self._apply_rate(self.rate)

    def teardown(self) -> None:
        """Stop every process started in the cluster and delete its namespaces.

        Idempotent; signals arriving meanwhile are deferred until it is done.
        """
        with self._lock:
            deferred = self._defer_signals()
            try:
                self._stop_processes()
                if self._created:
                    _kill_namespace_processes(self._created, self.term_grace)
                for name in reversed(self._created):
                    _run(["ip", "netns", "delete", name], check=False)
                    _remove_etc(name)
                left = set(list_namespaces()) & set(self._created) if self._created else set()
                self._created = [n for n in self._created if n in left]
                self._up = False
                atexit.unregister(self.teardown)
                if left:
                    print(f"emulated_cluster: could not delete network namespaces "
                          f"{', '.join(sorted(left))}", file=sys.stderr)
            finally:
                self._restore_signal_handlers(deferred)

    # ---------------------------------------------------------------- signals
    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _defer_signals(self) -> Optional[Dict[int, object]]:
        if threading.current_thread() is not threading.main_thread():
            return None
        saved = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            saved[sig] = signal.signal(sig, lambda signum, frame: None)
        return saved

    def _restore_signal_handlers(self, deferred: Optional[Dict[int, object]]) -> None:
        if deferred is None:
            return
        for sig, old in deferred.items():
            signal.signal(sig, old)
        if not self._up:
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers = {}

    # -------------------------------------------------------------- processes
    def node_env(self, node: Union[int, Node]) -> Dict[str, str]:
        """Variables set for every process started in ``node``."""
        n = self.node(node)
        return {
            "GLOO_SOCKET_IFNAME": NODE_IFNAME,
            "TP_SOCKET_IFNAME": NODE_IFNAME,
            "EMULATED_CLUSTER": "1",
            "EMULATED_NNODES": str(self.nodes),
            "EMULATED_NODE_RANK": str(n.index),
            "EMULATED_NODE_ADDR": n.address,
            "EMULATED_NODE_ADDRS": ",".join(self.addresses),
            "EMULATED_MASTER_ADDR": self.master_addr,
            "EMULATED_RANKS_PER_NODE": str(self.ranks_per_node),
            "EMULATED_RATE": self.rate or "none",
            "EMULATED_NAMESPACE": n.namespace,
        }

    def command(self, node: Union[int, Node], cmd: Command) -> List[str]:
        """argv that runs ``cmd`` (argv list, or a string for ``sh -c``) inside ``node``."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else [str(c) for c in cmd]
        if not argv:
            raise ValueError("empty command")
        return ["ip", "netns", "exec", self.node(node).namespace, *argv]

    def popen(self, node: Union[int, Node], cmd: Command, env: Optional[Mapping[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in ``node`` (own process group); teardown stops it."""
        if not self._up:
            raise ClusterError("the emulated cluster is not set up (use it as a context manager)")
        full_env = dict(os.environ)
        full_env.update(self.node_env(node))
        if env:
            full_env.update({k: str(v) for k, v in env.items()})
        kwargs.setdefault("start_new_session", True)
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG fires when the launching *thread* ends: main thread only.
            kwargs.setdefault("preexec_fn", _set_pdeathsig)
        proc = subprocess.Popen(self.command(node, cmd), env=full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def exec(self, node: Union[int, Node], cmd: Command, env: Optional[Mapping[str, str]] = None,
             timeout: Optional[float] = None, capture_output: bool = False,
             input: Optional[str] = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``cmd`` in ``node`` and wait; returns a CompletedProcess (text output).

        On timeout the process is stopped and subprocess.TimeoutExpired raised.
        """
        pipe = subprocess.PIPE if capture_output else None
        proc = self.popen(node, cmd, env=env, stdout=pipe, stderr=pipe, text=True,
                          stdin=subprocess.PIPE if input is not None else None)
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except BaseException:
            self._terminate(proc)
            raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def run_each(self, cmd: Union[Command, Callable[[Node], Command]],
                 env: Optional[Mapping[str, str]] = None, nodes: Optional[Sequence[int]] = None,
                 timeout: Optional[float] = None, fail_grace: float = 10.0,
                 tag_output: bool = False) -> int:
        """Run a command in every node (or those in ``nodes``) at once and wait for all.

        ``cmd`` is an argv list, a shell string, or a function of the Node giving
        one.  When one node's command fails, the others get ``fail_grace``
        seconds to finish and are then stopped (a rank waiting for a dead peer
        could otherwise hang until its collective timeout).  Returns 0, the
        exit status of the first command that failed (128+N if killed by signal
        N), or 124 on timeout.
        """
        targets = [self.node(k) for k in (range(self.nodes) if nodes is None else nodes)]
        procs, pumps = [], []
        for n in targets:
            c = cmd(n) if callable(cmd) else cmd
            if tag_output:
                p = self.popen(n, c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                t = threading.Thread(target=_pump, args=(p.stdout, f"[node {n.index}] "),
                                     daemon=True)
                t.start()
                pumps.append(t)
            else:
                p = self.popen(n, c, env=env)
            procs.append(p)
        rc = self._wait_all(procs, timeout, fail_grace)
        for t in pumps:
            t.join(timeout=5)
        return rc

    def torchrun_command(self, node: Union[int, Node], script_args: Sequence[str],
                         python: Optional[str] = None,
                         torchrun_args: Sequence[str] = ()) -> List[str]:
        """The ``python -m torch.distributed.run`` argv for ``node``."""
        n = self.node(node)
        return [python or sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(self.nodes), "--node-rank", str(n.index),
                "--nproc-per-node", str(self.ranks_per_node),
                "--master-addr", self.master_addr, "--master-port", str(self.master_port),
                *torchrun_args, *[str(a) for a in script_args]]

    def run_torchrun(self, script_args: Sequence[str], env: Optional[Mapping[str, str]] = None,
                     timeout: Optional[float] = None, fail_grace: float = 10.0,
                     python: Optional[str] = None, torchrun_args: Sequence[str] = (),
                     tag_output: bool = False) -> int:
        """Run ``script_args`` (script path and its arguments) with torchrun on every node.

        Node k runs ``torchrun --nnodes N --node-rank k --nproc-per-node M
        --master-addr <node 0> --master-port P`` in its namespace, with
        ``GLOO_SOCKET_IFNAME=eth0``.  Returns as ``run_each``.
        """
        if not script_args:
            raise ValueError("no script given")
        return self.run_each(lambda n: self.torchrun_command(n, script_args, python, torchrun_args),
                             env=env, timeout=timeout, fail_grace=fail_grace,
                             tag_output=tag_output)

    def _wait_all(self, procs: List[subprocess.Popen], timeout: Optional[float],
                  fail_grace: float) -> int:
        start = time.monotonic()
        first_failure: Optional[int] = None
        failed_at = 0.0
        try:
            while True:
                codes = [p.poll() for p in procs]
                for c in codes:
                    if c not in (None, 0) and first_failure is None:
                        first_failure, failed_at = _exit_code(c), time.monotonic()
                if all(c is not None for c in codes):
                    return first_failure or 0
                now = time.monotonic()
                if first_failure is not None and now - failed_at > fail_grace:
                    print(f"emulated_cluster: a node failed with exit status {first_failure}; "
                          "stopping the others", file=sys.stderr, flush=True)
                    self._terminate_all(procs)
                    return first_failure
                if timeout is not None and now - start > timeout:
                    print(f"emulated_cluster: timed out after {timeout:g} s; stopping",
                          file=sys.stderr, flush=True)
                    self._terminate_all(procs)
                    return 124
                time.sleep(0.05)
        except BaseException:
            self._terminate_all(procs)
            raise

    def _terminate(self, proc: subprocess.Popen, grace: Optional[float] = None) -> None:
        self._terminate_all([proc], grace)

    def _terminate_all(self, procs: Sequence[subprocess.Popen],
                       grace: Optional[float] = None) -> None:
        """SIGTERM the process groups of ``procs``, SIGKILL what is left after ``grace`` s."""
        grace = self.term_grace if grace is None else grace
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                return
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            for p in alive:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def _stop_processes(self) -> None:
        procs, self._procs = self._procs, []
        self._terminate_all(procs)

    # ------------------------------------------------------------ statistics
    def link_bytes(self, node: Union[int, Node]) -> Dict[str, Dict[str, int]]:
        """rx/tx byte counters of ``eth0`` (between nodes) and ``lo`` (inside) of ``node``."""
        ns = self.node(node).namespace
        proc = _run(["ip", "-n", ns, "-s", "-j", "link", "show"])
        out = {}
        for link in json.loads(proc.stdout):
            stats = link.get("stats64") or link.get("stats") or {}
            out[link["ifname"]] = {"rx_bytes": int(stats.get("rx", {}).get("bytes", 0)),
                                   "tx_bytes": int(stats.get("tx", {}).get("bytes", 0))}
        return out

    def describe(self) -> str:
        rate = self.rate or "unshaped"
        lines = [f"emulated cluster: {self.nodes} node(s) x {self.ranks_per_node} rank(s), "
                 f"links {rate}" + (f" (htb burst {self.burst})" if self.rate else "")
                 + ("" if self.shape_ingress or not self.rate else ", egress only")]
        for n in self.node_list:
            lines.append(f"  node {n.index}: namespace {n.namespace}, {NODE_IFNAME} {n.address}/24")
        lines.append(f"  switch: namespace {self.switch}, bridge br0")
        return "\n".join(lines)


def _pump(stream, tag: str) -> None:
    out = getattr(sys.stdout, "buffer", None)
    for line in iter(stream.readline, b""):
        data = tag.encode() + line
        if out is not None:
            out.write(data)
            out.flush()
        else:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
    stream.close()


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


def measure_throughput(cluster: EmulatedCluster, src: int, dst: int, nbytes: int,
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
        skip = min(nbytes // 2, _size_bytes(cluster.burst) + (1 << 20))
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
        cluster._terminate(receiver, grace=1.0)
    r = json.loads(out.strip().splitlines()[-1])
    return {"bits_per_s": 8 * r["steady_bytes"] / max(r["steady_seconds"], 1e-9),
            "total_bits_per_s": 8 * r["bytes"] / max(r["seconds"], 1e-9),
            "bytes": r["bytes"], "seconds": r["seconds"]}


def _size_bytes(size: str) -> int:
    m = _SIZE_RE.match(str(size))
    if not m:
        raise ValueError(f"bad size {size!r}")
    return int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def format_rate(bits_per_s: Optional[float]) -> str:
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"
