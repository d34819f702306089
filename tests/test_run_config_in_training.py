"""The loop builds the run's records once, after the tokenizer, and the trainer it builds reads those."""

import pytest
from distributed_harness import run_ranks

from megatron_tawpipe.arguments.run_config import RunConfig

from training_helpers import tiny_args


def _trainer_sees_the_loops_records(rank, argv):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import build_trainer, pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.training.validate_args import validate_args

    seen = []

    def factory(args, forward_step_func, run):
        trainer = build_trainer(args, forward_step_func, run)
        seen.append(getattr(trainer, "run", None) or trainer.config)
        assert isinstance(run, RunConfig) and run.model.padded_vocab_size == args.padded_vocab_size
        seen.append(run)
        return trainer

    try:
        pretrain(validate_args(parse_args(argv)), gpt_forward_step, trainer_factory=factory)
    finally:
        destroy()
    return seen[0] is seen[1]


@pytest.mark.parametrize("schedule", ["tawpipe", "1f1b"])
def test_the_loop_builds_the_records_once_and_the_trainer_reads_those(schedule):
    flags = ["--pipeline-schedule", schedule] + (["--pipeline-model-parallel-size", "2"] if schedule == "1f1b" else [])
    assert run_ranks(_trainer_sees_the_loops_records, 2, tiny_args(*flags, train_iters=2)) == [True, True]
