"""The global batch size over a run: constant, or Megatron-LM's ``--step-batch-size-schedule``.

``--step-batch-size-schedule "0:16 2.4B:320"`` reads as Megatron-LM reads it: space- (or comma-)
separated ``THRESHOLD:BATCH`` pairs, thresholds in tokens (converted to samples with
``--seq-length``, rounding down), suffixes K, M, B, T for 1e3..1e12, the first threshold 0 and the
thresholds strictly increasing. An iteration takes the batch of the last entry whose threshold
the samples consumed before it reach. The learning-rate schedule advances by the batch each
applied step took, and ``--train-samples`` ends after the first iteration that reaches it.

A schedule here is plain data, ``[(threshold_samples, global_batch), ...]``, kept in the
arguments (``args.batch_schedule``) so that it travels with them into checkpoints. Everything
that depends on the batch (micro-batches per rank, the weight-passing plan, tokens per second,
the LR span of ``--train-iters`` runs) asks this module.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

Schedule = List[Tuple[int, int]]


class IterationBatch(NamedTuple):
    """One iteration's global batch and the micro-batches per data-parallel rank it takes."""

    global_batch_size: int
    num_microbatches: int

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
FLAG = "--step-batch-size-schedule"


def _number(text: str, entry: str) -> int:
    value = text.strip().upper()
    scale = _SUFFIXES.get(value[-1:], 1)
    if scale > 1:
        value = value[:-1]
    try:
        number = float(value) * scale
    except ValueError:
        raise ValueError(f"{FLAG}: '{entry}' is not THRESHOLD:BATCH (numbers, with an optional K/M/B/T "
                         "suffix)") from None
    return int(number)


def parse_step_schedule(text: str, seq_length: int) -> Schedule:
    """``"0:16 2.4B:320"`` -> ``[(0, 16), (2.4e9 // seq_length, 320)]`` (thresholds in samples)."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError(f"{FLAG} is empty: give THRESHOLD:BATCH pairs, e.g. \"0:16 2.4B:320\"")
    schedule: Schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"{FLAG}: '{entry}' is not THRESHOLD:BATCH (e.g. \"0:16 2.4B:320\")")
        threshold, batch = entry.split(":", 1)
        tokens, size = _number(threshold, entry), _number(batch, entry)
        if size <= 0:
            raise ValueError(f"{FLAG}: the batch of '{entry}' must be positive")
        schedule.append((tokens // seq_length, size))
    schedule.sort(key=lambda pair: pair[0])
    if schedule[0][0] != 0:
        raise ValueError(f"{FLAG}: the first threshold must be 0 (the batch at the start), got "
                         f"{schedule[0][0] * seq_length} tokens")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"{FLAG}: thresholds must increase strictly (in samples of --seq-length "
                             f"{seq_length}: {before} then {after})")
    return schedule


def constant(global_batch_size: int) -> Schedule:
    return [(0, int(global_batch_size))]


def batch_at(schedule: Sequence[Tuple[int, int]], consumed_samples: int) -> int:
    """The global batch of the iteration that starts after ``consumed_samples``."""
    size = schedule[0][1]
    for threshold, batch in schedule:
        if consumed_samples < threshold:
            break
        size = batch
    return int(size)


def largest_batch(schedule: Sequence[Tuple[int, int]]) -> int:
    return max(batch for _, batch in schedule)


def samples_after(schedule: Sequence[Tuple[int, int]], iterations: int) -> int:
    """Samples consumed by the first ``iterations`` iterations."""
    consumed = 0
    if len(schedule) == 1:
        return int(iterations) * schedule[0][1]
    for _ in range(int(iterations)):
        consumed += batch_at(schedule, consumed)
    return consumed


def iterations_for_samples(schedule: Sequence[Tuple[int, int]], train_samples: int) -> int:
    """Iterations of a ``--train-samples`` run, as Megatron-LM counts them: a constant batch takes
    ``train_samples // batch``; a schedule runs until the consumed samples reach ``train_samples``."""
    if len(schedule) == 1:
        return int(train_samples) // schedule[0][1]
    consumed = iterations = 0
    while consumed < train_samples:
        consumed += batch_at(schedule, consumed)
        iterations += 1
    return iterations


def reachable(schedule: Sequence[Tuple[int, int]], from_samples: int, until_samples: int) -> Schedule:
    """The entries in force at some point while the consumed samples go from ``from_samples`` up to
    (not including) ``until_samples``: entry i holds on [threshold_i, threshold_i+1)."""
    ends = [threshold for threshold, _ in schedule[1:]] + [float("inf")]
    return [(threshold, batch) for (threshold, batch), end in zip(schedule, ends)
            if threshold < until_samples and end > from_samples]


def micro_batches(batch: int, micro_batch_size: int, data_parallel_size: int) -> Optional[int]:
    """Micro-batches per data-parallel rank for a global ``batch``, or None where it does not divide."""
    per_step = micro_batch_size * data_parallel_size
    if batch % per_step or batch < per_step:
        return None
    return batch // per_step


def iteration_batch(schedule: Sequence[Tuple[int, int]], micro_batch_size: int, data_parallel_size: int,
                    consumed_samples: int) -> IterationBatch:
    """The batch of the iteration that starts after ``consumed_samples``. The schedule was checked for this
    layout up front (validate_args and resume)."""
    batch = batch_at(schedule, consumed_samples)
    count = micro_batches(batch, micro_batch_size, data_parallel_size)
    if count is None:  # not reachable past check_layout; kept as a guard
        raise ValueError(f"{FLAG}: a global batch of {batch} at {consumed_samples} consumed samples is not "
                         f"a multiple of --micro-batch-size x data-parallel size "
                         f"({micro_batch_size * data_parallel_size})")
    return IterationBatch(batch, count)


def check_layout(args, from_samples: int = 0) -> List[int]:
    """Every batch the run can still reach fits the layout; returns the micro-batch counts per rank
    (ascending) that the run will use. Raises ValueError naming the flag otherwise."""
    schedule = args.batch_schedule
    until = samples_after(schedule, args.train_iters)  # --train-samples was turned into iterations already
    per_step = args.micro_batch_size * args.data_parallel_size
    counts = set()
    for threshold, batch in reachable(schedule, from_samples, max(until, from_samples + 1)):
        count = micro_batches(batch, args.micro_batch_size, args.data_parallel_size)
        if count is None and len(schedule) == 1:
            raise ValueError(f"--global-batch-size {batch} must be divisible by --micro-batch-size "
                             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
        if count is None:
            raise ValueError(f"{FLAG}: the global batch {batch} (from {threshold} samples) must be a multiple of "
                             f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
                             f"{args.data_parallel_size} = {per_step}")
        counts.add(count)
    return sorted(counts)
