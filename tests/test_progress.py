"""The progress board: posts, the diagnosis naming a dead or stalled rank, and the hang watchdog (one process)."""

import json
import threading
import time

import pytest

from megatron_tawpipe.monitor import progress
from megatron_tawpipe.monitor.progress import KEY_PREFIX, ProgressBoard, describe_records, hang_limit_s


class DictStore:
    """The three c10d store calls the board uses, in memory."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


class Clock:
    def __init__(self):
        self.offset = 0.0

    def __call__(self):
        return time.time() + self.offset


def _record(rank, iteration=2, where="plan step 7 of 40, Forward(mb=0, shard=1)", waiting=None,
            since=100.0, beat=100.0, state="running"):
    return {"rank": rank, "iteration": iteration, "where": where, "waiting": waiting, "since": since,
            "beat": beat, "state": state, "reason": ""}


def test_position_is_posted_when_it_changes():
    store = DictStore()
    board = ProgressBoard(store, rank=1, world_size=2, timeout_s=60)
    board.iteration = 3
    board.at("plan step 5 of 9, Forward(mb=1, shard=0)")
    posted = json.loads(store.get(KEY_PREFIX + "1"))
    assert posted["iteration"] == 3 and posted["where"].startswith("plan step 5 of 9") and posted["waiting"] is None
    with board.waiting("receive of weight shard 2 from rank 0"):
        assert json.loads(store.get(KEY_PREFIX + "1"))["waiting"] == "receive of weight shard 2 from rank 0"
    assert json.loads(store.get(KEY_PREFIX + "1"))["waiting"] is None
    board.finish("failed", "gave up")
    assert json.loads(store.get(KEY_PREFIX + "1"))["state"] == "failed"
    board.finish("finished")  # only the first ending counts
    assert json.loads(store.get(KEY_PREFIX + "1"))["state"] == "failed"


def test_dead_rank_is_named_with_its_step_and_cascade_victims_are_not_blamed():
    now = 200.0
    records = {
        0: _record(0, waiting="send of grad shard 1 to rank 1", since=185, beat=199.5),
        1: dict(_record(1, since=184, beat=190), state="failed"),           # gave up on rank 2
        2: _record(2, where="plan step 13 of 80, Forward(mb=0, shard=2)", since=180.0, beat=181.0),  # silent
        3: _record(3, waiting="broadcast of weight shard 2", since=186, beat=199.8),
    }
    text, found = describe_records(records, reader=0, now=now, timeout_s=15)
    assert found
    assert "rank 2 stopped (silent for 19 s: died or unreachable) at iteration 2, plan step 13 of 80, Forward" in text
    assert "rank 1 gave up waiting as well" in text
    assert "rank 3" not in text  # alive and waiting: not a culprit


def test_stalled_rank_is_told_from_waiting_ones():
    now = 200.0
    records = {
        0: _record(0, waiting="pipeline transfer (receive from rank 1)", since=180, beat=199.9),
        1: _record(1, where="native schedule, forward number 2 of this step", since=175, beat=199.9),
        2: _record(2, where="evaluation step", since=199, beat=199.9),  # just moved: running
    }
    text, found = describe_records(records, reader=0, now=now, timeout_s=15)
    assert found and "rank 1 stalled (alive, no progress for 25 s)" in text and "rank 2" not in text
    # A rank that stopped itself (its watchdog) while outside any wait is the culprit, too.
    records[1]["state"] = "stalled"
    text, found = describe_records(records, reader=0, now=now, timeout_s=15)
    assert found and "rank 1 stalled" in text and "stopped by its watchdog" in text


def test_no_culprit_lists_where_everyone_waits():
    records = {r: _record(r, waiting=f"receive from rank {(r + 1) % 3}", since=190, beat=199.9) for r in range(3)}
    records[2] = None
    text, found = describe_records(records, reader=0, now=200.0, timeout_s=15)
    assert found and "rank 2 never reported progress" in text
    records[2] = _record(2, waiting="receive from rank 0", since=190, beat=199.9)
    text, found = describe_records(records, reader=0, now=200.0, timeout_s=15)
    assert not found and "no rank is silent or stuck outside a wait" in text
    assert "rank 1 waiting at iteration 2" in text and "for receive from rank 2" in text


def test_watchdog_fires_only_inside_a_step_without_progress():
    store, clock = DictStore(), Clock()
    fired = []
    done = threading.Event()

    def on_hang(message):
        fired.append(message)
        done.set()

    board = ProgressBoard(store, rank=0, world_size=2, timeout_s=10, on_hang=on_hang, clock=clock).start()
    store.set(KEY_PREFIX + "1", json.dumps(_record(1, waiting="receive from rank 0", since=clock(), beat=clock())))
    try:
        clock.offset = 2 * hang_limit_s(10)  # long idle outside a step: nothing happens
        time.sleep(0.6)
        assert not fired
        with board.step(4, "training step"):
            board.at("plan step 3 of 9, Forward(mb=0, shard=1)")
            clock.offset += hang_limit_s(10) + 1
            assert done.wait(5), "the watchdog did not fire"
    finally:
        board.finish()
    assert "rank 0 made no progress" in fired[0] and "iteration 4, plan step 3 of 9" in fired[0]
    # Not waiting for anyone when it fired: it says so to the others.
    assert json.loads(store.get(KEY_PREFIX + "0"))["state"] == "stalled"


def test_no_board_costs_nothing_and_says_so():
    board = progress.board()
    board.at("anything")
    with board.step(1, "training step"), board.waiting("x"):
        pass
    assert "no records" in board.diagnose()


class CountingStore(DictStore):
    def __init__(self):
        super().__init__()
        self.sets = 0

    def set(self, key, value):
        self.sets += 1
        super().set(key, value)


class FrozenClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def _posted(store, rank=0):
    return json.loads(store.get(KEY_PREFIX + str(rank)))


def test_positions_beyond_the_budget_are_coalesced_to_the_latest():
    store, clock = CountingStore(), FrozenClock()
    board = ProgressBoard(store, rank=0, world_size=2, timeout_s=60, clock=clock, max_posts_per_s=4, burst=3)
    for step in range(3):  # the burst: posted at once
        board.at(f"plan step {step} of 100")
    assert store.sets == 3 and _posted(store)["where"] == "plan step 2 of 100"
    for step in range(3, 50):  # budget spent: nothing posted, only the latest kept
        board.at(f"plan step {step} of 100")
    assert store.sets == 3 and _posted(store)["where"] == "plan step 2 of 100"
    clock.now += 0.25  # one post's worth of budget (4 per second)
    board.at("plan step 50 of 100")
    assert store.sets == 4 and _posted(store)["where"] == "plan step 50 of 100"
    # How a rank ends is always posted, budget or not.
    board.at("plan step 51 of 100")
    board.finish("failed", "gave up")
    assert _posted(store)["state"] == "failed" and _posted(store)["where"] == "plan step 51 of 100"


def test_a_wait_that_blocks_is_posted_by_the_heartbeat_when_the_budget_allows():
    store = CountingStore()
    board = ProgressBoard(store, rank=0, world_size=2, timeout_s=60, max_posts_per_s=4, burst=1).start()
    try:
        board.at("plan step 7 of 9, Forward(mb=0, shard=1)")  # the start used the burst: pending
        with board.waiting("receive of weight shard 2 from rank 1"):
            deadline = time.time() + 3
            while _posted(store)["waiting"] is None and time.time() < deadline:
                time.sleep(0.02)
            record = _posted(store)
            assert record["waiting"] == "receive of weight shard 2 from rank 1", record
            assert record["where"] == "plan step 7 of 9, Forward(mb=0, shard=1)"
    finally:
        board.finish()


def test_store_sets_per_second_stay_within_the_budget():
    store = CountingStore()
    board = ProgressBoard(store, rank=0, world_size=2, timeout_s=60, max_posts_per_s=20, burst=5).start()
    start = time.time()
    try:
        step = 0
        while time.time() - start < 1.0:
            board.at(f"plan step {step}")
            with board.waiting("transfer"):
                pass
            step += 1
    finally:
        elapsed = time.time() - start
        board.finish()
    assert step > 1000  # far more positions than posts
    assert store.sets <= 5 + 20 * elapsed + 1, (store.sets, elapsed)  # burst + rate, + the final record
    assert _posted(store)["state"] == "finished"


def test_budget_must_leave_room_for_the_heartbeat():
    with pytest.raises(ValueError, match="max_posts_per_s"):
        ProgressBoard(DictStore(), rank=0, world_size=1, timeout_s=60, max_posts_per_s=1)
