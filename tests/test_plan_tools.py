"""tools/simulate.py and tools/plot_schedule.py from the command line."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--ranks", "8", "--groups", "2", "--num-layers", "16", "--hidden-size", "1024",
         "--seq-length", "4096", "--num-microbatches", "2", "--inter-bw", "1.25GB/s"]


def run_tool(name, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_simulate_json_has_one_row_per_schedule():
    rows = json.loads(run_tool("simulate.py", "--schedule", "tawpipe,weipipe,1f1b,interleaved,fsdp",
                               "--json", *SMALL))
    assert [r["schedule"] for r in rows] == ["tawpipe", "weipipe", "1f1b", "interleaved", "fsdp"]
    for r in rows:
        for key in ("tokens_per_sec_per_rank", "bubble_ratio", "inter_group_bytes",
                    "intra_group_bytes", "weight_buffers"):
            assert isinstance(r[key], (int, float)), key
        assert r["tokens_per_sec_per_rank"] > 0 and 0 <= r["bubble_ratio"] < 1


def test_simulate_table_and_ablation_flags():
    text = run_tool("simulate.py", "--schedule", "tawpipe,tawpipe-nooverlap,tawpipe-flat",
                    *SMALL)
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["schedule", "iter", "s"]
    assert [x.split()[0] for x in lines[3:]] == ["tawpipe", "tawpipe-nooverlap", "tawpipe-flat"]
    rows = json.loads(run_tool("simulate.py", "--schedule", "tawpipe", "--no-overlap", "--flat",
                               "--json", *SMALL))
    assert rows[0]["options"]["overlap"] is False and rows[0]["options"]["groups"] == 1


def test_simulate_rejects_unknown_schedule():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"),
                          "--schedule", "nope"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "unknown schedule" in out.stderr


def test_simulate_all_runs_on_one_group_and_refuses_a_replicated_first_shard_there():
    """'all' drops tawpipe-rep where it cannot run (one group, --flat); naming it there is an error."""
    one_group = [a if a != "2" else "1" for a in SMALL]
    for extra in (one_group, SMALL + ["--flat"]):
        rows = json.loads(run_tool("simulate.py", "--schedule", "all", "--json", *extra))
        names = [r["schedule"] for r in rows]
        assert not any(n.endswith("-rep") for n in names) and "weipipe" in names and "fsdp" in names
    rows = json.loads(run_tool("simulate.py", "--schedule", "all", "--json", *SMALL))
    assert "tawpipe-rep" in [r["schedule"] for r in rows]
    # --replicate-first-shard applies to the TawPipe plans that can hold shard 0 in every group only.
    rows = json.loads(run_tool("simulate.py", "--schedule", "tawpipe,tawpipe-flat", "--replicate-first-shard",
                               "--json", *SMALL))
    assert rows[0]["options"].get("replicate_first") is True and "replicate_first" not in rows[1]["options"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--schedule", "tawpipe-rep",
                          *one_group], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "tawpipe-rep" in out.stderr and "--groups >= 2" in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed (pip install megatron_tawpipe[plot])")
def test_plot_schedule_writes_a_png(tmp_path):
    out = tmp_path / "tawpipe.png"
    text = run_tool("plot_schedule.py", "--schedule", "tawpipe", "--out", str(out), "--grid",
                    *SMALL)
    assert "wrote" in text and "rank 7" in text
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
