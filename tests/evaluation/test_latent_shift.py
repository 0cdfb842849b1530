"""The shift of latent statistics against the base's, as a world model normalizing with the base's sees it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import reference_weights
from tests.evaluation.wan_base import tiny_wan
from tokenizer_posttrain.evaluation.latent_shift import (
    CONSTANTS,
    shift_from_base,
    shift_line,
    shift_markdown,
    stats_shift,
)
from tokenizer_posttrain.evaluation.latent_stats import LatentStats, base_latent_stats
from tokenizer_posttrain.io.checkpoint import load_tokenizer


def test_the_shift_against_the_base_is_in_units_of_the_base_std_per_channel() -> None:
    base = LatentStats(torch.zeros(2, 3), torch.full((2, 3), 2.0), torch.zeros(2), torch.ones(2), clips=1)
    mean = torch.tensor([[1.0, 1.0, 4.0], [0.0, 0.0, 0.0]])
    std = torch.tensor([[2.0, 2.0, 2.0], [1.0, 4.0, 2.0]])
    shift = stats_shift(LatentStats(mean, std, torch.zeros(2), torch.ones(2), clips=1), base)
    first, second = shift["channels"]
    assert first["mean_offset"] == pytest.approx(1.0) and first["worst_mean_offset"] == pytest.approx(2.0)
    assert second["std_ratio"] == pytest.approx(3.5 / 3) and second["worst_std_ratio"] == pytest.approx(2.0)
    assert shift["max_abs_mean_offset"] == pytest.approx(2.0) and shift["max_std_change"] == pytest.approx(1.0)
    table = shift_markdown(shift)
    assert "| 0 | +1.0000 | +2.0000 | 1.0000 | 1.0000 |" in table and "largest std change 100.00%" in " ".join(table)


def test_against_the_wan_constants_the_shift_is_of_the_pooled_statistics_per_channel() -> None:
    config = tiny_wan().config
    base = base_latent_stats(config)
    assert base is not None
    mean, std = base.mean.clone(), base.std.clone()
    mean[0] += base.std[0] * torch.linspace(0, 1, mean.shape[1])  # channel 0 drifts over the positions
    std[1] *= 2
    new = LatentStats(mean, std, mean[:, 0], std[:, 0], clips=4)
    shift = shift_from_base(new, config, base=None)
    assert shift is not None and shift["reference"] == CONSTANTS
    first, second, third = shift["channels"][:3]
    # Channel 0: a pooled mean offset of half a std, its spread of means widening the pooled std.
    assert first["mean_offset"] == pytest.approx(0.5, abs=1e-5) and first["worst_mean_offset"] == pytest.approx(1.0)
    spread = torch.linspace(0, 1, 32).std(unbiased=False)
    assert first["std_ratio"] == pytest.approx(float(spread.hypot(torch.tensor(1.0))), rel=1e-4)
    assert second["std_ratio"] == pytest.approx(2.0) and third["mean_offset"] == pytest.approx(0.0, abs=1e-6)
    assert "per-channel constants" in " ".join(shift_markdown(shift))
    assert shift_line(shift).startswith("latent statistics against the base's per-channel constants: largest mean")
    # Cosmos has no constants: without the base's files there is nothing to compare with.
    cosmos = load_tokenizer(reference_weights("CV8x8x8")).config
    assert shift_from_base(new, cosmos, base=None) is None
