"""Megatron-LM users' command lines: its published scripts' flags, its default (GPT) model, its rules.

The script blocks below are the flags of Megatron-LM's own example scripts (NVIDIA/Megatron-LM at
d98e8a64), scaled to CPU sizes, with mock data; each says which flags were taken out and why.
They run under tawpipe, weipipe and native 1F1B with only ``--pipeline-schedule`` changed.
"""

import math
import os

import pytest

from distributed_harness import run_ranks
from training_helpers import GPT_FLAGS, assert_close_rel, assert_matches_reference, losses, tiny_args, train_rank


# examples/llama/train_llama3_8b_h100_fp8.sh, every block, sizes scaled down (4 layers, hidden 64,
# 8 query heads in 2 groups, 64 tokens, vocabulary 250, 24 samples). Taken out:
#   GPU-only: --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather,
#             --attention-backend fused (Transformer Engine's kernels).
# --apply-layernorm-1p stays: zero-centred norm weights, which torch norms take on CPUs (models/norms.py).
def llama3_8b_script(tmp):
    return [
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224",
        "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8",
        "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "24",
        "--lr-decay-samples", "20", "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        # DDP_ARGS
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        # DATA_ARGS_LIST (the mock-data branch; the script passes the split with its quotes)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
        "--data-cache-path", str(tmp / "cache"), "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "2", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
        "--distributed-timeout-minutes", "60", "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"),
        "--tensorboard-dir", str(tmp / "tensorboard"), "--ckpt-format", "torch_dist",
    ]


# examples/gpt3/train_gpt3_175b_distributed.sh, scaled down (4 layers, hidden 64, 64 tokens, tensor
# parallel 8 -> 1 and pipeline 16 -> 2 for 4 CPU ranks, 4 iterations). Taken out:
#   data: --data-path/--vocab-file/--merge-file (GPT-2 BPE files) -> --mock-data with NullTokenizer;
#   the batch ramp (--step-batch-size-schedule) scaled to go from 4 to 8 sequences after 192 tokens.
def gpt3_175b_script(tmp):
    return [
        # GPT_MODEL_ARGS
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--step-batch-size-schedule", "0:4 192:8", "--train-iters", "4",
        "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
        "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "4",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        # DATA_ARGS
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250", "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--eval-iters", "2",
        "--tensorboard-dir", str(tmp / "tensorboard"),
    ]


SCRIPTS = {"llama3-8b": llama3_8b_script, "gpt3-175b": gpt3_175b_script}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_published_scripts_run_under_every_schedule(script, tmp_path):
    """Changing only --pipeline-schedule: each schedule trains, and all three agree on the losses."""
    results = {}
    for schedule in ("tawpipe", "weipipe", "1f1b"):
        directory = tmp_path / schedule
        directory.mkdir()
        argv = SCRIPTS[script](directory) + ["--pipeline-schedule", schedule]
        per_rank = run_ranks(train_rank, 4, argv)
        records = per_rank[-1]
        assert all(math.isfinite(loss) for loss in losses(records)), (schedule, losses(records))
        assert (directory / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(len(records))
        results[schedule] = records
    assert len(results["tawpipe"]) == 3 if script == "llama3-8b" else 4      # 24 samples / 8; --train-iters 4
    # bf16 / fp16 arithmetic in a different order per schedule: agreement to low precision.
    for schedule in ("weipipe", "1f1b"):
        assert_close_rel(losses(results[schedule]), losses(results["tawpipe"]), 2e-2, f"{schedule} loss")
    # The final validation pass of a finished run (Megatron-LM's), with --eval-iters 2.
    assert "validation_lm_loss" in results["tawpipe"][-1]


def test_llama3_8b_script_with_default_layernorm_trains_zero_centred_under_tawpipe(tmp_path):
    """A revision of the Llama-3 8B script gives --apply-layernorm-1p without --normalization: Megatron-LM's
    default LayerNorm (with its bias), zero-centred. tawpipe trains it as native 1F1B does."""
    results = {}
    for schedule in ("tawpipe", "1f1b"):
        directory = tmp_path / schedule
        directory.mkdir()
        argv = llama3_8b_script(directory)
        del argv[argv.index("--normalization"):argv.index("--normalization") + 2]
        records = run_ranks(train_rank, 4, argv + ["--pipeline-schedule", schedule])[-1]
        assert len(records) == 3 and all(math.isfinite(loss) for loss in losses(records)), (schedule, records)
        results[schedule] = records
    assert_close_rel(losses(results["tawpipe"]), losses(results["1f1b"]), 2e-2, "tawpipe loss")

UNIMPLEMENTED = [
    (["--ckpt-format", "zarr"], "--ckpt-format zarr: this project writes torch_dist"),
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: fp8 training is not supported yet"),
    (["--attention-backend", "fused"], "--attention-backend fused needs Transformer Engine and a CUDA GPU"),
    # Values megatron-core's LR scheduler would only assert on, later:
    (["--lr-warmup-init", "1e-3"], "--lr-warmup-init 0.001 must not exceed --lr 0.00015"),
    (["--min-lr", "-0.1"], "--min-lr must be >= 0, got -0.1"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1", "--end-weight-decay", "0.01"],
     "--start-weight-decay 0.1 must be >= 0 and at most --end-weight-decay 0.01"),
    (["--exit-signal-handler", "--exit-signal", "SIGKILL"], "--exit-signal SIGKILL: give a signal that can be caught"),
]


@pytest.mark.parametrize("extra,message", UNIMPLEMENTED, ids=[e[0] for e, _ in UNIMPLEMENTED])
def test_unimplemented_script_flags_are_refused(extra, message, capsys, monkeypatch, tmp_path):
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert pretrain_llama.main(llama3_8b_script(tmp_path) + ["--pipeline-schedule", "tawpipe"] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_notices_say_what_has_no_effect(capsys, monkeypatch, tmp_path):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(gpt3_175b_script(tmp_path) + ["--pipeline-schedule", "tawpipe",
                                                                  "--sequence-parallel", "--use-flash-attn"]),
                         world_size=4)
    out = capsys.readouterr().out
    assert args.pipeline_model_parallel_size == 1 and args.sequence_parallel is False
    assert "the 2 ranks of each --pipeline-model-parallel-size pipeline join the weight pipeline" in out
    assert "--sequence-parallel: no effect with --tensor-model-parallel-size 1" in out
    assert "--use-flash-attn: Megatron-LM no longer reads it" in out


needs_megatron_training = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("megatron.training") is None,
    reason="megatron-core < 0.17 ships no megatron.training (CI's 0.16.1); checked under 0.17+")


@needs_megatron_training
def test_project_flags_join_megatron_lms_parser_through_its_hook(monkeypatch):
    import sys

    from megatron.training import arguments

    from megatron_tawpipe.arguments import add_tawpipe_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "4", "--pipeline-schedule", "tawpipe",
                                      "--tawpipe-microbatches-per-visit", "2", "--metrics-file", "m.jsonl"])
    args = arguments.parse_args(extra_args_provider=add_tawpipe_args)
    assert (args.num_layers, args.pipeline_schedule, args.tawpipe_microbatches_per_visit) == (4, "tawpipe", 2)
    assert args.metrics_file == "m.jsonl"


@pytest.mark.parametrize("extra,outcome", [
    (["--manual-gc-interval", "10"], "notice: --manual-gc-interval 10: Python's garbage collector stays automatic"),
    (["--yaml-cfg", "run.yaml"], "--yaml-cfg run.yaml: YAML configurations are not read: give the flags"),
    (["--moe-router-topk", "4"], "--moe-router-topk 4: mixture-of-experts models are not supported"),
    (["--rerun-mode", "bogus"], "--rerun-mode bogus: gradient / loss checks beyond NaN detection are not made"),
    (["--activation-offload-fraction", "1.0"], "notice: 1.0 is Megatron-LM's default for "
                                               "--activation-offload-fraction; it has no effect here because CPU "
                                               "offloading is not supported"),
    (["--activation-offload-fraction", "0.5"], "--activation-offload-fraction 0.5: CPU offloading is not supported"),
    (["--use-gigatoken"], "--use-gigatoken: a flag of Megatron-LM's development branch that no megatron-core "
                          "release 0.16-0.19 has"),
    (["--DDP-impl", "local"], "--DDP-impl is a Megatron-DeepSpeed flag this project does not implement"),
])
def test_megatron_lm_flags_are_answered_from_the_flag_table(extra, outcome, capsys, monkeypatch, tmp_path):
    """The same answers under megatron-core 0.16 and 0.19: the committed table decides, not the installed parser."""
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    argv = llama3_8b_script(tmp_path) + ["--pipeline-schedule", "tawpipe"] + extra
    if outcome.startswith("notice"):
        from megatron_tawpipe.arguments import parse_args
        from megatron_tawpipe.training.validate_args import validate_args

        validate_args(parse_args(argv), world_size=4)
        assert outcome in capsys.readouterr().out
        return
    assert pretrain_llama.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and outcome in err[0], err


# ---- Megatron-LM's defaults and derived values -----------------------------------------------

def test_defaults_are_megatron_lms():
    from megatron_tawpipe.arguments import parse_args

    args = parse_args(["--train-iters", "1", "--hidden-size", "96", "--num-attention-heads", "4"])
    assert (args.normalization, args.position_embedding_type, args.add_bias_linear, args.add_qkv_bias,
            args.swiglu) == ("LayerNorm", "learned_absolute", True, True, False)
    assert (args.hidden_dropout, args.attention_dropout) == (0.1, 0.1)
    assert (args.lr_decay_style, args.adam_beta2, args.weight_decay) == ("linear", 0.999, 0.01)
    assert (args.log_interval, args.eval_iters, args.eval_interval, args.lr) == (100, 100, None, None)
    assert args.untie_embeddings_and_output_weights is False and args.create_attention_mask_in_dataloader
    assert (args.ffn_hidden_size, args.kv_channels) == (4 * 96, 24)
    swiglu = parse_args(["--train-iters", "1", "--hidden-size", "96", "--num-attention-heads", "4", "--swiglu"])
    assert swiglu.ffn_hidden_size == int(4 * 96 * 2 / 3 / 64) * 64 == 256
    gqa = parse_args(["--train-iters", "1", "--num-attention-heads", "4", "--group-query-attention"])
    assert gqa.num_query_groups == 1                   # Megatron-LM's default count of key/value groups
    deepspeed = parse_args(["--train-iters", "1", "--normalization", "rmsnorm", "--num-key-value-heads", "2",
                            "--use-rotary-position-embeddings"])
    assert (deepspeed.normalization, deepspeed.num_query_groups, deepspeed.position_embedding_type) == (
        "RMSNorm", 2, "rope")


def test_sample_based_schedule_is_megatron_lms():
    """--train-samples: floor(samples / batch) iterations; LR spans in samples, as Megatron-LM counts them."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    base = tiny_args(train_iters=1, global_batch=8)
    base = base[:base.index("--train-iters")] + base[base.index("--train-iters") + 2:]
    base.remove("--lr-warmup-iters"), base.remove("1")
    args = validate_args(parse_args(base + ["--train-samples", "30", "--lr-warmup-samples", "12",
                                            "--lr-decay-samples", "28"]), world_size=1)
    assert (args.train_iters, args.lr_warmup_steps, args.lr_decay_steps) == (3, 12, 28)
    fraction = validate_args(parse_args(base + ["--train-samples", "30", "--lr-warmup-fraction", "0.25"]),
                             world_size=1)
    assert (fraction.lr_warmup_steps, fraction.lr_decay_steps) == (7, 30)
    iters = validate_args(parse_args(tiny_args(train_iters=5, global_batch=8)), world_size=1)
    assert (iters.lr_warmup_steps, iters.lr_decay_steps) == (8, 40)


def test_lr_follows_megatron_lms_schedule_in_samples(tmp_path):
    """The learning rate of every iteration against the formula (linear warmup from --lr-warmup-init,
    cosine decay over --lr-decay-samples), stepped by the global batch."""
    base = tiny_args(train_iters=1, global_batch=8)
    base = base[:base.index("--train-iters")] + base[base.index("--train-iters") + 2:]
    base.remove("--lr-warmup-iters"), base.remove("1")
    argv = base + ["--train-samples", "48", "--lr-warmup-samples", "12", "--lr-decay-samples", "44",
                   "--lr-warmup-init", "1e-4"]
    (records,) = run_ranks(train_rank, 1, argv)
    lr, min_lr, init = 1e-3, 1e-4, 1e-4
    for record in records:
        step = record["consumed_samples"]           # the scheduler counts samples after each step
        if step <= 12:
            expected = init + (lr - init) * step / 12
        else:
            ratio = min(1.0, (step - 12) / (44 - 12))
            expected = min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)
        assert record["learning_rate"] == pytest.approx(expected, rel=1e-6), record
    assert len(records) == 6


# ---- the model follows the flags -----------------------------------------------------------

def _build_and_count(rank, argv):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tawpipe.compat import cpu as cpu_compat
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.data import pad_vocab_size
    from megatron_tawpipe.models.llama import build_llama_model, llama_config

    cpu_compat.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    args = validate_args(parse_args(argv), world_size=1)
    args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    model = build_llama_model(args, llama_config(args))
    kinds = {type(m).__name__ for m in model.modules()}
    names = {name for name, _ in model.named_parameters()}
    activation = model.decoder.layers[0].mlp.config.activation_func.__name__
    return sum(p.numel() for p in model.parameters()), args.padded_vocab_size, sorted(kinds), sorted(names), activation


def megatron_lm_parameter_count(L, h, a, g, d, f, V, swiglu, layernorm, untied):
    """Megatron-LM's own count (theoretical_memory_usage): it leaves out linear biases and
    learned position embeddings."""
    q = d * a
    norm = 2 if layernorm else 1
    per_layer = 2 * h * q * (1 + g / a) + 2 * h * f * (1.5 if swiglu else 1.0) + 2 * h * norm
    return int(L * per_layer + norm * h + h * V * (2 if untied else 1))


def test_gpt_flags_build_megatron_lms_gpt():
    """Megatron-LM's defaults: LayerNorm, GELU, linear biases (QKV included), learned positions, tied."""
    argv = tiny_args(architecture=GPT_FLAGS)
    argv.remove("--untie-embeddings-and-output-weights")
    ((count, V, kinds, names, activation),) = run_ranks(_build_and_count, 1, argv)
    L, h, a, f, S = 8, 64, 4, 128, 32
    biases = L * (3 * h + h + f + h)                 # QKV, output projection, fc1, fc2
    positions = S * h
    assert count == megatron_lm_parameter_count(L, h, a, a, h // a, f, V, False, True, False) + biases + positions
    assert activation == "gelu"
    assert "embedding.position_embeddings.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert "decoder.layers.0.input_layernorm.bias" in names          # LayerNorm has a bias
    assert "output_layer.weight" not in names                        # tied to the word embeddings
    assert "RotaryEmbedding" not in kinds


def test_llama_flags_build_llama():
    """RMSNorm, SwiGLU, no biases, rotary positions, GQA, untied: exactly Megatron-LM's count."""
    ((count, V, kinds, names, activation),) = run_ranks(
        _build_and_count, 1, tiny_args("--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8"))
    assert count == megatron_lm_parameter_count(8, 64, 4, 2, 8, 128, V, True, False, True)
    assert activation == "silu" and "RotaryEmbedding" in kinds
    assert not any(name.endswith(".bias") for name in names)


GPT_CASES = [
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"], 8, 8),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-no-recompute", "tied"], 4, 8),
    (2, ["--pipeline-schedule", "weipipe"], 4, 6),
]


@pytest.mark.parametrize("world,extra,layers,global_batch", GPT_CASES,
                         ids=["tawpipe-P4-G2", "tawpipe-P4-norecompute-tied", "weipipe-P2"])
def test_weight_passing_matches_reference_on_megatron_lms_gpt(world, extra, layers, global_batch, tmp_path):
    """The shard template follows the flags: LayerNorm, GELU, biases and learned positions (replicated
    beside the embedding) train exactly like one process."""
    tied = "tied" in extra
    extra = [f for f in extra if f != "tied"]

    def argv(*more, save):
        out = tiny_args(*more, train_iters=3, global_batch=global_batch, architecture=GPT_FLAGS)
        out[out.index("--num-layers") + 1] = str(layers)
        if tied:
            out.remove("--untie-embeddings-and-output-weights")
        return out + ["--save", save, "--save-interval", "1"]

    ref_save, save = str(tmp_path / "ref"), str(tmp_path / "ours")
    (reference,) = run_ranks(train_rank, 1, argv(save=ref_save))
    per_rank = run_ranks(train_rank, world, argv(*extra, "--tawpipe-nccl-faithful", save=save))
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], 1e-5, "grad norm")
    assert max(r["grad_norm"] for r in reference) > 1.0                  # clipping was active
    # Gradients entering every step within 1e-5, parameters within what Adam makes of that (the key bias's
    # exact gradient is zero: rounding noise, which Adam scales to updates of about --lr).
    assert_matches_reference(save, ref_save, 3)
    for record in per_rank[0]:
        assert record["inter_group_bytes"] == record["planned_inter_group_bytes"]


def _load_error(rank, argv):
    from megatron_tawpipe.checkpoint import CheckpointError

    try:
        train_rank(rank, argv)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_checkpoint_records_the_architecture(tmp_path):
    """A Llama checkpoint refuses to load into a GPT run, naming the flag."""
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, train_iters=2))
    (error,) = run_ranks(_load_error, 1, tiny_args("--load", save, train_iters=3, architecture=GPT_FLAGS))
    assert error and "checkpoint has normalization=RMSNorm, this run --normalization gives LayerNorm" in error


# ---- exits: Slurm preemption and time limits ------------------------------------------------

def _signalled_rank(rank, argv, signal_rank, at_iteration):
    """Train; rank ``signal_rank`` receives SIGTERM during iteration ``at_iteration``."""
    import os
    import signal

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import build_trainer, pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    def factory(args, forward_step_func, run):
        trainer = build_trainer(args, forward_step_func, run)
        step, calls = trainer.train_step, []

        def train_step(iterators, num_microbatches):
            calls.append(1)
            if rank == signal_rank and len(calls) == at_iteration:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(iterators, num_microbatches)

        trainer.train_step = train_step
        return trainer

    args = validate_args(parse_args(argv))
    try:
        return [record.to_json() for record in pretrain(args, gpt_forward_step, trainer_factory=factory)]
    finally:
        destroy()


def test_sigterm_saves_and_every_rank_stops_after_the_same_iteration(tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_args("--pipeline-schedule", "tawpipe", "--exit-signal-handler", "--save", str(save),
                     "--lr-decay-iters", "20", train_iters=20, global_batch=4)
    per_rank = run_ranks(_signalled_rank, 2, argv, 1, 3)
    assert [len(records) for records in per_rank] == [3, 3]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # The checkpoint resumes: the run goes on from iteration 4 (the same LR schedule, as Megatron-LM
    # requires unless --override-opt_param-scheduler).
    resumed = run_ranks(train_rank, 2, tiny_args("--pipeline-schedule", "tawpipe", "--load", str(save),
                                                 "--lr-decay-iters", "20", train_iters=5, global_batch=4))
    assert [r["iteration"] for r in resumed[0]] == [4, 5]


def test_exit_duration_stops_and_saves(tmp_path):
    save = tmp_path / "ckpt"
    (records,) = run_ranks(train_rank, 1, tiny_args("--exit-duration-in-mins", "0.00001", "--save", str(save),
                                                    train_iters=20))
    assert len(records) == 1
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_no_save_optim_checkpoint_needs_no_load_optim(tmp_path):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, "--no-save-optim", "--no-save-rng", train_iters=2))
    (error,) = run_ranks(_load_error, 1, tiny_args("--load", save, train_iters=3))
    assert error and "saved with --no-save-optim" in error and "--no-load-optim" in error
    (records,) = run_ranks(train_rank, 1, tiny_args("--load", save, "--no-load-optim", "--no-load-rng", train_iters=3))
    assert [r["iteration"] for r in records] == [3]


def test_empty_load_directory_is_reported_or_refused(tmp_path, capfd):
    empty = str(tmp_path / "empty")
    (error,) = run_ranks(_load_error, 1, tiny_args("--load", empty, "--exit-on-missing-checkpoint", train_iters=2))
    assert error and "holds no checkpoint" in error
    (records,) = run_ranks(train_rank, 1, tiny_args("--load", empty, train_iters=2))
    assert len(records) == 2
    assert "no checkpoint found in --load" in capfd.readouterr().out


def test_tensorboard_scalars_have_megatron_lms_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory = tmp_path / "tb"
    (records,) = run_ranks(train_rank, 1, tiny_args("--tensorboard-dir", str(directory), "--log-interval", "1",
                                                    "--log-timers-to-tensorboard", "--log-throughput",
                                                    "--eval-iters", "1", "--eval-interval", "2",
                                                    "--log-validation-ppl-to-tensorboard", train_iters=4))
    events = EventAccumulator(str(directory))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("learning-rate", "batch-size", "lm loss", "grad-norm", "lm loss validation",
                 "lm loss validation ppl"):
        assert name in tags and f"{name} vs samples" in tags, (name, sorted(tags))
    assert {"iteration-time", "throughput"} <= tags
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx(losses(records))
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24, 32]
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4]
    assert [e.value for e in events.Scalars("learning-rate")] == pytest.approx([r["learning_rate"] for r in records])


def _wandb_history(run_file):
    """History rows of an offline W&B run file: a LevelDB-style log (32 KiB blocks of records with a 7-byte
    header: crc, length, type) of the run's protobuf records, after a 7-byte file header."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, rows, pending = open(run_file, "rb").read(), 32768, [], b""
    offset = 7
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
        elif kind == 0:
            break
    return rows


def test_wandb_logs_megatron_lms_scalars_offline(tmp_path, monkeypatch):
    import glob

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (records,) = run_ranks(train_rank, 1, tiny_args("--wandb-project", "tawpipe-test", "--wandb-exp-name", "tiny",
                                                    "--wandb-save-dir", str(tmp_path / "wb"), "--wandb-entity",
                                                    "tawpipe-team", train_iters=3))
    (run_file,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(run_file, "rb") as stream:
        assert b"tawpipe-team" in stream.read()      # the run is logged under --wandb-entity
    rows = [row for row in _wandb_history(run_file) if "lm loss" in row]
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert [row["lm loss"] for row in rows] == pytest.approx(losses(records))
    assert [row["learning-rate"] for row in rows] == pytest.approx([r["learning_rate"] for r in records])
    assert all("grad-norm" in row and "batch-size" in row for row in rows)


def test_wandb_without_the_package_is_one_line(monkeypatch):
    import importlib.util

    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ArgumentError, match=r"--wandb-project p needs the wandb package \(pip install wandb\)"):
        validate_args(parse_args(tiny_args("--wandb-project", "p")))
