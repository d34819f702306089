"""The advisor's search (tools/simulate.py --advise): micro-batch sizes beyond 4 for every strategy,
TawPipe's visits per shard down to one, each within memory; what it searched; and that its shortcuts
(ceilings, memory growing with the micro-batch, a split backward holding at least its plain schedule,
pretrain_llama.py's check only where the answer shows it) give the exhaustive search's answer."""

from dataclasses import replace

import pytest

from megatron_tawpipe.cli.plan_args import check_command
from megatron_tawpipe.plan import build_plan
from megatron_tawpipe.plan.traffic import link_bytes
from megatron_tawpipe.sim.advisor import Advisor, advise
from megatron_tawpipe.sim.advisor_configs import (enumerate_configs, family_of, micro_batch_sizes, size_of,
                                                  visit_sizes)
from megatron_tawpipe.sim.advisor_report import format_report

from test_advisor import TINY, tiny_cluster as cluster   # the advisor tests' model and cluster


def test_sizes_searched():
    assert micro_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and micro_batch_sizes(12) == [1, 2, 4, 8]
    assert visit_sizes(8) == [1, 2, 4, 8] and visit_sizes(12) == [1, 2, 4, 12] and visit_sizes(3) == [1, 3]


def test_every_strategy_is_tried_beyond_4_and_tawpipe_down_to_one_visit_per_shard():
    """64 sequences on 8 GPUs: 8 per GPU. Every data-parallel strategy is tried at micro-batches of 1 to 8
    (pipelines up to their batch per pipeline), with and without recompute; TawPipe at b=1 with 1, 2, 4 and 8
    micro-batches per visit (8: one visit per shard), at every tensor-parallel size."""
    configs, _ = enumerate_configs(TINY, cluster(), 64)
    sizes = {}
    for c in configs:
        sizes.setdefault((c.strategy, c.knobs.get("tp", 1)), set()).add(c.micro_batch_size)
    for s in ("distopt", "distopt-node", "fsdp", "hsdp", "hfsdp", "weipipe"):
        assert sizes[(s, 1)] == {1, 2, 4, 8}, s
        assert sizes[(s, 2)] == {1, 2, 4, 8, 16}, s        # 4 tensor-parallel groups: 16 sequences each
    assert sizes[("1f1b", 1)] == {1, 2, 4, 8, 16, 32, 64}         # up to 8 stages: one pipeline of 64 sequences
    assert sizes[("pp-nodes", 1)] == {1, 2, 4, 8, 16}             # 2 stages (one per node): 4 pipelines of 16
    taw = [c for c in configs if c.strategy == "tawpipe"]
    assert {c.micro_batch_size for c in taw} == {1}
    assert {c.knobs["chunk"] for c in taw if "tp" not in c.knobs} == {1, 2, 4, 8}
    assert {c.knobs["chunk"] for c in taw if c.knobs.get("tp") == 2} == {1, 2, 4, 8, 16}
    one_visit = [c for c in taw if c.knobs["chunk"] == 8 and "tp" not in c.knobs]
    assert {(c.recompute, c.knobs["cache"], c.knobs["replicate_first"]) for c in one_visit} == \
        {(r, k, p) for r in (True, False) for k in (True, False) for p in (True, False)}


def _exhaustive(model, cl, G):
    """Every enumerated configuration simulated (no ceiling, no memory shortcut): its status and figures."""
    adv = Advisor(model, cl, G)
    configs, _ = enumerate_configs(model, cl, G)
    for c in configs:
        adv.evaluate(c)
    return configs


def _best_per_strategy(configs):
    best = {}
    for c in configs:
        if c.status == "ok" and c.tokens_per_sec_per_gpu > best.get(c.strategy, (0.0, ""))[0]:
            best[c.strategy] = (c.tokens_per_sec_per_gpu, c.label())
    return best


@pytest.mark.parametrize("memory,seq,G,layers", [(80e9, 2048, 64, 8), (3.2e9, 8192, 32, 8), (1.6e9, 8192, 32, 8),
                                                 (3.2e9, 4096, 32, 10)])
def test_pruned_search_gives_the_exhaustive_answer(memory, seq, G, layers):
    """On small clusters where memory binds at some sizes (3.2 and 1.6 GB per GPU at 8k) and where it
    does not, and with 10 layers (uneven shards and stages, whose ceiling is the best of the splits the
    advisor chooses among): every strategy's best and the winner are those of simulating everything; what was not
    simulated for being larger than a size that does not fit does not fit either (memory grows with the
    micro-batch and the visit), and a split backward that was skipped because its plain schedule does not
    fit does not fit."""
    model = replace(TINY, seq_length=seq, num_layers=layers)
    cl = cluster(gpu_memory=memory)
    s = advise(model, cl, G)
    everything = _exhaustive(model, cl, G)
    full = _best_per_strategy(everything)
    assert {r["strategy"] for r in s["ranked"]} == set(full)
    pruned_best = {}
    for r in s["ranked"]:
        pruned_best.setdefault(r["strategy"], (r["tokens_per_sec_per_gpu"], r["label"]))
    for strategy, (tps, label) in full.items():
        assert pruned_best[strategy][0] == pytest.approx(tps), (strategy, label, pruned_best[strategy])
    assert s["best"]["tokens_per_sec_per_gpu"] == pytest.approx(max(v[0] for v in full.values()))
    # the memory shortcut: what it skipped does not fit (the exhaustive run simulated it)
    adv = Advisor(model, cl, G)
    configs, _ = adv.run()
    key = lambda c: (family_of(c), size_of(c))  # noqa: E731   (a settled pipeline's label names its stages)
    by_key = {key(c): c for c in everything}
    larger = [c for c in configs if c.status == "larger"]
    if memory < 80e9:
        assert larger       # the shortcut is exercised
    for c in larger:
        assert by_key[key(c)].status == "no-fit", c.label()


def test_top2_pruning_keeps_the_winner_runner_up_and_best_runnable():
    model = replace(TINY, seq_length=8192)
    cl = cluster(gpu_memory=3.2e9)
    full = _best_per_strategy(_exhaustive(model, cl, 32))
    order = sorted(full.values(), reverse=True)
    s = advise(model, cl, 32, prune="top2", check_command=check_command)
    best = {}
    for r in s["ranked"]:
        best.setdefault(r["strategy"], r["tokens_per_sec_per_gpu"])
    ranked = sorted(best.values(), reverse=True)
    assert ranked[0] == pytest.approx(order[0][0]) and ranked[1] == pytest.approx(order[1][0])


def test_what_was_searched_is_said():
    """The answer says, per strategy, which micro-batch sizes (TawPipe: micro-batches per visit) were tried
    and which fit, and whether one visit per shard fits; the report prints it."""
    model = replace(TINY, seq_length=8192)
    s = advise(model, cluster(gpu_memory=3.2e9), 32)
    searched = s["searched"]
    assert set(searched) == {"distopt-node", "distopt", "hsdp", "hfsdp", "fsdp", "pp-nodes", "1f1b", "interleaved",
                             "tawpipe", "weipipe"}
    for strategy, e in searched.items():
        assert set(e["micro_batch_sizes_fitting"]) <= set(e["micro_batch_sizes"]), strategy
        assert e["recompute"] == [False, True] and 1 in e["tensor_parallel"]
        assert e["configurations"] >= e["evaluated"] + e["larger_than_fits"] + e["pruned"]
    assert searched["distopt"]["micro_batch_sizes"] == [1, 2, 4, 8, 16]   # T=4: 2 groups of 16 sequences
    assert sum(e["larger_than_fits"] for e in searched.values()) == s["larger"] > 0   # memory stopped some
    taw = searched["tawpipe"]
    assert taw["micro_batch_sizes"] == [1] and taw["microbatches_per_visit"][:3] == [1, 2, 4]
    fits = [c for c in s["ranked"] if c["strategy"] == "tawpipe"]
    assert sorted({r["knobs"]["chunk"] for r in fits}) == taw["microbatches_per_visit_fitting"]
    # one visit per shard: every micro-batch of a virtual rank (32 sequences over 8 / (T x C) of them) in one
    assert taw["one_visit_per_shard_fits"] == any(
        r["knobs"]["chunk"] * (8 // (r["knobs"].get("tp", 1) * r["knobs"].get("cp", 1))) == 32 for r in fits)
    text = format_report(s)
    assert "searched (every strategy" in text and "tawpipe      b=1 with micro-batches per visit 1, 2, 4" in text


def test_commands_are_checked_where_the_answer_shows_them():
    """pretrain_llama.py's check runs on the listed rows, each strategy's best down to its first runnable
    configuration and the best runnable one, not on every configuration; the others say they were not
    checked. A configuration the trainer refuses is still found and marked (FSDP2 with tensor parallelism)."""
    calls = []

    def counting(argv, world):
        calls.append(argv)
        return check_command(argv, world)

    s = advise(TINY, cluster(), 32, check_command=counting, listed=5)
    ranked = s["ranked"]
    assert len(calls) < len(ranked)
    assert all(r["trainable"] is not None for r in ranked[:5])
    seen = set()
    for r in ranked:
        if r["strategy"] not in seen:
            assert r["trainable"] is not None, r["label"]       # each strategy's best is checked
        if r["trainable"]:
            seen.add(r["strategy"])
    assert any(r["trainable"] is None and "not checked" in r["note"] for r in ranked)
    refused = [r for r in ranked if r["trainable"] is False]
    assert all("refuses it" in r["note"] for r in refused)
    assert any(r["strategy"] == "fsdp" and r["knobs"].get("tp", 1) > 1 for r in refused)
    # the unchecked ones are what the trainer says of them when asked
    adv = Advisor(TINY, cluster(), 32, check_command=check_command)
    configs, _ = adv.run(listed=5)
    for c in [c for c in configs if c.status == "ok" and c.trainable is None][:6]:
        c.checked, c.trainable = False, True
        assert adv.check(c) in (True, False)


@pytest.mark.parametrize("P,D,N,opts", [(8, 2, 8, {"chunk": 2, "cache": True}), (8, 4, 4, {"chunk": 1, "cache": False}),
                                        (6, 3, 4, {"chunk": 4, "cache": True, "replicate_first": True})])
def test_a_split_backward_moves_what_its_plain_schedule_moves_and_holds_at_least_as_much(P, D, N, opts):
    """The advisor's ceilings of tawpipe-zb and weipipe-interleave-zb use their plain schedules' bytes, and
    it skips a split backward whose plain schedule does not fit: both hold for the plans."""
    from megatron_tawpipe.sim.advisor_configs import Config

    for zb, plain, o in (("tawpipe-zb", "tawpipe", opts), ("weipipe-interleave-zb", "weipipe", {})):
        a = build_plan(zb, num_ranks=P, num_groups=D, num_layers=P, num_microbatches=N, **o)
        b = build_plan(plain, num_ranks=P, num_groups=D, num_layers=P, num_microbatches=N, **o)
        assert link_bytes(a, 1e6, bytes_per_grad=2e6) == link_bytes(b, 1e6, bytes_per_grad=2e6)
    model = replace(TINY, num_layers=P)
    cl = cluster(ranks=P, nodes=D)
    adv = Advisor(model, cl, N * P)
    for recompute in (True, False):
        knobs = {"chunk": opts["chunk"], "cache": opts["cache"], "replicate_first": opts.get("replicate_first", False)}
        plain = adv.evaluate(Config("tawpipe", 1, recompute, dict(knobs)))
        split = adv.evaluate(Config("tawpipe", 1, recompute, dict(knobs, plan_schedule="tawpipe-zb")))
        assert split.memory.total >= plain.memory.total
        for term in ("weights", "grads", "optimizer", "comm_buffers", "logits"):
            assert getattr(split.memory, term) >= getattr(plain.memory, term) - 1e-6, term


@pytest.mark.parametrize("gbs", [16, 64])
def test_no_configuration_is_enumerated_twice(gbs):
    """Each strategy, micro-batch size, recompute setting and set of knobs once (TawPipe's layouts come from the
    run's own candidate list, whose recompute knob the advisor sets itself)."""
    import json

    configs, _ = enumerate_configs(TINY, cluster(), gbs)
    keys = [(c.strategy, c.micro_batch_size, c.recompute, json.dumps(c.knobs, sort_keys=True, default=str))
            for c in configs]
    assert len(keys) == len(set(keys)) and any(k[0] == "tawpipe" for k in keys)
