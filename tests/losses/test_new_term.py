"""A new loss term through the public seam alone: a :class:`TermConfig` whose ``build()`` names a
:class:`LossTerm` that reads the step's :class:`StepContext`, registered by one typed field of a :class:`LossConfig`.

The field sits on a subclass of :class:`LossConfig` (standing for the one line a new term adds to ``LossConfig``
itself), so nothing global is registered: the teardown checks that no other test can see the term."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.conftest import fit
from tests.training.test_step_guard import Recorder
from tokenizer_posttrain.losses import TERMS, LossConfig, LossTerm, StepContext, TermConfig, build_loss
from tokenizer_posttrain.training.config import ModelConfig, OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel

CPU = torch.device("cpu")


@dataclass
class SquaredConfig(TermConfig):
    """Mean squared pixel error over the counted pixels (a toy term)."""

    def build(self) -> SquaredTerm:
        return SquaredTerm(self)


class SquaredTerm(LossTerm):
    """:class:`SquaredConfig`'s term."""

    def __init__(self, config: SquaredConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, context: StepContext) -> Tensor:
        squared = (context.reconstruction.float() - context.target.float()) ** 2
        weight = context.mask.float().expand_as(squared)
        return (squared * weight).sum() / weight.sum().clamp_min(1)


@dataclass
class WithSquared(LossConfig):
    """The shipped terms and the toy one."""

    squared: SquaredConfig = field(default_factory=SquaredConfig)
    """The toy term; weight 0 (default): off."""


@pytest.fixture
def squared() -> Iterator[type[WithSquared]]:
    """The config with the toy term; afterwards, the shipped config still knows nothing of it."""
    yield WithSquared
    assert "squared" not in TERMS and "squared" not in LossConfig().term_names
    with pytest.raises(TypeError, match="squared"):
        LossConfig(squared=SquaredConfig(1.0))  # type: ignore[call-arg]


def scheduled(config: type[WithSquared]) -> WithSquared:
    """L1, and the toy term from optimizer step 1 at weight 0.5."""
    return config(perceptual_weight=0.0, squared=SquaredConfig(boundaries=[1], values=[0.0, 0.5]))


def test_the_new_term_follows_its_schedule_and_its_settings_are_checked(squared: type[WithSquared]) -> None:
    config = scheduled(squared)
    assert config.term_names == [*TERMS, "squared"]  # summed last, after the shipped terms
    assert config.weights_at(0) == {"l1": 1.0} and config.weights_at(1) == {"l1": 1.0, "squared": 0.5}
    assert config.schedule_starts() == [0, 1]
    assert [note.split(":")[0] for note in config.unreached_changes(1)] == ["loss.squared.boundaries=[1]"]
    with pytest.raises(ValueError, match=r"loss\.squared\.weight=-1\.0 must be finite and >= 0"):
        squared(squared=SquaredConfig(-1.0))
    with pytest.raises(ValueError, match=r"loss\.squared\.values has 1 entries"):
        squared(squared=SquaredConfig(boundaries=[3], values=[0.1]))


def test_its_value_joins_the_total_from_its_first_step(squared: type[WithSquared]) -> None:
    loss = build_loss(scheduled(squared))
    target = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    recon = target + 0.25
    mask = torch.ones(2, 1, 3, 8, 8)
    mask[1] = 0  # the second clip is padding: it does not count
    before = loss(StepContext(recon, target, mask), loss.prepare(0, CPU))
    assert set(before) == {"l1", "loss"}  # weight 0 at step 0: not computed
    terms = loss(StepContext(recon, target, mask), loss.prepare(1, CPU))
    assert set(terms) == {"l1", "squared", "loss"}
    torch.testing.assert_close(terms["squared"], torch.tensor(0.0625))
    torch.testing.assert_close(terms["loss"], terms["l1"] + 0.5 * terms["squared"])


@pytest.mark.filterwarnings("ignore:model.jit_ckpt_pth is not set")
def test_the_training_step_trains_on_it_and_logs_it(squared: type[WithSquared], tmp_path: Path) -> None:
    module = TokenizerModel(ModelConfig(model="CV8x8x8", channels=8), OptimConfig(lr=1e-3), scheduled(squared))
    before = {k: v.clone() for k, v in module.network.state_dict().items()}
    recorder = Recorder()
    fit(module, tmp_path, steps=2, logger=recorder, log_every_n_steps=1)
    rows = {step: row for step, row in recorder.rows if "train/loss" in row}
    assert "train/squared" not in rows[0] and rows[1]["train/squared"] > 0
    assert rows[1]["train/loss"] == pytest.approx(rows[1]["train/l1"] + 0.5 * rows[1]["train/squared"], rel=1e-4)
    after = module.network.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
