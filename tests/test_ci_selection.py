"""CI's second pass (newest megatron-core, Python 3.12) runs the files tests/megatron_core_api_files.txt
selects: they exist, and no test file that builds or trains a model through megatron-core, or parses
Megatron-LM's flags, escapes the choice (each is selected or left out with a reason)."""

import os
import re

import pytest

from conftest import TESTS, megatron_core_api_files, megatron_core_api_processes

# What makes a test file touch megatron-core's API: importing it, training (train_rank / pretrain /
# pretrain_llama.py) or parsing the flags.
TOUCHES_MEGATRON = re.compile(r"megatron\.core|megatron\.training|train_rank|pretrain\(|pretrain_llama|parse_args")
# What makes a test file fork ranks from its pytest process (the harness's run_ranks, multiprocessing, torchrun, a fork).
FORKS_RANKS = re.compile(r"run_ranks|multiprocessing|torchrun|torch\.distributed\.run|os\.fork\(")


def test_every_listed_file_exists_once_and_has_a_reason_if_left_out():
    selected, left_out = megatron_core_api_files()
    listed = sorted(set(selected)) + list(left_out)
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    # A file on two lines: its cases split into two processes, each line the file alone with a -k subset.
    processes, _ = megatron_core_api_processes()
    for name in {n for n in selected if selected.count(n) > 1}:
        lines = [(files, expression) for files, expression in processes if name in files]
        assert len(lines) == 2 and all(files == [name] and expression for files, expression in lines), lines
    missing = [name for name in listed if not os.path.isfile(os.path.join(TESTS, name))]
    assert not missing, f"tests/megatron_core_api_files.txt names files that do not exist: {missing}"
    assert all(left_out.values()), [name for name, reason in left_out.items() if not reason]
    # The equivalence, checkpoint, parser and tensor-parallel files are among the selected.
    for name in ("test_weight_passing_equivalence.py", "test_native_equivalence.py", "test_checkpoint.py",
                 "test_megatron_lm_compat.py", "test_tensor_parallel_weight_passing.py", "test_data.py"):
        assert name in selected


def test_every_test_file_touching_megatron_core_is_selected_or_left_out_with_a_reason():
    selected, left_out = megatron_core_api_files()
    unlisted = []
    for name in sorted(os.listdir(TESTS)):
        if name.startswith("test_") and name.endswith(".py") and name not in selected and name not in left_out:
            with open(os.path.join(TESTS, name), encoding="utf-8") as f:
                if TOUCHES_MEGATRON.search(f.read()):
                    unlisted.append(name)
    assert not unlisted, (f"{unlisted} use megatron-core's API: add them to tests/megatron_core_api_files.txt "
                          "(or leave them out there, with a reason)")


# Files that fork ranks but share one pytest process in the second pass, checked there: 10 runs of the four
# in one process clean, also with test_device_portability.py's and test_cpu_compat.py's CUDA stand-ins first.
CHECKED_SHARED = {"test_attention.py", "test_data_paths.py", "test_uneven_layers.py", "test_device_portability.py"}


def test_files_sharing_a_process_fork_no_ranks():
    """A line naming several files runs them in one pytest process: in torch's 3.12 CUDA build the ranks that a
    long pytest process forks can crash once earlier tests have loaded CUDA's bindings, so none may fork ranks
    unless the shared run was checked (CHECKED_SHARED)."""
    processes, _ = megatron_core_api_processes()
    assert processes and all(files for files, _ in processes)
    forking = []
    for files, _ in processes:
        if len(files) > 1:
            for name in files:
                with open(os.path.join(TESTS, name), encoding="utf-8") as f:
                    if FORKS_RANKS.search(f.read()) and name not in CHECKED_SHARED:
                        forking.append(name)
    assert not forking, f"{forking} fork ranks: give each its own line in tests/megatron_core_api_files.txt"


class _Collected:
    """A plugin keeping the files of the items a pytest session selected."""

    files = None

    def pytest_collection_finish(self, session):
        self.files = {os.path.basename(str(item.path)) for item in session.items}


def test_the_marker_selects_exactly_the_listed_files(capsys):
    """Collected in this process, as a separate pytest process would (the test modules, imported once, are
    not imported again; a new process would spend seconds on megatron-core's imports alone)."""
    collected = _Collected()
    status = pytest.main(["--collect-only", "-q", "-m", "megatron_core_api", "-p", "no:cacheprovider", TESTS],
                         plugins=[collected])
    out = capsys.readouterr()
    assert status == 0 and collected.files == set(megatron_core_api_files()[0]), out.out[-2000:] + out.err[-2000:]
