"""The export command: the official file set and a model card from a training checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.training.conftest import tiny_run
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.training.train import train


def test_export_command_writes_files_and_model_card(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = train(**tiny_run(tmp_path / "r", model={"ema_decay": 0.9}, trainer={"checkpoint_every_n_steps": 1}))
    # a checkpoint from during the run (at the end Lightning copies the EMA into the live weights)
    ckpt = run / "checkpoints" / "step=2.ckpt"
    # An evaluation against the base puts its verdict in the card.
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"metrics": {"psnr": 5.0}, "baseline_metrics": {"psnr": 6.0}, "n_clips": 3}))
    for flag, out in ((["--results", str(results)], "plain"), (["--ema"], "ema")):
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / out), *flag]) == 0
        card = (tmp_path / out / "README.md").read_text()
        assert "CV8x8x8" in card and "| steps | 2 |" in card
        verdict = "**Verdict: WORSE than the base: PSNR 6.00 -> 5.00 dB (-1.000 dB) on 3 held-out clips.**"
        assert (verdict in card) == (out == "plain"), card
    plain = torch.jit.load(str(tmp_path / "plain" / "autoencoder.jit")).state_dict()
    ema = torch.jit.load(str(tmp_path / "ema" / "autoencoder.jit")).state_dict()
    assert any(not torch.equal(plain[k], ema[k]) for k in plain)  # the EMA average differs from the last weights
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1, err
