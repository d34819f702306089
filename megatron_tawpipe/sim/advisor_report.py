"""The advisor's command lines and its report (table, memory arithmetic,
what does not fit and why); see :mod:`megatron_tawpipe.sim.advisor`."""

from __future__ import annotations

import os
import shlex
import tempfile

from megatron_tawpipe.plan.files import write_plan
from megatron_tawpipe.sim.advisor_configs import STRATEGY_ORDER, Absence, wp_options, wp_schedule
from megatron_tawpipe.sim.context_parallel import (CONTEXT_PARALLEL_SIZES, CONTEXT_PARALLEL_STRATEGIES,
                                                   MIN_TOKENS_PER_RANK, context_parallel_problem)
from megatron_tawpipe.sim.context_parallel_weights import virtual_rank_pricing
from megatron_tawpipe.sim.layout_choice import LayoutRequest, TawPipeLayout, choose_layout
from megatron_tawpipe.sim.memory import MemoryBreakdown, gb
from megatron_tawpipe.sim.tensor_parallel import TENSOR_PARALLEL_SIZES, tensor_parallel_problem

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce"]


def command(cfg, model, cluster, global_batch: int):
    """(argv of pretrain_llama.py, full command line with torchrun and a comment)."""
    D, d = cluster.nodes, cluster.per_node
    argv = model.flags() + ["--micro-batch-size", str(cfg.micro_batch_size),
                            "--global-batch-size", str(global_batch), "--bf16"]
    argv += strategy_flags(cfg, model, cluster)
    comment = ("add data and training flags (--train-iters, --data-path or --mock-data, --tokenizer-type, "
               "--lr, ...)")
    build = plan_build_command(cfg, model, cluster, global_batch) + " && " if cfg.knobs.get("plan_schedule") else ""
    line = build + f"torchrun --nnodes {D} --nproc-per-node {d} pretrain_llama.py " + " ".join(
        shlex.quote(a) for a in argv)
    return argv, line + f"   # {comment}"


def strategy_flags(cfg, model, cluster, recompute_flags: bool = True):
    """The ``pretrain_llama.py`` flags that select ``cfg``'s strategy and knobs (the schedule, its parallel layout,
    its options; with ``recompute_flags``, the recomputation it was priced with)."""
    D = cluster.nodes
    s, k = cfg.strategy, cfg.knobs
    argv = []
    if k.get("tp", 1) > 1:   # tensor parallelism inside the nodes, as Megatron users run it: with sequence parallelism
        argv += ["--tensor-model-parallel-size", str(k["tp"]), "--sequence-parallel"]
    if k.get("cp", 1) > 1:   # context parallelism inside the nodes (the native schedules)
        argv += ["--context-parallel-size", str(k["cp"])]
    native_rc = RECOMPUTE if cfg.recompute and recompute_flags else []
    # weight passing: recompute as priced (a TawPipe layout the run decides itself decides it too)
    wp_rc = (["--tawpipe-recompute", "on" if cfg.recompute else "off"]
             if recompute_flags and not k.get("auto_layout") else [])
    if k.get("plan_schedule"):    # a split-backward schedule: its plan file first, then the run of it
        argv += ["--pipeline-schedule", "plan:" + PLAN_FILE, "--tawpipe-num-groups", str(D)]
        argv += list(k.get("split_flags", []))
        argv += wp_rc
    elif s == "tawpipe":
        argv += ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", str(D)]
        if not k.get("auto_layout"):   # the layout as simulated; auto: the layout the run decides (the same)
            argv += ["--tawpipe-microbatches-per-visit", str(k["chunk"])]
            argv += ["--tawpipe-replicate-first-shard"] if k.get("replicate_first") else []
            argv += ["--tawpipe-ownership", "spread"] if k.get("ownership") == "spread" else []
            argv += (["--tawpipe-shards-per-rank", str(k["shards_per_rank"])]
                     if k.get("shards_per_rank", 1) != 1 else [])
            # the shard cache as simulated (one group: nothing to keep, auto leaves it off)
            argv += ["--tawpipe-cache", "on" if k["cache"] else "off"] if D > 1 else []
            argv += ["--tawpipe-replicated-reduce", k["replicated_reduce"]] if "replicated_reduce" in k else []
        argv += list(k.get("split_flags", []))      # uneven shards: the default split needs none
        argv += wp_rc
    elif s == "weipipe":
        argv += ["--pipeline-schedule", "weipipe", "--tawpipe-num-groups", str(D)] + wp_rc
        argv += ["--weipipe-zero-bubble", str(k["zero_bubble"])] if k.get("zero_bubble") else []
        argv += list(k.get("split_flags", []))
    elif s in ("pp-nodes", "1f1b", "interleaved"):
        pp = k["pipeline_size"]
        argv += ["--pipeline-schedule", "interleaved" if s == "interleaved" else "1f1b",
                 "--pipeline-model-parallel-size", str(pp)]
        if k.get("split_flags"):    # uneven stages: megatron-core's first/last-stage flags or a layout
            argv += list(k["split_flags"])
        elif s == "interleaved":
            argv += ["--num-layers-per-virtual-pipeline-stage",
                     str(model.num_layers // (pp * k["virtual_stages"]))]
        argv += (DISTOPT if cluster.ranks // (pp * k.get("tp", 1)) > 1 else []) + native_rc
    elif s == "fsdp":
        argv += ["--use-torch-fsdp2"] + native_rc
    elif s == "hsdp":
        argv += ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", str(D)] + native_rc
    elif s in ("distopt", "distopt-node"):
        argv += DISTOPT + ["--overlap-param-gather"]
        argv += ["--num-distributed-optimizer-instances", str(D)] if s == "distopt-node" else []
        argv += native_rc
    elif s == "hfsdp":
        argv += DISTOPT + ["--overlap-param-gather", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                           "optim_grads_params", "--outer-dp-sharding-strategy", "optim",
                           "--num-distributed-optimizer-instances", str(D)] + native_rc
    return argv


def mark_auto_layouts(advisor, configs, listed: int) -> None:
    """TawPipe's listed configurations whose layout is the one ``pretrain_llama.py`` decides by default on this
    cost model and memory (:func:`megatron_tawpipe.sim.layout_choice.choose_layout`): their commands give no
    layout flag (``knobs["auto_layout"]``)."""
    ok = sorted((c for c in configs if c.status == "ok"),
                key=lambda c: (-round(c.tokens_per_sec_per_gpu, 1), c.memory.total))
    decided: dict = {}
    for cfg in ok[:max(listed, 1)]:
        k = cfg.knobs
        if cfg.strategy != "tawpipe" or k.get("plan_schedule"):
            continue
        tp, cp = k.get("tp", 1), k.get("cp", 1)
        key = (cfg.micro_batch_size, tp, cp)
        if key not in decided:
            P = advisor.cluster.ranks // (tp * cp)
            N = advisor.G // cfg.micro_batch_size // P
            sub = advisor.virtual(tp, cp)   # its plans (built already for what it evaluated) over the P / (T x C)
            one = {rc: advisor.cost(cfg.micro_batch_size, rc) for rc in (False, True)}
            # with C > 1: the virtual ranks' pricing (at T x C), one owner per shard (the run's request)
            costs, pieces = (virtual_rank_pricing(one, cp, sub.shape(cfg.micro_batch_size), tp) if cp > 1
                             else (one, None))
            choice = choose_layout(LayoutRequest(ownership="owner" if cp > 1 else None), costs, P,
                                   advisor.cluster.nodes, advisor.model.num_layers, [N], advisor.cluster.usable_memory,
                                   tensor_parallel=tp, pieces=pieces,
                                   plan_builder=lambda n, opts, sub=sub: sub._plan("tawpipe", n, **opts))
            decided[key] = choice.chosen
        mine = TawPipeLayout(k.get("ownership", "owner"), k.get("shards_per_rank", 1),
                             bool(k.get("replicate_first")), bool(k["cache"]) and advisor.cluster.nodes > 1,
                             k["chunk"], k.get("replicated_reduce", "hierarchical"), cfg.recompute)
        if mine == decided[key]:
            k["auto_layout"] = True
            cfg.argv, cfg.command = command(cfg, advisor.model, advisor.cluster, advisor.G)


PLAN_FILE = "plan.json"    # where an advised split-backward schedule's plan is written


def plan_build_command(cfg, model, cluster, global_batch: int) -> str:
    """``tools/plan.py build`` of a configuration's plan file (``knobs["plan_schedule"]``: tawpipe-zb,
    weipipe-interleave-zb, weipipe-zb1-paired), over its (virtual) ranks with its micro-batches per rank."""
    k = cfg.knobs
    ranks = cluster.ranks // k.get("tp", 1)
    argv = ["python", "tools/plan.py", "build", "--schedule", k["plan_schedule"], "--ranks", str(ranks),
            "--groups", str(cluster.nodes), "--num-layers", str(model.num_layers),
            "--num-microbatches", str(global_batch // cfg.micro_batch_size // ranks)]
    if cfg.strategy == "tawpipe":
        argv += ["--chunk", str(k["chunk"]), "--cache" if k["cache"] else "--no-cache"]
        argv += ["--replicate-first-shard"] if k.get("replicate_first") else []
        argv += ["--tawpipe-ownership", "spread"] if k.get("ownership") == "spread" else []
        argv += ["--tawpipe-shards-per-rank", str(k["shards_per_rank"])] if k.get("shards_per_rank", 1) != 1 else []
        argv += ["--tawpipe-replicated-reduce", "sharded"] if k.get("replicated_reduce") == "sharded" else []
    if k.get("shard_layers"):
        argv += ["--shard-layers", ",".join(map(str, k["shard_layers"]))]
    return " ".join(argv + ["--out", PLAN_FILE])


# ---------------------------------------------------------------------- report
def left_out(configs, prune: str) -> list:
    """Why a strategy that applies has no configuration in the ranking although none failed to fit
    (pruned, or left out by ``trainable_only``), and how many knobs ``trainable_only`` left out."""
    out = []
    for s in STRATEGY_ORDER:
        mine = [c for c in configs if c.strategy == s]
        skipped = [c for c in mine if c.status == "skipped"]
        if any(c.status in ("ok", "no-fit") for c in mine):
            if skipped:
                out.append(Absence((s,), f"{len(skipped)} configurations", "not runnable with pretrain_llama.py "
                                   "(their notes), left out by --trainable-only", "leave out --trainable-only"))
            continue
        pruned = [c for c in mine if c.status == "pruned"]
        if pruned:
            out.append(Absence((s,), "", f"not simulated: its ceiling, {max(c.bound for c in pruned):.0f} tokens/s "
                               f"per GPU, cannot beat what is ranked (--prune {prune})",
                               "--prune strategy simulates every strategy's best"))
        elif skipped:
            out.append(Absence((s,), "", "not runnable with pretrain_llama.py, left out by --trainable-only",
                               "leave out --trainable-only"))
    return out


def searched(configs, global_batch: int, ranks: int) -> dict:
    """What was searched, per strategy: the micro-batch sizes (TawPipe: micro-batches per visit at b=1,
    with the visits per shard they make), recompute, tensor-parallel sizes, and how many configurations
    were simulated, found too large without a simulation (a smaller size did not fit), pruned by their
    ceiling or left out."""
    out = {}
    for s in STRATEGY_ORDER:
        mine = [c for c in configs if c.strategy == s]
        if not mine:
            continue
        tried = [c for c in mine if c.status in ("ok", "no-fit", "skipped")]
        fits = [c for c in mine if c.status in ("ok", "skipped")]
        entry = {"micro_batch_sizes": sorted({c.micro_batch_size for c in mine}),
                 "micro_batch_sizes_fitting": sorted({c.micro_batch_size for c in fits}),
                 "tensor_parallel": sorted({c.knobs.get("tp", 1) for c in mine}),
                 "context_parallel": sorted({c.knobs.get("cp", 1) for c in mine}),
                 "recompute": sorted({c.recompute for c in mine}),
                 "configurations": len(mine), "evaluated": len(tried),
                 "larger_than_fits": sum(c.status == "larger" for c in mine),
                 "pruned": sum(c.status == "pruned" for c in mine)}
        if s == "tawpipe":
            entry["microbatches_per_visit"] = sorted({c.knobs["chunk"] for c in mine})
            entry["microbatches_per_visit_fitting"] = sorted({c.knobs["chunk"] for c in fits})
            entry["one_visit_per_shard_fits"] = any(
                c.knobs["chunk"] == global_batch // c.micro_batch_size // (ranks // (c.knobs.get("tp", 1) * c.knobs.get("cp", 1)))
                for c in fits)
        out[s] = entry
    return out


def summarize(model, cluster, global_batch: int, configs, absent, prune: str = "strategy") -> dict:
    """The advisor's answer (``--json``): ``ranked``, ``rejected`` (the smallest configuration of each
    strategy that does not fit, with ``reason`` and ``fix``), ``not_applicable`` (one line per
    :class:`~megatron_tawpipe.sim.advisor_configs.Absence`, naming its strategies), ``absent`` (the same as
    objects), ``reasons`` (per strategy, every line that says why it or some of its knobs are missing)
    and ``missing`` (the strategies with nothing in the ranking, each with its reasons)."""
    # ties (to 0.1 tok/s: several strategies at the compute bound) go to what this
    # project can train, then to the smaller memory requirement
    ok = sorted((c for c in configs if c.status == "ok"),
                key=lambda c: (-round(c.tokens_per_sec_per_gpu, 1), c.trainable is False, c.memory.total))
    nofit = [c for c in configs if c.status == "no-fit"]
    rejected = {}
    for c in sorted(nofit, key=lambda c: c.memory.total):
        rejected.setdefault(c.strategy, c)         # the smallest requirement per strategy
    out = {
        "cluster": {"ranks": cluster.ranks, "nodes": cluster.nodes, "ranks_per_node": cluster.per_node,
                    "intra_bw_bytes_per_s": cluster.intra_bw, "inter_bw_bytes_per_s": cluster.inter_bw,
                    "peak_tflops": cluster.peak_tflops, "efficiency": cluster.efficiency,
                    "gpu_memory_bytes": cluster.gpu_memory, "usable_memory_bytes": cluster.usable_memory},
        "model": dict(vars(model), params=model.params),
        "global_batch_sequences": global_batch,
        "global_batch_tokens": global_batch * model.seq_length,
        "ranked": [c.row() for c in ok],
        "rejected": [dict(c.row(), reason=no_fit_reason(c, cluster), fix=no_fit_fix(c, cluster, model))
                     for c in rejected.values()],
        "not_applicable": [f"{_group(a.strategies)}: {a.line()}" for a in absent],
        "absent": [a.as_dict() for a in absent],
        "pruned": sum(c.status == "pruned" for c in configs),
        "larger": sum(c.status == "larger" for c in configs),
        "prune": prune,
        "evaluated": sum(c.status in ("ok", "no-fit") for c in configs),
        "best": ok[0].row() if ok else None,
    }
    ranked = {c.strategy for c in ok}
    reasons = {}
    for s in STRATEGY_ORDER:
        lines = [a.line() for a in sorted(absent, key=lambda a: a.what != "") if s in a.strategies]
        if s not in ranked and s in rejected:
            c = rejected[s]
            lines.append(f"nothing fits; smallest {c.label()}: {no_fit_reason(c, cluster)}; "
                         f"fix: {no_fit_fix(c, cluster, model)}")
        if lines or s not in ranked:
            reasons[s] = lines or ["no configuration was tried"]
    out["reasons"] = reasons
    out["missing"] = {s: reasons[s] for s in STRATEGY_ORDER if s not in ranked}
    if not ok:
        smallest = min(nofit, key=lambda c: c.memory.total) if nofit else None
        out["error"] = nothing_fits_message(smallest, cluster, out["not_applicable"])
    return out


def _sizes(values) -> str:
    return ", ".join(map(str, values)) if values else "none"


def searched_lines(searched: dict) -> list:
    """One line per strategy: the micro-batch sizes tried and those that fit (TawPipe: micro-batches per
    visit at b=1, and whether one visit per shard fits), recompute and tensor-parallel sizes."""
    if not searched:
        return []
    lines = ["searched (every strategy: micro-batch sizes in powers of two up to its batch per replica, each "
             "family up to the first that does not fit; recompute on and off):"]
    for s, e in searched.items():
        if s == "tawpipe":
            what = (f"b=1 with micro-batches per visit {_sizes(e['microbatches_per_visit'])} (fit: "
                    f"{_sizes(e['microbatches_per_visit_fitting'])}; one visit per shard "
                    f"{'fits' if e['one_visit_per_shard_fits'] else 'does not fit'})")
        else:
            what = (f"b={_sizes(e['micro_batch_sizes'])} (fit: {_sizes(e['micro_batch_sizes_fitting'])})")
        cp = e.get("context_parallel", [1])
        sizes = f"T={_sizes(e['tensor_parallel'])}" + (f", C={_sizes(cp)}" if cp != [1] else "")
        lines.append(f"  {s:<12} {what}, {sizes}: {e['evaluated']} evaluated, "
                     f"{e['larger_than_fits']} larger than what fits, {e['pruned']} pruned")
    return lines


def _group(strategies) -> str:
    if set(strategies) == set(STRATEGY_ORDER):
        return "all strategies"
    return ", ".join(strategies)


def no_fit_fix(c, cluster, model) -> str:
    """What would make configuration ``c`` fit, for its largest memory term."""
    term, _ = c.memory.dominant()
    k, tips = c.knobs, []
    if term in ("activations", "logits"):
        if not c.recompute and term == "activations":
            tips.append("recompute")
        if c.micro_batch_size > 1:
            tips.append("micro-batch size 1")
    if term == "comm_buffers" and c.strategy == "tawpipe" and k.get("cache"):
        tips.append("no shard cache")
    if term in ("activations", "logits") and c.strategy in CONTEXT_PARALLEL_STRATEGIES:
        longer = [C for C in CONTEXT_PARALLEL_SIZES if C > k.get("cp", 1) and not context_parallel_problem(
            C, k.get("tp", 1), cluster.per_node, model.seq_length, cluster.ranks, MIN_TOKENS_PER_RANK)]
        if longer:
            tips.append(f"context parallelism C={longer[0]} (splits the sequence: activations and logits)")
    larger = [t for t in TENSOR_PARALLEL_SIZES if t > k.get("tp", 1) and not tensor_parallel_problem(
        t, cluster.per_node, model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size)]
    if larger:
        tips.append(f"tensor parallelism T={larger[0]} (slices every term)")
    if term in ("weights", "grads", "optimizer") and c.strategy in ("distopt-node", "hsdp"):
        tips.append("sharding over all GPUs (distopt, hfsdp, tawpipe)")
    over = c.memory.total - cluster.usable_memory
    tips.append(f"{gb(over)} more per GPU (--gpu-memory, --memory-reserve)")
    return ", or ".join(tips)


def no_fit_reason(c, cluster) -> str:
    term, value = c.memory.dominant()
    over = c.memory.total - cluster.usable_memory
    return (f"needs {gb(c.memory.total)} > {gb(cluster.usable_memory)} usable by {gb(over)}; "
            f"largest term {term} {gb(value)} ({c.memory.notes.get(term, '')})")


def nothing_fits_message(smallest, cluster, na) -> str:
    if smallest is None:
        return "no strategy applies: " + "; ".join(na)
    return (f"nothing fits in {gb(cluster.gpu_memory)} per GPU ({gb(cluster.usable_memory)} usable): "
            f"the smallest requirement is {smallest.strategy} {smallest.label()} at "
            f"{gb(smallest.memory.total)}, dominated by {smallest.memory.dominant()[0]} "
            f"({gb(smallest.memory.dominant()[1])})")


def _missing_lines(summary: dict, per_group: int) -> list:
    """The strategies missing from the ranking with their reasons, then the knobs not tried, grouped by
    the strategies they concern (at most ``per_group`` lines each; all of them in ``--json``)."""
    lines = []
    if summary["missing"]:
        lines += ["", "absent from the ranking, and why (fix after ';'):"]
        for s, why in summary["missing"].items():
            lines.append(f"  {s}:")
            lines += [f"    {x}" for x in why[:per_group]]
            if len(why) > per_group:
                lines.append(f"    ... {len(why) - per_group} more (--json: reasons)")
    groups = {}
    for a in summary["absent"]:
        if not set(a["strategies"]) <= set(summary["missing"]):
            groups.setdefault(_group(a["strategies"]), []).append(a["line"])
    if groups:
        lines += ["", "not tried, and why (fix after ';'):"]
        for key, why in groups.items():
            lines.append(f"  {key}:")
            lines += [f"    {x}" for x in why[:per_group]]
            if len(why) > per_group:
                lines.append(f"    ... {len(why) - per_group} more (--json: absent)")
    return lines


def format_report(summary: dict, top_memory: int = 3, rows: int = 15, reasons_per_group: int = 8) -> str:
    cl, md = summary["cluster"], summary["model"]
    lines = [
        f"cluster: {cl['ranks']} GPUs = {cl['nodes']} nodes x {cl['ranks_per_node']}, intra "
        f"{cl['intra_bw_bytes_per_s'] / 1e9:g} GB/s, inter {cl['inter_bw_bytes_per_s'] / 1e9:g} GB/s "
        f"({cl['inter_bw_bytes_per_s'] * 8 / 1e9:g} Gbit/s), {cl['peak_tflops']:g} TFLOP/s x "
        f"{cl['efficiency']:g}, {gb(cl['gpu_memory_bytes'])} per GPU ({gb(cl['usable_memory_bytes'])} usable)",
        f"model: L={md['num_layers']} H={md['hidden_size']} ffn={md['ffn_hidden_size']} heads "
        f"{md['num_attention_heads']}/{md['num_query_groups']} vocab {md['vocab_size']} "
        f"({md['params'] / 1e9:.2f}e9 params), S={md['seq_length']}, global batch "
        f"{summary['global_batch_sequences']} sequences ({summary['global_batch_tokens'] / 1e6:.2f}M tokens)",
        f"{summary['evaluated']} configurations evaluated, {summary['pruned']} not simulated (their "
        "ceiling cannot beat " + ("their strategy's best" if summary["prune"] == "strategy"
                                                else "their strategy's best or the runner-up") + "), "
        f"{summary.get('larger', 0)} not simulated (a smaller micro-batch of the same knobs does not fit)"]
    lines += searched_lines(summary.get("searched", {})) + [""]
    ranked = summary["ranked"]
    if ranked:
        top = ranked[0]["tokens_per_sec_per_gpu"]
        head = ("#", "strategy", "knobs", "tok/s/GPU", "vs best", "iter s", "bubble", "inter GB/node",
                "mem GB", "")
        body, seen, notes = [], set(), []
        for i, r in enumerate(ranked, 1):
            first = r["strategy"] not in seen
            seen.add(r["strategy"])
            if i > rows and not first:
                continue
            body.append((str(i), r["strategy"], r["label"], f"{r['tokens_per_sec_per_gpu']:.0f}",
                         f"{100 * (r['tokens_per_sec_per_gpu'] / top - 1):+.1f}%",
                         f"{r['iteration_time_s']:.2f}", f"{r['bubble_ratio']:.3f}",
                         f"{r['inter_bytes_per_node'] / 1e9:.1f}", f"{r['memory_bytes'] / 1e9:.1f}",
                         "" if r["trainable"] is not False else "not runnable here (note)"))
            if r["trainable"] is False and r["note"] not in notes:
                notes.append(r["note"])
        widths = [max(len(h), *(len(x[i]) for x in body)) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.ljust(w) if i in (1, 2, 9) else c.rjust(w)  # noqa: E731
                                      for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in body]
        if len(ranked) > len(body):
            lines.append(f"... {len(ranked) - len(body)} more that fit (below #{rows}: only each "
                         "strategy's best is listed)")
        lines += ["notes:"] + [f"  {n}" for n in notes] if notes else []
    if summary["rejected"]:
        lines += ["", "does not fit (smallest configuration of each strategy):"]
        for r in summary["rejected"]:
            lines.append(f"  {r['strategy']} {r['label']}: {r['reason']}; fix: {r['fix']}")
    lines += _missing_lines(summary, per_group=reasons_per_group)
    for i, r in enumerate(ranked[:top_memory], 1):
        m = MemoryBreakdown.from_dict(r["memory_breakdown"])
        lines += ["", f"memory per GPU, #{i} {r['strategy']} {r['label']}:"] + m.lines()
    if ranked:
        lines += ["", "best:", "  " + ranked[0]["command"]]
        if not ranked[0]["trainable"]:
            best_here = next((r for r in ranked if r["trainable"]), None)
            if best_here:
                lines += ["best trainable with this project:", "  " + best_here["command"]]
    return "\n".join(lines)


def check_listed(advisor, configs, listed: int) -> None:
    """Check what the answer shows (see :meth:`megatron_tawpipe.sim.advisor.Advisor.run`), in the ranking's order;
    mark the rest not checked."""
    if advisor.check_command is None:
        return
    ok = sorted((c for c in configs if c.status == "ok"),
                key=lambda c: (-round(c.tokens_per_sec_per_gpu, 1), c.memory.total))
    runnable: set = set()
    for i, cfg in enumerate(ok):
        if i < listed or cfg.strategy not in runnable or not runnable:
            if advisor.check(cfg):
                runnable.add(cfg.strategy)
        elif not cfg.checked:
            cfg.trainable, cfg.note = None, "not checked against pretrain_llama.py (not listed)"


def check_with_plan_file(advisor, cfg) -> str:
    """The advisor's ``check_command`` of ``cfg``'s command; a plan-file configuration with its plan written
    first."""
    if not cfg.knobs.get("plan_schedule"):
        return advisor.check_command(cfg.argv, advisor.cluster.ranks)
    sub, inner, _ = advisor._split(cfg)
    plan = sub._plan(wp_schedule(inner), advisor.G // cfg.micro_batch_size // sub.cluster.ranks, **wp_options(inner))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, PLAN_FILE)
        write_plan(plan, path)
        argv = ["plan:" + path if a == "plan:" + PLAN_FILE else a for a in cfg.argv]
        return advisor.check_command(argv, advisor.cluster.ranks)
