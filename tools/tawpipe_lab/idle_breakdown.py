"""Where one weight-passing iteration's wall time goes, measured and simulated, per rank.

A measured iteration is ``pretrain_llama.py --timeline-file`` output: every rank's plan actions with
the host's clock around each (``actions``), the compute span inside each Forward/Backward, the time a
Wait spent on its own work after the transfer (zeroing a sent gradient), the seconds of emulated
compute slept in the plan, and the training step's phases around the plan (``marks``: set-up, the plan,
the partial gradients' reduction, the gradient norm's local sums and all-reduce, clipping, AdamW, the
metrics' all-reduces, and the time between steps). :func:`measured_breakdown` splits each rank's wall
time into :data:`CATEGORIES`; they sum to it (the plan's time outside its actions is the executor's
time between actions).

:func:`simulated_breakdown` does the same for the simulator's timeline of the same plan and costs
(:func:`megatron_tawpipe.sim.simulate.simulate`, ``record=True``): compute, copies, the plan's
optimizer step, the idle at each Wait (classified as the measured one is) and the tail a rank waits for
the slowest one (where a measured rank waits in the gradient norm's all-reduce).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.timeline import (COMPUTE_LABELS, COPY_LABELS, ISSUE, OPTIMIZER_LABEL, WAIT, StepPhase,
                                            WaitLabel, action_label, wait_label)

P = StepPhase

# Fine categories, then the groups a table shows them in (the order of the rows).
GROUPS = {
    "compute": ("compute",),
    "compute, host work (data, loss, gradient adds)": ("compute host work",),
    "executor bookkeeping": ("action overhead", "between actions", "issue"),
    "host copies (load, accumulate, zero)": ("load", "acc", "zero", "zero sent gradient"),
    "wait weight intra": ("wait weight intra",),
    "wait weight inter": ("wait weight inter",),
    "wait grad intra": ("wait grad intra",),
    "wait grad inter": ("wait grad inter",),
    "wait shard-0 holders' all-reduce": ("wait allreduce intra", "wait allreduce inter"),
    "wait replicated all-reduce": ("wait replicated intra", "wait replicated inter"),
    "gradient norm all-reduce (waits for the slowest rank)": (P.NORM_ALL_REDUCE.value, "tail"),
    "partial grads, unscale, norm sums, clip": (P.PARTIAL_GRADIENTS.value, P.UNSCALE.value, P.NORM_LOCAL.value,
                                                P.CLIP.value),
    "optimizer step": (P.OPTIMIZER.value, P.REPLICATED_MASTERS.value),
    "other (set-up, metrics, between steps)": (P.SET_UP.value, P.BUSY_FRACTION.value, P.METRICS.value,
                                               P.BETWEEN_STEPS.value, "wait other"),
}
CATEGORIES = tuple(c for members in GROUPS.values() for c in members)


def _wait_category(label: str) -> str:
    """A Wait's label (:class:`WaitLabel`, as the executor writes it) -> a category."""
    waited = WaitLabel.parse(label)
    if waited is not None and f"wait {waited.kind} {waited.link}" in CATEGORIES:
        return f"wait {waited.kind} {waited.link}"
    return "wait other"


def measured_breakdown(doc: dict) -> Dict[int, Dict[str, float]]:
    """Per rank: seconds per category of :data:`CATEGORIES`, and ``"wall"`` (their sum: from the end of the
    previous step's timeline, or this step's start on the first, to the end of the metrics' all-reduces)."""
    if "ranks" not in doc:
        raise ValueError("this timeline has no per-action records: write it with this version's --timeline-file")
    out = {}
    for record in doc["ranks"]:
        rank, marks = record["rank"], record["marks"]
        cats = dict.fromkeys(CATEGORIES, 0.0)
        if marks[0][1] is None:      # the first step: nothing before it to count
            marks = marks[1:]
        plan_end = dict(marks).get(P.PLAN.value)
        plan_start = marks[[name for name, _ in marks].index(P.PLAN.value) - 1][1]
        for (_, previous), (name, at) in zip(marks, marks[1:]):
            if name != P.PLAN.value:
                cats[name] += at - previous
        in_actions = 0.0
        for _step, label, start, end, detail in record["actions"]:
            length = end - start
            in_actions += length
            if label in COMPUTE_LABELS:
                span = detail[1] - detail[0]
                cats["compute"] += span
                cats["action overhead"] += length - span
            elif label in COPY_LABELS:
                cats[label] += length
            elif label == ISSUE:
                cats["issue"] += length
            elif label.startswith(WAIT):
                after = detail if isinstance(detail, (int, float)) else 0.0
                cats["zero sent gradient"] += after
                cats[_wait_category(label)] += length - after
            else:                    # the plan's OptimizerStep: a no-op at run time (the trainer steps)
                cats["between actions"] += length
        cats["between actions"] += (plan_end - plan_start) - in_actions
        slept = record.get("slept_in_plan")
        if slept is not None:        # emulated compute: the sleeps are the compute, the rest host work
            cats["compute host work"] = cats["compute"] - slept
            cats["compute"] = slept
        cats["wall"] = marks[-1][1] - marks[0][1]
        out[rank] = cats
    return out


def _wait_labels(plan, rank: int) -> Dict[int, str]:
    """Step of each Wait of ``rank`` -> the executor's label of it (:func:`wait_label`)."""
    started, labels = {}, {}
    for step, a in enumerate(plan.actions[rank]):
        if type(a) in A.STARTS:
            started[a.tag] = a
        elif type(a) is A.Wait and a.tag in started:
            labels[step] = str(wait_label(plan, rank, started[a.tag]))
    return labels


def simulated_breakdown(plan, result) -> Dict[int, Dict[str, float]]:
    """Per rank of a simulated iteration (``simulate(plan, cost, record=True)``): seconds per category
    and ``"wall"`` (the iteration's time: a rank that finishes early waits for the last, ``tail``)."""
    out = {}
    for rank in range(plan.num_ranks):
        cats = dict.fromkeys(CATEGORIES, 0.0)
        for span in result.spans:
            if span.rank != rank:
                continue
            if span.kind in COMPUTE_LABELS:
                cats["compute"] += span.end - span.start
            elif span.kind in COPY_LABELS:
                cats[span.kind] += span.end - span.start
            elif span.kind == OPTIMIZER_LABEL:
                cats["optimizer step"] += span.end - span.start
        labels = _wait_labels(plan, rank)
        for (r, step), idle in result.idle.items():
            if r == rank:
                cats[_wait_category(labels.get(step, WAIT))] += idle
        cats["tail"] = result.iteration_time - result.finish_time[rank]
        cats["wall"] = result.iteration_time
        out[rank] = cats
    return out


def grouped(cats: Dict[str, float]) -> Dict[str, float]:
    """A rank's categories summed into the rows of :data:`GROUPS` (and ``"wall"``)."""
    rows = {group: sum(cats.get(c, 0.0) for c in members) for group, members in GROUPS.items()}
    rows["wall"] = cats["wall"]
    return rows


def mean_over_ranks(breakdown: Dict[int, Dict[str, float]]) -> Dict[str, float]:
    keys = next(iter(breakdown.values())).keys()
    return {k: sum(b[k] for b in breakdown.values()) / len(breakdown) for k in keys}


def check_plan_matches(doc: dict, plan) -> Optional[str]:
    """None where the timeline ran ``plan`` (the same action labels on every rank), else what differs."""
    if doc["num_ranks"] != plan.num_ranks:
        return f"the timeline has {doc['num_ranks']} ranks, the simulated plan {plan.num_ranks}"
    for record in doc["ranks"]:
        rank = record["rank"]
        measured = [label.split(":")[0] for _, label, *_ in record["actions"]]
        planned = [action_label(a) for a in plan.actions[rank]]
        if measured != planned:
            return (f"rank {rank}: the timeline has {len(measured)} actions, the simulated plan {len(planned)}"
                    + ("" if len(measured) != len(planned) else " (in another order or kind)"))
    return None


def format_table(columns: Sequence[tuple]) -> str:
    """``columns``: (title, grouped rows) pairs; a table of ms and % of each column's wall time."""
    head = ["where the time goes"] + [f"{title} ms" for title, _ in columns] + [f"{title} %" for title, _ in columns]
    names: List[str] = list(GROUPS) + ["wall"]
    lines = []
    for name in names:
        cells = [name] + [f"{rows[name] * 1e3:.1f}" for _, rows in columns]
        cells += [f"{100.0 * rows[name] / rows['wall']:.1f}" if rows["wall"] > 0 else "-" for _, rows in columns]
        lines.append(cells)
    widths = [max(len(head[i]), *(len(line[i]) for line in lines)) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])
