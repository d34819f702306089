"""How far apart two fp32 AdamW runs may be when their gradients differ only by rounding.

Two runs of the same model, data and initial weights that sum their gradients in different orders
(another schedule, tensor parallelism, another CPU's kernels) compute gradients that differ by rounding:
a few units in the last place of the terms summed, well under 1e-5 of a tensor's largest gradient.
Their losses and gradient norms stay within 1e-5, and so do the gradients that enter the optimizer.
Adam does not keep that proportion for the parameters: it divides each element's first moment by the
square root of its second, update = lr * m_hat / (sqrt(v_hat) + eps), so an element whose gradient is
within rounding of zero moves by up to about lr whichever way its rounding fell, and an element whose
gradient is small moves by lr times its relative rounding error. A fixed tolerance on the parameters is
then either broken by a CPU that rounds differently or loose enough to hide real errors.

The comparison here is what rounding cannot amplify:

1. The gradient that entered the optimizer at step t (after clipping), recovered from the Adam first
   moments that both runs save every iteration, g_t = (m_t - beta1 m_{t-1}) / (1 - beta1), within
   ``rtol`` of the reference gradient's largest element, plus the rounding of that recovery
   (``RECOVERY_ULPS`` units of the moments, fp32).
2. Each run's parameters moved as AdamW moves them: p_t = p_{t-1} (1 - lr_t wd) - lr_t r_t with
   r_t = m_hat / (sqrt(v_hat) + eps) from the run's own saved moments and the learning rate that
   megatron's scheduler gives the saved arguments for step t (to fp32 rounding). This checks the
   derivation's inputs (betas, eps, learning rates, weight-decay groups) against what the runs did.
3. Every parameter element within B_t + ``rtol`` * (the tensor's largest) of the reference, where
   B_t = sum over s <= t of lr_s * dev_s, and dev_s bounds how far r_s can move when every past
   gradient of the element is moved by at most E (check 1's tolerance, recovery rounding counted for
   both runs): the first moment by at most sum_k (1 - beta1) beta1^(s-k) E_k, the second moment between
   its values for |g_k| - E_k (not below 0) and |g_k| + E_k, r_s taken at the corners of that box and
   capped by the largest |m_hat| / sqrt(v_hat) that any gradient sequence reaches (Cauchy-Schwarz).
   Weight decay only shrinks a difference (factor 1 - lr wd <= 1). The ``rtol`` term is the rounding
   of the update arithmetic itself, far below it.

An element with a large gradient gets a bound of lr times its relative gradient error (tiny); one whose
gradient is within E of zero gets up to lr * cap per step. A mapping error (a parameter exchanged with
another, a permuted slice, a gradient scaled wrongly) changes gradients far beyond ``rtol`` and fails
check 1 (Adam would hide a scaled gradient from the parameters); an update applied wrongly fails 2 or 3.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence, Tuple

import torch

U = 2.0 ** -24           # fp32 unit roundoff
RECOVERY_ULPS = 8         # m_t's rounding in Adam's lerp (<= 3 units of |m_t| + |m_{t-1}|, over 1 - beta1) per run
UPDATE_ULPS = 8           # rounding of p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps) in fp32

State = Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # name: (parameter, exp_avg, exp_avg_sq)


# ---- reading the checkpoints ---------------------------------------------------------------------

def _read_torch_dist(directory: str) -> State:
    """Parameters (the fp32 masters where saved) and Adam moments, whole, named per layer."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(directory)
    tensors = {key: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata)}
    wanted = {}
    for key in tensors:
        if key.startswith("optimizer."):
            continue
        source = next((s for s in ("optimizer.state.fp32_param." + key, "optimizer.state.param." + key)
                       if s in tensors), key)
        moments = ("optimizer.state.exp_avg." + key, "optimizer.state.exp_avg_sq." + key)
        missing = [m for m in moments if m not in tensors]
        assert not missing, f"{directory}: no Adam state {missing} (save with the optimizer)"
        wanted[key] = (source,) + moments
    state = {s: torch.empty(tuple(tensors[s].size), dtype=tensors[s].properties.dtype)
             for sources in wanted.values() for s in sources}
    load(state, storage_reader=reader, no_dist=True)
    out: State = {}
    for key, sources in wanted.items():
        values = [state[s].double() for s in sources]
        if key.startswith("decoder.layers."):  # stacked over the layers
            rest = key[len("decoder.layers."):]
            out.update({f"decoder.layers.{i}.{rest}": tuple(v[i] for v in values) for i in range(values[0].shape[0])})
        else:
            out[key] = tuple(values)
    return out


def read_adam_history(root: str, iterations: int) -> List[State]:
    """The state after each step 1..``iterations`` from the torch_dist checkpoints under ``root``."""
    from megatron_tawpipe.checkpoint import checkpoint_format, iteration_dir

    history = []
    for iteration in range(1, iterations + 1):
        directory = iteration_dir(root, iteration)
        assert os.path.isdir(directory), f"{directory}: missing (save every iteration: --save-interval 1)"
        assert checkpoint_format(directory) == "torch_dist", f"{directory}: compare torch_dist checkpoints"
        history.append(_read_torch_dist(directory))
    return history


def step_hyperparameters(reference_root: str, shapes: Dict[str, Sequence[int]], iterations: int) -> dict:
    """Adam's betas and eps and, per step and parameter, the learning rate and weight decay that megatron's
    scheduler gives the arguments saved in the reference's first checkpoint (this project's parameter groups:
    no weight decay on biases and 1-D parameters, --decoupled-lr for the embedding and output layer)."""
    from megatron.core import dist_checkpointing

    from megatron_tawpipe.checkpoint import iteration_dir
    from megatron_tawpipe.optimizer.param_groups import megatron_param_groups
    from megatron_tawpipe.arguments.run_config import RunConfig
    from megatron_tawpipe.training.loop import build_scheduler

    args = dist_checkpointing.load_common_state_dict(iteration_dir(reference_root, 1))["args"]
    assert getattr(args, "rampup_batch_size", None) is None, "the schedule below assumes a constant global batch"
    names = sorted(shapes)
    stand_ins = [torch.empty(tuple(shapes[name]), device="meta") for name in names]

    class _Groups:
        param_groups = megatron_param_groups(list(zip(names, stand_ins)), args)

    group_of = {name: next(g for g in _Groups.param_groups if any(p is t for p in g["params"]))
                for name, t in zip(names, stand_ins)}
    scheduler = build_scheduler(RunConfig.from_args(args, world_size=1, ranks_per_node=1), _Groups)
    steps = []
    for _ in range(iterations):
        steps.append({name: (group_of[name]["lr"], group_of[name]["weight_decay"]) for name in names})
        scheduler.step(increment=args.global_batch_size)
    return {"beta1": args.adam_beta1, "beta2": args.adam_beta2, "eps": args.adam_eps, "steps": steps}


# ---- the bound ------------------------------------------------------------------------------------

def direction_cap(t: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat| / sqrt(v_hat) after ``t`` steps over all gradient sequences (Cauchy-Schwarz:
    |sum_k beta1^(t-k) g_k| <= sqrt(sum_j (beta1^2 / beta2)^j) * sqrt(sum_k beta2^(t-k) g_k^2))."""
    c1, c2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    series = sum((beta1 * beta1 / beta2) ** j for j in range(t))
    return (1.0 - beta1) * math.sqrt(c2) / (c1 * math.sqrt(1.0 - beta2)) * math.sqrt(series)


def direction(m, v, t: int, beta1: float, beta2: float, eps: float):
    """AdamW's r = m_hat / (sqrt(v_hat) + eps) after ``t`` steps."""
    return (m / (1.0 - beta1 ** t)) / (torch.sqrt(v.clamp(min=0.0) / (1.0 - beta2 ** t)) + eps)


def _where(diff: torch.Tensor, allowed: torch.Tensor) -> str:
    excess = diff - allowed
    flat = int(torch.argmax(excess))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    return f"element {index}: diff {diff.flatten()[flat].item():.3e}, allowed {allowed.flatten()[flat].item():.3e}"


def adam_problems(ours: List[State], theirs: List[State], hyper: dict, rtol: float = 1e-5) -> List[str]:
    """What breaks checks 1-3 of the module's description, one line each (empty: the runs agree)."""
    b1, b2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
    problems: List[str] = []
    for name in sorted(theirs[0]):
        zero = torch.zeros_like(theirs[0][name][1])
        bound = torch.zeros_like(zero)            # B_t: what Adam can carry the gradient differences to
        grads, widths = [], []                    # the reference's gradients, and E per step
        previous = {"ours": (None, zero), "theirs": (None, zero)}
        for t in range(1, len(theirs) + 1):
            lr, wd = hyper["steps"][t - 1][name]
            recovered = {}
            for who, run in (("ours", ours), ("theirs", theirs)):
                p, m, v = run[t - 1][name]
                p_prev, m_prev = previous[who]
                recovered[who] = (m - b1 * m_prev) / (1.0 - b1)
                if p_prev is not None:   # check 2: the update is AdamW's with the schedule's lr
                    r = direction(m, v, t, b1, b2, eps)
                    expected = p_prev * (1.0 - lr * wd) - lr * r
                    allowed = UPDATE_ULPS * U * (p_prev.abs() + p.abs() + lr * r.abs()) + 1e-30
                    diff = (p - expected).abs()
                    if (diff > allowed).any():
                        problems.append(f"{who}: {name} at step {t} did not move as AdamW with lr {lr:.3e}, weight "
                                        f"decay {wd} moves it from its saved moments: {_where(diff, allowed)}")
                previous[who] = (p, m)
            m_prev_theirs = theirs[t - 2][name][1] if t > 1 else zero
            recovery = RECOVERY_ULPS * U * (theirs[t - 1][name][1].abs() + m_prev_theirs.abs()) / (1.0 - b1)
            g = recovered["theirs"]
            tolerance = rtol * g.abs().max() + recovery
            gdiff = (recovered["ours"] - g).abs()
            if (gdiff > tolerance).any():   # check 1
                problems.append(f"gradient of {name} at step {t} (max |g| {g.abs().max().item():.3e}): "
                                f"{_where(gdiff, tolerance)}")
            grads.append(g)
            widths.append(tolerance + recovery)
            # Check 3: the box of gradient sequences within E of the reference's, through AdamW.
            m_width = sum((1.0 - b1) * b1 ** (t - k) * widths[k - 1] for k in range(1, t + 1))
            v_low = sum((1.0 - b2) * b2 ** (t - k) * (grads[k - 1].abs() - widths[k - 1]).clamp(min=0.0) ** 2
                        for k in range(1, t + 1))
            v_high = sum((1.0 - b2) * b2 ** (t - k) * (grads[k - 1].abs() + widths[k - 1]) ** 2
                         for k in range(1, t + 1))
            _, m_ref, v_ref = theirs[t - 1][name]
            r_ref = direction(m_ref, v_ref, t, b1, b2, eps)
            m_high, m_low = m_ref + m_width, m_ref - m_width
            r_high = torch.where(m_high >= 0, direction(m_high, v_low, t, b1, b2, eps),
                                 direction(m_high, v_high, t, b1, b2, eps))
            r_low = torch.where(m_low <= 0, direction(m_low, v_low, t, b1, b2, eps),
                                direction(m_low, v_high, t, b1, b2, eps))
            cap = direction_cap(t, b1, b2)
            dev = torch.maximum(r_high.clamp(max=cap) - r_ref, r_ref - r_low.clamp(min=-cap)).clamp(min=0.0)
            bound = bound + lr * dev
            p_ours, p_theirs = ours[t - 1][name][0], theirs[t - 1][name][0]
            allowed = bound + rtol * p_theirs.abs().max()
            pdiff = (p_ours - p_theirs).abs()
            if (pdiff > allowed).any():
                problems.append(f"{name} after step {t} (max |p| {p_theirs.abs().max().item():.3e}, lr {lr:.3e}): "
                                f"{_where(pdiff, allowed)}")
    return problems
