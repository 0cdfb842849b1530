"""The loss seam: terms by name and their weighted total, schedules, lazy networks, launch-time checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.losses.test_perceptual import videos
from tokenizer_posttrain.losses import TERMS, LossConfig, StepContext, build_loss
from tokenizer_posttrain.losses.gram import GramConfig
from tokenizer_posttrain.losses.l1 import L1Config, masked_l1
from tokenizer_posttrain.losses.perceptual import PerceptualConfig, PerceptualLoss, VGG16Pass
from tokenizer_posttrain.losses.terms import TermConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


def test_every_term_is_a_config_field() -> None:
    # In the fields' order, whatever terms later releases add (a new term edits no test but its own).
    config = LossConfig()
    fields = [f.name for f in dataclasses.fields(LossConfig) if isinstance(getattr(config, f.name), TermConfig)]
    assert list(TERMS) == fields
    shipped = ["l1", "perceptual", "gram", "high_freq", "flow", "consistency"]
    assert [name for name in TERMS if name in shipped] == shipped


def test_terms_and_weighted_total_equal_the_previous_formula(weights_file: Path) -> None:
    # The formula the trainer used before the seam: l1_weight * masked_l1 + perceptual_weight * PerceptualLoss.
    target, noise = videos(b=1, t=2)
    recon, mask = target + 0.1 * noise, torch.ones(1, 1, 2, 16, 16)
    loss = build_loss(LossConfig(l1=L1Config(2.0), perceptual=PerceptualConfig(0.5, weights_path=str(weights_file))))
    terms = loss(StepContext(recon, target, mask), loss.prepare(0, CPU))
    l1, perceptual = masked_l1(recon, target, mask), PerceptualLoss(str(weights_file))(recon, target, mask)
    assert torch.equal(terms["l1"], l1) and torch.equal(terms["perceptual"], perceptual)
    assert torch.equal(terms["loss"], 2.0 * l1 + 0.5 * perceptual)
    torch.testing.assert_close(terms["l1"], (recon - target).abs().mean())
    assert set(terms) == {"l1", "perceptual", "loss"}


def test_a_term_at_weight_zero_is_not_computed() -> None:
    target, noise = videos(b=1, t=2)
    loss = build_loss(LossConfig(perceptual_weight=0.0))
    terms = loss(StepContext(target + noise, target, torch.ones(1, 1, 2, 16, 16)), loss.prepare(0, CPU))
    assert set(terms) == {"l1", "loss"} and torch.equal(terms["loss"], terms["l1"])


def test_a_scheduled_network_is_found_at_launch_and_built_when_first_needed(weights_file: Path) -> None:
    schedule = {"boundaries": [5], "values": [0.0, 0.1], "weights_path": str(weights_file)}
    loss = build_loss(LossConfig(perceptual=PerceptualConfig(**schedule)))
    assert loss.vgg is not None
    assert loss.prepare(4, CPU) == {"l1": 1.0} and loss.vgg.network is None  # off: nothing read, nothing built
    assert loss.prepare(5, CPU) == {"l1": 1.0, "perceptual": 0.1} and isinstance(loss.vgg.network, VGG16Pass)
    missing = {**schedule, "weights_path": str(weights_file.parent / "gone.pth")}
    with pytest.raises(FileNotFoundError, match="gone.pth"):  # at launch, not at step 5
        build_loss(LossConfig(perceptual=PerceptualConfig(**missing)))


def test_shorthand_weights_set_the_terms() -> None:
    config = LossConfig(l1_weight=0.5, perceptual_weight=0.0)
    assert (config.l1.weight, config.perceptual.weight) == (0.5, 0.0)
    with pytest.raises(ValueError, match="loss.perceptual has a schedule"):
        LossConfig(perceptual_weight=0.2, perceptual=PerceptualConfig(boundaries=[3], values=[0.0, 0.1]))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"l1": L1Config(-1.0)}, "loss.l1.weight=-1.0 must be finite and >= 0"),
        ({"l1": L1Config(float("nan"))}, "loss.l1.weight=nan must be finite"),
        ({"perceptual": PerceptualConfig(boundaries=[3], values=[0.1])}, "loss.perceptual.values has 1 entries"),
        ({"perceptual": PerceptualConfig(boundaries=[3])}, "loss.perceptual.values is empty"),
        ({"perceptual": PerceptualConfig(boundaries=[5, 2], values=[0, 1, 2])}, "must be increasing"),
        ({"perceptual": PerceptualConfig(frame_chunk=0)}, "loss.perceptual.frame_chunk=0"),
        ({"gram": GramConfig(boundaries=[3])}, "loss.gram.values is empty"),
        ({"gram": GramConfig(-0.5)}, "loss.gram.weight=-0.5 must be finite and >= 0"),
        ({"l1_weight": 0.0, "perceptual_weight": 0.0}, "every loss term has weight 0 at step 0"),
        (
            {"l1": L1Config(boundaries=[9], values=[1.0, 0.0]), "perceptual_weight": 0.0},
            "every loss term has weight 0 at step 9",
        ),
    ],
)
def test_bad_settings_name_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LossConfig(**config)


def test_schedule_changes_that_a_run_never_reaches_are_named() -> None:
    config = LossConfig(
        l1=L1Config(boundaries=[8, 99], values=[1.0, 0.5, 0.2]),
        perceptual_weight=0.0,
        gram=GramConfig(boundaries=[500000], values=[0.0, 0.062]),
    )
    # Steps 0 ... 98: the change at step 8 comes, the one at step 99 does not.
    assert config.unreached_changes(99) == [
        "loss.l1.boundaries=[8, 99]: trainer.max_steps=99 ends before step 99, where the weight would change "
        "from 0.5 to 0.2; it stays 0.5",
        "loss.gram.boundaries=[500000]: trainer.max_steps=99 ends before step 500000, where the weight would "
        "change from 0.0 to 0.062; it stays 0.0 (the term is never on)",
    ]
    assert [note.split(":")[0] for note in config.unreached_changes(100)] == ["loss.gram.boundaries=[500000]"]
    assert LossConfig().unreached_changes(1) == []
