"""The real command line: smoke run, resume, overrides and failures. Runs in this process, except where a fresh
process is the point (bad input in a fresh process, the two torchrun processes)."""

import csv
import dataclasses
import inspect
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import read_metrics, run_cli, run_cli_here, run_torchrun
from tokenizer_posttrain.commands.train_cli import run_cli as run_cli_in_process
from tokenizer_posttrain.losses import LossConfig, build_loss
from tokenizer_posttrain.losses.gan import GANConfig
from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.training.adversarial import AdversarialStage
from tokenizer_posttrain.training.train import train


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    workdir = tmp_path_factory.mktemp("cli")
    result = run_cli_here(
        "--factory",
        "tiny",
        "trainer.max_steps=30",
        "trainer.val_check_interval=10",
        "trainer.checkpoint_every_n_steps=10",
        "optim.lr=3e-4",
        f"log.log_dir={workdir}",
        "log.name=smoke",
        cwd=workdir,
    )
    return workdir / "smoke", result


def test_smoke_run_trains_checkpoints_and_exports(first_run: tuple[Path, object]) -> None:
    run_dir, result = first_run
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses  # the loss falls
    assert any(r.get("val/psnr") for r in rows)
    ckpts = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"last.ckpt", "step=10.ckpt", "step=20.ckpt", "step=30.ckpt"} <= ckpts
    assert {"encoder.jit", "decoder.jit", "autoencoder.jit"} <= {p.name for p in (run_dir / "export").iterdir()}
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 30
    assert ckpt["hyper_parameters"]["optim"]["lr"] == 3e-4  # the override reached the config
    assert ckpt["hyper_parameters"]["model"]["channels"] == 16
    assert all(v.dtype == torch.float32 for k, v in ckpt["state_dict"].items() if "conv3d" in k)


def test_second_run_in_the_same_folder_resumes(first_run: tuple[Path, object]) -> None:
    run_dir, first = first_run
    assert first.returncode == 0
    result = run_cli_here(
        "--factory",
        "tiny",
        "trainer.max_steps=34",
        f"log.log_dir={run_dir.parent}",
        "log.name=smoke",
        "log.export_on_end=false",
        cwd=run_dir.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in result.stdout
    latest = sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    with open(latest / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert min(steps) == 30 and max(steps) == 33  # continued at step 30, did not restart at 0
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 34


BAD_INPUT = [
    ("trainer.max_stepz=3", "cannot apply override trainer.max_stepz=3: no such setting"),
    ("modle.channels=16", "cannot apply override modle.channels=16: 'modle' is not an override group"),
    ("trainer.max_steps=abc", "invalid override trainer.max_steps=abc: 'abc' is not a valid int"),
    ("optim.lr=inf", "invalid optim.lr=inf: must be a positive, finite number"),
    ("loss.l1_weight=-1", "invalid loss.l1_weight=-1.0: must be finite and >= 0"),
    ("--factory", "--factory needs a value (e.g. --factory tiny)"),
    ("--bogus", "unknown option --bogus; train_tokenizer.py --help lists the options"),
]


def test_bad_input_in_a_fresh_process_is_one_line_and_no_work(tmp_path: Path) -> None:
    # The launch checks build the network (warning about random weights) before failing on the batch split:
    # a failed launch shows only its problem.
    result = run_cli(
        "--factory", "tiny", "trainer.max_steps=2", f"log.log_dir={tmp_path}", "data.global_batch_size=3",
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith("error: data.global_batch_size=3 is not a multiple of"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # nothing else: no traceback, no warning
    assert not (tmp_path / "tiny_cv8x8x8" / "checkpoints").exists()  # failed before any work


@pytest.mark.parametrize("override, message", BAD_INPUT)
def test_bad_input_exits_non_zero_with_a_message(
    override: str, message: str, tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recipes

    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py"])  # run_cli rewrites it
    args = ["--factory", "tiny", "trainer.max_steps=2", f"log.log_dir={tmp_path}", override]
    assert run_cli_in_process(train, recipes.cv8x8x8.cv8x8x8, args) == 1
    err = capfd.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err  # a clear message, nothing else
    assert not (tmp_path / "tiny_cv8x8x8" / "checkpoints").exists()  # failed before any work


def test_a_launch_says_what_it_runs_in_a_few_lines(first_run: tuple[Path, object]) -> None:
    # Before: NeMo-Run's 40-line table, Lightning's GPU/TPU lines and litlogger advert, a pytree deprecation.
    run_dir, result = first_run
    out, err = result.stdout, result.stderr
    before_first_step = out.split("[train]")[0].splitlines() + err.splitlines()
    assert len(before_first_step) < 25, out + err
    assert out.startswith("recipe: tiny, changed: trainer.max_steps=30 trainer.val_check_interval=10"), out
    assert "model: CV8x8x8 at width 16, RANDOM weights (model.jit_ckpt_pth not set)" in out
    assert "data: built-in synthetic clips (no data.path), clips 17x64x64, batch 2" in out
    assert f"run: {run_dir} (new run), to step 30 on 1 x cpu" in out
    for noise in ("Dry run for task", "Resolved Arguments", "GPU available", "TPU available", "litlogger", "LeafSpec"):
        assert noise not in out + err, noise
    # A warning is one line, without Python's file name and source line under it.
    assert "warning: model.jit_ckpt_pth is not set: training CV8x8x8 from RANDOM weights" in err
    assert "UserWarning" not in err and "self.network" not in err


def test_every_cv_export_carries_latent_statistics(first_run: tuple[Path, object]) -> None:
    # The encoder trained, so the base has none to copy: measured on the run's own (synthetic) clips, in the
    # layout the Cosmos-1.0 world models' loader reads (mean, std), [C, T] over a 121-frame chunk's latents.
    run_dir, result = first_run
    mean, std = torch.load(run_dir / "export" / "mean_std.pt", weights_only=True)
    assert mean.shape == std.shape == (16, 16)
    assert torch.isfinite(mean).all() and (std > 0).all()
    image_mean, image_std = torch.load(run_dir / "export" / "image_mean_std.pt", weights_only=True)
    assert image_mean.shape == image_std.shape == (16,)
    assert "latent statistics (mean_std.pt, image_mean_std.pt): measured on 16 synthetic clips" in result.stdout


def test_without_latent_statistics_the_summary_gives_the_command(tmp_path: Path) -> None:
    args = ("--factory", "tiny", "trainer.max_steps=1", "trainer.val_check_interval=1", f"log.log_dir={tmp_path}")
    result = run_cli_here(
        *args, "log.latent_stats_clips=0", "data.frames=9", "data.height=32", "data.width=32", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    export = tmp_path / "tiny_cv8x8x8" / "export"
    assert (export / "encoder.jit").is_file() and not (export / "mean_std.pt").exists()
    assert (
        "no mean_std.pt in the export (log.latent_stats_clips=0); to write it: python -m tokenizer_posttrain export "
        f"--checkpoint {tmp_path / 'tiny_cv8x8x8' / 'checkpoints' / 'last.ckpt'} --out {export} --latent-stats DATA"
    ) in result.stdout
    refused = run_cli_here(*args, "log.latent_stats_clips=-1", cwd=tmp_path)
    assert refused.returncode == 1 and "invalid log.latent_stats_clips=-1" in refused.stderr, refused.stderr


REFUSED_LAUNCHES = [
    (("data.frames=10",), "the clip shape does not fit CV8x8x8: data.frames=10 is not 1+8k frames"),
    (("data.global_batch_size=3",), "data.global_batch_size=3 is not a multiple of data.micro_batch_size"),
    (("model.jit_ckpt_pth={tmp}/missing",), "checkpoint {tmp}/missing does not exist"),
    (("loss.perceptual.weight=0.1", "loss.perceptual.weights_path={tmp}/vgg16.pth"), "{tmp}/vgg16.pth"),
    (("data.path={tmp}/no_data",), "{tmp}/no_data"),
]
"""Launches a real launch refuses before any work, and a word of each refusal."""


@pytest.mark.parametrize(
    "overrides, message", REFUSED_LAUNCHES, ids=lambda v: str(v[0]) if isinstance(v, tuple) else ""
)
def test_dryrun_refuses_what_a_launch_refuses_and_neither_leaves_a_folder(
    overrides: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    logs = tmp_path / "logs" / "team"
    args = ["--factory", "tiny", f"log.log_dir={logs}", *(o.format(tmp=tmp_path) for o in overrides)]
    dry = run_cli_here(*args, "--dryrun", cwd=tmp_path)
    real = run_cli_here(*args, cwd=tmp_path)
    for result in (dry, real):
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        assert result.stderr.startswith("error: ") and message.format(tmp=tmp_path) in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert dry.stderr == real.stderr
    assert not (tmp_path / "logs").exists()  # neither the run folder nor the log folder made for it is left


def test_dryrun_shows_every_setting_runs_the_checks_and_writes_nothing(tmp_path: Path) -> None:
    from tokenizer_posttrain.commands.overrides import settings

    result = run_cli_here(
        "--factory", "tiny", f"log.log_dir={tmp_path / 'logs'}", "trainer.max_steps=7", "--dryrun", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for setting in settings(train):
        if not setting.group:
            assert f"  {setting.key} = " in out, setting.key  # defaults too, e.g. the learning rate
    assert "  optim.lr = " in out
    assert "  trainer.max_steps = 7  (recipe tiny: 60)" in out
    assert f"run: {tmp_path / 'logs' / 'tiny_cv8x8x8'} (new run), to step 7 on 1 x cpu" in out
    assert out.rstrip().endswith("dry run: every launch check passed; nothing was written")
    assert not (tmp_path / "logs").exists()


GAN = ("loss.gan.weight=0.1", "loss.gan.channels=8", "loss.gan.layers=2")
"""The GAN stage from step 0. LeCam stays off here: its moving averages are each rank's own (they follow the logits
of the clips a rank sees, in the order it sees them), so they differ from one process's, legitimately.

The adaptive weight, recomputed at every micro-batch (``adaptive_every=1``), is taken from that micro-batch's own
gradients (autograd.grad, before any all-reduce), on a rank as in one process: with the same micro-batch size either
way (1 here) it is the same number for the same clip, so adaptive on is exact too. With other micro-batch sizes on
the two sides it would legitimately differ, and so it does with ``adaptive_every=8``: each rank reuses the weight of
its own first micro-batch, one process that of the step's first. (The default, null, is 1 here: the step takes the
weight's gradients apart, AdversarialStage.split_step.)"""


VGG = ("loss.perceptual.weight=0.1", "loss.gram.weight=0.062", "loss.perceptual.weights_path={vgg}")
"""The VGG16 terms (random weights): a frozen loss network beside the tokenizer, outside its DDP."""


@pytest.mark.parametrize(
    "extra",
    [(), (*GAN, "loss.gan.adaptive=true", "loss.gan.adaptive_every=1"), VGG],
    ids=["plain", "gan-adaptive", "vgg-terms"],
)
def test_two_processes_train_exactly_like_one_with_gradient_accumulation(tmp_path: Path, extra: tuple) -> None:
    from tests.losses.test_perceptual import random_vgg16_state
    from tokenizer_posttrain.losses.perceptual import VGG16_FILE

    vgg_terms = extra == VGG
    if vgg_terms:
        torch.manual_seed(0)
        torch.save(random_vgg16_state(), tmp_path / VGG16_FILE)
        extra = tuple(arg.format(vgg=tmp_path / VGG16_FILE) for arg in extra)
    # The same 4 clips per step either way: ranks take alternate positions of one seeded stream,
    # and DDP averages over ranks what a single process averages over its 4 micro-batches.
    common = ("--factory", "tiny", "trainer.max_steps=3", "data.global_batch_size=4", "data.micro_batch_size=1")
    common += ("data.frames=9", "data.height=32", "data.width=32")  # the recipe's 17x64x64 clips: 7.6x the pixels
    common += ("trainer.precision=32-true", "trainer.seed=1234", "log.export_on_end=false", f"log.log_dir={tmp_path}")
    common += extra
    result = run_torchrun(*common, "log.name=ddp", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unused parameters" not in result.stderr  # the discriminator is outside the tokenizer's DDP
    single = run_cli_here(*common, "log.name=single", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "last.ckpt", weights_only=True)
    one = torch.load(tmp_path / "single" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ddp["global_step"] == one["global_step"] == 3
    # 4 clips per step over 2 processes at micro batch 1: 2 micro-batches accumulated per step
    assert ddp["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 6
    assert one["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 12
    # Step by step: the gradient norm is taken after DDP's all-reduce, so it sees all 4 clips.
    norms = [
        [float(r["train/grad_norm"]) for r in read_metrics(tmp_path / run) if r["train/grad_norm"]]
        for run in ("ddp", "single")
    ]
    assert len(norms[0]) == len(norms[1]) == 3
    # The first step's gradients start from the same weights: only summation order differs. Later steps start from
    # weights that differ by that much, which a random VGG16's unnormalised features amplify (1e-5 at step 2,
    # 2.3e-4 at step 3 on the CPU).
    torch.testing.assert_close(norms[0][0], norms[1][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms[0][:2], norms[1][:2], rtol=1e-4, atol=0)
    last = 2e-3 if vgg_terms else 1e-4
    torch.testing.assert_close(norms[0][2], norms[1][2], rtol=last, atol=0)
    # At the end: the runs' weight updates agree to a small fraction of their size (summation
    # order differs between an all-reduce and accumulation; nothing else may).
    pl.seed_everything(1234, verbose=False)  # trainer.seed: the run's initial weights
    start = build_tokenizer("CV8x8x8", channels=16).state_dict()
    weights = [k for k, v in one["state_dict"].items() if v.is_floating_point()]
    disagreement = sum(((ddp["state_dict"][k] - one["state_dict"][k]) ** 2).sum() for k in weights).sqrt()
    update = sum(((one["state_dict"][k] - start[k.removeprefix("network.")]) ** 2).sum() for k in weights).sqrt()
    assert update > 0.05 and disagreement < 1e-3 * update, (float(disagreement), float(update))
    assert all(k.startswith("network.") for k in ddp["state_dict"])  # no loss network in the checkpoint
    if vgg_terms:
        logged = [r for r in read_metrics(tmp_path / "ddp") if r.get("train/gram")]
        assert logged and all(float(r["train/perceptual"]) > 0 and float(r["train/gram"]) > 0 for r in logged)
    if "loss.gan.weight=0.1" in extra:
        # The discriminator too: its own DDP averages over ranks what one process accumulates.
        assert (
            "adversarial" not in ddp["state_dict"] and ddp["adversarial"]["steps"] == one["adversarial"]["steps"] == 3
        )
        d_ddp, d_one = ddp["adversarial"]["discriminator"], one["adversarial"]["discriminator"]
        gan = GANConfig(weight=0.1, channels=8, layers=2)
        network, no_vgg = build_tokenizer("CV8x8x8", channels=16), build_loss(LossConfig(perceptual_weight=0.0))
        stage = AdversarialStage(gan, network, no_vgg)
        d_start = stage.discriminator.state_dict()
        assert d_ddp.keys() == d_one.keys() == d_start.keys()
        d_disagreement = sum(((d_ddp[k] - d_one[k]) ** 2).sum() for k in d_start).sqrt()
        d_update = sum(((d_one[k] - d_start[k]) ** 2).sum() for k in d_start).sqrt()
        assert d_update > 1e-3 and d_disagreement < 1e-3 * d_update, (float(d_disagreement), float(d_update))


def test_help_lists_every_setting_with_its_type_default_and_doc_and_exits_0(tmp_path: Path) -> None:
    # NeMo-Run's help listed the groups only (and once crashed on postponed annotations).
    result = run_cli_here("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            key = f"{prefix}.{f.name}"
            if dataclasses.is_dataclass(default):
                assert any(line.strip().startswith(f"{key}.*") for line in lines), key
                walk(key, type(default))
            else:
                assert any(line.strip().startswith(f"{key}: ") and f" = {default!r}" in line for line in lines), key

    for group, cls in inspect.get_annotations(train, eval_str=True).items():
        if dataclasses.is_dataclass(cls):
            walk(group, cls)
    assert "    model.lora.rank: int = 0  — Adapter rank; 0 = no LoRA (train the weights themselves)." in lines
    assert "    loss.perceptual.weight: float = 0.1  — Weight of the term at every step" in result.stdout
    assert "  model.compile: bool = False  [cv8x8x8: True]  — torch.compile the training forward" in result.stdout
    for option in ("--factory, -f NAME", "--yaml FILE", "--dryrun", "--yes, -y"):
        assert f"  {option} " in result.stdout, option


def test_a_yaml_file_whose_top_level_is_a_list_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "f.yaml").write_text("- a\n- b\n")
    result = run_cli_here("--factory", "tiny", "--yaml", "f.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "error: f.yaml: the top level must be a mapping of override groups (model, data, trainer, optim, resume, "
        "log, loss), e.g. 'model: {channels: 16}', not a list\n"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("modle:\n  channels: 16\n", "error: f.yaml: 'modle' is not an override group (did you mean model?)"),
        ("model:\n  chanels: 16\n", "error: f.yaml: model.chanels is not a setting (did you mean model.channels?)"),
        ("model: {channels: 16\n", "error: f.yaml: not valid YAML: expected ',' or '}', but got '<stream end>'"),
    ],
)
def test_a_bad_yaml_file_is_one_line_before_nemo_run_reads_it(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recipes

    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py"])  # run_cli rewrites it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.yaml").write_text(text)
    assert run_cli_in_process(train, recipes.cv8x8x8.cv8x8x8, ["--yaml", "f.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_help_of_another_recipe_shows_its_values_and_an_unknown_recipe_is_named(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recipes

    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py"])
    assert run_cli_in_process(train, recipes.cv8x8x8.cv8x8x8, ["--factory", "tiny", "-h"]) == 0
    assert "  data.frames: int = 33  [tiny: 17]  — Frames per clip" in capsys.readouterr().out
    assert run_cli_in_process(train, recipes.cv8x8x8.cv8x8x8, ["--factory", "tinny"]) == 1
    assert capsys.readouterr().err == (
        "error: --factory tinny: no such recipe; the recipes are cosmos_finetune, cv8x8x8, dv8x16x16, tiny, tiny_dv, "
        "tiny_wan21, tiny_wan22, wan21, wan22\n"
    )
