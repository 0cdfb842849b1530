"""The Wan2.2 VAE through the whole training path on the CPU (issue 39): a ``tiny_wan22`` run on the smallest clips
its 16x16 spatial compression takes (5x16x16: two latent frames of 1x1) that trains, checkpoints, exports Wan2.2's
own ``.pth`` and resumes exactly after a SIGKILL; then the decoder side alone and LoRA, post-training that export.

Kept lean (the Wan2.1 counterpart, test_wan21_run.py, has the checks every Wan family shares: the GAN stage, the
speed switches, the launch checks): one uninterrupted run (the module's fixture) serves the checks of the run, its
export, the reference losses of the killed-and-resumed run and the base of the short runs."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_cli_here
from tests.training.test_checkpointing import losses, wait_for
from tests.training.test_wan21_run import ENCODER_SIDE, WAN_DATA, _changed, _train_steps
from tokenizer_posttrain import load_tokenizer
from tokenizer_posttrain.io.formats import WAN22_PTH
from tokenizer_posttrain.training.config import LoRAConfig

RUN = "tiny_wan22"
STEPS = 8
KILL_AFTER = 4
"""The checkpoint whose appearance the killed run waits for."""
ARGS = [
    "--factory",
    "tiny_wan22",
    *(f"data.{key}={value}" for key, value in WAN_DATA.items()),
    "data.global_batch_size=1",  # one 5x16x16 clip a step: the recipe's two double the work, not the checks
    "data.micro_batch_size=1",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.val_check_interval=1000",  # no validation: test_wan21_run.py checks the Wan families' posterior mean
    "optim.lr=1e-3",
    "log.latent_stats_clips=0",  # the statistics are measured elsewhere (tests/commands/test_export_cmd.py)
    f"trainer.max_steps={STEPS}",
]
WAN22 = "Wan2.2-VAE"


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted ``tiny_wan22`` run of :data:`STEPS` steps: its folder and what it printed."""
    root = tmp_path_factory.mktemp("wan22_whole")
    result = run_cli_here(*ARGS, f"log.log_dir={root}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / RUN, result.stdout


def test_the_run_trains_a_posterior_sample_under_the_kl_term(whole_run: tuple[Path, str]) -> None:
    run_dir, out = whole_run
    assert "model: Wan2.2-VAE at width 8" in out and "clips 5x16x16" in out
    total, kl = losses(run_dir), losses(run_dir, "train/kl")
    assert sorted(total) == sorted(kl) == list(range(STEPS))
    assert all(math.isfinite(v) for v in total.values()) and all(v > 0 and math.isfinite(v) for v in kl.values())
    first, last = [total[s] for s in range(3)], [total[s] for s in range(STEPS - 3, STEPS)]
    assert sum(last) < sum(first), total  # the loss falls
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert hp["model"]["model"] == WAN22 and hp["model"]["sample_posterior"] and hp["loss"]["kl"]["weight"] == 1e-6
    assert ckpt["global_step"] == STEPS
    early = torch.load(run_dir / "checkpoints" / f"step={STEPS - 2}.ckpt", weights_only=True)["state_dict"]
    moved = [k for k, v in ckpt["state_dict"].items() if not torch.equal(v, early[k])]
    assert any(k.startswith("network.encoder.") for k in moved) and any(k.startswith("network.decoder.") for k in moved)


def test_the_export_is_wan22_s_own_file_with_the_checkpoint_s_weights(whole_run: tuple[Path, str]) -> None:
    run_dir, out = whole_run
    export = run_dir / "export"
    assert {WAN22_PTH, "model.safetensors", "config.json"} <= {p.name for p in export.iterdir()}
    assert f"export ({WAN22_PTH}, model.safetensors, config.json): {export}" in out
    trained = load_tokenizer(run_dir / "checkpoints" / "last.ckpt")
    exported = load_tokenizer(export / WAN22_PTH)  # strict, and both widths read from the shapes
    assert type(exported).__name__ == "Wan22VAE" and exported.config == trained.config
    assert (exported.config.channels, exported.config.dec_channels, exported.config.z_dim) == (8, 12, 48)
    state = torch.load(export / WAN22_PTH, weights_only=True)  # a plain dict of tensors, as Wan2.2's code loads it
    assert list(state) == list(trained.state_dict())
    for key, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value), key


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(whole_run: tuple[Path, str], tmp_path: Path) -> None:
    # Posterior samples draw noise every step: the losses match only if the random states come back too.
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train_tokenizer.py"), *ARGS, f"log.log_dir={tmp_path}"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    ckpt_dir = tmp_path / RUN / "checkpoints"
    try:
        wait_for(ckpt_dir / f"step={KILL_AFTER}.ckpt", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    done = max(torch.load(p, weights_only=True)["global_step"] for p in ckpt_dir.glob("*.ckpt"))
    assert KILL_AFTER <= done < STEPS
    resumed = run_cli_here(*ARGS, f"log.log_dir={tmp_path}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    for name in ("train/loss", "train/kl"):
        a, b = losses(whole_run[0], name), losses(tmp_path / RUN, name)
        for step in range(done, STEPS):
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (name, step, a[step], b[step])


@pytest.mark.parametrize("side", ["decoder", "lora"])
def test_the_decoder_side_or_lora_post_trains_the_run_s_export(
    whole_run: tuple[Path, str], tmp_path: Path, side: str
) -> None:
    # The run's own export is the base: Wan2.2_VAE.pth as a post-training starts from it.
    base = whole_run[0] / "export" / WAN22_PTH
    if side == "decoder":
        # The latent space stays: nothing on the encoder side (encoder, conv1) moves.
        changed = _changed(_train_steps(tmp_path, base, steps=1, model={"model": WAN22, "trainable": "decoder"}), base)
        assert changed and not any(k.startswith(ENCODER_SIDE) for k in changed), sorted(changed)
        assert "decoder.head.2.weight" in changed and "conv2.weight" in changed
        return
    model = {"model": WAN22, "lora": LoRAConfig(rank=2)}
    trained = _train_steps(tmp_path, base, steps=1, model=model, log={"export_on_end": True})
    changed = _changed(trained, base)
    # Only convolution weights take adapters; folded in, the export is a plain Wan2.2 file again.
    assert changed and all(k.endswith(".weight") for k in changed)
    assert "decoder.head.2.weight" in changed and "encoder.conv1.weight" in changed
    exported = torch.load(tmp_path / "run" / "export" / WAN22_PTH, weights_only=True)
    assert set(exported) == set(trained) and not any(".lora_" in k for k in exported)
    assert all(torch.equal(exported[k], v) for k, v in trained.items())
