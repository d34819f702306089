"""Every rule a plan file is held to, and its message, as docs/writing-a-schedule.md lists them.

Each case breaks one rule of a tiny sound plan (2 ranks in 2 groups, 2 layers, one micro-batch per rank,
written out below) or of its file, runs the check that enforces the rule (reading the file, the validator,
``pretrain_llama.py``'s flag checks) and returns the message. The test reads the table of the docs page:
every case has a row and every row a case, and each row's example message (``…`` marks what is left out)
is what the check says.
"""

import dataclasses
import json
import os
import re

import pytest

from megatron_tawpipe.plan import Plan, PlanError, build_plan, read_plan, validate_plan, write_plan
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.nccl import NcclModel, batch_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "writing-a-schedule.md")
W, G = "weight", "grad"


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Not one of the plan's actions."""
    shard: int


def on_both(start, *before) -> str:
    """The base plan with ``before`` and the collective ``start`` (and its wait) first on both ranks."""
    return edited([(r, 0, "+", x) for r in (0, 1) for x in reversed((*before, start, A.Wait(start.tag)))])


def base() -> Plan:
    """Rank r owns shard r. Shard 0's weights go 0 -> 1 for the forward and again for the backward, shard
    1's 1 -> 0; each rank sends its partial gradient of the other's shard to the owner."""
    r0 = [A.LoadWeights(0, "w0"), A.SendStart(10, 1, "w0", W, 0, "inter"), A.Forward(0, 0, "w0"), A.Wait(10),
          A.RecvStart(11, 1, "w0", W, 1, "inter"), A.Wait(11), A.Forward(0, 1, "w0"), A.ZeroGrad(1, "g0"),
          A.Backward(0, 1, "w0", "g0"), A.SendStart(20, 1, "g0", G, 1, "inter"), A.Wait(20),
          A.LoadWeights(0, "w0"), A.SendStart(12, 1, "w0", W, 0, "inter"), A.Backward(0, 0, "w0", "main"),
          A.Wait(12), A.RecvStart(21, 1, "g0", G, 0, "inter"), A.Wait(21), A.AccumulateToOwner(0, "g0"),
          A.ReplicatedAllReduceStart(30, (0, 1)), A.Wait(30), A.OptimizerStep()]
    r1 = [A.RecvStart(10, 0, "w0", W, 0, "inter"), A.Wait(10), A.Forward(0, 0, "w0"), A.LoadWeights(1, "w0"),
          A.SendStart(11, 0, "w0", W, 1, "inter"), A.Forward(0, 1, "w0"), A.Backward(0, 1, "w0", "main"),
          A.Wait(11), A.RecvStart(20, 0, "g0", G, 1, "inter"), A.Wait(20), A.AccumulateToOwner(1, "g0"),
          A.RecvStart(12, 0, "w0", W, 0, "inter"), A.Wait(12), A.ZeroGrad(0, "g0"), A.Backward(0, 0, "w0", "g0"),
          A.SendStart(21, 0, "g0", G, 0, "inter"), A.Wait(21), A.ReplicatedAllReduceStart(30, (0, 1)),
          A.Wait(30), A.OptimizerStep()]
    return Plan(schedule="tiny", family="weight", num_ranks=2, num_groups=2, num_layers=2, num_microbatches=1,
                owners=(0, 1), streams=(0, 1), max_weight_buffers=1, max_grad_buffers=1, actions=[r0, r1])


def refused(plan: Plan, **kwargs) -> str:
    with pytest.raises(PlanError) as err:
        validate_plan(plan, **kwargs)
    return str(err.value)


def edited(edits=(), **meta) -> str:
    """The validator's message for the base plan with ``edits`` applied to its action lists, in order:
    ``(rank, step, action)`` replaces a step, ``(rank, step, None)`` deletes it, ``(rank, step, "+", action)``
    inserts one before it; ``meta`` replaces metadata fields."""
    plan = base()
    for edit in edits:
        rank, step, what = edit[:3]
        if what is None:
            del plan.actions[rank][step]
        elif what == "+":
            plan.actions[rank].insert(step, edit[3])
        else:
            plan.actions[rank][step] = what
    return refused(dataclasses.replace(plan, **meta) if meta else plan)


def field(rank, step, **changes):
    """Step ``step`` of ``rank`` in the base plan with some fields changed."""
    return (rank, step, dataclasses.replace(base().actions[rank][step], **changes))


def read_error(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        read_plan(str(path))
    return str(err.value).replace(str(tmp_path) + os.sep, "")


def base_json(**meta) -> dict:
    doc = json.loads(base().to_json())
    doc["meta"].update(meta)
    return doc


def three_ranks():
    """weipipe on 3 ranks (one group), for the rules that need a third rank, and its first weight transfer."""
    plan = build_plan("weipipe", num_ranks=3, num_groups=1, num_layers=3, num_microbatches=1)
    plan = dataclasses.replace(plan, actions=[list(a) for a in plan.actions])
    src = 0
    i, send = next((i, a) for i, a in enumerate(plan.actions[src]) if type(a) is A.SendStart)
    third = next(r for r in range(3) if r not in (src, send.peer))
    return plan, src, i, send, third


# ------------------------------------------------------------------------------------------------ the cases
def case_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        read_plan(str(tmp_path / "nothere.json"))
    return str(err.value).replace(str(tmp_path) + os.sep, "")


def case_file_json(tmp_path):
    return read_error(tmp_path, "broken.json", "{not json")


def case_file_field(tmp_path):
    doc = base_json()
    del doc["meta"]["owners"]
    return read_error(tmp_path, "broken.json", json.dumps(doc))


def case_file_action(tmp_path):
    doc = base_json()
    doc["actions"][0][0] = {"op": "Prefetch", "shard": 0}
    return read_error(tmp_path, "broken.json", json.dumps(doc))


def case_file_format(tmp_path):
    return read_error(tmp_path, "broken.json", json.dumps(base_json(format=2)))


def case_file_csv_meta(tmp_path):
    return read_error(tmp_path, "broken.csv", base().to_csv().split("\n", 1)[1])


def case_file_csv_order(tmp_path):
    lines = base().to_csv().split("\n")
    lines[2], lines[3] = lines[3], lines[2]       # rank 0's steps 0 and 1
    return read_error(tmp_path, "broken.csv", "\n".join(lines))


CASES = {
    # reading the file
    "file-missing": case_file_missing,
    "file-json": case_file_json,
    "file-field": case_file_field,
    "file-action": case_file_action,
    "file-format": case_file_format,
    "file-csv-meta": case_file_csv_meta,
    "file-csv-order": case_file_csv_order,
    # metadata
    "meta-lists": lambda: refused(dataclasses.replace(base(), actions=base().actions[:1])),
    "meta-groups": lambda: edited(num_groups=3),
    "meta-split": lambda: edited(shard_layers=(1, 2)),
    "meta-owners": lambda: edited(owners=(0, 5)),
    "meta-equal-shards": lambda: edited(owners=(0, 0)),
    "meta-family": lambda: edited(family="mixed"),
    "meta-replica-shard": lambda: edited(replicas={5: (1,)}),
    "meta-replica-ranks": lambda: edited(replicas={0: (0,)}),
    # each rank's list, matching, order (static)
    "wait-unstarted": lambda: edited([(0, 0, "+", A.Wait(99))]),
    "not-an-action": lambda: edited([(0, 2, Prefetch(1))]),
    "main-target": lambda: edited([(0, 7, A.ZeroGrad(1, "main"))]),
    "buffer-role": lambda: edited([(0, 7, A.ZeroGrad(1, "w0"))]),
    "tag-twice": lambda: edited([field(0, 12, tag=10), (0, 14, A.Wait(10))]),
    "p2p-peer": lambda: edited([field(0, 1, peer=0)]),
    "p2p-kind": lambda: edited([field(0, 1, kind="bias")]),
    "p2p-link": lambda: edited([field(0, 1, link="intra")]),
    "never-waited": lambda: edited([(0, 3, None)]),
    "buffer-bound": lambda: edited([(0, 4, "+", A.LoadWeights(0, "w1")), (0, 5, "+", A.Forward(0, 0, "w1"))]),
    "members": lambda: edited([field(0, 18, ranks=(1, 0))]),
    "collective-root": lambda: edited([(0, 0, "+", A.BroadcastStart(40, 5, (0, 1), "w0", W, 0, "inter"))]),
    "collective-kind": lambda: edited([(0, 0, "+", A.BroadcastStart(40, 0, (0, 1), "w0", "act", 0, "inter"))]),
    "collective-link": lambda: edited([(0, 0, "+", A.BroadcastStart(40, 0, (0, 1), "w0", W, 0, "intra"))]),
    "p2p-order": lambda: edited([field(0, 1, tag=12), (0, 3, A.Wait(12)), field(0, 12, tag=10), (0, 14, A.Wait(10))]),
    "collective-order": lambda: edited([
        field(0, 18, part="head"), (0, 20, "+", A.ReplicatedAllReduceStart(31, (0, 1), "embedding")),
        (0, 21, "+", A.Wait(31)),
        field(1, 17, tag=31, part="embedding"), field(1, 18, tag=31),
        (1, 19, "+", A.ReplicatedAllReduceStart(30, (0, 1), "head")), (1, 20, "+", A.Wait(30))]),
    "no-receive": lambda: edited([(1, 1, None), (1, 0, None)]),
    "tag-pairs": "three-ranks",
    "p2p-peers": "three-ranks",
    "p2p-fields": lambda: edited([field(1, 0, shard=1)]),
    "collective-missing": lambda: edited([(1, 18, None), (1, 17, None)]),
    "collective-differs": lambda: edited([field(1, 17, part="head")]),
}


def three_rank_case(which):
    plan, src, i, send, third = three_ranks()
    if which == "tag-pairs":       # a third rank posts a receive with the transfer's tag
        plan.actions[third][0:0] = [A.RecvStart(send.tag, src, send.buf, send.kind, send.shard,
                                                plan.link_between(third, src)), A.Wait(send.tag)]
    else:                          # the receiver names the third rank as the sender
        dst = send.peer
        j = next(j for j, a in enumerate(plan.actions[dst]) if type(a) is A.RecvStart and a.tag == send.tag)
        plan.actions[dst][j] = dataclasses.replace(plan.actions[dst][j], peer=third)
    return refused(plan)


CASES["tag-pairs"] = lambda: three_rank_case("tag-pairs")
CASES["p2p-peers"] = lambda: three_rank_case("p2p-peers")

CASES.update({
    # running every rank together (the symbolic pass)
    "in-flight": lambda: edited([(0, 2, "+", A.LoadWeights(0, "w0"))]),
    "weight-held": lambda: edited([(0, 2, A.Forward(0, 1, "w0"))]),
    "grad-emptied": lambda: edited([field(0, 13, gbuf="g0")]),
    "grad-uninit": lambda: edited([(0, 7, None)]),
    "grad-shard": lambda: edited([(0, 7, A.ZeroGrad(0, "g0"))]),
    "mb-range": lambda: edited([(0, 2, A.Forward(3, 0, "w0"))]),
    "shard-range": lambda: edited([(0, 2, A.Forward(0, 2, "w0"))]),
    "forward-order": lambda: edited([(1, 2, None)]),
    "backward-order": lambda: edited([(1, 6, None)]),
    "backward-early": lambda: edited([(1, 3, "+", A.Backward(0, 0, "w0", "g0"))]),
    "backward-weight": lambda: edited([(0, 13, A.BackwardWeight(0, 0, "w0", "main"))]),
    "main-owner": lambda: edited([field(0, 8, gbuf="main")]),
    "load-owner": lambda: edited([(0, 11, A.LoadWeights(1, "w0"))]),
    "zero-discards": lambda: edited([(0, 9, "+", A.ZeroGrad(1, "g0"))]),
    "accumulate-owner": lambda: edited([(0, 17, A.AccumulateToOwner(1, "g0"))]),
    "step-in-flight": lambda: edited([(0, 19, "+", A.OptimizerStep())]),
    "step-last": lambda: edited([(0, 20, "+", A.OptimizerStep())]),
    "step-replicated": lambda: edited([(0, 19, None), (0, 18, None), (1, 18, None), (1, 17, None)]),
    "step-contributions": lambda: edited([(0, 17, None), (0, 16, None), (0, 15, None),
                                          (1, 16, None), (1, 15, None)]),
    "read-receiving": lambda: edited([(1, 9, "+", A.SendStart(40, 0, "g0", G, 1, "inter")), (1, 10, "+", A.Wait(40)),
                                      (0, 15, "+", A.RecvStart(40, 1, "g0", G, 1, "inter")), (0, 16, "+", A.Wait(40))]),
    "grad-sent-twice": lambda: edited([(0, 11, "+", A.SendStart(22, 1, "g0", G, 1, "inter")),
                                       (0, 12, "+", A.Wait(22)),
                                       (1, 11, "+", A.RecvStart(22, 0, "g0", G, 1, "inter")),
                                       (1, 12, "+", A.Wait(22))]),
    "receive-discards": lambda: edited([(0, 9, "+", A.RecvStart(22, 1, "g0", G, 1, "inter")), (0, 10, "+", A.Wait(22)),
                                        (1, 8, "+", A.Wait(22)), (1, 0, "+", A.SendStart(22, 0, "g0", G, 1, "inter")),
                                        (1, 0, "+", A.ZeroGrad(1, "g0"))]),
    "broadcast-grad": lambda: on_both(A.BroadcastStart(40, 0, (0, 1), "g0", G, 0, "inter")),
    "reduce-weight": lambda: on_both(A.ReduceStart(40, 0, (0, 1), "w0", W, 0, "inter")),
    "allreduce-weight": lambda: on_both(A.AllReduceStart(40, (0, 1), "w0", W, 0, "inter")),
    "allreduce-holders": lambda: on_both(A.AllReduceStart(40, (0, 1), "g0", G, 0, "inter"), A.ZeroGrad(0, "g0")),
    "replicated-part": lambda: edited([field(0, 18, part="bias"), field(1, 17, part="bias")]),
    "replicated-twice": lambda: edited([(0, 20, "+", A.ReplicatedAllReduceStart(31, (0, 1))), (0, 21, "+", A.Wait(31)),
                                        (1, 19, "+", A.ReplicatedAllReduceStart(31, (0, 1))),
                                        (1, 20, "+", A.Wait(31))]),
    # rank 0 waits for shard 1 before sending shard 0, rank 1 for shard 0 before sending shard 1
    "deadlock": lambda: edited([(0, 5, None), (0, 4, None), (0, 0, "+", base().actions[0][4]),
                                (0, 1, "+", A.Wait(11))]),
    # checks once every rank has finished (a rank without its OptimizerStep gets this far)
    "unfinished": lambda: edited([(0, 20, None), (0, 13, None)]),
    "backward-input": lambda: edited([(0, 20, None), (0, 13, A.BackwardInput(0, 0, "w0"))]),
    "end-undelivered": lambda: edited([(0, 20, None), (0, 17, None)]),
    "end-contributions": lambda: edited([(0, 20, None), (0, 17, None), (0, 16, None), (0, 15, None),
                                         (1, 16, None), (1, 15, None)]),
    "one-step": lambda: edited([(0, 20, None)]),
})


# ------------------------------------------------------------------------------------ NCCL's ordering rules
def bare(acts0, acts1, family="weight") -> Plan:
    """Two ranks in two groups around the given communication (the NCCL model looks at nothing else)."""
    return Plan(schedule="hand", family=family, num_ranks=2, num_groups=2, num_layers=2, num_microbatches=1,
                owners=(0, 1), streams=(0, 1), max_weight_buffers=2, max_grad_buffers=2,
                actions=[list(acts0), list(acts1)])


def nccl(plan, mode, lazy=False) -> str:
    with pytest.raises(PlanError) as err:
        NcclModel(plan, mode, lazy=lazy).run()
    return str(err.value)


def entries(acts0) -> str:
    with pytest.raises(PlanError) as err:
        batch_entries(bare(acts0, []), 0, "group")
    return str(err.value)


def act(cls, tag, peer, shard, mb=0, batch=None, kind="act"):
    return cls(tag, peer, "", kind, shard, "inter", mb=mb, batch=batch)


CASES.update({
    # each rank sends first and waits for it: nothing receives
    "nccl-deadlock": lambda: nccl(bare([act(A.SendStart, 1, 1, 0), act(A.RecvStart, 2, 1, 1), A.Wait(1), A.Wait(2)],
                                       [act(A.SendStart, 2, 0, 1), act(A.RecvStart, 1, 0, 0), A.Wait(2), A.Wait(1)],
                                       "activation"), "group"),
    "nccl-tags": lambda: nccl(bare([act(A.SendStart, 1, 1, 0), act(A.SendStart, 2, 1, 0, mb=1), A.Wait(1), A.Wait(2)],
                                   [act(A.RecvStart, 2, 0, 0, mb=1), act(A.RecvStart, 1, 0, 0), A.Wait(1), A.Wait(2)],
                                   "activation"), "group"),
    "nccl-partner": lambda: nccl(bare([act(A.SendStart, 1, 1, 0, batch=7), A.Wait(1)],
                                      [act(A.RecvStart, 1, 0, 0), A.Wait(1)], "activation"), "pair"),
    "nccl-pair-creation": lambda: nccl(bare(
        [act(A.SendStart, 1, 1, 0, kind="actgrad"), act(A.SendStart, 2, 1, 0), A.Wait(2), A.Wait(1)],
        [act(A.RecvStart, 2, 0, 0), A.Wait(2), act(A.RecvStart, 1, 0, 0, kind="actgrad"), A.Wait(1)],
        "activation"), "pair"),
    "nccl-lazy": lambda: nccl(bare(
        [A.SendStart(1, 1, "w0", W, 0, "inter", batch=0), A.RecvStart(2, 1, "g0", G, 0, "inter", batch=1),
         A.Wait(1), A.Wait(2)],
        [A.SendStart(2, 0, "g0", G, 0, "inter", batch=0), A.RecvStart(1, 0, "w0", W, 0, "inter", batch=1),
         A.Wait(2), A.Wait(1)]), "group", lazy=True),
    "batch-communicators": lambda: entries([A.SendStart(1, 1, "w0", W, 0, "inter", batch=3),
                                            A.RecvStart(2, 1, "w1", W, 1, "inter", batch=3)]),
    "batch-adjacent": lambda: entries([A.SendStart(1, 1, "w0", W, 0, "inter", batch=3), A.Wait(1),
                                       A.SendStart(2, 1, "w1", W, 1, "inter", batch=3), A.Wait(2)]),
})


# ------------------------------------------------------------------- against the run's flags (pretrain_llama.py)
RELAY = os.path.join(ROOT, "examples", "plans", "relay-ring.json")


def flags_error(monkeypatch, plan=RELAY, *extra, world=4, layers=4, global_batch=8, nodes=1, edit=None,
                tmp_path=None):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.common.errors import ArgumentError
    from megatron_tawpipe.training.validate_args import validate_args
    from training_helpers import tiny_args

    if edit is not None:
        with open(RELAY) as f:
            doc = json.load(f)
        edit(doc)
        plan = str(tmp_path / "edited.json")
        with open(plan, "w") as f:
            json.dump(doc, f)
    argv = tiny_args(*extra, global_batch=global_batch, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(layers)
    argv += ["--pipeline-schedule", f"plan:{plan}" if plan is not None else "plan:"]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world // nodes))
    with pytest.raises(ArgumentError) as err:
        validate_args(parse_args(argv), world_size=world)
    return str(err.value).replace(str(tmp_path) + os.sep if tmp_path else ROOT + os.sep, "").replace(ROOT + os.sep, "")


def _family(doc):
    doc["meta"]["family"] = "activation"


def _streams(doc):
    doc["meta"]["streams"] = [0, 0, 1, 1]


def _broken(doc):
    del doc["actions"][2][1]          # rank 2's first Wait


def _uneven(doc):
    doc["meta"].update(num_layers=5, shard_layers=[1, 1, 1, 2])


GROUPS = ("--tawpipe-num-groups", "2")
FLAG_CASES = {
    "flags-file": lambda mp, tmp: flags_error(mp, None),
    "flags-no-overlap": lambda mp, tmp: flags_error(mp, RELAY, *GROUPS, "--tawpipe-no-overlap"),
    "flags-read": lambda mp, tmp: flags_error(mp, "nothere.json"),
    "flags-family": lambda mp, tmp: flags_error(mp, edit=_family, tmp_path=tmp),
    "flags-streams": lambda mp, tmp: flags_error(mp, edit=_streams, tmp_path=tmp),
    "flags-validator": lambda mp, tmp: flags_error(mp, RELAY, *GROUPS, edit=_broken, tmp_path=tmp),
    "flags-ranks": lambda mp, tmp: flags_error(mp, RELAY, *GROUPS, world=2, global_batch=4),
    "flags-groups": lambda mp, tmp: flags_error(mp, RELAY, "--tawpipe-num-groups", "1"),
    "flags-nodes": lambda mp, tmp: flags_error(mp, RELAY),
    "flags-layers": lambda mp, tmp: flags_error(mp, RELAY, *GROUPS, layers=8),
    "flags-split": lambda mp, tmp: flags_error(mp, RELAY, *GROUPS, layers=5, edit=_uneven, tmp_path=tmp),
    "flags-batch": lambda mp, tmp: flags_error(mp, RELAY, *GROUPS, global_batch=12),
}


# ------------------------------------------------------------------------------------------------- the test
ROW = re.compile(r"^\| `([a-z0-9-]+)` \| (.+) \| `(.+)` \|$")


def documented() -> dict:
    """``{case: example message}`` from the tables of docs/writing-a-schedule.md."""
    with open(DOC, encoding="utf-8") as f:
        return {m.group(1): m.group(3) for m in map(ROW.match, f.read().splitlines()) if m}


def test_every_case_is_documented_and_every_documented_rule_has_a_case():
    doc = documented()
    cases = set(CASES) | set(FLAG_CASES)
    assert not cases - set(doc), f"rules without a row in {DOC}: {sorted(cases - set(doc))}"
    assert not set(doc) - cases, f"rows of {DOC} without a case here: {sorted(set(doc) - cases)}"


def assert_documented(case: str, message: str) -> None:
    """The row's example, cut at each ``…``, appears in ``message`` piece by piece, in order."""
    at = 0
    pieces = [p.strip() for p in documented()[case].split("…")]
    assert any(pieces), case
    for piece in filter(None, pieces):
        found = message.find(piece, at)
        assert found >= 0, f"{case}: {piece!r} is not in the message (after {at}): {message}"
        at = found + len(piece)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_documented_message_is_the_checks(case, tmp_path):
    check = CASES[case]
    message = check(tmp_path) if "tmp_path" in check.__code__.co_varnames[:check.__code__.co_argcount] else check()
    assert_documented(case, " ".join(message.split()))


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_the_documented_flag_refusal_is_pretrain_llamas(case, monkeypatch, tmp_path):
    assert_documented(case, " ".join(FLAG_CASES[case](monkeypatch, tmp_path).split()))


def test_the_base_plan_is_sound(tmp_path):
    """Each case breaks one rule: the plans the cases start from break none, and the tiny plan survives its file."""
    validate_plan(base())
    validate_plan(read_plan(RELAY))
    path = str(tmp_path / "tiny.json")
    write_plan(base(), path)
    assert read_plan(path).actions == base().actions
