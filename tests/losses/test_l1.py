"""The masked L1 term."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.losses.l1 import masked_l1


def test_masked_l1_ignores_masked_pixels() -> None:
    target = torch.zeros(1, 3, 2, 4, 4)
    rec = torch.ones_like(target)
    mask = torch.zeros(1, 1, 2, 4, 4)
    mask[:, :, 0] = 1
    rec[:, :, 1] = 100.0  # only in the masked-out frame
    assert masked_l1(rec, target, mask).item() == pytest.approx(1.0)
