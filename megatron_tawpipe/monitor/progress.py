"""Where every rank is: so that a dead or stalled rank is named, and no hang is silent.

Each rank posts its position (iteration, plan step or micro-batch, and what it
is waiting for, if anything) to the job's c10d store when it changes, within a
budget of store ``set``s per rank (a token bucket: ``max_posts_per_s`` on
average, bursts of up to ``burst`` posts), so that thousands of ranks running
small plan steps cannot flood the store. Positions that arrive while the budget
is spent are coalesced: the rank keeps only the latest, and a background thread
posts it as soon as the budget allows (about 0.1 s at the default budget), so a
rank blocked in a wait or stalled in compute always shows where it is. The same
thread repeats the post every second as a heartbeat. A rank killed mid-step
leaves its last post: its exact step while it posts within budget, otherwise a
position at most about 0.1 s old. How a rank ended (finished, failed, stalled)
is always posted, outside the budget.

When a rank gives up on a peer (the executor's bounded waits), it reads every
rank's last post and names the culprit: a rank that went silent (died or became
unreachable) or one that is alive but has not moved from a step that is not a
wait (stalled). Ranks that themselves gave up waiting are reported as such,
so a cascade does not blame an intermediate rank.

The same thread is a watchdog for what cannot time out by itself (megatron's
native pipeline transfers wait without a bound): while a training or
evaluation step is running, a rank whose position has not changed for longer
than ``--distributed-timeout-minutes`` (plus a margin) prints the diagnosis and
exits with status 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch.distributed as dist

KEY_PREFIX = "megatron_tawpipe/monitor/progress/"
BEAT_INTERVAL_S = 1.0       # a post at least this often, also while nothing changes (liveness)
MAX_POSTS_PER_S = 50.0      # store sets per second per rank, on average (the heartbeat included)
BURST_POSTS = 500           # posts a rank may make at once after a quiet spell (start-up, evaluation)
SILENT_AFTER_S = 4 * BEAT_INTERVAL_S + 1.0
HANG_EXIT_DELAY_S = 3.0


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a torch without this helper: no board
        return None


def hang_limit_s(timeout_s: float) -> float:
    """How long a step may make no progress before the watchdog stops the process.

    Longer than any single bounded wait (``timeout_s``), so the executor's own,
    more precise error comes first wherever there is one.
    """
    return 1.25 * timeout_s + 5.0


def _exit_on_hang(message: str) -> None:
    print(f"{os.path.basename(sys.argv[0]) or 'megatron_tawpipe'}: error: {message}", file=sys.stderr, flush=True)
    board = _current
    if board.hosts_store():
        board.linger_for_readers()
    else:
        # Peers' watchdogs fire at about the same moment and read this rank's last post.
        time.sleep(HANG_EXIT_DELAY_S)
    os._exit(1)


class _PostBudget:
    """A token bucket: ``rate`` posts per second on average, at most ``burst`` at once."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated = now

    def take(self, now: float) -> bool:
        """Spend one post if the budget has one (the caller holds the board's lock)."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class ProgressBoard:
    """This rank's position, posted to the store; and a reader of every rank's position."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float,
                 on_hang: Callable[[str], None] = _exit_on_hang, clock: Callable[[], float] = time.time,
                 max_posts_per_s: float = MAX_POSTS_PER_S, burst: int = BURST_POSTS):
        if max_posts_per_s < 2.0 / BEAT_INTERVAL_S or burst < 1:
            raise ValueError(f"progress posts: max_posts_per_s must be >= {2.0 / BEAT_INTERVAL_S:g} (the heartbeat "
                             f"and a position each beat) and burst >= 1, got {max_posts_per_s:g} and {burst}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self.clock = clock
        self.iteration = 0
        self._where: object = "starting"
        self._waiting: Optional[str] = None
        self._since = clock()
        self._armed = 0
        self.last_diagnosis: Optional[str] = None  # the watchdog's, when it fired
        self._reported = False
        self._final_state: Optional[str] = None
        self._final_reason = ""
        self._posted_at = 0.0
        self._budget = _PostBudget(max_posts_per_s, burst, clock())
        self._dirty = False  # the position changed since the last post (it waits for the budget)
        self._lock = threading.Lock()  # the training thread and the heartbeat share one store client
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- the training side (about 10 us per position) ------------------------------------

    def at(self, where: object) -> None:
        """Enter a new position; ``where`` is formatted with ``str`` only when posted."""
        self._where = where
        self._waiting = None
        self._moved()

    @contextlib.contextmanager
    def waiting(self, what: str):
        self._waiting = what
        self._moved()
        try:
            yield
        finally:
            self._waiting = None
            self._moved()

    @contextlib.contextmanager
    def step(self, iteration: int, what: str):
        """A training or evaluation step: the watchdog is armed inside it."""
        self.iteration = iteration
        self.at(what)
        self._armed += 1
        try:
            yield
        finally:
            self._armed -= 1

    def _moved(self) -> None:
        self._since = self.clock()
        self._dirty = True
        self._post(within_budget=True)

    # ---- posting -----------------------------------------------------------------------

    def start(self) -> "ProgressBoard":
        if self.store is not None and self._thread is None:
            self._post(within_budget=True)
            self._thread = threading.Thread(target=self._run, name="tawpipe-progress", daemon=True)
            self._thread.start()
        return self

    def finish(self, state: str = "finished", reason: str = "") -> None:
        """Stop posting; leave a last record saying how this rank ended (the first call counts)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._post(state=state, reason=reason)

    def reported(self) -> None:
        """This rank has read the others' posts and said its piece: the store may go."""
        self._reported = True
        self._post(state=self._final_state or "failed", reason=self._final_reason)

    def _record(self, state: str = "running", reason: str = "") -> dict:
        return {"rank": self.rank, "iteration": self.iteration, "where": str(self._where),
                "waiting": self._waiting, "since": self._since, "beat": self.clock(),
                "state": state, "reason": reason, "reported": self._reported}

    def _post(self, state: str = "running", reason: str = "", within_budget: bool = False) -> None:
        """Write this rank's record; ``within_budget``: only if the budget allows, else leave it pending."""
        if self.store is None or (self._stop.is_set() and state == "running"):
            return
        if state != "running":
            self._final_state, self._final_reason = state, reason
        with self._lock:
            if within_budget and not self._budget.take(self.clock()):
                return  # pending: the heartbeat thread posts the latest position when the budget allows
            self._dirty = False
            record = json.dumps(self._record(state, reason))
            try:
                self.store.set(KEY_PREFIX + str(self.rank), record)
            except Exception:  # the store is gone (its host died): nothing left to tell
                return
            self._posted_at = self.clock()

    def _run(self) -> None:
        tick = min(BEAT_INTERVAL_S / 4, max(1.0 / self._budget.rate, 0.05))  # pending positions wait <= 2 ticks
        while not self._stop.wait(tick):
            now = self.clock()
            if self._dirty or now - self._posted_at >= BEAT_INTERVAL_S:
                self._post(within_budget=True)
            if self._armed and now - self._since > hang_limit_s(self.timeout_s):
                self._hang(now)
                return

    def _hang(self, now: float) -> None:
        position = f"iteration {self.iteration}, {self._where}"
        if self._waiting:
            position += f", waiting for {self._waiting}"
        message = (f"rank {self.rank} made no progress for {now - self._since:.0f} s at {position} "
                   f"(--distributed-timeout-minutes {self.timeout_s / 60:g})")
        # Not waiting for anyone: this rank is the one that stalled, whatever the others see next.
        self._stop.set()  # this is how the rank ends: nothing posted later may say otherwise
        self._post(state="failed" if self._waiting else "stalled", reason=message)
        self.last_diagnosis = self.diagnose()
        self.reported()
        self.on_hang(f"{message}; {self.last_diagnosis}")

    # ---- the store's host --------------------------------------------------------------

    def hosts_store(self) -> bool:
        """Outside torchrun's agent store, the first rank's process serves the job's store."""
        return self.store is not None and self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"

    def linger_for_readers(self) -> None:
        """If this process serves the store, keep it up until every other rank is done with it.

        They need it to read the progress posts when they fail in turn (a cascade reaches
        them up to one timeout later). A rank is done when it finished, when it reported
        its diagnosis, or when it has been silent for longer than a diagnosis takes.
        Bounded by one timeout plus two diagnoses.
        """
        if not self.hosts_store():
            return
        deadline = self.clock() + self.timeout_s + 2 * (SILENT_AFTER_S + 1.0)

        def done(rec, now) -> bool:
            if rec is None:
                return False
            if rec["state"] == "finished" or rec.get("reported"):
                return True
            silent = now - rec["beat"]
            return silent > (SILENT_AFTER_S if rec["state"] == "running" else 2 * SILENT_AFTER_S + 2.0)

        while self.clock() < deadline:
            try:
                records = self.read_all()
            except Exception:
                return
            now = self.clock()
            if all(done(rec, now) for rank, rec in records.items() if rank != self.rank):
                return
            time.sleep(0.5)

    # ---- reading -----------------------------------------------------------------------

    def read_all(self) -> Dict[int, Optional[dict]]:
        records: Dict[int, Optional[dict]] = {}
        for rank in range(self.world_size):
            key = KEY_PREFIX + str(rank)
            with self._lock:
                records[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return records

    def diagnose(self, settle_s: float = 0.0) -> str:
        """One sentence naming the rank(s) that stopped, as far as the posts tell.

        A peer that just died may still look alive (its last beat is recent):
        with ``settle_s``, keep reading until a culprit shows or that time passed.
        """
        if self.store is None:
            return "progress: no records (no store)"
        deadline = self.clock() + settle_s
        while True:
            try:
                records = self.read_all()
            except Exception as exc:  # the store's host died with the job's first rank
                return f"progress: records unreadable ({exc.__class__.__name__})"
            text, found = describe_records(records, self.rank, self.clock(), self.timeout_s)
            if found or self.clock() >= deadline:
                return text
            time.sleep(0.5)


def describe_records(records: Dict[int, Optional[dict]], reader: int, now: float,
                     timeout_s: float) -> Tuple[str, bool]:
    """``(sentence, whether a culprit was found)`` from every rank's last post, seen by ``reader``."""
    culprits, gave_up, others = [], [], []
    for rank, rec in sorted(records.items()):
        if rank == reader:
            continue
        if rec is None:
            culprits.append(f"rank {rank} never reported progress")
            continue
        position = f"iteration {rec['iteration']}, {rec['where']}"
        if rec["state"] == "failed":
            gave_up.append(f"rank {rank}")
        elif rec["state"] == "stalled":
            culprits.append(f"rank {rank} stalled (no progress for {now - rec['since']:.0f} s outside any wait; "
                            f"stopped by its watchdog) at {position}")
        elif rec["state"] == "finished":
            others.append(f"rank {rank} finished")
        elif now - rec["beat"] > SILENT_AFTER_S:
            culprits.append(f"rank {rank} stopped (silent for {now - rec['beat']:.0f} s: died or unreachable) "
                            f"at {position}")
        elif rec["waiting"] is None and now - rec["since"] > timeout_s / 2:
            culprits.append(f"rank {rank} stalled (alive, no progress for {now - rec['since']:.0f} s) at {position}")
        elif rec["waiting"]:
            others.append(f"rank {rank} waiting at {position} for {rec['waiting']}")
        else:
            others.append(f"rank {rank} running at {position}")
    parts = []
    if culprits:
        parts.append("; ".join(culprits))
    else:
        parts.append("no rank is silent or stuck outside a wait")
    if gave_up:
        parts.append(f"{', '.join(gave_up)} gave up waiting as well")
    if others and not culprits:
        parts.append("; ".join(others))
    return "progress: " + "; ".join(parts), bool(culprits)


class _NoBoard(ProgressBoard):
    """Stands in when no board runs (single-process tools, tests of parts)."""

    def __init__(self):
        super().__init__(None, 0, 1, 600.0)


_current: ProgressBoard = _NoBoard()


def board() -> ProgressBoard:
    return _current


def start_board(timeout_s: float, max_posts_per_s: float = MAX_POSTS_PER_S, burst: int = BURST_POSTS) -> ProgressBoard:
    global _current
    _current = ProgressBoard(_default_store(), dist.get_rank(), dist.get_world_size(), timeout_s,
                             max_posts_per_s=max_posts_per_s, burst=burst).start()
    return _current


def stop_board(state: str = "finished", reason: str = "") -> None:
    global _current
    _current.finish(state, reason)
    _current = _NoBoard()
