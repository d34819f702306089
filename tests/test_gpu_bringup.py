"""tools/gpu_bringup.sh on a machine without a GPU: --help, --dry-run (which wheels are found or missing,
the budgeted plan, every step with its command, exit 0 or 2), a real run's refusal (no CUDA, unusable
wheels), and real runs through the script's test hook (GPU_BRINGUP_TEST_STEP replaces every step's
command): a slow step cut by the budget, later steps recorded as skipped, the archive rewritten after
every step, --step-timeout. The runs start together (each imports torch once to ask about CUDA); the
budgeted run takes about 30 s."""

import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_bringup.sh")
MAIN = "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
SECOND = "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
MCORE_REQUIRES = ["torch>=2.6.0", "numpy", "packaging>=24.2", 'wandb; extra == "training"']


def fake_wheel(folder, filename, requires=(), requires_python=None):
    """A wheel file with only its METADATA (what the dry run reads)."""
    name, version = filename.split("-")[:2]
    lines = ["Metadata-Version: 2.1", f"Name: {name.replace('_', '-')}", f"Version: {version}"]
    if requires_python:
        lines.append(f"Requires-Python: {requires_python}")
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(os.path.join(folder, filename), "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n\nDescription.\n")


CUT_BUDGET = 30
MAIN_STEPS = ["install", "install-repo", "imports", "pretrain-tawpipe", "pretrain-1f1b", "compare-losses",
              "gpu_check-compute", "pytest-gpu", "gpu_check-others"]


def start(*args, env=None):
    proc = subprocess.Popen(["bash", SCRIPT, "--python", sys.executable, *args], cwd=ROOT, text=True,
                            env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.started = time.monotonic()
    return proc


PLAN_LINE = re.compile(r"^\s+(\d+)  \[([^]]+)\] (\S+)  \((.*)\)$")


def plan(out):
    """The dry run's step lines: (number, pass, step, what the parentheses say)."""
    return [(int(m[1]), m[2], m[3], m[4]) for m in map(PLAN_LINE.match, out.splitlines()) if m]


def steps_of(results):
    with open(os.path.join(results, "summary.json")) as f:
        return json.load(f)["steps"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's run, started at once: (exit status, stdout, stderr, folders) by case."""
    base = tmp_path_factory.mktemp("bringup")
    folders = {}
    for case in ("none", "present", "problems"):
        wheels, out, installs = base / case / "wheels", base / case / "out", base / case / "installs"
        wheels.mkdir(parents=True)
        folders[case] = (str(wheels), str(out), str(installs))
    fake_wheel(folders["present"][0], MAIN, MCORE_REQUIRES, ">=3.12")
    with open(os.path.join(folders["present"][0], SECOND), "wb") as f:  # named like the real one, not a zip
        f.write(b"not a zip")
    fake_wheel(folders["present"][0], "einops-0.8.1-py3-none-any.whl", [], ">=3.8")
    problems = folders["problems"][0]
    fake_wheel(problems, MAIN, MCORE_REQUIRES, ">=3.12")
    fake_wheel(problems, MAIN.replace("0.19.2", "0.19.0"), MCORE_REQUIRES, ">=3.12")
    fake_wheel(problems, "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl")
    fake_wheel(problems, "helper_pkg-1.0-py3-none-any.whl", ["tawpipe-absent-package>=1.2"])
    fake_wheel(problems, "old_pkg-1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    # The wheels with problems go to a real run: on this machine without CUDA it refuses like a dry run,
    # naming every problem, and writes nothing.
    procs = {case: start(*(["--dry-run"] if case != "problems" else []), "--wheels", w, "--out", o, "--install-dir", i)
             for case, (w, o, i) in folders.items()}
    procs["budget-300"] = start("--dry-run", "--budget", "300", "--wheels", folders["present"][0])
    procs["step-timeout-30"] = start("--dry-run", "--step-timeout", "30", "--budget", "0", "--wheels", folders["present"][0])
    # Real runs through the test hook: each step lists the archive as it stands when the step starts.
    for case, flags, slow in (("cut", ["--budget", str(CUT_BUDGET), "--min-start", "1"], "pretrain-tawpipe"),
                              ("capped", ["--budget", "0", "--step-timeout", "2"], "environment")):
        root = base / case
        folders[case] = (str(root / "wheels"), str(root / "results"), str(root / "installs"), str(root / "r.tar.gz"))
        snippet = f'tar -tzf "{folders[case][3]}" | sort; [ "$2" != {slow} ] || sleep 120'
        procs[case] = start(*flags, "--wheels", folders[case][0], "--out", folders[case][1], "--install-dir",
                            folders[case][2], "--tar", folders[case][3], env={"GPU_BRINGUP_TEST_STEP": snippet})
    results = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        results[case] = (proc.returncode, out, err, folders.get(case), time.monotonic() - proc.started)
    return results


def _nothing_written(folders):
    _, out, installs = folders[:3]
    assert not os.path.exists(out) and not os.path.exists(installs)


def test_help_names_the_download_command():
    proc = subprocess.run(["bash", SCRIPT, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for text in ("--dry-run", "--wheels DIR", "--out DIR", "python3 -m pip download --no-deps --only-binary=:all:",
                 "--python-version 3.12", "megatron-core==0.19.2", "megatron-core==0.16.1", "summary.md"):
        assert text in proc.stdout, text


def test_a_wrong_flag_is_refused_in_one_line():
    proc = subprocess.run(["bash", SCRIPT, "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "gpu_bringup.sh: error: unknown argument '--bogus' (see --help)"


def test_dry_run_without_wheels_names_the_missing_one_and_prints_every_step(runs):
    status, out, err, folders, _ = runs["none"]
    wheels = folders[0]
    assert status == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("gpu_bringup.sh: error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"gpu_bringup.sh: error: missing wheel megatron-core 0.19.x for CPython 3.12 in {wheels}: ")
    assert errors[0].endswith(f"--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 "
                              f"--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform "
                              f"manylinux2014_x86_64 --platform manylinux1_x86_64 -d {wheels} megatron-core==0.19.2")
    assert "MISSING  megatron-core 0.19.x (required)" in out
    assert "absent   megatron-core 0.16.1 (optional second pass)" in out
    assert "torch sees no CUDA device: a real run needs one GPU" in out
    # Every step, with its command, though the wheel is missing.
    steps = [step for _, _, step, _ in plan(out)]
    assert steps == ["nvidia-smi-q", "environment"] + MAIN_STEPS
    for command in ("nvidia-smi -q", " -m pip install --no-index --no-deps", "--target",
                    "tools/gpu_check.py --json", "-m pytest -m gpu -q -rs -p no:cacheprovider tests --junitxml",
                    "pretrain_llama.py", "--pipeline-schedule tawpipe", "--pipeline-schedule 1f1b",
                    "tools/compare_metrics.py", "--rtol 1e-2"):
        assert command in out, command
    assert "[mcore-0.16.1] skipped: no megatron-core 0.16.1 wheel" in out
    _nothing_written(folders)


def test_dry_run_with_the_wheels_lists_both_passes_and_exits_0(runs):
    status, out, err, folders, _ = runs["present"]
    wheels, results, installs = folders
    assert status == 0, out + err
    assert out.rstrip().endswith("gpu_bringup.sh --dry-run: the inputs would do.")
    assert f"found    megatron-core 0.19.2  {MAIN}  (pass mcore-0.19.2)" in out
    assert f"found    megatron-core 0.16.1  {SECOND}  (pass mcore-0.16.1)" in out
    assert "found    einops 0.8.1" in out
    # The fake 0.16.1 is no zip: named, not fatal in a dry run.
    assert f"cannot read the METADATA of {SECOND}" in out
    for requirement in ("torch>=2.6.0", "packaging>=24.2", "sentencepiece>=0.2", "pytest"):
        assert f"ok       {requirement}  (" in out, requirement
    assert "wandb" not in out  # an extra's requirement
    passes = [p for _, p, _, _ in plan(out)]
    assert passes.count("mcore-0.19.2") == passes.count("mcore-0.16.1") == 9 and passes.count("machine") == 2
    installs_lines = [line for line in out.splitlines() if "-m pip install --no-index --no-deps --no-compile" in line]
    assert len(installs_lines) == 2
    assert os.path.join(wheels, MAIN) in installs_lines[0] and os.path.join(installs, "mcore-0.19.2", "site") in installs_lines[0]
    assert os.path.join(wheels, SECOND) in installs_lines[1] and os.path.join(installs, "mcore-0.16.1", "site") in installs_lines[1]
    assert all(os.path.join(wheels, "einops-0.8.1-py3-none-any.whl") in line for line in installs_lines)
    assert f"--json {results}/mcore-0.19.2/gpu_check-compute.json" in out
    assert f"--junitxml {results}/mcore-0.16.1/pytest-gpu.xml" in out
    assert f"PYTHONPATH={installs}/mcore-0.19.2/site" in out
    assert f"then: summary.md and summary.json in {results}" in out
    assert "budget: 540 s from the start" in out
    assert "error" not in err, err
    _nothing_written(folders)


def test_a_run_names_every_unusable_wheel_and_refuses_without_cuda(runs):
    status, out, err, folders, _ = runs["problems"]
    wheels = folders[0]
    assert status == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("gpu_bringup.sh: error:")]
    assert "gpu_bringup.sh: error: torch sees no CUDA device: a real run needs one GPU" in errors
    assert any("more than one megatron-core 0.19.x" in e and "keep one" in e for e in errors), errors
    assert any("torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl" in e and "never install torch" in e for e in errors)
    assert any(e.startswith("gpu_bringup.sh: error: old_pkg-1.0-cp311-cp311-manylinux_2_17_x86_64.whl cannot install "
                            "for CPython 3.12 (built for cp311, not CPython 3.12)") for e in errors), errors
    missing = [e for e in errors if "tawpipe-absent-package" in e]
    assert len(missing) == 1
    assert missing[0].startswith("gpu_bringup.sh: error: missing wheel tawpipe-absent-package>=1.2 "
                                 "(required by helper-pkg 1.0;")
    assert missing[0].endswith(f"-d {wheels} 'tawpipe-absent-package>=1.2'")
    assert "UNUSABLE old-pkg 1.0" in err  # the inventory comes first, on stderr
    assert out == ""
    _nothing_written(folders)


def test_steps_come_most_valuable_first_and_the_second_release_last(runs):
    steps = [(p, step) for _, p, step, _ in plan(runs["present"][1])]
    assert steps == ([("machine", "nvidia-smi-q"), ("machine", "environment")]
                     + [("mcore-0.19.2", s) for s in MAIN_STEPS] + [("mcore-0.16.1", s) for s in MAIN_STEPS])


@pytest.mark.parametrize("case, budget", [("present", 540), ("budget-300", 300)])
def test_the_dry_run_plan_keeps_within_the_budget(runs, case, budget):
    status, out, err, _, _ = runs[case]
    assert status == 0, out + err
    usable = budget - 8                                  # the script's reserve for the end
    ends, skipped, previous = [], [], 0
    for number, pass_, step, what in plan(out):
        cap = int(re.match(r"cap (\d+) s", what)[1])
        if "worst case: skipped: budget" in what:
            skipped.append(number)
            continue
        timeout, end, of = map(int, re.search(r"timeout (\d+) s; worst case ends at (\d+) s of (\d+) s", what).groups())
        assert of == usable and 0 < timeout <= cap
        assert end == previous + timeout + 4              # its timeout and the per-step overhead
        assert not skipped, f"step {number} planned after a skipped one"  # the plan fills in order
        ends.append(end)
        previous = end
    assert ends and max(ends) <= usable
    assert skipped, "the whole plan fits: the test's budget no longer forces a choice"
    assert f"within the {usable} s of the {budget}-s budget" in out
    if budget == 300:   # the first steps run to their caps; what is left goes to the next, then nothing
        assert ends[0] == 20 + 4 and skipped[0] == len(ends) + 1


def test_step_timeout_replaces_every_cap_in_the_plan(runs):
    status, out, err, _, _ = runs["step-timeout-30"]
    assert status == 0, out + err
    whats = [what for _, _, _, what in plan(out)]
    assert len(whats) == 20 and all(w.startswith("cap 30 s; timeout 30 s;") for w in whats), whats
    assert "budget: none" in out


@pytest.mark.timing
def test_a_slow_step_is_cut_by_the_budget_and_later_steps_are_skipped(runs):
    status, out, err, (_, results, _, archive), _ = runs["cut"]
    assert status == 1, out + err
    steps = {(s["pass"], s["step"]): s for s in steps_of(results)}
    cut = steps[("mcore-0.19.x", "pretrain-tawpipe")]
    assert re.fullmatch(r"timed out \(\d+ s: budget\)", cut["status"]) and cut["exit"] == 124, cut
    assert cut["timeout"] < 120   # the step (a 120-s sleep) was given what was left of the budget
    for name in MAIN_STEPS[:3]:
        assert steps[("mcore-0.19.x", name)]["status"] == "ok"
    assert steps[("mcore-0.19.x", "compare-losses")]["status"] == "skipped: budget (pretrain-1f1b was skipped)"
    for name in ("pretrain-1f1b", "gpu_check-compute", "pytest-gpu", "gpu_check-others"):
        assert steps[("mcore-0.19.x", name)]["status"].startswith("skipped: budget ("), name
    summary = json.load(open(os.path.join(results, "summary.json")))
    assert summary["failed"] and "mcore-0.19.x/pytest-gpu" in summary["skipped_for_budget"]
    assert "skipped for the budget: mcore-0.19.x/pretrain-1f1b" in open(os.path.join(results, "summary.md")).read()


@pytest.mark.timing
def test_the_archive_is_rewritten_after_every_step_and_unpacks_to_the_results(runs, tmp_path):
    status, out, err, (_, results, _, archive), _ = runs["cut"]
    name = os.path.basename(results)
    # Each step listed the archive when it started: every earlier step's log was in it.
    order = ["nvidia-smi-q.txt", "environment.log"] + [f"mcore-0.19.x/{s}.log" for s in MAIN_STEPS[:4]]
    for i, log in enumerate(order):
        listed = set(open(os.path.join(results, log)).read().split())
        assert {f"{name}/{earlier}" for earlier in order[:i]} <= listed, (log, listed)
        assert f"{name}/{log}" not in listed
    assert not os.path.exists(archive + ".part")
    unpacked = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    assert os.listdir(unpacked) == [name]
    packed = {os.path.relpath(os.path.join(d, f), unpacked / name) for d, _, fs in os.walk(unpacked / name) for f in fs}
    on_disk = {os.path.relpath(os.path.join(d, f), results) for d, _, fs in os.walk(results) for f in fs}
    assert packed == on_disk and "summary.json" in packed
    assert (unpacked / name / "summary.json").read_text() == open(os.path.join(results, "summary.json")).read()


def test_step_timeout_cuts_a_step_at_its_cap_without_a_budget(runs):
    status, out, err, (_, results, _, _), _ = runs["capped"]
    assert status == 1, out + err
    steps = {(s["pass"], s["step"]): s for s in steps_of(results)}
    assert steps[("machine", "environment")]["status"] == "timed out (2 s)"
    ran = [s for s in steps.values() if s["pass"] == "mcore-0.19.x"]
    assert [s["step"] for s in ran] == MAIN_STEPS and all(s["status"] == "ok" and s["timeout"] == 2 for s in ran)


@pytest.mark.parametrize("flags, message", [
    (["--budget", "abc"], "--budget must be a whole number of seconds (0: none), got 'abc'"),
    (["--budget", "5"], "--budget must be 0 (none) or more than 12 s"),
    (["--step-timeout", "-1"], "--step-timeout must be a whole number of seconds (0: no cap), got '-1'"),
    (["--min-start", "0"], "--min-start must be a whole number of seconds, at least 1, got '0'"),
])
def test_bad_budget_flags_are_refused_in_one_line(flags, message):
    proc = subprocess.run(["bash", SCRIPT, *flags], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith(f"gpu_bringup.sh: error: {message}"), proc.stderr


@pytest.mark.timing
def test_the_budget_and_the_step_cap_hold_in_wall_time(runs):
    """The wall-clock side of the two cuts: the script ends within its budget, the cut step within it, the
    capped step soon after its 2-s cap (a loaded machine stretches these; with 30 s of budget, it can also use
    the budget up before the slow step starts, hence the timing mark on the budget's two tests above)."""
    _, _, _, (_, results, _, _), wall = runs["cut"]
    assert wall < CUT_BUDGET, wall
    cut = {(s["pass"], s["step"]): s for s in steps_of(results)}[("mcore-0.19.x", "pretrain-tawpipe")]
    assert cut["seconds"] < CUT_BUDGET
    _, _, _, (_, capped, _, _), _ = runs["capped"]
    assert {(s["pass"], s["step"]): s for s in steps_of(capped)}[("machine", "environment")]["seconds"] < 6
