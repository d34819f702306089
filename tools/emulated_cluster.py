#!/usr/bin/env python
"""Run a command on an emulated multi-node cluster inside this machine (needs root).

Creates NODES network namespaces (one per emulated node, addresses
10.77.0.1, 10.77.0.2, ...) joined by veth pairs to a bridge in a switch
namespace, shapes each node's link to RATE in both directions with htb, runs
the command, and deletes everything afterwards: on success, on failure, on
Ctrl-C and on SIGTERM.  Nothing in the machine's own (root) network namespace
is touched and no traffic leaves the machine.

Default mode: torchrun on every node.  Node k runs, in its namespace,

    python -m torch.distributed.run --nnodes NODES --node-rank k \\
        --nproc-per-node RANKS_PER_NODE --master-addr 10.77.0.1 --master-port PORT \\
        COMMAND...

with GLOO_SOCKET_IFNAME=eth0, e.g.

    tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 100mbit -- \\
        pretrain_llama.py --pipeline-schedule tawpipe --mock-data ...

--each-node runs COMMAND itself (no torchrun) in every node, e.g. for
benchmarks of your own; these variables tell it where it runs:
EMULATED_NODE_RANK, EMULATED_NNODES, EMULATED_NODE_ADDR, EMULATED_NODE_ADDRS
(comma-separated), EMULATED_MASTER_ADDR, EMULATED_RANKS_PER_NODE,
EMULATED_RATE, EMULATED_NAMESPACE.

--measure (without a command) reports the throughput of one TCP stream
between node 0 and node 1 and inside node 0.

Traffic between ranks of the same node is not shaped: all ranks of a node
bind to its eth0 address (GLOO_SOCKET_IFNAME=eth0), and the kernel delivers
packets addressed to the namespace's own address over lo, never through
eth0's qdisc.  Only traffic to another node crosses the shaped link, which
all ranks of a node share like one NIC.

Inside a node, /etc/hosts (a file /etc/netns/<namespace>/hosts that ip netns
exec mounts there, deleted at teardown) maps the machine's hostname to the
node's address and each node's namespace name to its address, as DNS is not
reachable from the namespaces.

torchrun may log "Error waiting on exit barrier ... Failed to recv" on a node
other than 0 after training has finished: node 0's agent hosts the rendezvous
store and can exit before the others have read the barrier's last key
(pytorch/pytorch#69520; real clusters see it too).  It does not change the
exit status.

Latency cannot be emulated: the kernel has no netem (no sch_netem module),
so only bandwidth is shaped.  htb lets a link that has been idle send BURST
bytes at once before the rate applies.  By default BURST is what the link
sends in 500 us at RATE, at least 8k (1gbit: 62k): 4x the smallest bucket
that kept 1-2 gbit at full rate (a smaller one loses tokens when
htb's timer wakes up late), so a pipeline's 1-3 MB messages after idle go
at most a few percent faster than RATE (a 2m bucket sent a 3 MB message
after idle at ~3x the rate).

    emulated_cluster.py burst-sweep --rates 200mbit,500mbit,1gbit,2gbit \\
        --realtime-rates 1gbit,2gbit --json examples/results/link_burst.json

measures, for each rate and burst, the steady throughput and the rate single
1 MB and 3 MB messages see after the link was idle (burst-sweep --help).

The exit status is the command's (the first failing node's; 128+N if it was
killed by signal N), 124 on --timeout, 130 after Ctrl-C, 1 if the cluster
could not be created.  Namespaces are named twp<pid>n<k> and twp<pid>sw;
--cleanup-stale deletes those of invocations that were killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

try:
    import megatron_tawpipe  # noqa: F401  (installed, or found below)
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tawpipe_lab.emulated_cluster import DEFAULT_MASTER_PORT, EmulatedCluster  # noqa: E402
from tawpipe_lab.link_probe import format_rate, measure_throughput  # noqa: E402
from tawpipe_lab.netns import check_prerequisites, cleanup_stale  # noqa: E402
from tawpipe_lab.node_network import DEFAULT_BURST_RULE, DEFAULT_SUBNET, default_burst  # noqa: E402
from megatron_tawpipe.common.errors import ClusterError  # noqa: E402
from megatron_tawpipe.common.units import parse_tc_rate  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emulated_cluster.py", description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] -- COMMAND [ARGS...]")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="torchrun --nproc-per-node (default 1)")
    p.add_argument("--rate", default="1gbit",
                   help="link rate of each node, each direction, as tc writes it: 100mbit, "
                        "1gbit, ... (tc's 'bps' is BYTES/s: 10mbps = 80mbit); 'none' for "
                        "unshaped links (default 1gbit)")
    p.add_argument("--burst", default=None,
                   help=f"htb burst and cburst, a tc size (64k, 2m); default: "
                        f"{DEFAULT_BURST_RULE} (burst-sweep), e.g. {default_burst(1e9)} at 1gbit")
    p.add_argument("--egress-only", action="store_true",
                   help="shape only what nodes send, not also what they receive")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                   help=f"torchrun rendezvous port on node 0 (default {DEFAULT_MASTER_PORT})")
    p.add_argument("--subnet", default=DEFAULT_SUBNET,
                   help=f"first three octets of the nodes' /24 (default {DEFAULT_SUBNET})")
    p.add_argument("--each-node", action="store_true",
                   help="run COMMAND as is in every node instead of torchrun")
    p.add_argument("--node", type=int, action="append", dest="only_nodes", metavar="K",
                   help="with --each-node: only in node K (repeatable)")
    p.add_argument("--torchrun-args", default="",
                   help="extra torchrun options, one string (e.g. \"--max-restarts 0\")")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter that runs torchrun (default: this one)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop everything after this many seconds (exit status 124)")
    p.add_argument("--fail-grace", type=float, default=10.0,
                   help="seconds the other nodes get to finish once one has failed (default 10)")
    p.add_argument("--tag-output", action="store_true",
                   help="prefix every output line with [node K]")
    p.add_argument("--measure", action="store_true",
                   help="measure node 0 -> node 1 and intra-node throughput first")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="delete namespaces left by killed invocations, then run COMMAND if any")
    p.add_argument("-v", "--verbose", action="store_true", help="print every ip/tc command")
    p.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _measure(cluster: EmulatedCluster) -> None:
    bits = cluster.rate_bits_per_s
    if cluster.nodes >= 2:
        nbytes = int(min(bits * 2 / 8, 500e6)) + (4 << 20) if bits else 500_000_000
        r = measure_throughput(cluster, 0, 1, nbytes)
        print(f"node 0 -> node 1: {format_rate(r['bits_per_s'])} "
              f"(configured {format_rate(bits)}; {r['bytes'] / 1e6:.0f} MB in {r['seconds']:.2f} s)",
              flush=True)
    r = measure_throughput(cluster, 0, 0, 500_000_000)
    print(f"inside node 0 (lo): {format_rate(r['bits_per_s'])}", flush=True)


def build_sweep_parser() -> argparse.ArgumentParser:
    from tawpipe_lab import link_burst

    p = argparse.ArgumentParser(
        prog="emulated_cluster.py burst-sweep",
        description="Measure a two-node link for each rate x htb burst: the steady throughput of a long "
                    "transfer and the rate single messages see after the link was idle (relative to "
                    "the shaped rate; TCP payload is at most "
                    f"{link_burst.PAYLOAD_SHARE:.4f} of it). Needs root.")
    p.add_argument("--rates", default=",".join(link_burst.DEFAULT_RATES),
                   help="comma-separated tc rates (default %(default)s)")
    p.add_argument("--bursts", default=",".join(link_burst.DEFAULT_BURSTS),
                   help="comma-separated tc sizes, 'default' for the links' default at each rate "
                        "(default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; medians kept (default 3)")
    p.add_argument("--idle", type=float, default=1.0, help="seconds idle before each message (default 1)")
    p.add_argument("--steady", type=float, default=0.5,
                   help="seconds at the rate of each steady transfer (default 0.5)")
    p.add_argument("--realtime-rates", default="",
                   help="comma-separated tc rates whose steady throughput is measured again with the "
                        "probe processes at real-time priority (chrt -f 50), for each burst")
    p.add_argument("--json", default=None, help="write the result here")
    return p


def sweep_main(argv) -> int:
    import json

    from tawpipe_lab import link_burst

    args = build_sweep_parser().parse_args(argv)
    try:
        check_prerequisites()
    except ClusterError as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 1
    try:
        result = link_burst.sweep([r for r in args.rates.split(",") if r], [b for b in args.bursts.split(",") if b],
                                  repeats=args.repeats, idle_s=args.idle, steady_s=args.steady,
                                  realtime_rates=[r for r in args.realtime_rates.split(",") if r],
                                  progress=lambda line: print(line, flush=True))
    except ValueError as e:
        build_sweep_parser().error(str(e))
    except ClusterError as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 1
    for key, what in (("smallest_sustaining_burst", ""), ("smallest_sustaining_burst_realtime", " (real-time probes)")):
        if result[key]:
            print(f"smallest burst sustaining the rate{what}: "
                  + ", ".join(f"{rate} {burst}" for rate, burst in result[key].items()))
    print("default rule: " + ", ".join(f"{rate} {burst}" for rate, burst in result["default_rule"]["bursts"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["burst-sweep"]:
        return sweep_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command and not (args.measure or args.cleanup_stale):
        parser.error("no command given (put it after --)")
    if args.only_nodes and not args.each_node:
        parser.error("--node only goes with --each-node")
    try:
        parse_tc_rate(args.rate)
    except ValueError as e:
        parser.error(str(e))
    try:
        check_prerequisites()
    except ClusterError as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 1
    if args.cleanup_stale:
        gone = cleanup_stale()
        print(f"emulated_cluster: deleted {len(gone)} stale namespace(s)"
              + (f": {' '.join(gone)}" if gone else ""), file=sys.stderr)
        if not command and not args.measure:
            return 0
    try:
        cluster = EmulatedCluster(args.nodes, args.ranks_per_node, args.rate, burst=args.burst,
                                  shape_ingress=not args.egress_only, subnet=args.subnet,
                                  master_port=args.master_port, verbose=args.verbose)
    except ValueError as e:
        parser.error(str(e))
    start = time.monotonic()
    try:
        with cluster:
            print(cluster.describe(), file=sys.stderr, flush=True)
            if args.measure:
                _measure(cluster)
            if not command:
                return 0
            if args.each_node:
                rc = cluster.run_each(command, nodes=args.only_nodes, timeout=args.timeout,
                                      fail_grace=args.fail_grace, tag_output=args.tag_output)
            else:
                rc = cluster.run_torchrun(command, timeout=args.timeout,
                                          fail_grace=args.fail_grace, python=args.python,
                                          torchrun_args=shlex.split(args.torchrun_args),
                                          tag_output=args.tag_output)
    except ClusterError as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("emulated_cluster: interrupted; cluster torn down", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e.code, int) and e.code > 128:
            print(f"emulated_cluster: terminated by signal {e.code - 128}; cluster torn down",
                  file=sys.stderr)
        raise
    print(f"emulated_cluster: exit status {rc} after {time.monotonic() - start:.1f} s; "
          "cluster torn down", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
