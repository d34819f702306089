"""The emulated cluster (tools/emulated_cluster.py): shaping, intra-node path, teardown.

Needs root to create network namespaces; the tests that create any are skipped,
with the reason, where that is impossible.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from distributed_harness import run_ranks
from tawpipe_lab import emulated_cluster as ec
from tawpipe_lab import link_burst, link_probe, netns, node_network
from megatron_tawpipe.common.units import parse_tc_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "emulated_cluster.py")
MB = 1 << 20

AVAILABLE, REASON = netns.namespaces_available() if sys.platform.startswith("linux") else (False, "not Linux")
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=f"cannot create network namespaces: {REASON}")


def _ours(prefix):
    return [n for n in netns.list_namespaces() if n.startswith(prefix)]


# ---------------------------------------------------------------- no root needed

def test_parse_rate():
    assert parse_tc_rate("100mbit") == 100e6
    assert parse_tc_rate("1gbit") == 1e9
    assert parse_tc_rate("1.5Gbit") == 1.5e9
    assert parse_tc_rate("10mbps") == 80e6  # tc: bps = bytes per second
    assert parse_tc_rate("none") is None and parse_tc_rate(None) is None
    for bad in ("fast", "100", "-1mbit", "1 gigabit"):
        with pytest.raises(ValueError):
            parse_tc_rate(bad)


def test_says_it_needs_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ec.ClusterError, match=r"needs root \(CAP_NET_ADMIN\) to create network namespaces"):
        netns.check_prerequisites()
    spec = importlib.util.spec_from_file_location("emulated_cluster_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--nodes", "2", "--", "train.py"]) == 1
    assert "needs root (CAP_NET_ADMIN) to create network namespaces" in capsys.readouterr().err


# ------------------------------------------------------------------ with netns

@pytest.mark.timing
@needs_netns
def test_shaped_link_is_slower_than_unshaped_and_intra_node_is_not_shaped():
    rate = "50mbit"
    with ec.EmulatedCluster(nodes=2, ranks_per_node=1, rate=rate) as cluster:
        names = cluster.namespaces
        assert set(names) <= set(netns.list_namespaces())
        shaped = link_probe.measure_throughput(cluster, 0, 1, 8 * MB)["bits_per_s"]
        # The switch-side veth is shaped too: node 1 -> node 0 is limited as well.
        reverse = link_probe.measure_throughput(cluster, 1, 0, 6 * MB)["bits_per_s"]
        # Ranks of one node talk to the node's own eth0 address: lo, not the shaped eth0.
        before = cluster.link_bytes(0)
        intra = link_probe.measure_throughput(cluster, 0, 0, 64 * MB)["bits_per_s"]
        after = cluster.link_bytes(0)
        cluster.set_rate(None)
        unshaped = link_probe.measure_throughput(cluster, 0, 1, 64 * MB)["bits_per_s"]
    assert not set(names) & set(netns.list_namespaces())

    configured = parse_tc_rate(rate)
    print(f"shaped {shaped / 1e6:.1f} Mbit/s, reverse {reverse / 1e6:.1f} Mbit/s, "
          f"intra-node {intra / 1e9:.2f} Gbit/s, unshaped {unshaped / 1e9:.2f} Gbit/s")
    # htb counts Ethernet frames, TCP payload is ~95% of them.
    for measured in (shaped, reverse):
        assert 0.75 * configured < measured < 1.1 * configured
    assert unshaped > 10 * shaped
    assert intra > 10 * shaped
    assert after["lo"]["tx_bytes"] - before["lo"]["tx_bytes"] >= 64 * MB
    assert after["eth0"]["tx_bytes"] - before["eth0"]["tx_bytes"] < MB


@needs_netns
def test_torchrun_ranks_share_node_link_and_use_lo_inside_a_node(tmp_path):
    """2 nodes x 2 ranks with gloo: rank 0 -> 1 stays on lo, rank 0 -> 2 crosses eth0."""
    script = tmp_path / "probe.py"
    out = tmp_path / "probe.json"
    script.write_text(
        "import json, os, sys\n"
        "import torch, torch.distributed as dist\n"
        "def tx():\n"
        "    with open('/proc/net/dev') as f:\n"
        "        rows = [l.split(':', 1) for l in f.readlines()[2:]]\n"
        "    return {n.strip(): int(r.split()[8]) for n, r in rows}\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "where = [None] * dist.get_world_size()\n"
        "dist.all_gather_object(where, (rank, int(os.environ['EMULATED_NODE_RANK'])))\n"
        "big = torch.zeros(4_000_000)\n"
        "def phase(src, dst):\n"
        "    dist.barrier(); before = tx(); dist.barrier()\n"
        "    if rank == src: dist.send(big, dst)\n"
        "    elif rank == dst: dist.recv(big, src)\n"
        "    dist.barrier(); after = tx(); dist.barrier()\n"
        "    return {k: after[k] - before[k] for k in ('lo', 'eth0')}\n"
        "intra, cross = phase(0, 1), phase(0, 2)\n"
        "if rank == 0:\n"
        "    json.dump({'where': where, 'intra': intra, 'cross': cross}, open(sys.argv[1], 'w'))\n"
        "dist.destroy_process_group()\n")
    with ec.EmulatedCluster(nodes=2, ranks_per_node=2, rate="1gbit") as cluster:
        names = cluster.namespaces
        rc = cluster.run_torchrun([str(script), str(out)], env={"OMP_NUM_THREADS": "1"},
                                  timeout=120)
    assert not set(names) & set(netns.list_namespaces())
    assert rc == 0
    result = json.loads(out.read_text())
    assert [tuple(w) for w in result["where"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert result["intra"]["lo"] >= 16_000_000 and result["intra"]["eth0"] < 1_000_000
    assert result["cross"]["eth0"] >= 16_000_000 and result["cross"]["lo"] < 1_000_000


@needs_netns
def test_teardown_after_failure_and_exception():
    with ec.EmulatedCluster(nodes=2, ranks_per_node=1, rate="10mbit") as cluster:
        names = cluster.namespaces
        assert cluster.run_each(["sh", "-c", 'exit "$((3 + EMULATED_NODE_RANK))"'],
                                fail_grace=5) in (3, 4)
        assert cluster.exec(1, "exit 5").returncode == 5
    assert not set(names) & set(netns.list_namespaces())

    with pytest.raises(subprocess.CalledProcessError):
        with ec.EmulatedCluster(nodes=2, ranks_per_node=1, rate="10mbit") as cluster:
            names = cluster.namespaces
            sleeper = cluster.popen(1, ["sleep", "60"])
            cluster.exec(0, ["false"], check=True)
    assert sleeper.poll() is not None
    assert not set(names) & set(netns.list_namespaces())


@needs_netns
def test_teardown_when_setup_fails_half_way(monkeypatch):
    def broken(self, rate, first=False):
        raise ec.ClusterError("tc refused")

    monkeypatch.setattr(ec.EmulatedCluster, "_apply_rate", broken)
    cluster = ec.EmulatedCluster(nodes=2, ranks_per_node=1, rate="10mbit")
    with pytest.raises(ec.ClusterError, match="tc refused"):
        with cluster:
            pass
    assert not set(cluster.namespaces) & set(netns.list_namespaces())
    assert not any(os.path.exists(os.path.join(netns.NETNS_ETC, n)) for n in cluster.namespaces)


@needs_netns
def test_tool_returns_the_command_exit_status_and_cleans_up():
    proc = subprocess.Popen([sys.executable, TOOL, "--nodes", "2", "--rate", "100mbit", "--each-node",
                             "--", "sh", "-c", 'echo "node $EMULATED_NODE_RANK $EMULATED_NODE_ADDR"; exit 7'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert "node 0 10.77.0.1" in out and "node 1 10.77.0.2" in out
    assert f"namespace twp{proc.pid}n0" in err
    assert not _ours(f"twp{proc.pid}")


@needs_netns
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_tool_tears_down_on_signal(sig, code):
    proc = subprocess.Popen([sys.executable, TOOL, "--nodes", "2", "--each-node", "--",
                             "sh", "-c", "sleep 60 & sleep 60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f"twp{proc.pid}"
    deadline = time.monotonic() + 20
    pids = []
    while time.monotonic() < deadline and len(pids) < 4:
        pids = [p for n in _ours(prefix) for p in netns.netns_pids(n)]
        time.sleep(0.05)
    assert len(pids) >= 4, "the command did not start in both nodes"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert not _ours(prefix)
    time.sleep(0.1)
    assert not any(netns.pid_alive(p) for p in pids)


def _printed_by_tool(rank, module, argv):
    """What a bench tool's main prints on this rank."""
    import contextlib
    import importlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        importlib.import_module(f"tawpipe_lab.{module}").main(argv)
    return out.getvalue()


def test_link_duplex_times_every_pattern_on_four_ranks():
    """The gloo duplex measurement runs its patterns (here on one machine's loopback), one of them with a
    process group per direction, and reports rates and their ratios to one way alone."""
    from tawpipe_lab.link_duplex import DIRECTED, patterns

    assert patterns(4)["both ways, two pairs"] == [(0, 2), (2, 0), (1, 3), (3, 1)]
    assert set(patterns(2)) == {"one way", "both ways, one pair"}
    printed = run_ranks(_printed_by_tool, 4, "link_duplex", ["--sizes", "65536,262144", "--messages", "2",
                                                             "--repeats", "1"])
    report = json.loads(printed[0])
    assert set(report["bytes_per_s"]) == set(patterns(4)) | {DIRECTED}   # and each direction on its own group
    for name, rates in report["bytes_per_s"].items():
        assert set(rates) == {"65536", "262144"} and all(v > 0 for v in rates.values())
    assert report["over_one_way"]["one way"] == {"65536": 1.0, "262144": 1.0}
    assert printed[1:] == ["", "", ""]      # rank 0 reports


def test_fsdp_overhead_compares_fsdp2_with_its_bare_collectives():
    printed = run_ranks(_printed_by_tool, 2, "fsdp_overhead", ["--layers", "2", "--layer-params", "16384",
                                                               "--repeats", "2"])
    report = json.loads(printed[0])
    assert report["ranks"] == 2 and report["layer_params"] == 16384 and report["layer_bytes"] == 4 * 16384
    assert report["fsdp_s_per_layer_and_microbatch"] > 0 and report["bare_collectives_s"] > 0
    assert report["extra_s"] == pytest.approx(report["fsdp_s_per_layer_and_microbatch"] - report["bare_collectives_s"])
    assert printed[1] == ""


# ------------------------------------------------------------ the links' htb bucket

def test_default_burst_is_the_link_rate_times_a_fixed_time_with_a_floor():
    nb = node_network
    rates = [parse_tc_rate(r) for r in ("1mbit", "100mbit", "200mbit", "500mbit", "1gbit", "2gbit",
                                        "10gbit", "25gbit", "100gbit")]
    sizes = [netns.tc_size_bytes(nb.default_burst(r)) for r in rates]
    assert sizes == sorted(sizes)                                    # monotone in the rate
    for rate, size in zip(rates, sizes):
        assert netns.check_tc_size(nb.default_burst(rate)) == nb.default_burst(rate)
        assert size >= max(nb.MIN_BURST_BYTES, rate / 8 * nb.BURST_TIME_S)
        assert size < max(nb.MIN_BURST_BYTES, rate / 8 * nb.BURST_TIME_S) + 1024   # whole KiB, rounded up
        if rate <= 10e9:
            assert size <= netns.tc_size_bytes("2m")                 # never above the old default
    assert nb.default_burst(parse_tc_rate("1mbit")) == nb.default_burst(None) == "8k"   # the floor
    assert nb.default_burst(parse_tc_rate("1gbit")) == "62k"          # 500 us of 125 MB/s
    assert nb.default_burst(parse_tc_rate("2gbit")) == "123k"
    with pytest.raises(ValueError):
        nb.default_burst(0.0)


def test_node_network_uses_the_rule_unless_a_burst_is_given(monkeypatch):
    def commands(net):
        sent = []
        monkeypatch.setattr(net, "_cmd", sent.append)
        net._apply_rate(net.rate, first=True)
        return [" ".join(argv) for argv in sent]

    net = ec.EmulatedCluster(nodes=2, rate="1gbit")                  # nothing created before setup()
    assert net.burst == "62k" and net.burst_is_default
    assert "htb burst 62k, default: 500 us at the link rate" in net.describe()
    cmds = commands(net)
    assert len(cmds) == 8                                           # qdisc + class, 2 nodes, both ways
    assert (f"tc -n {net.prefix}n0 class add dev eth0 parent 1: classid 1:10 htb rate 1gbit ceil 1gbit "
            "burst 62k cburst 62k quantum 200000") in cmds
    assert f"tc -n {net.switch} qdisc add dev v1 root handle 1: htb default 10" in cmds
    net.set_rate("2gbit")                                           # the rule follows the rate
    assert net.burst == "123k" and all("burst 123k cburst 123k" in c for c in commands(net) if " class " in c)

    given = node_network.NodeNetwork(2, "1gbit", burst="2m", shape_ingress=False)
    assert given.burst == "2m" and not given.burst_is_default and "htb burst 2m, as given), egress only" in given.describe()
    given.set_rate("200mbit")
    cmds = commands(given)
    assert len(cmds) == 4 and all("burst 2m cburst 2m" in c for c in cmds if " class " in c)
    given.burst = None                                              # back to the rule
    assert given.burst == "13k"
    with pytest.raises(ValueError, match="bad size"):
        ec.EmulatedCluster(nodes=2, burst="2 megabytes")


def test_burst_sweep_needs_root_and_formats_its_table(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("emulated_cluster_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.build_parser().parse_args(["--", "x"]).burst is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert tool.main(["burst-sweep", "--rates", "1gbit", "--bursts", "16k"]) == 1
    assert "needs root" in capsys.readouterr().err
    facts = link_burst.machine_facts()
    assert facts["kernel"] and facts["cpus"] >= 1 and facts["date"]
    point = {"rate": "1gbit", "burst": "16k", "burst_us_at_rate": 131.1,
             "steady": {"over_rate": 0.952, "over_payload_limit": 0.995},
             "messages_after_idle": {"1MB": {"over_rate": 0.96}, "3MB": {"over_rate": 0.955}}}
    table = link_burst.format_table({"points": [point]}).splitlines()
    assert table[0].split() == ["rate", "burst", "us", "steady", "/limit", "1MB", "3MB"]
    assert table[1].split() == ["1gbit", "16k", "131.1", "0.952", "0.995", "0.960", "0.955"]
    steady_only = {k: v for k, v in point.items() if k != "messages_after_idle"}
    assert link_burst.format_table({"points": [dict(steady_only, default=True)]}, header=False).split() == [
        "1gbit", "16k*", "131.1", "0.952", "0.995"]               # the default; real-time points: no messages


@pytest.mark.timing
@needs_netns
def test_default_burst_keeps_the_rate_and_sends_no_message_faster():
    """With the default bucket a long transfer keeps the rate and a 3 MB message after idle takes
    at least ~95% of size / rate; with the old 2 MiB bucket it took about a third of that.  A busy
    machine only slows transfers down, so the fastest of a few runs is compared."""
    size = 3_000_000
    with ec.EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        bits = cluster.rate_bits_per_s
        steady = max(link_probe.measure_throughput(cluster, 0, 1, 48 * MB)["bits_per_s"] for _ in range(2))
        quick = link_probe.measure_messages(cluster, 0, 1, [size, size], idle_s=0.3)
        cluster.burst = "2m"
        cluster.set_rate("1gbit")
        old = link_probe.measure_messages(cluster, 0, 1, [size, size, size], idle_s=0.3)
    print(f"steady {steady / bits:.3f} of the rate; 3 MB after idle: {[round(8 * size / s / bits, 3) for s in quick]} "
          f"of the rate, with a 2m bucket {[round(8 * size / s / bits, 3) for s in old]}")
    assert 0.97 * link_burst.PAYLOAD_SHARE < steady / bits < 1.0
    assert min(quick) >= 0.95 * 8 * size / bits
    assert min(old) < 0.75 * 8 * size / bits


# ------------------------------------------------------------ bytes counted whole, against the interfaces

BYTES_MODEL = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
               "--lr", "3e-4", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
               "--ffn-hidden-size", "256", "--seq-length", "64", "--max-position-embeddings", "64",
               "--vocab-size", "1024", "--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1",
               "--global-batch-size", "8", "--log-interval", "1000", "--eval-interval", "1000"]


def _dead_pid():
    pid = 4_000_000
    while netns.pid_alive(pid):
        pid += 1
    return pid


@needs_netns
def test_counted_bytes_match_the_interfaces_and_the_plan(tmp_path):
    """Two strategies back to back on 2 nodes x 2 ranks (each on its own rendezvous port), after a namespace
    a killed run left behind: every collective's bytes, counted, are what the nodes' eth0 sent (within
    INTERFACE_TOLERANCE: headers, the rendezvous store); for TawPipe with the replicated first shard the
    count is the executor's plan transfers plus the replicated parameters' all-reduce through the nodes: each
    node's link 2(D-1)/D of their gradients (the all-reduce of each rank's half with its peer on the other node)."""
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, read_metrics, run_benchmark
    from megatron_tawpipe.bench.collective_bytes import INTERFACE_TOLERANCE
    from tawpipe_lab.benchmark_cluster import benchmark_cluster

    stale = f"twp{_dead_pid()}n0"
    netns.add_namespace(stale)
    lines = []
    config = BenchmarkConfig(schedules=("tawpipe-rep", "distopt-node"), ranks=4, cluster=(2, 2, "1gbit"),
                             repetitions=1, train_iters=3, warmup_iters=1, model_args=BYTES_MODEL,
                             outdir=str(tmp_path), timeout_s=240, env={"OMP_NUM_THREADS": "1"},
                             recompute=True)   # recompute pinned: the layout whose collectives are counted below
    try:
        result = run_benchmark(config, progress=lines.append, cluster=benchmark_cluster)
    finally:
        netns.delete_namespace(stale)
    assert any(stale in line and "left by killed runs" in line for line in lines)
    rows = {r["schedule"]: r for r in result["summary"]}
    for row in rows.values():
        counted, sent = row["inter_node_bytes_whole_run_per_iteration"], row["node_tx_bytes_per_iteration"]
        print(f"{row['schedule']}: counted {counted / 1e6:.2f} MB, eth0 {sent / 1e6:.2f} MB per iteration")
        assert counted > 1e6 and abs(sent / counted - 1) < INTERFACE_TOLERANCE
        assert row["inter_node_bytes_per_iteration"] > 0 and row["intra_node_bytes_per_iteration"] > 0
    taw = rows["tawpipe-rep"]
    plan = [r["planned_inter_group_bytes"] for r in read_metrics(result["runs"][0]["metrics_file"])][-1]
    formulas = taw["formulas_per_iteration"]
    # The replicated gradients each rank holds: what its node's all-gather (their last stage) returns to it,
    # the tied embedding (its vocabulary padded) and the final norm; the stage across the nodes moves 2(D-1)/D
    # of them per node (D = 2), nothing else spans all 4 ranks but the loss's and the norm's scalars.
    hidden, vocab = (int(BYTES_MODEL[BYTES_MODEL.index(flag) + 1]) for flag in ("--hidden-size", "--vocab-size"))
    (gathered,) = [f for f in formulas.values() if f["kind"] == "all_gather"]
    replicated = gathered["payload"] / 4
    assert gathered["inter"] == 0 and 4 * (vocab * hidden + hidden) <= replicated < 4 * (vocab + 256) * hidden
    everyone = sum(f["inter"] for f in formulas.values() if f["kind"] == "all_reduce" and f["members"] == 4)
    assert everyone < 1e-3 * replicated
    assert taw["inter_node_bytes_per_iteration"] == pytest.approx(plan + 2 * (2 - 1) * replicated + everyone,
                                                                  rel=1e-9)
    assert taw["inter_group_bytes"] == pytest.approx(plan)     # the executor's own count, kept beside
    # The distributed optimizer per node: its cross-instance all-reduce is between one rank of each node.
    cross = [f for f in rows["distopt-node"]["formulas_per_iteration"].values() if f["nodes"] == 2 and f["inter"] > 0]
    assert cross and all(f["members"] == 2 for f in cross if f["kind"] == "all_reduce" and f["payload"] > 1e5)


@needs_netns
def test_three_nodes_counted_collectives_match_their_interfaces(tmp_path):
    """3 nodes x 2 ranks: ranks 2k and 2k+1 sit on node k, and each collective's counted bytes (ring
    all-reduce, reduce-scatter, all-gather, a broadcast's binomial tree, a reduce, a group of one rank per
    node) are what the three eth0 sent."""
    script = tmp_path / "probe.py"
    out = tmp_path / "probe.json"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from megatron_tawpipe.bench.collective_bytes import CollectiveCounter\n"
        "counter = CollectiveCounter(int(os.environ['RANK']), int(os.environ['LOCAL_WORLD_SIZE'])).install()\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank, world = dist.get_rank(), dist.get_world_size()\n"
        "def tx():\n"
        "    with open('/proc/net/dev') as f:\n"
        "        rows = [l.split(':', 1) for l in f.readlines()[2:]]\n"
        "    return {n.strip(): int(r.split()[8]) for n, r in rows}['eth0']\n"
        "N = 1_200_000\n"
        "heads = dist.new_group([0, 2, 4])\n"
        "ops = {'all_reduce': lambda: dist.all_reduce(torch.ones(N)),\n"
        "       'reduce_scatter': lambda: dist.reduce_scatter_tensor(torch.zeros(N // world), torch.ones(N)),\n"
        "       'all_gather': lambda: dist.all_gather_into_tensor(torch.zeros(N), torch.ones(N // world)),\n"
        "       'broadcast': lambda: dist.broadcast(torch.ones(N), src=1),\n"
        "       'reduce': lambda: dist.reduce(torch.ones(N), dst=1),\n"
        "       'heads': lambda: dist.all_reduce(torch.ones(N), group=heads) if rank % 2 == 0 else None}\n"
        "where, result = [None] * world, {}\n"
        "dist.all_gather_object(where, (rank, int(os.environ['EMULATED_NODE_RANK'])))\n"
        "for name, op in ops.items():\n"
        "    dist.barrier(); before, counted = tx(), counter.totals['inter']; dist.barrier()\n"
        "    op()\n"
        "    dist.barrier(); after = tx(); mine = counter.totals['inter'] - counted; dist.barrier()\n"
        "    got = [None] * world\n"
        "    dist.all_gather_object(got, (after - before, mine))\n"
        "    result[name] = got\n"
        "if rank == 0:\n"
        "    json.dump({'where': where, 'result': result}, open(sys.argv[1], 'w'))\n"
        "dist.destroy_process_group()\n")
    with ec.EmulatedCluster(nodes=3, ranks_per_node=2, rate="1gbit") as cluster:
        names = cluster.namespaces
        assert len(names) == 4
        rc = cluster.run_torchrun([str(script), str(out)], env={"OMP_NUM_THREADS": "1"}, timeout=180,
                                  master_port=29611)
        assert cluster.stop_leftovers() == 0
    assert not set(names) & set(netns.list_namespaces())
    assert rc == 0
    data = json.loads(out.read_text())
    assert [tuple(w) for w in data["where"]] == [(r, r // 2) for r in range(6)]
    for name, per_rank in data["result"].items():
        sent = sum(tx for rank, (tx, _) in enumerate(per_rank) if rank % 2 == 0)   # one reading per node
        counted = sum(mine for _, mine in per_rank)
        print(f"{name}: eth0 {sent / 1e6:.2f} MB, counted {counted / 1e6:.2f} MB")
        assert counted > 1e6 and abs(sent / counted - 1) < 0.02
