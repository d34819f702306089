"""Small models, in-process training runs and flag checks shared by the tests."""

from __future__ import annotations

import contextlib
from typing import List, Optional

from megatron_tawpipe.arguments import LLAMA_FLAGS

TINY_SHAPE = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "200",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--untie-embeddings-and-output-weights",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
    "--clip-grad", "1.0", "--seed", "7", "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1000",
    "--adam-beta2", "0.95", "--num-workers", "0",
]
TINY_MODEL = list(LLAMA_FLAGS) + TINY_SHAPE
# Megatron-LM's default architecture (GPT: LayerNorm, GELU, linear biases, learned absolute
# positions), without dropout so that runs can be compared exactly.
GPT_FLAGS = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--no-create-attention-mask-in-dataloader"]


def pinned_layout(groups: int, recompute: bool = True) -> List[str]:
    """TawPipe's layout flags, every knob given: one owner per shard, one shard per rank, the shard cache where
    there are two or more groups, one micro-batch per visit, the hierarchical reduction, no replicated first shard,
    recompute (the layout TawPipe ran by default before the run decided it). For tests whose figures belong to one
    layout (bytes, plan steps, files) or that compare separately launched runs bit for bit: with a layout flag at
    auto the run decides on what it measures (docs/tawpipe-layout.md)."""
    return ["--tawpipe-ownership", "owner", "--tawpipe-shards-per-rank", "1", "--no-tawpipe-replicate-first-shard",
            "--tawpipe-cache", "on" if groups >= 2 else "off", "--tawpipe-microbatches-per-visit", "1",
            "--tawpipe-replicated-reduce", "hierarchical", "--tawpipe-recompute", "on" if recompute else "off"]


RECOMPUTE_FLAGS = ("--tawpipe-recompute", "--tawpipe-no-recompute", "--recompute-granularity")


def recompute_as_written(argv: List[str]) -> List[str]:
    """A tawpipe / weipipe case written when both recomputed by default (before ``--tawpipe-recompute auto``, which
    keeps a tiny model's activations): ``--tawpipe-recompute on`` unless the case sets recompute itself, so that it
    keeps running the recomputing path it was written for."""
    if "--pipeline-schedule" not in argv or any(flag in argv for flag in RECOMPUTE_FLAGS):
        return list(argv)
    if argv[argv.index("--pipeline-schedule") + 1] not in ("tawpipe", "weipipe"):
        return list(argv)
    return list(argv) + ["--tawpipe-recompute", "on"]


def tiny_args(*extra: str, train_iters: int = 3, global_batch: int = 8, micro_batch: int = 1,
              architecture=LLAMA_FLAGS) -> List[str]:
    return list(architecture) + TINY_SHAPE + ["--train-iters", str(train_iters), "--global-batch-size", str(global_batch),
                         "--micro-batch-size", str(micro_batch)] + list(extra)


def data_args(prefix: str, tokenizer_flags: List[str], train_iters: int = 2) -> List[str]:
    """``tiny_args`` training on the indexed data at ``prefix`` with the tokenizer ``tokenizer_flags`` give."""
    argv = tiny_args(train_iters=train_iters)
    i = argv.index("--mock-data")
    argv[i:i + 1] = ["--data-path", prefix, "--split", "90,10,0"]
    for flag in ("--tokenizer-type", "--vocab-size"):
        j = argv.index(flag)
        del argv[j:j + 2]
    return argv + list(tokenizer_flags)


def train_rank(rank: int, argv: List[str], forward_step_func=None) -> List[dict]:
    """Body of one rank: parse, validate, train (with the GPT forward step unless ``forward_step_func`` is
    given), tear down; return the iteration records."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    args = validate_args(parse_args(argv))
    try:
        return [record.to_json() for record in pretrain(args, forward_step_func or gpt_forward_step)]
    finally:
        destroy()


@contextlib.contextmanager
def loaded_trainer(argv: List[str]):
    """The trainer ``pretrain_llama.py`` builds for ``argv`` (process groups up, tokenizer built) with the
    checkpoint under ``--load`` loaded: yields ``(trainer, (iteration, consumed samples))``; tears down after."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.checkpoint import load_checkpoint
    from megatron_tawpipe.data import build_tokenizer
    from megatron_tawpipe.distributed.initialize import destroy, initialize_distributed, initialize_model_parallel
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.training.loop import build_trainer, legacy_reference_factory
    from megatron_tawpipe.training.validate_args import validate_args

    args = validate_args(parse_args(argv))
    initialize_distributed(args)
    initialize_model_parallel(args)
    try:
        build_tokenizer(args)
        trainer = build_trainer(args, gpt_forward_step)
        yield trainer, load_checkpoint(args.load, trainer, None, args,
                                       legacy_reference_factory(args, gpt_forward_step))
    finally:
        destroy()


def metrics_by_iteration(path) -> dict:
    """A ``--metrics-file``'s records by iteration, the last of each (a resumed run repeats those after its
    checkpoint); empty while the file does not exist."""
    import json
    import os

    last = {}
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            if line.strip():
                record = json.loads(line)
                last[record["iteration"]] = record
    return last


def losses(records: List[dict]) -> List[float]:
    return [r["lm_loss"] for r in records]


def assert_close_rel(actual: List[float], expected: List[float], rtol: float, what: str = "loss") -> None:
    assert len(actual) == len(expected), (actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e), f"{what} at iteration {i + 1}: {a} vs reference {e} (rtol {rtol})"


def data_args_error(args) -> str:
    """The one-line ValueError that ``validate_data_args`` raises for ``args``."""
    import pytest

    from megatron_tawpipe import data

    with pytest.raises(ValueError) as info:
        data.validate_data_args(args)
    message = str(info.value)
    assert "\n" not in message
    return message


def assert_same_parameters(root, reference_root, iteration, rtol=1e-5):
    """The optimizer's gradients and every parameter up to the checkpoint at ``iteration`` agree with the
    reference's as :func:`assert_matches_reference` derives (both runs save every iteration)."""
    assert_matches_reference(root, reference_root, iteration, rtol)


def assert_matches_reference(root, reference_root, iterations, rtol=1e-5):
    """The gradients that entered the optimizer at every step agree with the reference's to ``rtol`` of each
    tensor's largest, and every parameter lies within the distance that Adam can carry gradient differences of
    that size (see :mod:`adam_bounds`). Both runs saved torch_dist checkpoints every iteration up to
    ``iterations``; the learning rate of each step is the one megatron's scheduler gives the saved arguments."""
    from adam_bounds import adam_problems, read_adam_history, step_hyperparameters

    ours, theirs = (read_adam_history(r, iterations) for r in (root, reference_root))
    assert set(ours[0]) == set(theirs[0]), sorted(set(ours[0]) ^ set(theirs[0]))
    hyper = step_hyperparameters(reference_root, {name: p.shape for name, (p, _, _) in theirs[0].items()},
                                 iterations)
    problems = adam_problems(ours, theirs, hyper, rtol)
    assert not problems, "\n".join(problems[:20])


def assert_trains_like(per_rank: List[List[dict]], reference: List[dict], save: str, reference_save: str,
                       iterations: int, rtol: float = 1e-5) -> None:
    """Every rank's losses and gradient norms within ``rtol`` of a single-process reference that trains (its
    loss moves, its gradient norm exceeds 1: clipping active); gradients and parameters after every step as
    :func:`assert_matches_reference` compares them."""
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), rtol)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], rtol, "grad norm")
    assert max(r["grad_norm"] for r in reference) > 1.0 and losses(reference)[0] != losses(reference)[-1]
    assert_matches_reference(save, reference_save, iterations, rtol)


def flag_answer(argv):
    """How the Megatron-LM flags ``argv`` (after ``tiny_args()``) are answered: ('accepted', notices) or
    ('refused', the line)."""
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.compat.megatron_lm import NOTICES

    try:
        return "accepted", getattr(parse_args(tiny_args() + argv), NOTICES, [])
    except ArgumentError as exc:
        return "refused", str(exc)


def without_notices(args) -> dict:
    """Parsed flags as a dict, the notices left out."""
    from megatron_tawpipe.compat.megatron_lm import NOTICES

    values = dict(vars(args))
    values.pop(NOTICES, None)
    return values
