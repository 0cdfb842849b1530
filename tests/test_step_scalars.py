"""Per-step scalars read back a step late, and the NaN/Inf step counter."""

import math

import pytest
import torch

from tokenizer_posttrain.step_scalars import (
    DeviceScalars,
    NonFiniteLossError,
    NonFiniteSteps,
    grad_norm,
    skip_flag,
)


def test_scalars_come_back_in_order_keeping_the_newest_back() -> None:
    queue = DeviceScalars()
    queue.push(0, {"a": torch.tensor(1.5), "b": torch.tensor([2.0], dtype=torch.bfloat16)})
    queue.push(1, {"a": torch.tensor(float("nan")), "b": torch.tensor(3)})
    assert queue.pop(keep_last=1) == [(0, {"a": 1.5, "b": 2.0})]
    assert queue.pop(keep_last=1) == []
    ((step, values),) = queue.pop()
    assert step == 1 and math.isnan(values["a"]) and values["b"] == 3.0
    assert queue.pop() == []


def test_skip_flag_is_fused_adamws_found_inf() -> None:
    flags = [float(skip_flag(torch.tensor(v))) for v in (1.0, float("nan"), float("inf"), 0.0)]
    assert flags == [0.0, 1.0, 1.0, 0.0]


def test_non_finite_steps_count_in_a_row_and_stop() -> None:
    steps = NonFiniteSteps(max_in_a_row=2)
    with pytest.warns(UserWarning, match="step 3: gradient norm is nan; step skipped \\(1 in a row\\)"):
        assert steps.check(3, float("nan"))
    assert not steps.check(4, 0.5) and steps.in_a_row == 0
    with pytest.warns(UserWarning):
        assert steps.check(5, float("inf"))
    with (
        pytest.raises(NonFiniteLossError, match="2 steps in a row .*trainer.max_bad_steps=2"),
        pytest.warns(UserWarning),
    ):
        steps.check(6, float("nan"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scalars_cross_from_a_gpu_through_pinned_copies() -> None:
    queue = DeviceScalars()
    x = torch.randn(4096, 4096, device="cuda")
    for step in range(3):
        queue.push(step, {"sum": (x @ x).sum() * 0 + step, "nan": torch.tensor(float("nan"), device="cuda")})
    # A pinned copy behind an event per step, read back in order with the right values.
    popped = queue.pop(keep_last=1) + queue.pop()
    assert [step for step, _ in popped] == [0, 1, 2]
    assert [values["sum"] for _, values in popped] == [0.0, 1.0, 2.0]
    assert all(math.isnan(values["nan"]) for _, values in popped)


def test_grad_norm_is_fp32_whatever_the_gradient_dtype() -> None:
    grads = [torch.full((300,), 0.01, dtype=torch.bfloat16), torch.full((7, 3), -2.0)]
    norm = grad_norm(grads)
    expected = (300 * float(torch.tensor(0.01, dtype=torch.bfloat16)) ** 2 + 21 * 4.0) ** 0.5
    assert norm.dtype == torch.float32 and norm.shape == ()
    assert float(norm) == pytest.approx(expected, rel=1e-6)
