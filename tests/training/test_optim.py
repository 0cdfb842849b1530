"""AdamW parameter groups by name prefix, warmup and decay schedules reaching the optimizer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import fit
from tests.training.conftest import no_vgg, tiny
from tokenizer_posttrain.training.config import OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.optim import lr_factor, param_groups


def test_lr_groups_and_schedules() -> None:
    net = TokenizerModel(tiny(), loss=no_vgg()).network
    groups = {g["name"]: g for g in param_groups(net, 1e-4, {"decoder.": 2e-4, "decoder.up.0.": 3e-4})}
    assert groups["decoder.up.0."]["lr"] == 3e-4 and groups["decoder."]["lr"] == 2e-4
    assert groups["default"]["lr"] == 1e-4
    assert sum(len(g["params"]) for g in groups.values()) == len(list(net.parameters()))
    assert all(
        n.startswith("decoder.up.0.")
        for n, p in net.named_parameters()
        if any(p is q for q in groups["decoder.up.0."]["params"])
    )
    with pytest.raises(ValueError, match="match no trainable parameter"):
        param_groups(net, 1e-4, {"decodr.": 1e-3})
    assert [lr_factor(s, 4, "constant", 20, 0.0) for s in (0, 3, 10)] == [0.25, 1.0, 1.0]
    assert lr_factor(4, 4, "cosine", 20, 0.0) == pytest.approx(1.0)
    assert lr_factor(12, 4, "cosine", 20, 0.0) == pytest.approx(0.5)
    assert lr_factor(20, 4, "cosine", 20, 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, "linear", 20, 0.0) == pytest.approx(0.5)


def test_cosine_schedule_reaches_the_optimizer(tmp_path: Path) -> None:
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=1), no_vgg())
    trainer = fit(module, tmp_path, steps=3)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 2)), abs=1e-12)
