"""Weight schedules over optimizer steps, by NVIDIA's boundary convention."""

from __future__ import annotations

from tokenizer_posttrain.losses.perceptual import PerceptualConfig


def test_weights_follow_the_schedule_on_optimizer_steps() -> None:
    # NVIDIA's trainers: ``values[0]`` while the 0-based step is below the first boundary.
    config = PerceptualConfig(boundaries=[10, 20], values=[0.0, 0.1, 0.5])
    assert [config.weight_at(step) for step in (0, 9, 10, 19, 20, 10_000)] == [0.0, 0.0, 0.1, 0.1, 0.5, 0.5]
    assert PerceptualConfig(weight=0.3).weight_at(123) == 0.3


def test_a_term_is_on_when_any_step_has_weight() -> None:
    assert PerceptualConfig(boundaries=[3], values=[0.0, 0.2]).ever_on
    assert not PerceptualConfig(weight=0.0).ever_on
    assert PerceptualConfig(boundaries=[3], values=[0.0, 0.2]).weights == [0.0, 0.2]
