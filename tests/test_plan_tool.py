"""tools/plan.py: build, validate, simulate and draw plan files from the command line."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron_tawpipe.plan import build_plan, read_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RING = os.path.join(ROOT, "examples", "plans", "relay-ring.json")
SHAPE = ["--ranks", "4", "--groups", "2", "--num-layers", "6", "--num-microbatches", "2"]


def plan_tool(*args, status=0):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == status, (out.returncode, out.stdout, out.stderr)
    return out


@pytest.mark.parametrize("extension", ["json", "csv"])
def test_build_validate_simulate_round_trip(extension, tmp_path):
    path = str(tmp_path / f"tawpipe.{extension}")
    out = plan_tool("build", "--schedule", "tawpipe", *SHAPE, "--shard-layers", "1,1,2,2", "--out", path)
    assert f"wrote {path}" in out.stdout
    plan = read_plan(path)
    expected = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=6, num_microbatches=2,
                          shard_layers=(1, 1, 2, 2))
    assert plan.to_json() == expected.to_json()
    if extension == "json":   # one action per line after the metadata; without --out, the same on standard output
        with open(path) as f:
            text = f.read()
        assert len(text.splitlines()) == plan.num_actions() + 4 + 2 * plan.num_ranks
        assert plan_tool("build", "--schedule", "tawpipe", *SHAPE, "--shard-layers", "1,1,2,2").stdout == text
    assert "sound: tawpipe: P=4 groups=2 L=6" in plan_tool("validate", path).stdout
    row = json.loads(plan_tool("simulate", path, "--json", "--inter-bw", "1.25GB/s").stdout)
    assert row["schedule"] == "tawpipe" and row["tokens_per_sec_per_rank"] > 0 and row["inter_group_bytes"] > 0


def test_validate_names_rank_and_step_of_a_broken_plan(tmp_path):
    with open(RING) as f:
        doc = json.load(f)
    rank = doc["actions"][2]
    del rank[next(i for i, a in enumerate(rank) if a["op"] == "Wait")]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    out = plan_tool("validate", str(broken), status=1)
    assert out.stderr.strip() == (f"{broken}: rank 2, step 0, RecvStart(tag=101, peer=1, buf='w0', kind='weight', "
                                  "shard=0, link='inter', size=1.0, mb=-1, batch=None): started but never waited for")
    plan_tool("simulate", str(broken), status=1)
    assert "no such file" in plan_tool("validate", str(tmp_path / "nothere.json"), status=2).stderr
    assert "replicate_first needs at least 2" in plan_tool("build", "--schedule", "tawpipe-rep", "--ranks", "4",
                                                          "--groups", "1", status=2).stderr


def test_the_hand_written_plan_validates_simulates_and_draws_as_text():
    out = plan_tool("validate", RING, "--grid")
    assert "sound: relay-ring: P=4 groups=2 L=4" in out.stdout and "w(rw0<0)" in out.stdout
    text = plan_tool("simulate", RING).stdout
    assert "schedule: relay-ring" in text and "bubble_ratio" in text
    grid = plan_tool("draw", RING).stdout
    assert grid.splitlines()[1].split() == ["step", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_draw_writes_a_png(tmp_path):
    png = tmp_path / "ring.png"
    assert "wrote" in plan_tool("draw", RING, "--out", str(png)).stdout
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_build_split_backward(tmp_path):
    path = str(tmp_path / "split.json")
    plan_tool("build", "--schedule", "weipipe", "--ranks", "3", "--groups", "1", "--num-layers", "3",
              "--num-microbatches", "2", "--split-backward", "--out", path)
    from megatron_tawpipe.plan import split_backward

    expected = split_backward(build_plan("weipipe", num_ranks=3, num_groups=1, num_layers=3, num_microbatches=2))
    assert read_plan(path).to_json() == expected.to_json()
    assert "sound: weipipe" in plan_tool("validate", path).stdout
