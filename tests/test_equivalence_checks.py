"""The equivalence tests' comparison (tests/adam_bounds.py): it accepts what rounding does through Adam, and
catches mapping errors.

Synthetic fp32 AdamW runs, no training: a reference given gradients, and runs given the same gradients
moved by rounding, exchanged between parameters, permuted, scaled, or updated wrongly."""

import pytest
import torch

from adam_bounds import adam_problems, direction_cap

STEPS = 3
LRS = [1e-3, 1e-3, 5.5e-4]
WD = 0.01
BETAS = (0.9, 0.95)
EPS = 1e-8
SHAPES = {"a.weight": (16, 8), "b.weight": (16, 8), "c.bias": (8,)}
HYPER = {"beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
         "steps": [{name: (lr, 0.0 if len(shape) == 1 else WD) for name, shape in SHAPES.items()} for lr in LRS]}


def _gradients(seed=0):
    """Per step, per parameter: standard normal gradients with 1 in 8 elements within rounding of zero."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        grads = {}
        for name, shape in SHAPES.items():
            g = torch.randn(shape, generator=generator)
            tiny = torch.rand(shape, generator=generator) < 0.125
            grads[name] = torch.where(tiny, 1e-9 * torch.randn(shape, generator=generator), g)
        steps.append(grads)
    return steps


def _adamw(gradients, lr_scale=None):
    """torch's AdamW over SHAPES from the same initial weights, fed ``gradients``; (p, m, v) after each step,
    in float64 as the checkpoint reader returns them."""
    generator = torch.Generator().manual_seed(1)
    params = {name: (0.02 * torch.randn(shape, generator=generator)).requires_grad_(True)
              for name, shape in SHAPES.items()}
    optimizer = torch.optim.AdamW([{"params": [p], "weight_decay": 0.0 if p.dim() == 1 else WD}
                                   for p in params.values()], lr=LRS[0], betas=BETAS, eps=EPS)
    history = []
    for step, grads in enumerate(gradients):
        for group in optimizer.param_groups:
            group["lr"] = LRS[step] * (lr_scale(step) if lr_scale else 1.0)
        for name, p in params.items():
            p.grad = grads[name].clone()
        optimizer.step()
        history.append({name: (p.detach().double().clone(), optimizer.state[p]["exp_avg"].double().clone(),
                               optimizer.state[p]["exp_avg_sq"].double().clone()) for name, p in params.items()})
    return history


def _rounded(gradients, seed=2):
    """The gradients as another summation order computes them: each moved by 1e-7 of its tensor's largest
    (a few fp32 units; the gradient check allows 1e-5)."""
    generator = torch.Generator().manual_seed(seed)
    return [{name: g + 1e-7 * g.abs().max() * torch.randn(g.shape, generator=generator) for name, g in grads.items()}
            for grads in gradients]


@pytest.fixture(scope="module")
def reference():
    gradients = _gradients()
    return gradients, _adamw(gradients)


def test_rounding_of_the_gradients_passes_though_adam_moves_parameters_far_beyond_1e5(reference):
    gradients, theirs = reference
    ours = _adamw(_rounded(gradients))
    assert adam_problems(ours, theirs, HYPER) == []
    # What a fixed tolerance on the parameters would have seen: elements whose gradient is within rounding of
    # zero went their own way, by about lr (1e-3), against 1e-5 of a tensor's largest (about 1e-6 here).
    worst = max(((ours[-1][n][0] - theirs[-1][n][0]).abs().max() / theirs[-1][n][0].abs().max()).item()
                for n in SHAPES)
    assert worst > 1e-3


def test_exchanged_parameters_fail_the_gradient_check(reference):
    gradients, theirs = reference
    swapped = [dict(grads, **{"a.weight": grads["b.weight"], "b.weight": grads["a.weight"]}) for grads in gradients]
    problems = adam_problems(_adamw(swapped), theirs, HYPER)
    assert any(p.startswith("gradient of a.weight at step 1") for p in problems)
    assert any(p.startswith("gradient of b.weight at step 1") for p in problems)


def test_a_permuted_slice_fails(reference):
    """Two tensor-parallel halves of a.weight's rows put back in the wrong order."""
    gradients, theirs = reference
    permuted = [dict(grads, **{"a.weight": torch.cat([grads["a.weight"][8:], grads["a.weight"][:8]])})
                for grads in gradients]
    problems = adam_problems(_adamw(permuted), theirs, HYPER)
    assert any(p.startswith("gradient of a.weight") for p in problems)
    assert any(p.startswith("a.weight after step") for p in problems)


@pytest.mark.parametrize("scale", [2.0, 1.001])
def test_a_wrong_gradient_scale_fails_though_adam_hides_it_from_the_parameters(reference, scale):
    """A gradient scaled wrongly (a sum where a mean was due, a missing 1/world): Adam normalises it away, so
    only the gradients show it."""
    gradients, theirs = reference
    scaled = [{name: scale * g for name, g in grads.items()} for grads in gradients]
    problems = adam_problems(_adamw(scaled), theirs, HYPER)
    assert problems and all(p.startswith("gradient of ") for p in problems)


def test_a_wrong_learning_rate_fails_the_update_check(reference):
    gradients, theirs = reference
    problems = adam_problems(_adamw(gradients, lr_scale=lambda step: 1.5 if step == 1 else 1.0), theirs, HYPER)
    assert any(p.startswith("ours: a.weight at step 2 did not move as AdamW") for p in problems)
    assert any(p.startswith("a.weight after step 2") for p in problems)


def test_exchanged_parameter_values_fail_with_right_gradients(reference):
    """Right gradients and moments, parameter values saved under each other's names (a loader's mix-up)."""
    _, theirs = reference
    ours = [dict(state) for state in theirs]
    last = ours[-1]
    last["a.weight"], last["b.weight"] = ((last["b.weight"][0],) + last["a.weight"][1:],
                                          (last["a.weight"][0],) + last["b.weight"][1:])
    problems = adam_problems(ours, theirs, HYPER)
    assert any(p.startswith(f"a.weight after step {STEPS}") for p in problems)


def test_direction_cap_bounds_adam_for_any_gradients():
    """|m_hat| / sqrt(v_hat) stays under the cap for random gradient sequences, and reaches it for gradients
    proportional to (beta1 / beta2)^(steps ago); after one step the cap is 1."""
    beta1, beta2 = BETAS
    assert direction_cap(1, beta1, beta2) == pytest.approx(1.0)
    generator = torch.Generator().manual_seed(3)
    for t in (2, 3, 5):
        worst = 0.0
        for _ in range(200):
            g = torch.randn(t, generator=generator, dtype=torch.float64) * torch.rand(t, generator=generator,
                                                                                       dtype=torch.float64) ** 4
            m = sum((1 - beta1) * beta1 ** (t - 1 - k) * g[k] for k in range(t)) / (1 - beta1 ** t)
            v = sum((1 - beta2) * beta2 ** (t - 1 - k) * g[k] ** 2 for k in range(t)) / (1 - beta2 ** t)
            worst = max(worst, (m.abs() / v.sqrt()).item())
        # The sequence that reaches the cap: g_k proportional to (beta1 / beta2)^(t-1-k).
        g = torch.tensor([(beta1 / beta2) ** (t - 1 - k) for k in range(t)], dtype=torch.float64)
        m = sum((1 - beta1) * beta1 ** (t - 1 - k) * g[k] for k in range(t)) / (1 - beta1 ** t)
        v = sum((1 - beta2) * beta2 ** (t - 1 - k) * g[k] ** 2 for k in range(t)) / (1 - beta2 ** t)
        cap = direction_cap(t, beta1, beta2)
        assert worst <= cap + 1e-12
        assert (m / v.sqrt()).item() == pytest.approx(cap, rel=1e-12)
