"""--use-precision-aware-optimizer with --main-grads-dtype / --main-params-dtype / --exp-avg-dtype /
--exp-avg-sq-dtype: the flags' rules, the optimizer's arithmetic, bf16 main gradients under weight
passing (bounded against fp32 ones, half the gradient bytes), checkpoints with these dtypes."""

import glob
import os

import pytest
import torch

from distributed_harness import run_ranks
from training_helpers import losses, tiny_args, train_rank, pinned_layout
from megatron_tawpipe.arguments import parse_args
from megatron_tawpipe.optimizer.precision_aware import PrecisionAwareAdamW, precision_refusal
from megatron_tawpipe.training.validate_args import validate_args

TAWPIPE = ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *pinned_layout(2)]   # bytes of one layout
PAO = ["--use-precision-aware-optimizer"]
BF16_GRADS = ["--bf16", *PAO, "--main-grads-dtype", "bf16"]


# ---- flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,world,message", [
    (["--bf16", "--main-grads-dtype", "bf16", *TAWPIPE], 4, "--main-grads-dtype bf16 needs --use-precision-aware"),
    (["--exp-avg-dtype", "bf16", *TAWPIPE], 4, "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    ([*PAO, "--main-grads-dtype", "bf16", *TAWPIPE], 4, "--main-grads-dtype bf16 needs --bf16"),
    ([*BF16_GRADS, "--accumulate-allreduce-grads-in-fp32", *TAWPIPE], 4, "contradicts --accumulate-allreduce"),
    ([*PAO, "--main-params-dtype", "fp16", *TAWPIPE], 4, "--main-params-dtype fp16 needs --bf16 or --fp16"),
    ([*PAO, "--bf16", "--exp-avg-sq-dtype", "fp8", *TAWPIPE], 4, "--exp-avg-sq-dtype fp8"),
    ([*BF16_GRADS, "--pipeline-schedule", "1f1b"], 2, "needs --use-distributed-optimizer"),
    ([*BF16_GRADS, "--use-torch-fsdp2"], 2, "--use-torch-fsdp2 steps torch's AdamW"),
], ids=["grads-without-pao", "moment-without-pao", "bf16-grads-without-bf16", "fp32-accumulation",
        "fp16-masters-in-fp32-training", "fp8-moment", "native-without-distopt", "fsdp2"])
def test_bad_combinations_are_refused(extra, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_args(parse_args(tiny_args(*extra)), world_size=world)


def test_native_schedules_need_transformer_engine_fused_adam():
    args = parse_args(tiny_args(*BF16_GRADS, "--use-distributed-optimizer"))
    refusal = precision_refusal(args, weight_passing=False, fused_adam=lambda: False)
    assert "needs Transformer Engine's FusedAdam" in refusal and "--grad-reduce-in-bf16" in refusal
    assert precision_refusal(args, weight_passing=False, fused_adam=lambda: True) is None
    args.optimizer = "sgd"
    assert "--optimizer adam only" in precision_refusal(args, weight_passing=True)
    # weight passing takes them without the distributed optimizer or Transformer Engine
    assert validate_args(parse_args(tiny_args(*BF16_GRADS, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16",
                                              *TAWPIPE)), world_size=4).main_grads_dtype == "bf16"


def test_native_ddp_follows_megatron_lms_gradient_buffer_rule():
    from megatron_tawpipe.arguments.run_config import OptimizerSettings, PrecisionConfig
    from megatron_tawpipe.baselines.native import grad_reduce_in_fp32, precision_aware_fields

    def fp32_buffers(*flags):
        args = parse_args(tiny_args(*flags))
        return grad_reduce_in_fp32(OptimizerSettings.from_args(args), PrecisionConfig.from_args(args))

    assert fp32_buffers("--bf16")
    assert not fp32_buffers("--bf16", "--grad-reduce-in-bf16")
    flags = (*BF16_GRADS, "--use-distributed-optimizer", "--exp-avg-dtype", "bf16")
    assert not fp32_buffers(*flags)
    fields = precision_aware_fields(PrecisionConfig.from_args(parse_args(tiny_args(*flags))))
    assert fields["main_grads_dtype"] == torch.bfloat16 and fields["exp_avg_dtype"] == torch.bfloat16
    assert fields["exp_avg_sq_dtype"] == torch.float32 and fields["use_precision_aware_optimizer"]


# ---- the optimizer ----------------------------------------------------------------------------

def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g), torch.randn(11, generator=g)]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(5, 7, generator=g) * 10 ** (step - 2), torch.randn(11, generator=g)]


OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_fp32_moments_equal_torch_adamw_bit_for_bit():
    ours, theirs = _params(), _params()
    opt = PrecisionAwareAdamW([{"params": ours}], **OPTIONS)
    ref = torch.optim.AdamW([{"params": theirs}], foreach=False, **OPTIONS)
    for step in range(4):
        for p, q, g in zip(ours, theirs, _grads(step)):
            p.decoupled_grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
    for p, q in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], ref.state[q][key])


@pytest.mark.parametrize("exp_avg,exp_avg_sq", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_moments_stored_in_their_dtype_and_rounded_after_each_update(exp_avg, exp_avg_sq):
    ours = _params()
    masters = [p.clone() for p in ours]
    opt = PrecisionAwareAdamW([{"params": ours}], exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq, **OPTIONS)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ours]
    beta1, beta2 = OPTIONS["betas"]
    lr, eps, wd = OPTIONS["lr"], OPTIONS["eps"], OPTIONS["weight_decay"]
    for step in range(1, 5):
        grads = _grads(step - 1)
        for p, g in zip(ours, grads):
            p.grad = g   # no decoupled_grad: .grad is read
        opt.step()
        for i, (w, g) in enumerate(zip(masters, grads)):   # the reference: fp32 update, moments rounded to storage
            m, v = moments[i]
            w.mul_(1 - lr * wd)
            m = (m * beta1 + g * (1 - beta1)).to(exp_avg).float()
            v = (v * beta2 + g * g * (1 - beta2)).to(exp_avg_sq).float()
            moments[i] = (m, v)
            w.sub_(lr / (1 - beta1 ** step) * m / (v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps))
    for p, w, (m, v) in zip(ours, masters, moments):
        state = opt.state[p]
        assert state["exp_avg"].dtype == exp_avg and state["exp_avg_sq"].dtype == exp_avg_sq
        # (torch's lerp and this reference's multiply-add differ by fp32 rounding before the 16-bit rounding)
        torch.testing.assert_close(state["exp_avg"].float(), m, rtol=2 ** -7, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"].float(), v, rtol=2 ** -7, atol=0)
        torch.testing.assert_close(p, w, rtol=1e-3, atol=1e-5)


def test_fp8_moments_are_refused_by_the_optimizer():
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        PrecisionAwareAdamW(_params(), exp_avg_dtype=torch.uint8)


# ---- weight passing with bf16 main gradients ---------------------------------------------------

def _gradients_and_magnitudes(rank, argv):
    """Train one iteration; return the main gradients this rank owns (before clipping and the step) and, for
    every element, the sum over all backward passes of the |partial gradient| they added (all ranks)."""
    import torch.distributed as dist

    from megatron_tawpipe.runtime import layer_compute, trainer

    magnitudes = {}

    def collect(self, mb, shard, grad_buffer):
        template = self.template
        if not magnitudes:
            magnitudes["shards"] = [torch.zeros(template.numel_of(s)) for s in range(self.model.plan.num_shards)]
            magnitudes["replicated"] = [torch.zeros(p.shape) for _, p in template.replicated_parameters()]
        for view, param in zip(template.views(magnitudes["shards"][shard]), template._layer_params):
            if param.grad is not None:
                view.add_(param.grad.float().abs())
        for total, (_, param) in zip(magnitudes["replicated"], template.replicated_parameters()):
            if param.grad is not None:
                total.add_(param.grad.float().abs())
        original_collect(self, mb, shard, grad_buffer)

    def optimizer_step(self):
        for tensor in magnitudes["shards"] + magnitudes["replicated"]:
            dist.all_reduce(tensor)
        model = self.model
        plain = lambda t: t.float().numpy().copy()  # noqa: E731 - (tensors do not cross the harness's queue)
        captured["shards"] = {s: (plain(model.main_grad(s)), plain(magnitudes["shards"][s])) for s in model.counted}
        captured["replicated"] = [(plain(g), plain(m)) for g, m in zip(model.replicated_grads(), magnitudes["replicated"])]
        captured["dtypes"] = sorted({str(g.dtype) for g in model.shard_grads() + model.replicated_grads()})
        return original_step(self)

    captured = {}
    original_collect, original_step = layer_compute.LayerCompute._collect, trainer.WeightPassingTrainer._optimizer_step
    layer_compute.LayerCompute._collect = collect
    trainer.WeightPassingTrainer._optimizer_step = optimizer_step
    return train_rank(rank, argv), captured


def _gamma(n: int, unit_roundoff: float) -> float:
    """Higham's gamma_n: a sum of n + 1 terms in floating point (any order) is within gamma_n * sum |terms|."""
    return n * unit_roundoff / (1 - n * unit_roundoff)


@pytest.mark.parametrize("world,schedule", [(4, TAWPIPE), (2, ["--pipeline-schedule", "weipipe"])],
                         ids=["tawpipe-2groups", "weipipe"])
def test_bf16_main_gradients_within_the_rounding_bound_and_half_the_gradient_bytes(world, schedule):
    global_batch = 8
    argv = tiny_args("--bf16", *schedule, "--exit-interval", "1", train_iters=2, global_batch=global_batch)
    fp32 = run_ranks(_gradients_and_magnitudes, world, argv)
    bf16 = run_ranks(_gradients_and_magnitudes, world, argv + PAO + ["--main-grads-dtype", "bf16"])
    # Every element of a main gradient is a sum of k = global micro-batches partial gradients (bf16 compute's,
    # the same in both runs: the weights and data are). Summed in bf16 (unit roundoff 2^-8) or fp32 (2^-24)
    # in whatever order the plan and the collectives take, each result is within gamma_{k-1} * sum |terms|
    # of the exact sum: the two runs differ by at most the sum of both bounds.
    k = global_batch
    bound = _gamma(k - 1, 2.0 ** -8) + _gamma(k - 1, 2.0 ** -24)
    differs = False
    for (_, ref), (_, got) in zip(fp32, bf16):
        assert ref["dtypes"] == ["torch.float32"] and got["dtypes"] == ["torch.bfloat16"]
        pairs = [(ref["shards"][s][0], got["shards"][s][0], got["shards"][s][1]) for s in got["shards"]]
        pairs += [(r[0], g[0], g[1]) for r, g in zip(ref["replicated"], got["replicated"])]
        for expected, actual, magnitude in map(lambda t: [torch.from_numpy(x) for x in t], pairs):
            excess = (actual - expected).abs() - bound * magnitude * (1 + 1e-5)
            assert float(excess.max()) <= 0.0, float(excess.max())
            differs |= not torch.equal(actual, expected)
    assert differs   # the bf16 run did round
    # The same forward: the first loss is identical.
    assert losses(bf16[0][0]) == losses(fp32[0][0])
    # Bytes: the executor counted what the plan prescribes, and the gradient part halved exactly while the
    # (bf16) weight part stayed. With the plan's coefficients a (weight units) and b (gradient units) per
    # link class, fp32 sends a*2n + b*4n bytes and bf16 a*2n + b*2n for n elements per shard buffer.
    from megatron_tawpipe.arguments import parse_args as parse
    from megatron_tawpipe.plan import build_plan
    from megatron_tawpipe.plan.traffic import link_bytes

    args = parse(argv)
    groups = 2 if "tawpipe" in schedule else 1
    plan = build_plan(schedule[1], num_ranks=world, num_groups=groups, num_layers=args.num_layers,
                      num_microbatches=global_batch // world)
    a, b = link_bytes(plan, 1.0, bytes_per_grad=0.0), link_bytes(plan, 0.0, bytes_per_grad=1.0)
    for link in ("intra", "inter"):
        r32, r16 = fp32[0][0][0], bf16[0][0][0]
        for record in (r32, r16):
            assert record[f"{link}_group_bytes"] == record[f"planned_{link}_group_bytes"]
        if not b[link]:
            assert r32[f"{link}_group_bytes"] == r16[f"{link}_group_bytes"]
            continue
        n = (r32[f"{link}_group_bytes"] - r16[f"{link}_group_bytes"]) / (2 * b[link])
        assert n > 0 and n == int(n)
        assert r16[f"{link}_group_bytes"] == a[link] * 2 * n + b[link] * 2 * n
        assert r32[f"{link}_group_bytes"] == a[link] * 2 * n + b[link] * 4 * n


# ---- checkpoints ---------------------------------------------------------------------------------

LOW = [*BF16_GRADS, "--main-params-dtype", "fp16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "tawpipe"])
def test_checkpoint_resume_with_low_precision_state_is_exact(ckpt_format, tmp_path):
    iters = 4
    argv = tiny_args(*TAWPIPE, *LOW, "--ckpt-format", ckpt_format, train_iters=iters)
    whole = run_ranks(train_rank, 4, argv)[0]
    save = str(tmp_path / "ckpt")
    first = run_ranks(train_rank, 4, argv + ["--save", save, "--exit-interval", "2"])[0]
    assert [r["iteration"] for r in first] == [1, 2]
    resumed = run_ranks(train_rank, 4, argv + ["--load", save])[0]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert losses(first) + losses(resumed) == losses(whole)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in whole[2:]]
    if ckpt_format == "tawpipe":   # the moments were written in their dtypes
        (path,) = glob.glob(os.path.join(save, "*", "params_rank00001.pt"))
        optim = torch.load(path, weights_only=False)["optimizer"]
        name = next(n for n in optim if n.startswith("decoder.layers."))
        assert optim[name]["exp_avg"].dtype == torch.bfloat16 and optim[name]["exp_avg_sq"].dtype == torch.float16


def test_benchmark_gives_every_strategy_its_bf16_gradient_option():
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, schedule_command

    config = BenchmarkConfig(model_args=["--bf16"], bf16_gradients=True)
    tawpipe = schedule_command("tawpipe", config, "m.json")
    assert tawpipe[tawpipe.index("--main-grads-dtype") + 1] == "bf16" and "--use-precision-aware-optimizer" in tawpipe
    for strategy in ("distopt", "fsdp"):
        assert "--grad-reduce-in-bf16" in schedule_command(strategy, config, "m.json")
    assert "--grad-reduce-in-bf16" not in schedule_command("distopt", BenchmarkConfig(model_args=["--bf16"]), "m.json")
