"""The simulator's bytes between nodes against the closed forms of docs/benchmarks-multinode.md, with the
word embedding tied to the output layer (Megatron-LM's default) and untied."""

import argparse

import pytest

from megatron_tawpipe.bench.benchmark import BenchmarkConfig
from megatron_tawpipe.bench.equal_memory import simulate_command
from megatron_tawpipe.cli.plan_args import add_model_args, cost_model, run_one
from megatron_tawpipe.sim.costmodel import params_per_layer

D, M = 2, 2                    # nodes, ranks per node
P = D * M
L, H, FFN, HEADS, S, V = 4, 64, 176, 2, 128, 256
PER_RANK = 4                   # micro-batches per rank
W = G = 4                      # fp32 weights and gradients


def _run(schedule, *extra):
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--ranks", str(P), "--groups", str(D), "--num-layers", str(L), "--hidden-size", str(H),
                         "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS), "--seq-length", str(S),
                         "--vocab-size", str(V), "--num-microbatches", str(PER_RANK), "--dtype-bytes", "4",
                         "--inter-bw", "1GB/s", "--no-recompute", *extra])
    _, result = run_one(schedule, args, cost_model(args))
    return result


PSI_L = L * params_per_layer(H, FFN, HEADS, HEADS)


def _psi_r(tied):
    return (1 if tied else 2) * V * H + H


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("reduce", ["hierarchical", "flat"])
def test_tawpipe_node_bytes_are_the_closed_form(tied, reduce):
    """(w+g) Psi_L (D-1) -- each foreign shard in and its gradient out once, the cache on -- plus the
    replicated parameters' all-reduce: through the nodes, each node's link 2(D-1)/D g Psi_R, D of them;
    flat, a ring over all P ranks, D hops crossing: D 2(P-1)/P g Psi_R."""
    flags = ("--cache", "--chunk", "2", "--tawpipe-replicated-reduce", reduce) + \
        (("--tie-embeddings-and-output-weights",) if tied else ())
    r = _run("tawpipe", *flags)
    ring = 2 * (D - 1) / D if reduce == "hierarchical" else 2 * (P - 1) / P
    expected = (W + G) * PSI_L * (D - 1) + D * ring * G * _psi_r(tied)
    assert r.link_bytes["inter"] == pytest.approx(expected, rel=1e-12)


def test_tied_and_untied_tawpipe_differ_by_one_embedding_in_the_all_reduce():
    for reduce, ring, inside in (("flat", 2 * (P - 1) / P, 2 * (P - 1) / P),
                                 ("hierarchical", 2 * (D - 1) / D, 2 * (D - 1) / D / M + 2 * (M - 1) / M)):
        flags = ("--cache", "--tawpipe-replicated-reduce", reduce)
        tied = _run("tawpipe", *flags, "--tie-embeddings-and-output-weights")
        untied = _run("tawpipe", *flags)
        assert untied.link_bytes["inter"] - tied.link_bytes["inter"] == pytest.approx(D * ring * G * V * H)
        assert untied.replicated_allreduce_bytes - tied.replicated_allreduce_bytes == pytest.approx(
            P * inside * G * V * H)


@pytest.mark.parametrize("tied", [True, False])
def test_pp_nodes_node_bytes_are_the_closed_form(tied):
    """2 (D-1) N M a (boundary activations and their gradients, N micro-batches in each of the M
    pipelines) plus, tied, the embedding gradient's all-reduce between each pipeline's first and last
    stage: 2 members on 2 nodes, each sending g V H, 2 M g V H in all; none untied."""
    r = _run("pp-nodes", *(("--tie-embeddings-and-output-weights",) if tied else ()))
    a = S * H * 4
    n = PER_RANK * P // M
    expected = 2 * (D - 1) * n * M * a + (2 * M * G * V * H if tied else 0)
    assert r.link_bytes["inter"] == expected
    assert r.options["embedding_allreduce_bytes"] == (2 * M * G * V * H if tied else 0)
    # The all-reduce is priced in time too: after the last backward, before the step.
    untied = _run("pp-nodes")
    if tied:
        t = r.options["embedding_allreduce_s"]
        # each ring step sends g V H / 2 both ways; M pairs share the 1 GB/s link
        assert t >= 2 * (G * V * H / 2) / (1e9 / M)
        assert r.iteration_time == pytest.approx(untied.iteration_time + t)
        assert r.tokens_per_sec_per_rank < untied.tokens_per_sec_per_rank


def test_pipeline_over_all_ranks_all_reduces_the_tied_embedding():
    """1F1B over all P ranks (one pipeline): first stage on node 0, last on node D-1."""
    tied = _run("1f1b", "--tie-embeddings-and-output-weights")
    untied = _run("1f1b")
    assert tied.link_bytes["inter"] - untied.link_bytes["inter"] == 2 * G * V * H
    assert tied.iteration_time > untied.iteration_time
    # on one node both stages sit inside it: the bytes stay there
    p = argparse.ArgumentParser()
    add_model_args(p)
    base = ["--ranks", "2", "--groups", "1", "--num-layers", "2", "--hidden-size", str(H), "--vocab-size", str(V),
            "--seq-length", str(S), "--dtype-bytes", "4"]
    a_tied, a_untied = p.parse_args(base + ["--tie-embeddings-and-output-weights"]), p.parse_args(base)
    r_tied, r_untied = (run_one("1f1b", a, cost_model(a))[1] for a in (a_tied, a_untied))
    assert r_tied.link_bytes["inter"] == r_untied.link_bytes["inter"] == 0
    assert r_tied.link_bytes["intra"] - r_untied.link_bytes["intra"] == 2 * G * V * H


def test_data_parallel_psi_counts_a_tied_embedding_once():
    """distopt over all P ranks: D 2(P-1)/P g Psi + D (P-1)/P w Psi (gloo's reduce-scatter moves an
    all-reduce's bytes), Psi = Psi_L + Psi_R."""
    r = _run("distopt", "--tie-embeddings-and-output-weights", "--backend", "gloo")
    psi = PSI_L + _psi_r(True)
    assert r.link_bytes["inter"] == pytest.approx(D * 2 * (P - 1) / P * G * psi + D * (P - 1) / P * W * psi)


@pytest.mark.parametrize("untie", [False, True])
def test_benchmark_simulates_the_embedding_layout_it_runs(untie):
    model = ["--num-layers", "4", "--hidden-size", "64", "--seq-length", "128", "--global-batch-size", "8"]
    model += ["--untie-embeddings-and-output-weights"] if untie else []
    config = BenchmarkConfig(schedules=("tawpipe", "pp-nodes"), ranks=4, model_args=model, cluster=(2, 2, "1gbit"))
    cmd = simulate_command(config, 1, ["tawpipe", "pp-nodes"], decided=False)
    assert ("--tie-embeddings-and-output-weights" in cmd) is (not untie)
