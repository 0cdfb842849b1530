"""loss.consistency in the training step: one more network pass on the windows only when on, gradients, a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.conftest import tiny, tiny_run
from tokenizer_posttrain.losses.consistency import WINDOWS, ConsistencyConfig
from tokenizer_posttrain.training.config import LossConfig
from tokenizer_posttrain.training.module import TokenizerModel


def encoder_batches(module: TokenizerModel, video: torch.Tensor, on: bool) -> tuple[list[int], dict]:
    """The batch sizes the encoder ran on in one training forward; the step's terms."""
    calls: list[int] = []
    handle = module.network.encoder.register_forward_hook(lambda _m, args, _o: calls.append(args[0].shape[0]))
    try:
        weights = module.loss.prepare(0, video.device)
        assert ("consistency" in weights) == on
        terms = module._step_forward(video, torch.ones_like(video[:, :1]), weights)
    finally:
        handle.remove()
    return calls, terms


@pytest.mark.usefixtures("one_torch_thread")
def test_weight_zero_runs_no_extra_pass_and_on_runs_one_on_all_windows() -> None:
    video = torch.rand(2, 3, 17, 16, 16) * 2 - 1
    off = TokenizerModel(tiny("CV8x8x8"), loss=LossConfig(perceptual_weight=0.0))
    calls, terms = encoder_batches(off, video, on=False)
    assert calls == [2] and "consistency" not in terms
    loss = LossConfig(perceptual_weight=0.0, consistency=ConsistencyConfig(0.5, window=9, step=4))
    on = TokenizerModel(tiny("CV8x8x8"), loss=loss)
    calls, terms = encoder_batches(on, video, on=True)
    assert calls == [2 * 3, 2]  # windows at frames 0, 4 and 8 of both clips, in one pass; then the clips
    # (0 here: the tiny DV model gives every window the same codes, so the windows decode alike.)
    assert torch.isfinite(terms["consistency"]) and terms["consistency"] >= 0
    torch.testing.assert_close(terms["loss"], terms["l1"] + 0.5 * terms["consistency"])
    terms["consistency"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in on.network.encoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in on.network.decoder.parameters())


@pytest.mark.usefixtures("one_torch_thread")
def test_dv_compares_pixels_only() -> None:
    loss = LossConfig(perceptual_weight=0.0, consistency=ConsistencyConfig(1.0, window=9, step=8))
    module = TokenizerModel(tiny("DV8x16x16"), loss=loss)
    video = torch.rand(1, 3, 17, 16, 16) * 2 - 1
    weights = module.loss.prepare(0, video.device)
    windows = module.loss.extra_passes(video, weights, module._extra_pass)[WINDOWS]
    assert windows.latent is None and windows.reconstruction.shape == (2, 3, 9, 16, 16)
    with torch.no_grad():  # what validation_step logs as val/consistency
        terms = module.losses(module.network(video), video, torch.ones_like(video[:, :1]))
    # (0 here: the tiny DV model gives every window the same codes, so the windows decode alike.)
    assert torch.isfinite(terms["consistency"]) and terms["consistency"] >= 0


@pytest.mark.usefixtures("one_torch_thread")
def test_a_tiny_run_logs_train_consistency(tmp_path: Path) -> None:
    from tests.conftest import read_metrics
    from tokenizer_posttrain.training.train import train

    loss = {"consistency": ConsistencyConfig(0.5, window=9, step=8)}
    run_dir = train(**tiny_run(tmp_path, steps=2, data={"frames": 17, "height": 16, "width": 16}, loss=loss))
    rows = {int(row["step"]): row for row in read_metrics(run_dir) if row.get("train/loss")}
    assert sorted(rows) == [0, 1]
    assert all(float(row["train/consistency"]) > 0 for row in rows.values())


def test_windows_that_do_not_fit_stop_the_launch_naming_the_key(tmp_path: Path) -> None:
    from tokenizer_posttrain.training.train import train

    loss = {"consistency": ConsistencyConfig(1.0, window=10, step=8)}
    with pytest.raises(ValueError, match=r"loss\.consistency\.window=10 is not 1\+8k frames \(use 9 or 17\)") as err:
        train(**tiny_run(tmp_path, data={"frames": 17, "height": 16, "width": 16}, loss=loss))
    assert "\n" not in str(err.value)
