"""The benchmark's results for people: the table, the chart, and the comparison with the simulator's
prediction (measured against predicted tokens/s, and every strategy's ratio to TawPipe)."""

from __future__ import annotations

from typing import List, Optional

from megatron_tawpipe.bench.collective_bytes import format_formulas
from megatron_tawpipe.bench.equal_memory import RULES, activation_memory, predicted_memory_by_schedule
from megatron_tawpipe.common.units import parse_tc_rate


def _fmt_bytes(value: Optional[float]) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def format_table(result: dict) -> str:
    """The results table; on an emulated cluster, then each strategy's between-node bytes by formula."""
    rows = result["summary"]
    cluster = any(r.get("node_tx_bytes_per_iteration") is not None for r in rows)
    counted = any(r.get("inter_node_bytes_per_iteration") is not None for r in rows)
    headers = ["schedule", "mbs", "tokens/s/rank", "spread", "ms/iter"]
    if counted:
        headers += ["between nodes/iter", "inside nodes/iter"]
    headers.append("plan transfers/iter")
    if cluster:
        headers += ["counted whole run/iter", "eth0 tx/iter", "eth0/counted"]
    # an equal-memory run: each strategy's predicted whole memory beside its measured peak
    predicted = predicted_memory_by_schedule(result) if result.get("equal_memory") else {}
    headers += ["peak mem/rank"] + (["predicted mem"] if predicted else []) + ["busy"]
    # on an emulated cluster with shaped links: how busy a node's link is, each way (ring collectives send
    # alike from every node: between-node bytes / nodes / (rate x iteration))
    link_rate = _link_bytes_per_s(result) if counted else None
    if link_rate:
        headers.append("node link busy")
    lines = []
    for r in rows:
        cells = [r["schedule"], str(r.get("micro_batch_size") or "-"), f"{r['tokens_per_sec_per_rank']:.1f}",
                 f"{r['tokens_per_sec_per_rank_min']:.0f}-{r['tokens_per_sec_per_rank_max']:.0f}"
                 f" ({r['spread_pct']:.0f}%)" if r["spread_pct"] is not None else "-",
                 f"{r['elapsed_ms']:.0f}"]
        if counted:
            cells += [_fmt_bytes(r.get("inter_node_bytes_per_iteration")),
                      _fmt_bytes(r.get("intra_node_bytes_per_iteration"))]
        cells.append(_fmt_bytes(r["inter_group_bytes"]))
        if cluster:
            whole, tx = r.get("inter_node_bytes_whole_run_per_iteration"), r["node_tx_bytes_per_iteration"]
            cells += [_fmt_bytes(whole), _fmt_bytes(tx), f"{tx / whole:.3f}" if whole and tx is not None else "-"]
        cells += [_fmt_bytes(r["peak_memory_bytes_max_rank"])]
        cells += [_fmt_bytes(predicted.get(r["schedule"]))] if predicted else []
        cells += ["-" if r["compute_busy_fraction"] is None else f"{100 * r['compute_busy_fraction']:.0f}%"]
        if link_rate:
            busy = node_link_busy(r, result["config"]["cluster"][0], link_rate)
            cells.append("-" if busy is None else f"{100 * busy:.0f}%")
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(headers)]
    out = []
    if result.get("equal_memory"):
        selection = result["equal_memory"]
        out.append(f"{RULES[selection.get('rule', 'activations')]}: budget {_fmt_bytes(selection['budget_bytes'])} "
                   f"({selection['budget_from']})")
    out.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    out.append("  ".join("-" * w for w in widths))
    for cells in lines:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    if counted:
        out += ["", BYTES_LEGEND]
        out += format_byte_formulas(result)
    return "\n".join(out)


def _link_bytes_per_s(result: dict) -> Optional[float]:
    """The emulated node links' rate in bytes/s (None off a cluster or unshaped)."""
    cluster = (result.get("config") or {}).get("cluster")
    bits = parse_tc_rate(cluster[2]) if cluster else None
    return bits / 8 if bits else None


def node_link_busy(row: dict, nodes: int, link_bytes_per_s: float) -> Optional[float]:
    """The share of an iteration a node's link (each way) carries a strategy's between-node bytes: a measured
    iteration's counted bytes between nodes, over the nodes, at the link's rate, over the iteration's time."""
    sent, ms = row.get("inter_node_bytes_per_iteration"), row.get("elapsed_ms")
    if sent is None or not ms or nodes < 2:
        return None
    return sent / nodes / link_bytes_per_s / (ms / 1000.0)


BYTES_LEGEND = ("between/inside nodes: every collective and transfer the ranks called, each counted by the "
                "algorithm gloo runs (sum over ranks, median of the measured iterations); plan transfers: what "
                "the weight-passing executor counts of its plan (no replicated all-reduce); counted whole run: "
                "start-up included, / iterations, as eth0 tx (what every node's interface sent, headers included)")


def format_byte_formulas(result: dict) -> List[str]:
    """Per strategy, its calls by formula (operation, members, ring hops between nodes) in a measured
    iteration (all ranks): what its between/inside-node columns are made of."""
    out = []
    for r in result["summary"]:
        formulas = r.get("formulas_per_iteration") or {}
        if not formulas:
            continue
        out.append(f"{r['schedule']} (one measured iteration, all ranks):")
        out += ["  " + line for line in format_formulas(formulas)]
    return out


def write_chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    names = [r["schedule"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    tps = [r["tokens_per_sec_per_rank"] for r in rows]
    err = [[t - r["tokens_per_sec_per_rank_min"] for t, r in zip(tps, rows)],
           [r["tokens_per_sec_per_rank_max"] - t for t, r in zip(tps, rows)]]
    axes[0].bar(names, tps, yerr=err, capsize=4, color="tab:blue")
    axes[0].set_title("tokens/s per rank (median, min-max)")
    inter = [(r["node_tx_bytes_per_iteration"] if r.get("node_tx_bytes_per_iteration") is not None
              else r.get("inter_node_bytes_per_iteration", r["inter_group_bytes"])) or 0 for r in rows]
    axes[1].bar(names, [b / 1e6 for b in inter], color="tab:orange")
    axes[1].set_title("MB between nodes / iteration")
    axes[2].bar(names, [(r["peak_memory_bytes_max_rank"] or 0) / 2 ** 20 for r in rows], color="tab:green")
    axes[2].set_title("peak memory per rank (MiB)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    cfg = result["config"]
    where = (f"emulated {cfg['cluster'][0]} nodes x {cfg['cluster'][1]} ranks, {cfg['cluster'][2]}"
             if cfg.get("cluster") else f"{cfg['ranks']} local ranks")
    fig.suptitle(f"{where}; {cfg['repetitions']} repetitions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def simulated_rows(result: dict) -> List[dict]:
    """The simulator's predictions an equal-memory benchmark made for each strategy at the micro-batch size
    it ran (``result["equal_memory"]``), as ``tools/simulate.py --json`` rows."""
    selection = result.get("equal_memory") or {}
    ran = result["config"].get("micro_batch_sizes") or {}
    rows = []
    for s, c in (selection.get("choices") or {}).items():
        size = ran.get(s, c["micro_batch_size"])
        priced = [c] + list(c.get("tried") or [])
        row = next((p for p in priced if p["micro_batch_size"] == size), None)
        if row and row.get("predicted_tokens_per_sec_per_rank"):
            rows.append({"schedule": s, "tokens_per_sec_per_rank": row["predicted_tokens_per_sec_per_rank"],
                         "busy": row.get("predicted_busy"),
                         "predicted_inter_node_bytes": row.get("predicted_inter_node_bytes"),
                         "activation_memory_bytes": row.get("activation_bytes"),
                         "memory_bytes_whole": row.get("memory_bytes")})
    return rows


def compare_with_simulation(result: dict, simulated: Optional[List[dict]] = None, reference: str = "tawpipe") -> dict:
    """Measured against predicted: tokens/s per schedule and the ratios ``reference`` / other.

    ``simulated`` is ``tools/simulate.py --json`` output for the same configuration (default: the
    predictions an equal-memory run made at each strategy's own micro-batch size). A ratio's deviation
    is (measured ratio / predicted ratio - 1).
    """
    if simulated is None:
        simulated = simulated_rows(result)
    measured = {row["schedule"]: row["tokens_per_sec_per_rank"] for row in result["summary"]}
    predicted = {row["schedule"]: row["tokens_per_sec_per_rank"] for row in simulated}
    summary = {row["schedule"]: row for row in result["summary"]}
    sim = {row["schedule"]: row for row in simulated}
    rows = [{"schedule": s, "measured": measured[s], "predicted": predicted[s],
             "measured_over_predicted": measured[s] / predicted[s],
             "busy_measured": summary[s].get("compute_busy_fraction"), "busy_predicted": _predicted_busy(sim[s]),
             # what the plan's compute held beyond its start (--record-plan-memory), against the memory
             # model's activations and logits
             "plan_memory_measured": summary[s].get("plan_memory_growth_bytes_max_rank"),
             "plan_memory_predicted": _activation_memory(sim[s]),
             # the whole footprint: the measured peak against the memory model's every part
             "memory_measured": summary[s].get("peak_memory_bytes_max_rank"),
             "memory_predicted": _whole_memory(sim[s]),
             # between nodes per iteration: every collective counted in the run, and the simulator's bytes
             "node_bytes_measured": summary[s].get("inter_node_bytes_per_iteration"),
             "node_bytes_predicted": sim[s].get("inter_group_bytes", sim[s].get("predicted_inter_node_bytes"))}
            for s in measured if s in predicted]
    ratios = []
    if reference in measured and reference in predicted:
        for s in measured:
            if s != reference and s in predicted:
                m, p = measured[reference] / measured[s], predicted[reference] / predicted[s]
                ratios.append({"ratio": f"{reference}/{s}", "measured": m, "predicted": p, "deviation": m / p - 1})
    return {"rows": rows, "ratios": ratios}


def _activation_memory(row: dict) -> Optional[float]:
    """Activations and logits of a prediction: an equal-memory choice's, or a ``tools/simulate.py`` row's."""
    if "activation_memory_bytes" in row:
        return row["activation_memory_bytes"]
    return activation_memory(row) if "activation_bytes" in row else None


def _whole_memory(row: dict) -> Optional[float]:
    """The whole footprint of a prediction: an equal-memory choice's, or a ``tools/simulate.py`` row's."""
    if "memory_bytes_whole" in row:
        return row["memory_bytes_whole"]
    memory = (row.get("options") or {}).get("memory_breakdown")
    return float(sum(v for k, v in memory.items() if k not in ("total", "notes"))) if memory else None


def _predicted_busy(row: dict) -> Optional[float]:
    if row.get("busy") is not None:
        return row["busy"]
    return 1.0 - row["bubble_ratio"] if row.get("bubble_ratio") is not None else None


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:.0f} MB"


def _mb1(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:.1f} MB"


def format_comparison(comparison: dict) -> str:
    memory = any(r.get("plan_memory_measured") is not None for r in comparison["rows"])
    whole = any(r.get("memory_measured") is not None and r.get("memory_predicted") is not None
                for r in comparison["rows"])
    nodes = any(r.get("node_bytes_measured") is not None and r.get("node_bytes_predicted") is not None
                for r in comparison["rows"])
    out = [f"{'schedule':<15}  {'measured tok/s/rank':>19}  {'simulated':>9}  {'measured/simulated':>18}  "
           f"{'busy':>5}  {'simulated':>9}" + (f"  {'plan memory':>11}  {'simulated':>9}" if memory else "")
           + (f"  {'between nodes':>13}  {'simulated':>9}" if nodes else "")
           + (f"  {'peak memory':>11}  {'whole, simulated':>16}" if whole else "")]
    for r in comparison["rows"]:
        out.append(f"{r['schedule']:<15}  {r['measured']:>19.1f}  {r['predicted']:>9.1f}  "
                   f"{r['measured_over_predicted']:>18.2f}  {_pct(r.get('busy_measured')):>5}  "
                   f"{_pct(r.get('busy_predicted')):>9}" +
                   (f"  {_mb(r.get('plan_memory_measured')):>11}  {_mb(r.get('plan_memory_predicted')):>9}"
                    if memory else "") +
                   (f"  {_mb1(r.get('node_bytes_measured')):>13}  {_mb1(r.get('node_bytes_predicted')):>9}"
                    if nodes else "") +
                   (f"  {_mb(r.get('memory_measured')):>11}  {_mb(r.get('memory_predicted')):>16}" if whole else ""))
    out.append("")
    out.append(f"{'ratio':<20}  {'measured':>8}  {'simulated':>9}  {'deviation':>9}")
    for r in comparison["ratios"]:
        out.append(f"{r['ratio']:<20}  {r['measured']:>8.2f}  {r['predicted']:>9.2f}  {100 * r['deviation']:>+8.0f}%")
    return "\n".join(out)
