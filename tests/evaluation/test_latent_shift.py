"""The shift of latent statistics against the base's, as a world model normalizing with the base's sees it."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.evaluation.latent_shift import shift_markdown, stats_shift
from tokenizer_posttrain.evaluation.latent_stats import LatentStats


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
