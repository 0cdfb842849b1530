"""The Wan2.1 VAE through the whole training path on the CPU, at width 8: a ``tiny_wan21`` run (KL term on,
decoding posterior samples) that checkpoints, exports Wan's own ``.pth`` and resumes exactly after a SIGKILL; the
decoder side alone, LoRA and the GAN stage on it; the speed switches of the training step; and the launch checks
(``--dryrun``, the settings only a VAE takes, Wan's clip rule).

One uninterrupted run (the module's fixture) serves the checks of the run, its export and the reference losses of
the killed-and-resumed run."""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, read_metrics, run_cli_here
from tests.training.conftest import tiny_run
from tests.training.test_checkpointing import losses, wait_for
from tokenizer_posttrain import build_tokenizer, load_tokenizer
from tokenizer_posttrain.io.formats import WAN21_PTH
from tokenizer_posttrain.losses.gan import GANConfig
from tokenizer_posttrain.losses.kl import KLConfig
from tokenizer_posttrain.training import acceleration
from tokenizer_posttrain.training.acceleration import compile_module_call
from tokenizer_posttrain.training.adversarial import gan_last_layer
from tokenizer_posttrain.training.config import LoRAConfig, LossConfig, ModelConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.train import train

RUN = "tiny_wan21"
STEPS = 10
ARGS = [
    "--factory",
    "tiny_wan21",
    "data.frames=9",
    "data.height=32",
    "data.width=32",
    "trainer.checkpoint_every_n_steps=1",
    "trainer.val_check_interval=5",
    "optim.lr=1e-3",
    "log.latent_stats_clips=0",  # the statistics are measured elsewhere: here the export of the weights
    f"trainer.max_steps={STEPS}",
]
WIDTH = 8
ENCODER_SIDE = ("encoder.", "conv1.")


def wan(**settings: object) -> dict[str, object]:
    """``model.*`` of the tiny Wan VAE with ``settings``."""
    return {"model": "Wan2.1-VAE", "channels": WIDTH, **settings}


WAN_DATA = {"frames": 5, "height": 16, "width": 16}
"""The smallest clip a Wan VAE takes with more than one latent frame (1 + 4 frames, 2x2 latents)."""


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted ``tiny_wan21`` run of :data:`STEPS` steps: its folder and what it printed."""
    root = tmp_path_factory.mktemp("wan_whole")
    result = run_cli_here(*ARGS, f"log.log_dir={root}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / RUN, result.stdout


def test_the_run_trains_a_posterior_sample_under_the_kl_term(whole_run: tuple[Path, str]) -> None:
    run_dir, out = whole_run
    assert "model: Wan2.1-VAE at width 8" in out
    total, kl = losses(run_dir), losses(run_dir, "train/kl")
    assert sorted(total) == sorted(kl) == list(range(STEPS))
    assert all(math.isfinite(v) for v in total.values()) and all(v > 0 and math.isfinite(v) for v in kl.values())
    first, last = [total[s] for s in range(3)], [total[s] for s in range(STEPS - 3, STEPS)]
    assert sum(last) < sum(first), total  # the loss falls
    assert any(r.get("val/psnr") for r in read_metrics(run_dir))  # validation decodes the mean
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert hp["model"]["sample_posterior"] and hp["loss"]["kl"]["weight"] == 1e-6
    assert ckpt["global_step"] == STEPS
    early = torch.load(run_dir / "checkpoints" / "step=8.ckpt", weights_only=True)["state_dict"]
    moved = [k for k, v in ckpt["state_dict"].items() if not torch.equal(v, early[k])]
    assert any(k.startswith("network.encoder.") for k in moved) and any(k.startswith("network.decoder.") for k in moved)


def test_the_export_is_wan_s_own_file_with_the_checkpoint_s_weights(whole_run: tuple[Path, str]) -> None:
    run_dir, out = whole_run
    export = run_dir / "export"
    assert {WAN21_PTH, "model.safetensors", "config.json"} <= {p.name for p in export.iterdir()}
    assert f"export ({WAN21_PTH}, model.safetensors, config.json): {export}" in out
    trained = load_tokenizer(run_dir / "checkpoints" / "last.ckpt")
    exported = load_tokenizer(export / WAN21_PTH)  # strict, and its width read from the shapes
    assert type(exported).__name__ == "Wan21VAE" and exported.config.channels == WIDTH
    state = torch.load(export / WAN21_PTH, weights_only=True)  # a plain dict of tensors, as Wan's code loads it
    assert list(state) == list(trained.state_dict())
    for key, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value), key


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(whole_run: tuple[Path, str], tmp_path: Path) -> None:
    # Posterior samples draw noise every step: the losses match only if the random states come back too.
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train_tokenizer.py"), *ARGS, f"log.log_dir={tmp_path}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    ckpt_dir = tmp_path / RUN / "checkpoints"
    wait_for(ckpt_dir / "step=4.ckpt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = max(torch.load(p, weights_only=True)["global_step"] for p in ckpt_dir.glob("*.ckpt"))
    assert 4 <= done < STEPS
    resumed = run_cli_here(*ARGS, f"log.log_dir={tmp_path}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    for name in ("train/loss", "train/kl"):
        a, b = losses(whole_run[0], name), losses(tmp_path / RUN, name)
        for step in range(done, STEPS):
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (name, step, a[step], b[step])


@pytest.fixture(scope="module")
def base_pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan VAE's weights as Wan ships them (a plain state dict in a ``.pth``): the base of the runs below."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wan_base") / WAN21_PTH
    torch.save(build_tokenizer("Wan2.1-VAE", channels=WIDTH).state_dict(), path)
    return path


def _train_steps(tmp_path: Path, base: Path, steps: int = 2, **groups: dict) -> dict[str, torch.Tensor]:
    """``steps`` steps of the tiny Wan VAE from ``base`` with ``groups`` (``model={...}``, ``loss={...}``); the
    trained network's weights (LoRA folded in)."""
    model = wan(jit_ckpt_pth=str(base), sample_posterior=True, **groups.pop("model", {}))
    configs = tiny_run(tmp_path, steps=steps, model=model, data=WAN_DATA, **groups)
    run_dir = train(**configs)
    return load_tokenizer(run_dir / "checkpoints" / "last.ckpt").state_dict()


def _changed(trained: dict[str, torch.Tensor], base: Path) -> set[str]:
    before = torch.load(base, weights_only=True)
    assert set(trained) == set(before)
    return {k for k, v in trained.items() if not torch.equal(v, before[k])}


def test_the_decoder_side_trains_alone_and_the_latent_space_stays(tmp_path: Path, base_pth: Path) -> None:
    changed = _changed(_train_steps(tmp_path, base_pth, model={"trainable": "decoder"}), base_pth)
    assert changed and not any(k.startswith(ENCODER_SIDE) for k in changed), sorted(changed)
    assert "decoder.head.2.weight" in changed and "conv2.weight" in changed


def test_an_ema_of_the_decoder_is_kept_and_loads_as_a_wan_network(tmp_path: Path, base_pth: Path) -> None:
    _train_steps(
        tmp_path, base_pth, model={"trainable": "decoder", "ema_decay": 0.5}, trainer={"checkpoint_every_n_steps": 1}
    )
    # A checkpoint from during the run: at the end Lightning copies the average into the live weights.
    during = tmp_path / "run" / "checkpoints" / "step=2.ckpt"
    trained, ema = load_tokenizer(during).state_dict(), load_tokenizer(during, ema=True).state_dict()
    assert set(ema) == set(trained)
    # The average lags the trained weights on the decoder side, and the frozen encoder side is the base's in both.
    assert not torch.equal(ema["decoder.head.2.weight"], trained["decoder.head.2.weight"])
    assert not (_changed(ema, base_pth) & {k for k in ema if k.startswith(ENCODER_SIDE)})


def test_lora_adapters_train_and_fold_into_an_export_wan_loads(tmp_path: Path, base_pth: Path) -> None:
    trained = _train_steps(tmp_path, base_pth, model={"lora": LoRAConfig(rank=2)}, log={"export_on_end": True})
    changed = _changed(trained, base_pth)
    # Every 3D convolution may be adapted; the 2D ones (spatial resamplers, attention) and the norms stay.
    assert changed and all(k.endswith(".weight") for k in changed)
    assert "decoder.head.2.weight" in changed and "encoder.conv1.weight" in changed
    exported = torch.load(tmp_path / "run" / "export" / WAN21_PTH, weights_only=True)
    assert set(exported) == set(trained) and not any(".lora_" in k for k in exported)
    assert all(torch.equal(exported[k], v) for k, v in trained.items())


@pytest.mark.parametrize("kl", [0.0, 1e-6], ids=["split-step", "whole-step"])
def test_the_gan_stage_trains_with_its_adaptive_weight_at_the_decoder_s_head(
    tmp_path: Path, base_pth: Path, kl: float
) -> None:
    # Without the KL term the generator's adaptive weight comes from the split step at decoder.head.2; with it
    # (a term beyond the reconstruction) from the whole step's gradients.
    gan = GANConfig(weight=0.1, channels=8, layers=1, adaptive=True)
    loss = {"perceptual_weight": 0.0, "kl": KLConfig(weight=kl), "gan": gan}

    assert gan_last_layer(build_tokenizer("Wan2.1-VAE", channels=WIDTH)) == "decoder.head.2.weight"
    stage = TokenizerModel(ModelConfig(**wan()), loss=LossConfig(**loss)).adversarial
    assert stage is not None and stage.tail_splits and stage.whole_step == (kl > 0)
    _train_steps(tmp_path, base_pth, loss=loss)
    rows = read_metrics(tmp_path / "run")
    for name in ("train/gan_g", "train/gan_d", "train/gan_weight", "train/loss"):
        values = [float(r[name]) for r in rows if r.get(name)]
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (name, values)


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.compile with Dynamo's capture and the eager backend (Inductor's code generation takes minutes on a
    CPU), its compiled pieces kept apart from other tests'."""
    monkeypatch.setattr(acceleration, "compile_module_call", lambda fn, mode=None: compile_module_call(fn, "eager"))
    monkeypatch.setattr(acceleration, "SEGMENT_BACKEND", "eager")
    monkeypatch.setattr(acceleration, "_compiled_functions", {})
    with torch._dynamo.config.patch(optimize_ddp=True):
        yield


@pytest.mark.usefixtures("eager_compile")
@pytest.mark.parametrize("scope", ["step", "blocks"])
def test_the_speed_switches_keep_the_wan_step_s_loss_and_gradients(base_pth: Path, scope: str) -> None:
    loss = LossConfig(perceptual_weight=0.0, kl=KLConfig(weight=1e-3))  # the posterior reaches the compiled loss
    plain = TokenizerModel(ModelConfig(**wan(jit_ckpt_pth=str(base_pth), sample_posterior=True)), loss=loss)
    # (Chunks of time compile per block only, ~8 times the graphs, 20 s here: the GPU test of
    # tests/training/test_acceleration.py runs that case; their eager results, tests/network/wan21/test_chunks.py.)
    switches = {"compile": True, "compile_scope": scope, "channels_last": True, "activation_checkpointing": True}
    fast = TokenizerModel(ModelConfig(**wan(jit_ckpt_pth=str(base_pth), sample_posterior=True, **switches)), loss=loss)
    assert list(fast.state_dict()) == list(plain.state_dict())
    copy.deepcopy(fast)  # the EMA callback copies the module
    video = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mask = torch.ones(1, 1, 5, 16, 16)
    results = []
    for module in (plain, fast):
        module.train()
        torch.manual_seed(7)  # the same posterior sample for both
        terms = module.step_forward(video, mask, module.loss.prepare(0, video.device))
        terms["loss"].backward()
        results.append((terms["loss"].detach(), torch.cat([p.grad.flatten() for p in module.network.parameters()])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0)
    assert (results[1][1] - results[0][1]).norm() / results[0][1].norm() < 1e-5


def test_a_wan_launch_runs_its_checks_in_a_dry_run(tmp_path: Path) -> None:
    result = run_cli_here("--factory", "tiny_wan21", f"log.log_dir={tmp_path / 'logs'}", "--dryrun", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model: Wan2.1-VAE at width 8, RANDOM weights" in result.stdout
    assert "data: built-in synthetic clips (no data.path), clips 17x64x64" in result.stdout
    assert "  model.sample_posterior = True" in result.stdout and "  loss.kl.weight = 1e-06" in result.stdout
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("factory", "overrides", "message"),
    [
        ("tiny", ["model.sample_posterior=true"], "model.sample_posterior=true: Cosmos-1.0-Tokenizer-CV8x8x8 has no"),
        ("tiny", ["loss.kl.weight=1e-6"], "loss.kl needs the posterior of a VAE"),
        ("tiny_wan21", ["data.frames=16"], "data.frames=16 is not 1+4k frames (use 13 or 17)"),
        ("tiny_wan21", ["data.frames=17", "data.height=60"], "data.height=60 is not a multiple of 8"),
    ],
    ids=["cosmos-sample-posterior", "cosmos-kl", "wan-frames", "wan-height"],
)
def test_settings_the_model_cannot_take_stop_the_launch_in_one_line(
    tmp_path: Path, factory: str, overrides: list[str], message: str
) -> None:
    for dry in (["--dryrun"], []):
        result = run_cli_here("--factory", factory, f"log.log_dir={tmp_path}", *overrides, *dry, cwd=tmp_path)
        assert result.returncode == 1 and result.stderr.startswith("error: "), result.stderr[-2000:]
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())
