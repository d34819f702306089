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
from megatron_tawpipe.bench import emulated_cluster as ec
from megatron_tawpipe.bench import link_probe, netns
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
        importlib.import_module(f"megatron_tawpipe.bench.{module}").main(argv)
    return out.getvalue()


def test_link_duplex_times_every_pattern_on_four_ranks():
    """The gloo duplex measurement runs its four patterns (here on one machine's loopback) and
    reports rates and their ratios to one way alone."""
    from megatron_tawpipe.bench.link_duplex import patterns

    assert patterns(4)["both ways, two pairs"] == [(0, 2), (2, 0), (1, 3), (3, 1)]
    assert set(patterns(2)) == {"one way", "both ways, one pair"}
    printed = run_ranks(_printed_by_tool, 4, "link_duplex", ["--sizes", "65536,262144", "--messages", "2",
                                                             "--repeats", "1"])
    report = json.loads(printed[0])
    assert set(report["bytes_per_s"]) == set(patterns(4))
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
