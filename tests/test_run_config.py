"""arguments.run_config: the flags read once into frozen records; sim.run_cost: one cost model of a run."""

import dataclasses
import json

import pytest

from megatron_tawpipe.arguments import LLAMA_FLAGS, parse_args
from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig, RunConfig
from megatron_tawpipe.sim.costmodel import CostModel
from megatron_tawpipe.sim.run_cost import cost_model_for_run

from training_helpers import tiny_args


def _config(*extra, world=4, per_node=4):
    from megatron_tawpipe.training.validate_args import validate_args

    args = validate_args(parse_args(tiny_args(*extra)), world_size=world)
    return args, RunConfig.from_args(args, world_size=world, ranks_per_node=per_node)


def test_the_records_hold_the_flags_and_are_frozen():
    args, config = _config("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                           "--tawpipe-microbatches-per-visit", "2", "--tensor-model-parallel-size", "2")
    assert config.model.hidden_size == args.hidden_size and config.model.swiglu and config.model.tie_embeddings is False
    assert (config.layout.world_size, config.layout.tensor_model_parallel_size, config.layout.data_parallel_size,
            config.layout.tawpipe_num_groups, config.layout.ranks_per_node) == (4, 2, 2, 2, 4)
    assert config.layout.data_parallel_size == args.data_parallel_size
    assert config.schedule.plan_name == "tawpipe" and config.schedule.tawpipe_microbatches_per_visit == 2
    assert config.schedule.recompute and config.precision.compute_bytes == 4 and config.precision.grad_bytes == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 1


def test_schedule_names_and_ownership():
    _, weipipe = _config("--pipeline-schedule", "weipipe", "--weipipe-zero-bubble", "2")
    assert weipipe.schedule.plan_name == "weipipe-zb2"
    # the layout flags left at auto are the run's to decide at start-up: a record made before that refuses to answer
    _, auto = _config("--pipeline-schedule", "tawpipe", "--tawpipe-ownership", "auto", "--tawpipe-num-groups", "2")
    with pytest.raises(ValueError, match="still auto"):
        auto.schedule.ownership(2)
    _, spread = _config("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-ownership", "spread",
                        "--tawpipe-shards-per-rank", "1", "--tawpipe-microbatches-per-visit", "1",
                        "--tawpipe-replicated-reduce", "flat")
    assert spread.schedule.ownership(2) == "spread"
    # another schedule's layout flags take their fixed values in validation (they do not apply)
    assert weipipe.schedule.tawpipe_ownership == "owner" and weipipe.schedule.tawpipe_shards_per_rank == 1


def _model(vocab, padded):
    args = parse_args(list(LLAMA_FLAGS) + ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                                           "--vocab-size", str(vocab), "--tokenizer-type", "NullTokenizer"])
    args.padded_vocab_size = padded
    return args


def test_the_cost_model_takes_the_padded_vocabulary_and_the_main_gradients_bytes():
    args = _model(1000, 1024)
    model = ModelConfig.from_args(args)
    fp32 = cost_model_for_run(model, PrecisionConfig.from_args(args), 1, recompute=True)
    unpadded = CostModel.from_flops(hidden_size=64, seq_length=64, ffn_hidden_size=args.ffn_hidden_size,
                                    vocab_size=1000, num_attention_heads=4, num_query_groups=4, dtype_bytes=4)
    assert fp32.head_forward == pytest.approx(unpadded.head_forward * 1024 / 1000)
    assert (fp32.dtype_bytes, fp32.grad_bytes) == (4, 4)
    bf16 = parse_args(list(LLAMA_FLAGS) + ["--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
                                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])
    half = cost_model_for_run(model, PrecisionConfig.from_args(bf16), 1, recompute=True)
    assert (half.dtype_bytes, half.grad_bytes) == (2, 2)
    # the memory check's gradient buffers at the runtime's gradient dtype: half of the fp32 default's
    plain = dataclasses.replace(half, grad_bytes=4)
    from megatron_tawpipe.plan import build_plan

    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=4, num_microbatches=2)
    assert half.grad_shard_bytes(plan) == plain.grad_shard_bytes(plan) / 2


def test_calibrate_prices_the_output_layer_it_measures(tmp_path):
    """tools/calibrate.py --from-cost-model: the head at the padded vocabulary (1000 -> 1024), as measured."""
    from megatron_tawpipe.bench.calibrate import main

    out = tmp_path / "model.json"
    assert main(["--output", str(out), "--from-cost-model", "--peak-tflops", "0.5", "--efficiency", "0.5"]
                + list(LLAMA_FLAGS) + ["--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads",
                                       "4", "--seq-length", "64", "--micro-batch-size", "1", "--vocab-size", "1000",
                                       "--num-layers", "2"]) == 0
    written = json.loads(out.read_text())
    padded = CostModel.from_flops(hidden_size=64, seq_length=64, ffn_hidden_size=192, vocab_size=1024,
                                  num_attention_heads=4, num_query_groups=4, peak_tflops=0.5, efficiency=0.5)
    assert written["head_forward"] == pytest.approx(padded.head_forward)
    assert written["layer_forward"] == pytest.approx(padded.layer_forward)
    assert written["vocab_size"] == 1000


def test_the_optimizer_and_training_records_hold_the_flags_and_the_derived_spans():
    args, config = _config("--use-distributed-optimizer", "--overlap-grad-reduce", "--clip-grad", "0.5",
                           "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--eval-iters", "3",
                           "--exit-signal-handler")
    adam, training = config.optimizer, config.training
    assert (adam.lr, adam.min_lr, adam.clip_grad) == (1e-3, 1e-4, 0.5)
    assert adam.use_distributed_optimizer and adam.overlap_grad_reduce and not adam.overlap_param_gather
    assert (training.train_iters, training.eval_iters, training.exit_signal) == (args.train_iters, 3, "SIGTERM")
    # Megatron-LM's iteration flags turned into samples by validate_args, read as it left them.
    lrs = training.lr_schedule
    assert lrs.lr_warmup_steps == 1 * args.global_batch_size and lrs.wsd_decay_steps == 2 * args.global_batch_size
    assert lrs.lr_decay_steps == args.lr_decay_steps and lrs.lr_decay_style == "WSD"
    with pytest.raises(dataclasses.FrozenInstanceError):
        adam.lr = 1.0


def test_megatron_cores_configs_are_built_from_the_records():
    import torch

    from megatron_tawpipe.baselines.native import ddp_config, optimizer_config
    from megatron_tawpipe.training.loop import build_scheduler

    _, config = _config("--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                        "--ddp-bucket-size", "1000",
                        "--weight-decay", "0.05", "--adam-beta2", "0.95")
    optimizer = optimizer_config(config.optimizer, config.precision)
    assert (optimizer.lr, optimizer.min_lr, optimizer.weight_decay, optimizer.adam_beta2) == (1e-3, 1e-4, 0.05, 0.95)
    assert optimizer.bf16 and optimizer.params_dtype == torch.bfloat16 and optimizer.use_distributed_optimizer
    ddp = ddp_config(config.optimizer, config.precision, interleaved=False)
    assert ddp.grad_reduce_in_fp32 and ddp.overlap_param_gather and ddp.bucket_size == 1000
    assert not ddp.align_param_gather        # only interleaved chunks gather together
    assert ddp_config(config.optimizer, config.precision, interleaved=True).align_param_gather

    class _Groups:
        param_groups = [{"params": [], "lr": 0.0, "weight_decay": 0.0}]

    scheduler = build_scheduler(config, _Groups)
    assert scheduler.max_lr == 1e-3 and scheduler.min_lr == 1e-4
    assert scheduler.lr_warmup_steps == config.training.lr_schedule.lr_warmup_steps
    assert _Groups.param_groups[0]["lr"] == 0.0 and _Groups.param_groups[0]["weight_decay"] == 0.05


def test_the_checks_set_nothing():
    """validate_args' checks assign no flag: what follows from the flags is settled in settle_args /
    layer_split_args (the functions validate_args calls by name)."""
    import ast
    import inspect

    from megatron_tawpipe.training import validate_args as checks

    tree = ast.parse(inspect.getsource(checks))
    written = [(node.lineno, ast.unparse(target)) for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
               for part in ast.walk(target)
               if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "args"]
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert written == [] and "setattr" not in calls, written   # (vars(args).pop: the parser's notices, read out)
    assert {"settle_batch_schedule", "settle_iterations", "settle_micro_batches", "settle_layer_split"} <= calls
