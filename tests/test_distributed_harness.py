"""The test harness's forked ranks: a rank whose interpreter crashes is named with its signal, and such a
run is started again once (never twice); an error a rank reports is not retried; the ports of CI's
concurrent pytest processes are disjoint."""

import os
import signal

import pytest
from distributed_harness import free_port, run_ranks


def _crash_first_tries(rank, marker_dir, crashes):
    """Rank 1 crashes (SIGSEGV) on each of its first ``crashes`` tries; every rank returns its rank and try."""
    tries = sorted(os.listdir(marker_dir))
    if rank == 1:
        open(os.path.join(marker_dir, f"try{len(tries)}"), "w").close()
        if len(tries) < crashes:
            os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_a_run_whose_rank_crashed_once_is_started_again_and_passes(tmp_path, capfd):
    assert run_ranks(_crash_first_tries, 2, str(tmp_path), 1, timeout=60) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["try0", "try1"]          # rank 1 ran twice: the work was redone
    assert "rank 1 crashed by SIGSEGV before reporting" in capfd.readouterr().err


def test_a_rank_that_crashes_twice_fails_the_test_naming_the_signal(tmp_path):
    with pytest.raises(AssertionError, match="rank 1 crashed by SIGSEGV before reporting"):
        run_ranks(_crash_first_tries, 2, str(tmp_path), 2, timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["try0", "try1"]          # once again, not more


def _fails(rank, marker_dir):
    open(os.path.join(marker_dir, f"rank{rank}-{len(os.listdir(marker_dir))}"), "w").close()
    raise ValueError(f"rank {rank} says no")


def test_an_error_a_rank_reports_is_not_retried(tmp_path):
    with pytest.raises(AssertionError, match="(?s)rank 0 failed:.*ValueError: rank 0 says no"):
        run_ranks(_fails, 1, str(tmp_path), timeout=60)
    assert os.listdir(tmp_path) == ["rank0-0"]


def test_ports_of_concurrent_ci_processes_do_not_overlap(monkeypatch):
    """CI's second pass runs two pytest processes at once, in slots 0/2 and 1/2: their ports never meet."""
    shares = []
    for slot in ("0/2", "1/2"):
        monkeypatch.setenv("TAWPIPE_TEST_PORT_SLOT", slot)
        shares.append({free_port() for _ in range(20)})
    assert all(20000 <= port < 26000 for port in shares[0]) and all(26000 <= port < 32000 for port in shares[1])
    monkeypatch.delenv("TAWPIPE_TEST_PORT_SLOT")
    assert all(20000 <= free_port() < 32000 for _ in range(20))
