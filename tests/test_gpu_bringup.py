"""tools/gpu_bringup.sh on a machine without a GPU: --help, --dry-run (which wheels are found or missing,
every step with its command, exit 0 or 2), and a real run's refusal (no CUDA, unusable wheels). The three
runs start together (each imports torch once to ask about CUDA), so the file takes a few seconds."""

import os
import subprocess
import sys
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


def start(*args):
    return subprocess.Popen(["bash", SCRIPT, "--python", sys.executable, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
    results = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[case] = (proc.returncode, out, err, folders[case])
    return results


def _nothing_written(folders):
    _, out, installs = folders
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
    status, out, err, folders = runs["none"]
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
    steps = [line.split("] ", 1)[1] for line in out.splitlines() if line.lstrip()[:1].isdigit() and "] " in line]
    assert steps == ["nvidia-smi-q", "environment", "install", "install-repo", "imports", "gpu_check", "pytest-gpu",
                     "pretrain-tawpipe", "pretrain-1f1b", "compare-losses"]
    for command in ("nvidia-smi -q", " -m pip install --no-index --no-deps", "--target",
                    "tools/gpu_check.py --json", "-m pytest -m gpu -q -rs -p no:cacheprovider tests --junitxml",
                    "pretrain_llama.py", "--pipeline-schedule tawpipe", "--pipeline-schedule 1f1b",
                    "tools/compare_metrics.py", "--rtol 1e-2"):
        assert command in out, command
    assert "[mcore-0.16.1] skipped: no megatron-core 0.16.1 wheel" in out
    _nothing_written(folders)


def test_dry_run_with_the_wheels_lists_both_passes_and_exits_0(runs):
    status, out, err, folders = runs["present"]
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
    steps = [line.split("] ", 1) for line in out.splitlines() if line.lstrip()[:1].isdigit() and "] " in line]
    passes = [step[0].split("[", 1)[1] for step in steps]
    assert passes.count("mcore-0.19.2") == passes.count("mcore-0.16.1") == 8 and passes.count("machine") == 2
    installs_lines = [line for line in out.splitlines() if "-m pip install --no-index --no-deps --no-compile" in line]
    assert len(installs_lines) == 2
    assert os.path.join(wheels, MAIN) in installs_lines[0] and os.path.join(installs, "mcore-0.19.2", "site") in installs_lines[0]
    assert os.path.join(wheels, SECOND) in installs_lines[1] and os.path.join(installs, "mcore-0.16.1", "site") in installs_lines[1]
    assert all(os.path.join(wheels, "einops-0.8.1-py3-none-any.whl") in line for line in installs_lines)
    assert f"--json {results}/mcore-0.19.2/gpu_check.json" in out
    assert f"--junitxml {results}/mcore-0.16.1/pytest-gpu.xml" in out
    assert f"PYTHONPATH={installs}/mcore-0.19.2/site" in out
    assert f"then: summary.md and summary.json in {results}" in out
    assert "error" not in err, err
    _nothing_written(folders)


def test_a_run_names_every_unusable_wheel_and_refuses_without_cuda(runs):
    status, out, err, folders = runs["problems"]
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
