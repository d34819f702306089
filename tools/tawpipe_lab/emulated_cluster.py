"""An emulated multi-node cluster inside one Linux machine: torchrun (or any command) on every node.

The nodes are network namespaces joined by shaped links (:mod:`.node_network` says how, and why
two ranks of one node talk over ``lo``); :class:`EmulatedCluster` adds the processes: a command in
one node (``exec``, ``popen``), in every node at once (``run_each``), or torchrun of a script with
``--nnodes N --nproc-per-node M`` (``run_torchrun``).

Use::

    with EmulatedCluster(nodes=2, ranks_per_node=2, rate="100mbit") as cluster:
        rc = cluster.run_torchrun(["pretrain_llama.py", "--train-iters", "3", "--lr", "1e-4", "--mock-data",
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])
        cluster.exec(1, ["python", "-c", "print('hello from node 1')"])

Everything is torn down in ``__exit__`` (also after an exception, SIGINT or
SIGTERM while inside the ``with`` block): processes still running in the
node namespaces are terminated, then the namespaces (and with them the veths
and the bridge) are deleted.  :func:`.netns.cleanup_stale` removes what a killed
(SIGKILL) invocation may have left behind.

Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` and ``tc``
programs.  No torch.  The ``ip``/``tc`` commands are in :mod:`.netns`, waiting
for and stopping processes in :mod:`.subprocesses`, the throughput probe in
:mod:`.link_probe`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from tawpipe_lab.netns import kill_namespace_processes, netns_pids
from tawpipe_lab.node_network import DEFAULT_SUBNET, NODE_IFNAME, Node, NodeNetwork
from megatron_tawpipe.bench.subprocesses import TeardownSignals, pump, set_pdeathsig, terminate_all, wait_all
from megatron_tawpipe.common.errors import ClusterError

__all__ = ["DEFAULT_MASTER_PORT", "EmulatedCluster", "Node"]

DEFAULT_MASTER_PORT = 29500

Command = Union[str, Sequence[str]]


class EmulatedCluster(NodeNetwork):
    """``nodes`` emulated nodes of ``ranks_per_node`` ranks, links shaped to ``rate``.

    Args (``nodes``, ``rate``, ``burst``, ``shape_ingress``, ``subnet``: as :class:`NodeNetwork`):
        ranks_per_node: processes per node that ``run_torchrun`` starts.
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
                 burst: Optional[str] = None, shape_ingress: bool = True,
                 subnet: str = DEFAULT_SUBNET, master_port: int = DEFAULT_MASTER_PORT,
                 prefix: Optional[str] = None, handle_signals: bool = True,
                 term_grace: float = 5.0, verbose: bool = False):
        if int(ranks_per_node) < 1:
            raise ValueError("ranks_per_node must be >= 1")
        super().__init__(nodes, rate, burst=burst, shape_ingress=shape_ingress, subnet=subnet,
                         prefix=prefix, term_grace=term_grace, verbose=verbose)
        self.ranks_per_node = int(ranks_per_node)
        self.master_port = int(master_port)
        self.handle_signals = handle_signals
        self._signals = TeardownSignals()
        self._procs: List[subprocess.Popen] = []
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    # ------------------------------------------------------------- lifecycle
    def __enter__(self) -> "EmulatedCluster":
        if self.handle_signals:
            self._signals.install()
        try:
            self.setup()
        except BaseException:
            self.teardown()  # also restores the signal handlers
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Stop every process started in the cluster and delete its namespaces.

        Idempotent; signals arriving meanwhile are deferred until it is done.
        """
        with self._lock:
            deferred = self._signals.defer()
            try:
                self._stop_processes()
                self._delete_namespaces()
            finally:
                self._signals.restore(deferred, uninstall=not self._up)

    def describe(self) -> str:
        return (f"emulated cluster: {self.nodes} node(s) x {self.ranks_per_node} rank(s), "
                + super().describe())

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
            kwargs.setdefault("preexec_fn", set_pdeathsig)
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
            terminate_all([proc], self.term_grace)
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
                t = threading.Thread(target=pump, args=(p.stdout, f"[node {n.index}] "),
                                     daemon=True)
                t.start()
                pumps.append(t)
            else:
                p = self.popen(n, c, env=env)
            procs.append(p)
        rc = wait_all(procs, timeout, fail_grace, self.term_grace)
        for t in pumps:
            t.join(timeout=5)
        return rc

    def torchrun_command(self, node: Union[int, Node], script_args: Sequence[str],
                         python: Optional[str] = None,
                         torchrun_args: Union[Sequence[str], Callable[[int], Sequence[str]]] = (),
                         master_port: Optional[int] = None) -> List[str]:
        """The ``python -m torch.distributed.run`` argv for ``node`` (``torchrun_args``: a list, or a
        function of the node's index giving one; ``master_port``: this run's, default the cluster's)."""
        n = self.node(node)
        extra = torchrun_args(n.index) if callable(torchrun_args) else torchrun_args
        port = self.master_port if master_port is None else int(master_port)
        return [python or sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(self.nodes), "--node-rank", str(n.index),
                "--nproc-per-node", str(self.ranks_per_node),
                "--master-addr", self.master_addr, "--master-port", str(port),
                *[str(a) for a in extra], *[str(a) for a in script_args]]

    def run_torchrun(self, script_args: Sequence[str], env: Optional[Mapping[str, str]] = None,
                     timeout: Optional[float] = None, fail_grace: float = 10.0,
                     python: Optional[str] = None,
                     torchrun_args: Union[Sequence[str], Callable[[int], Sequence[str]]] = (),
                     tag_output: bool = False, master_port: Optional[int] = None) -> int:
        """Run ``script_args`` (script path and its arguments) with torchrun on every node.

        Node k runs ``torchrun --nnodes N --node-rank k --nproc-per-node M
        --master-addr <node 0> --master-port P`` in its namespace, with
        ``GLOO_SOCKET_IFNAME=eth0``.  Returns as ``run_each``.  Runs one after another in one
        cluster should each get their own ``master_port``: the previous run's store socket may still
        be in TIME_WAIT.
        """
        if not script_args:
            raise ValueError("no script given")
        return self.run_each(lambda n: self.torchrun_command(n, script_args, python, torchrun_args, master_port),
                             env=env, timeout=timeout, fail_grace=fail_grace,
                             tag_output=tag_output)

    def stop_leftovers(self) -> int:
        """Stop every process still running in the node namespaces (SIGTERM, then SIGKILL after
        ``term_grace``) and wait until none is left; returns how many there were."""
        names = [n.namespace for n in self.node_list]
        found = sum(len(netns_pids(name)) for name in names)
        if found:
            kill_namespace_processes(names, self.term_grace)
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None]
        return found

    def _stop_processes(self) -> None:
        procs, self._procs = self._procs, []
        terminate_all(procs, self.term_grace)
