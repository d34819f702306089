"""Megatron's native pipeline schedules on gloo match a single-process run."""

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, assert_matches_reference, losses, tiny_args, train_rank


@pytest.fixture(scope="module")
def reference():
    (records,) = run_ranks(train_rank, 1, tiny_args("--pipeline-model-parallel-size", "1"))
    return records


@pytest.mark.parametrize("world,extra", [
    (2, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--pipeline-model-parallel-size", "4"]),
    (4, ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "4",
         "--num-layers-per-virtual-pipeline-stage", "1"]),
], ids=["1f1b-pp2", "1f1b-pp4", "interleaved-pp4-vp2"])
def test_pipeline_matches_single_process(reference, world, extra):
    per_rank = run_ranks(train_rank, world, tiny_args(*extra))
    assert len(reference) == 3
    for records in per_rank:  # every rank reports the same, reduced loss
        assert_close_rel(losses(records), losses(reference), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], 1e-4, "grad norm")
    # The run trains: the loss moves between iterations.
    assert losses(reference)[0] != losses(reference)[-1]


def test_data_parallel_pipeline_matches_single_process(reference):
    """pp 2 x dp 2: megatron DDP averages over replicas, the pipeline over stages."""
    per_rank = run_ranks(train_rank, 4, tiny_args("--pipeline-model-parallel-size", "2"))
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)


# ---- stages of different sizes: megatron-core's own uneven pipelines, chosen by Megatron-LM's flags ----------

UNEVEN_ITERS = 3


def _uneven_args(layers, *extra, save):
    argv = tiny_args(*extra, "--save", save, "--save-interval", "1", train_iters=UNEVEN_ITERS)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return argv


@pytest.fixture(scope="module")
def uneven_reference(tmp_path_factory):
    cache = {}

    def get(layers):
        if layers not in cache:
            save = str(tmp_path_factory.mktemp(f"native-ref-L{layers}"))
            (records,) = run_ranks(train_rank, 1, _uneven_args(layers, save=save))
            cache[layers] = (records, save)
        return cache[layers]

    return get


UNEVEN = [
    # world, layers, flags: megatron-core builds each stage's layers (num_layers_in_first/last_pipeline_stage,
    # pipeline_model_parallel_layout); the layer counts are not divisible by the pipeline size.
    (3, 5, ["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"]),      # 1, 2, 2
    (2, 3, ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"]),       # 2, 1
    (2, 5, ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",              # 1, 1 | 2, 1
            "--pipeline-model-parallel-layout", "Et|t|tt|tL"]),
]


@pytest.mark.parametrize("world,layers,extra", UNEVEN, ids=["1f1b-pp3-first1-L5", "1f1b-pp2-last1-L3",
                                                            "interleaved-pp2-vp2-layout-L5"])
def test_uneven_pipeline_matches_single_process(uneven_reference, tmp_path, world, layers, extra):
    """Loss, gradient norm and the gradients entering every step within 1e-5, every parameter within what
    Adam makes of that (training_helpers.assert_matches_reference), clipping active."""
    ref_records, ref_save = uneven_reference(layers)
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, world, _uneven_args(layers, *extra, save=save))
    for records in per_rank:
        assert_close_rel(losses(records), losses(ref_records), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records], 1e-5, "grad norm")
    assert max(r["grad_norm"] for r in ref_records) > 1.0 and losses(ref_records)[0] != losses(ref_records)[-1]
    assert_matches_reference(save, ref_save, UNEVEN_ITERS)


def _stage_layers(rank, argv):
    """The global decoder layers of each model chunk this rank builds, and the virtual pipeline size."""
    from megatron_tawpipe.arguments import parse_args, virtual_pipeline_size
    from megatron_tawpipe.training import build_trainer
    from megatron_tawpipe.data import build_tokenizer
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed, initialize_model_parallel
    from megatron_tawpipe.models.parameters import unwrap_model
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.training.validate_args import validate_args

    args = validate_args(parse_args(argv))
    initialize_distributed(args)
    initialize_model_parallel(args)
    try:
        build_tokenizer(args)
        trainer = build_trainer(args, gpt_forward_step)
        return ([[layer.layer_number - 1 for layer in unwrap_model(chunk).decoder.layers] for chunk in trainer.model],
                virtual_pipeline_size(args))
    finally:
        destroy()


@pytest.mark.parametrize("case,expected", [
    (UNEVEN[0], [[[0]], [[1, 2]], [[3, 4]]]),
    (UNEVEN[1], [[[0, 1]], [[2]]]),
    # layout stages in order: (vp 0: rank 0, rank 1), (vp 1: rank 0, rank 1)
    (UNEVEN[2], [[[0], [2, 3]], [[1], [4]]]),
], ids=["first1", "last1", "layout"])
def test_uneven_stages_hold_the_layers_the_flags_give(tmp_path, case, expected):
    world, layers, extra = case
    per_rank = run_ranks(_stage_layers, world, _uneven_args(layers, *extra, save=str(tmp_path)))
    assert [chunks for chunks, _ in per_rank] == expected
    assert {vp for _, vp in per_rank} == {2 if "interleaved" in extra else None}


@pytest.mark.parametrize("world,layers,extra,message", [
    (2, 5, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|tt|tL"],
     "has 4 stages, 2 per pipeline rank: --pipeline-schedule 1f1b runs one per rank"),
    (2, 5, ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
            "--pipeline-model-parallel-layout", "Ettt|ttL"], "interleaved needs two or more per rank"),
    (2, 4, ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
            "--pipeline-model-parallel-layout", "Et|t|t|tL", "--num-layers-per-virtual-pipeline-stage", "1"],
     "cannot be combined with --num-layers-per-virtual-pipeline-stage"),
    (2, 5, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "ttt|ttL"],
     "The first layer must be embedding"),
    (2, 5, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tt"],
     "The last layer must be loss"),
    (2, 6, ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
            "--decoder-first-pipeline-num-layers", "2"], "give the virtual stages with --pipeline-model-parallel-layout"),
    (4, 6, ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1"],
     "the 5 layers left must divide evenly over the 3 middle pieces"),
    (2, 5, ["--pipeline-model-parallel-size", "2"], "--num-layers 5 must be divisible by --pipeline-model-parallel-size 2"),
])
def test_uneven_native_flags_refused_in_one_line(tmp_path, world, layers, extra, message):
    import re

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.common.errors import ArgumentError
    from megatron_tawpipe.training.validate_args import validate_args

    with pytest.raises(ArgumentError, match=re.escape(message)):
        validate_args(parse_args(_uneven_args(layers, *extra, save=str(tmp_path))), world_size=world)
