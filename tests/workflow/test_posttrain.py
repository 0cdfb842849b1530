"""The one-command workflow and the export command, end to end on a CPU with real footage."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from data_tools.__main__ import main as data_tools_main
from tests.conftest import captured_output, read_metrics, reference_weights, run_script
from tests.videos import bigbuckbunny, encode_video, write_energon_dataset
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.core.errors import UserError
from tokenizer_posttrain.data.layout import dataset_splits
from tokenizer_posttrain.evaluation.latent_stats import MEAN_STD, dataset_latent_stats, read_latent_stats
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.io.export import export_tokenizer


def cli(*args: str, cwd: Path, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_script("-m", "tokenizer_posttrain", *args, cwd=cwd, timeout=timeout, env=env)


def _arguments(base: Path, videos: Path, out: Path, flags: tuple[str, ...], options: dict) -> list[str]:
    args = [f for key, value in options.items() for f in (f"--{key.replace('_', '-')}", *str(value).split())]
    command = ["posttrain", "--base", str(base), "--videos", str(videos), "--out", str(out), "--accelerator", "cpu"]
    return [*command, *args, *flags]


def posttrain(
    base: Path, videos: Path, out: Path, *flags: str, env: dict[str, str] | None = None, **options: object
) -> subprocess.CompletedProcess:
    """``python -m tokenizer_posttrain posttrain`` on the CPU in ``out``'s parent; ``options`` become
    ``--kebab-case value`` arguments (a value with spaces: several), ``flags`` are passed as they are."""
    return cli(*_arguments(base, videos, out, flags, options), cwd=out.parent, env=env)


def posttrain_here(base: Path, videos: Path, out: Path, *flags: str, **options: object) -> subprocess.CompletedProcess:
    """:func:`posttrain` through the same command line in this process (no interpreter start-up): for the tests
    whose point is not a fresh process's exit status."""
    args = _arguments(base, videos, out, flags, options)
    with captured_output() as output:
        code = main(args)
    return subprocess.CompletedProcess(args, code, *output)


@pytest.fixture(scope="module")
def base_and_videos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny CV model exported like an official folder, and two real videos (one is held out); read only."""
    tmp_path = tmp_path_factory.mktemp("base")
    base = export_tokenizer(load_tokenizer(reference_weights("CV8x8x8")), tmp_path / "base")
    videos = tmp_path / "videos"
    videos.mkdir()
    for name in ("bigbuckbunny.mp4", "bikes.mp4"):
        shutil.copy(bigbuckbunny().parent / name, videos / name)
    return base, videos


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, base_and_videos: tuple) -> Path:
    """The two videos made into shards once, by the command the workflow runs for them (``make-shards`` with
    ``--val-fraction 0.5``, one video held out; here in this process), for the runs whose point is not making shards
    (the held-out test's run makes its own): the same files the workflow makes; read only."""
    _, videos = base_and_videos
    out = tmp_path_factory.mktemp("shards") / "data"
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        status = data_tools_main(["make-shards", str(videos), str(out), "--val-fraction", "0.5"])
    assert status == 0, log.getvalue()[-4000:]
    assert {"train", "val"} <= dataset_splits(out)
    return out


@pytest.fixture(scope="module")
def base_with_stats(tmp_path_factory: pytest.TempPathFactory, base_and_videos: tuple) -> tuple[Path, Path, Path]:
    """(base folder with its own latent statistics as NVIDIA's folders have them, the videos, the small dataset
    the statistics were computed on); read only."""
    base, videos = base_and_videos
    folder = tmp_path_factory.mktemp("with_stats")
    shutil.copytree(base, folder / "base")
    data = write_energon_dataset(folder / "data", {f"v{i}": encode_video(17, 32, 32, seed=i) for i in range(3)})
    dataset_latent_stats(load_tokenizer(base), data, 3, 32, frames=17, progress=False).write(folder / "base")
    return folder / "base", videos, data


def test_posttrain_beats_its_starting_point_on_held_out_clips(tmp_path: Path, base_and_videos: tuple) -> None:
    base, videos = base_and_videos
    # 12 steps: held-out PSNR 6.43 -> 12.95 dB when written (13.74 dB after 40), far past the +1 dB asked for.
    # The whole model trains at a high rate: its latents move far (relative L2 1.5 when written), and --allow-drift
    # accepts that.
    result = posttrain_here(
        base,
        videos,
        tmp_path / "run",
        "--allow-drift",
        steps=12,
        lr="1e-3",
        frames=9,
        size=64,
        resize_short_side=128,
        batch_size=2,
        num_workers=0,
        val_fraction=0.5,
        eval_clips=8,
        stats_clips=2,
        formats="cosmos diffusers",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["psnr_after"] > summary["psnr_before"] + 1.0, summary
    # Better by PSNR, but latents moved past --max-drift: drifted, the PSNR verdict kept in the line.
    assert summary["verdict"] == "drifted" and summary["latent_drift"] > summary["drift_limit"] == 0.05
    assert summary["verdict_line"].startswith("DRIFTED from the base: latent drift ")
    assert summary["verdict_line"].endswith("better by PSNR alone)")
    assert f"post-trained tokenizer: {summary['verdict_line']}" in result.stdout
    # The PSNR decoded from noised latents, of the base and the post-trained tokenizer, in the summary and printed.
    levels = ["0.05", "0.1", "0.2"]
    assert list(summary["psnr_noised_before"]) == list(summary["psnr_noised_after"]) == levels
    noised = summary["psnr_noised_after"]
    assert "PSNR from noised latents (latent + level x channel std x noise): 0.05: " in result.stdout
    assert f"0.2: {summary['psnr_noised_before']['0.2']:.2f} -> {noised['0.2']:.2f} dB" in result.stdout
    # Eight clips of the one held-out video (before: one clip, however many --eval-clips asked for).
    assert (summary["held_out_clips"], summary["held_out_videos"]) == (8, 1)
    assert "on 8 held-out clips of 1 video" in summary["verdict_line"]
    # Absolute paths, the run's settings and where the time went.
    run = tmp_path / "run"
    assert summary["base"] == str(base) and summary["run"] == str(run) and summary["export"] == str(run / "export")
    assert summary["report"] == str(run / "eval" / "report.md") and summary["data"] == str(run / "data")
    assert summary["steps"] == 12 and summary["chosen"]["lr"] == 1e-3
    assert {"shards", "baseline_eval", "train", "latent_stats", "eval", "total"} <= set(summary["timings_s"])
    assert "time (min): shards " in result.stdout
    export = tmp_path / "run" / "export"
    assert {"encoder.jit", "decoder.jit", "autoencoder.jit", "model.safetensors", "README.md"} <= {
        p.name for p in export.iterdir()
    }
    report = (tmp_path / "run" / "eval" / "report.md").read_text()
    assert "psnr" in report.lower()
    assert "PSNR on held-out clips" in result.stdout
    # The model card comes from the run's own settings (it said base None and synthetic clips before).
    card = (export / "README.md").read_text()
    assert f"from `{base}`" in card and f"`{tmp_path / 'run' / 'data'}`, clips 9x64x64" in card, card
    assert "| steps | 12 |" in card and "| learning rate | 0.001 (cosine schedule, 1 warmup steps) |" in card
    # The tiny model is the CV8x8x8 architecture at width 16, not the released model; metrics rounded.
    assert card.startswith("# CV8x8x8 architecture at width 16 (post-trained; not the released")
    assert f"| psnr | {summary['psnr_before']:.2f} | {summary['psnr_after']:.2f} |" in card
    assert card.splitlines()[2].startswith("**Verdict: DRIFTED from the base: latent drift ")
    # The base has no latent statistics: the export's are computed from the training clips (two random 121-frame
    # chunks of the train split's one video, in two passes), and there is no base to show a shift against.
    assert summary["latent_stats"] == "computed from 2 training clips"
    mean, std = torch.load(export / MEAN_STD, weights_only=True)
    assert mean.view(16, -1)[:, :16].shape == std.shape == (16, 16) and bool((std > 0).all())
    assert (export / "image_mean_std.pt").is_file() and "Latent statistics" not in card
    # --formats cosmos diffusers: a diffusers vae folder beside the .jit files, normalizing with those statistics.
    vae = json.loads((export / "vae" / "config.json").read_text())
    assert vae["_class_name"] == "AutoencoderKLCosmos"
    assert (export / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    assert vae["latents_mean"] == pytest.approx(mean.flatten().tolist()) and len(vae["latents_std"]) == 256


def test_a_post_trained_tokenizer_worse_than_its_base_says_so_and_exits_3(
    tmp_path: Path, base_with_stats: tuple, shards: Path
) -> None:
    # A learning rate of 1 wrecks the tiny model in two steps: held-out PSNR falls (6.41 -> 5.30 dB when written).
    # The videos' shards are made already (shards; making them is the held-out test's part of the workflow).
    base, _, _ = base_with_stats
    options = dict(steps=2, lr="1.0", frames=9, size=32, resize_short_side=64, batch_size=1, num_workers=0)
    options.update(eval_clips=8, stats_clips=1)
    result = posttrain(base, shards, tmp_path / "run", **options)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"] == "worse" and summary["psnr_after"] < summary["psnr_before"], summary
    worse = f"WORSE than the base: PSNR {summary['psnr_before']:.2f} -> {summary['psnr_after']:.2f} dB"
    assert f"post-trained tokenizer: {worse}" in result.stdout
    assert result.stderr.splitlines()[-1].startswith(
        f"error: the post-trained tokenizer is WORSE than the base: held-out PSNR {summary['psnr_before']:.2f} -> "
    )
    assert "pass --allow-worse to accept it" in result.stderr and "Traceback" not in result.stderr
    # The wrecked encoder moved the latents far past the limit: flagged in the summary, the report and the card.
    drift = summary["drift_warning"]
    assert drift.startswith("latent drift ") and "is above the limit 0.05" in drift and summary["latent_drift"] > 0.05
    assert f"warning: {drift}" in result.stdout and "(the limit is --max-drift;" in result.stdout
    assert f"- **drift: {drift}**" in (tmp_path / "run" / "eval" / "report.md").read_text()
    assert f"**Warning: {drift}.**" in (tmp_path / "run" / "export" / "README.md").read_text()
    # Every hint names posttrain's own options, never the training run's settings.
    for setting in ("trainer.", "log.name", "log.latent_stats_clips", "optim.", "resume."):
        assert setting not in result.stdout + result.stderr, setting
    # Everything is written before the verdict: the card records it, the files stay to be looked at.
    export = tmp_path / "run" / "export"
    assert f"**Verdict: {worse}" in (export / "README.md").read_text()
    assert (export / "autoencoder.jit").is_file() and (tmp_path / "run" / "eval" / "report.md").is_file()
    # The encoder moved and the base had statistics: report and card show the shift a world model trained on the
    # base's statistics sees, per channel, matching the two files.
    new, old = read_latent_stats(export), read_latent_stats(base)
    offset = ((new.mean[:, :16] - old.mean[:, :16]) / old.std[:, :16]).mean(dim=1)
    shift = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())["latent_stats_shift"]
    assert [c["mean_offset"] for c in shift["channels"]] == pytest.approx(offset.tolist(), abs=1e-6)
    assert shift["max_abs_mean_offset"] > 0.01
    row = f"| 3 | {shift['channels'][3]['mean_offset']:+.4f} |"
    for text in ((tmp_path / "run" / "eval" / "report.md").read_text(), (export / "README.md").read_text()):
        assert "## Latent statistics against the base" in text and row in text
    # --allow-worse (exit 0) is the same workflow with allow_worse=True: the branch is a single condition, and the
    # option reaching the function is test_posttrain_cmd's; a second run here would cost ~20 s of the suite.


def test_sweep_picks_a_configuration_within_the_drift_limit(
    tmp_path: Path, base_with_stats: tuple, shards: Path
) -> None:
    base, _, data = base_with_stats  # the videos' shards made already (shards)
    result = posttrain(
        base,
        shards,
        tmp_path / "run",
        "--sweep",
        steps=2,
        frames=9,
        size=32,
        resize_short_side=64,
        num_workers=0,
        eval_clips=1,
        sweep_steps=2,
        sweep_lrs="1e-3",
        max_drift="0.001",
        latent_anchor="0.1",  # the decoder-only variant has no encoder to hold: it trains without the anchor
        stats_clips=1,
        env={"NEMORUN_HOME": str(tmp_path / "nemo_run")},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # One held-out clip decides nothing: inconclusive, with the reason, and the options that give a verdict.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (
        summary["verdict"] == "inconclusive" and summary["verdict_reason"] == "only 1 clip; a verdict needs at least 8"
    )
    assert "post-trained tokenizer: inconclusive against the base: PSNR" in result.stdout
    assert "for a verdict: at least 8 held-out clips (--eval-clips; up to 8 per held-out video" in result.stdout
    assert "--val-fraction" in result.stdout
    # Decoder-only: latents exactly as they were, a drift of 0, within even a limit of 0.001 (not drifted).
    assert summary["latent_drift"] == 0 and summary["drift_limit"] == 0.001 and summary["drift_warning"] is None
    card = (tmp_path / "run" / "export" / "README.md").read_text()
    assert "**Verdict: inconclusive against the base: PSNR" in card and "only 1 clip" in card
    choice = json.loads((tmp_path / "run" / "sweep" / "choice.json").read_text())
    # only decoder-only training leaves the latents exactly as they were
    assert choice == {"chosen": {"lr": 1e-3, "trainable": "decoder", "lora_rank": 0}, "within_drift": True}
    assert len(list((tmp_path / "run" / "sweep").glob("sweep_*/export/autoencoder.jit"))) == 3
    assert summary["chosen"]["trainable"] == "decoder"
    # Only the decoder trained: the latent space did not move, so the base's statistics are copied unchanged, and
    # recomputing them on the data the base's came from gives the base's numbers.
    export = tmp_path / "run" / "export"
    assert summary["latent_stats"] == f"copied from {base}"
    for name in ("mean_std.pt", "image_mean_std.pt"):
        assert (export / name).read_bytes() == (base / name).read_bytes()
    again = dataset_latent_stats(load_tokenizer(export), data, 3, 32, frames=17, progress=False)
    torch.testing.assert_close(again.mean, read_latent_stats(base).mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(again.std, read_latent_stats(base).std, atol=1e-6, rtol=0)
    assert "Identical to the base's" in (export / "README.md").read_text()


def test_shards_are_made_in_this_process_and_a_failure_stops_with_data_tools_error(
    tmp_path: Path, base_and_videos: tuple, capfd: pytest.CaptureFixture
) -> None:
    # The workflow calls data_tools' make-shards as a function (no fresh interpreter, no PYTHONPATH to set): what
    # it prints stays out of posttrain's output, and its error line ends posttrain with exit code 1.
    from tokenizer_posttrain.core.errors import DataError
    from tokenizer_posttrain.workflow.posttrain import prepare_data

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"(?s)making shards from .*empty failed:\nerror: no videos in .*empty"):
        prepare_data(empty, tmp_path / "run", 0.1)
    with pytest.raises(DataError, match=r"--val-fraction: must be in \[0, 1\), got 1.5"):
        prepare_data(empty, tmp_path / "run", 1.5)
    assert capfd.readouterr() == ("", "")
    base, _ = base_and_videos
    result = posttrain_here(base, empty, tmp_path / "out")
    assert result.returncode == 1 and f"no videos in {empty}" in result.stderr and "Traceback" not in result.stderr


def test_a_non_finite_learning_rate_stops_before_any_work(tmp_path: Path, base_and_videos: tuple) -> None:
    base, videos = base_and_videos
    result = posttrain_here(base, videos, tmp_path / "run", lr="inf")
    assert result.returncode == 1 and "invalid optim.lr=inf" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # no shards, no baseline evaluation


def _saved(content: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(content, buffer)
    return buffer.getvalue()


def _stats_file(content: object) -> Callable[[Path], None]:
    """Writes ``content`` as ``mean_std.pt``: bytes as they are, anything else with ``torch.save``."""
    return lambda path: path.write_bytes(content) if isinstance(content, bytes) else torch.save(content, path)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (_stats_file((torch.zeros(16, 16), datetime.date(2025, 1, 1))),
         r"mean_std.pt: it holds a pickled Python object \(datetime.date\)"),
        (_stats_file(_saved((torch.zeros(16, 16), torch.ones(16, 16)))[:200]),
         "mean_std.pt: .* The file looks truncated or is not a torch checkpoint"),
        (_stats_file({"mean": torch.zeros(16, 16)}), r"mean_std.pt does not hold a \(mean, std\) pair of tensors"),
        (_stats_file((torch.zeros(8, 16), torch.ones(8, 16))),
         r"mean_std.pt holds statistics of 8 latent channels \(read as \[channels, T\]: \[8, 16\]\), but CV8x8x8 has "
         r"16 and the workflow compares them with the post-trained encoder's"),
        (_stats_file((torch.zeros(16, 16), torch.zeros(16, 16))),
         "mean_std.pt holds NaN or infinite statistics or a std <= 0, which cannot normalize a latent"),
    ],
)  # fmt: skip
def test_bad_latent_statistics_in_the_base_folder_stop_before_any_work(
    tmp_path: Path, base_and_videos: tuple, write: Callable[[Path], None], message: str
) -> None:
    # Before: shards, a baseline evaluation and training ran first; the evaluation against the base then refused
    # the file (or the run went on with statistics no latent can be normalized with).
    base, videos = base_and_videos
    shutil.copytree(base, tmp_path / "base")
    write(tmp_path / "base" / MEAN_STD)
    options = dict(steps=1, frames=9, size=32, num_workers=0, val_fraction=0.5, eval_clips=1, stats_clips=1)
    result = posttrain_here(tmp_path / "base", videos, tmp_path / "run", **options)
    assert result.returncode == 1 and re.search(message, result.stderr), result.stdout[-3000:] + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert str(tmp_path / "base" / MEAN_STD) in result.stderr
    assert not (tmp_path / "run").exists()  # no shards, no run folder


def test_a_diffusers_export_of_a_discrete_tokenizer_is_refused_before_any_work(tmp_path: Path) -> None:
    from tokenizer_posttrain.core.errors import ExportError
    from tokenizer_posttrain.workflow.posttrain import posttrain as run_posttrain

    base = str(reference_weights("DV8x16x16"))
    with pytest.raises(ExportError, match="no diffusers format for DV8x16x16"):
        run_posttrain(base, str(tmp_path / "videos"), str(tmp_path / "run"), formats=["cosmos", "diffusers"])
    with pytest.raises(UserError, match="unknown format 'onnx'; use cosmos, wan21, wan22, diffusers or several"):
        run_posttrain(base, str(tmp_path / "videos"), str(tmp_path / "run"), formats=["onnx"])
    assert not (tmp_path / "run").exists()


def test_a_model_name_of_another_width_says_to_leave_out_model(tmp_path: Path) -> None:
    from tokenizer_posttrain.core.errors import CheckpointError
    from tokenizer_posttrain.workflow.posttrain import posttrain as run_posttrain

    with pytest.raises(CheckpointError, match="you asked for CV8x8x8: leave out --model: the checkpoint's model"):
        run_posttrain(str(reference_weights("CV8x8x8")), str(tmp_path / "videos"), str(tmp_path / "run"), "CV8x8x8")
    assert not (tmp_path / "run" / "data").exists()  # refused before making shards


def test_the_gan_stage_and_the_anchor_reach_the_training_run_and_bad_settings_stop_before_any_work(
    tmp_path: Path, base_with_stats: tuple
) -> None:
    base, videos, data = base_with_stats
    bad = posttrain_here(base, videos, tmp_path / "bad", gan_weight="0.1", gan_start="-2", steps=4)
    assert bad.returncode == 1 and "loss.gan.disc_start=-2" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
    # The small prepared dataset (no shards to make) and 9x32x32 clips: only the GAN's way through matters here.
    options = {"steps": 4, "frames": 9, "size": 32, "batch_size": 1, "num_workers": 0, "eval_clips": 1}
    options.update(allow_worse="", allow_drift="", stats_clips=1)  # whatever the four steps did: not this test's point
    # The latent anchor rides along: it reaches the training run too (its own option, --latent-anchor).
    result = posttrain_here(base, data, tmp_path / "run", gan_weight="0.1", latent_anchor="0.1", **options)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run" / "train") if r.get("train/loss")]
    # --gan-start defaults to half the steps: the discriminator trains from step 2.
    assert [bool(r.get("train/gan_d")) for r in rows] == [False, False, True, True]
    assert all(r.get("train/latent_anchor") is not None for r in rows)
    bad = posttrain_here(base, videos, tmp_path / "bad_anchor", latent_anchor="-1", steps=4)
    assert bad.returncode == 1 and "--latent-anchor: loss.latent_anchor.weight=-1.0 must be" in bad.stderr
    assert not (tmp_path / "bad_anchor").exists()


def test_the_verdict_ends_the_workflow_with_exit_code_3_when_worse_and_4_when_drifted(tmp_path: Path) -> None:
    from tokenizer_posttrain.commands.guard import run_guarded
    from tokenizer_posttrain.core.errors import WorseThanBaseError
    from tokenizer_posttrain.evaluation.report import Drift, Verdict
    from tokenizer_posttrain.workflow.posttrain import DriftedFromBaseError, check_verdict

    before = [20.0 + 0.5 * i for i in range(8)]
    drift = Drift("latent drift", 0.081, 0.05)
    worse = Verdict.of(before, [b - 1 + 0.01 * i for i, b in enumerate(before)], drift=drift)
    drifted = Verdict.of(before, [b + 1 + 0.01 * i for i, b in enumerate(before)], drift=drift)
    with pytest.raises(WorseThanBaseError, match="WORSE than the base: held-out PSNR 21.75 -> "):
        check_verdict(worse, tmp_path)
    with pytest.raises(DriftedFromBaseError) as raised:
        check_verdict(drifted, tmp_path)
    assert str(raised.value).startswith("the post-trained tokenizer DRIFTED from the base: held-out latent drift 0.081")
    assert "--trainable decoder" in str(raised.value) and "--allow-drift accepts it" in str(raised.value)
    # The command's exit codes: 3 worse (first), 4 drifted; each --allow-* waives its own check.
    with captured_output():
        assert run_guarded(lambda: check_verdict(worse, tmp_path)) == 3
        assert run_guarded(lambda: check_verdict(drifted, tmp_path)) == 4
        assert run_guarded(lambda: check_verdict(worse, tmp_path, allow_worse=True)) == 4
    check_verdict(worse, tmp_path, allow_worse=True, allow_drift=True)
    check_verdict(drifted, tmp_path, allow_drift=True)
    check_verdict(Verdict.of(before, before, drift=Drift("latent drift", 0.0, 0.0)), tmp_path)  # decoder-only


def test_training_messages_name_posttrain_options() -> None:
    from tokenizer_posttrain.workflow.posttrain import in_posttrain_terms

    # Messages of the training run inside posttrain (before: `raise trainer.max_steps`, `another log.name`).
    changed = (
        "/r/last.ckpt was written by a run with other settings (optim.lr: 0.001 -> 0.0001; model.lora.rank: 0 -> 8); "
        "start a new run with another log.name=..., or resume with these changes anyway with resume.allow_changes=true"
    )
    assert in_posttrain_terms(changed) == (
        "/r/last.ckpt was written by a run with other settings (--lr: 0.001 -> 0.0001; --lora-rank: 0 -> 8); "
        "start afresh with another --out"
    )
    busy = "/r is in use by another run: pid 7; wait for it, choose another run folder with log.name=..., or delete x"
    assert (
        in_posttrain_terms(busy) == "/r is in use by another run: pid 7; wait for it, choose another --out, or delete x"
    )
    assert in_posttrain_terms("raise trainer.max_steps") == "raise --steps"


def test_a_finished_training_run_is_exported_as_it_is_and_changed_settings_name_posttrain_options(
    tmp_path: Path, base_with_stats: tuple, shards: Path
) -> None:
    from tokenizer_posttrain.workflow.posttrain import _train_variant

    base, _, _ = base_with_stats
    args = (load_tokenizer(base).config.full_name, 16, str(base), str(shards), str(tmp_path), "train", 1)
    common = dict(frames=9, size=32, resize_short_side=64, batch_size=1, num_workers=0, accelerator="cpu")
    common.update(trainable="all", lora_rank=0, perceptual=0.0)
    with captured_output() as output:
        export = _train_variant(*args, lr=1e-3, **common)
    assert (export / "autoencoder.jit").is_file() and not (export / "mean_std.pt").exists()  # posttrain measures them
    (export / "autoencoder.jit").unlink()
    with captured_output() as output:
        again = _train_variant(*args, lr=1e-3, **common)  # a rerun of the same job: nothing to train
    assert again == export and (export / "autoencoder.jit").is_file()
    assert "already reached step 1 of --steps 1; not trained again" in output[0]
    with pytest.raises(UserError) as raised:
        _train_variant(*args, lr=1e-3, **{**common, "trainable": "decoder"})
    message = str(raised.value)
    assert "(--trainable: 'all' -> 'decoder')" in message and message.endswith("start afresh with another --out")
    assert "model." not in message and "log.name" not in message and "allow_changes" not in message


def test_the_statistics_clips_follow_the_run() -> None:
    from tokenizer_posttrain.workflow.posttrain import default_stats_clips

    # Before: 400 clips whatever the run (15 minutes on a CPU after 0.9 minutes of training).
    assert default_stats_clips(40, 2) == 20  # the CPU example: a quarter of the 80 training clips
    assert default_stats_clips(10, 1) == 16 and default_stats_clips(2000, 1) == 400  # at least 16, at most 400


@pytest.fixture(scope="module")
def wan_base_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Wan2.1 VAE saved as Wan ships it (a .pth state dict) and a small dataset of real clips, two to
    train on and one held out; read only."""
    from tests.evaluation.wan_base import tiny_wan_pth

    folder = tmp_path_factory.mktemp("wan")
    train = {f"v{i}": encode_video(9, 32, 32, seed=i) for i in range(2)}
    data = write_energon_dataset(folder / "data", train, {"held": encode_video(9, 32, 32, seed=7)})
    return tiny_wan_pth(folder / "base"), data


def test_posttrain_on_a_wan_base_measures_the_statistics_and_their_shift_from_the_constants(
    tmp_path: Path, wan_base_and_data: tuple[Path, Path]
) -> None:
    from tokenizer_posttrain.workflow.posttrain import posttrain as run_posttrain

    base, data = wan_base_and_data
    options = dict(steps=1, frames=9, size=32, num_workers=0, accelerator="cpu", eval_clips=2, stats_clips=2)
    summary = run_posttrain(
        str(base),
        str(data),
        str(tmp_path / "run"),
        formats=["wan21", "diffusers"],
        allow_worse=True,
        allow_drift=True,
        **options,
    )
    export = tmp_path / "run" / "export"
    assert {"Wan2.1_VAE.pth", "video_mean_std.pt", "images_mean_std.pt"} <= {p.name for p in export.iterdir()}
    assert (export / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    # The baseline, the training, the evaluation (drift on the posterior mean) and the shift, per channel.
    assert summary["latent_stats"] == "computed from 2 training clips" and summary["latent_drift"] > 0
    shift = summary["latent_stats_shift"]
    assert shift["reference"] == "constants" and [c["channel"] for c in shift["channels"]] == list(range(16))
    card = (export / "README.md").read_text()
    assert "## Latent statistics against the base" in card and "hard-codes and no file changes" in card
    assert "| latent statistics | computed from 2 training clips; `video_mean_std.pt` and" in card
    # A VAE trains as its recipes train it: on posterior samples, under the KL term.
    (trained,) = (tmp_path / "run").glob("*/checkpoints/last.ckpt")
    settings = torch.load(trained, weights_only=True)["hyper_parameters"]
    assert settings["model"]["sample_posterior"] and settings["loss"]["kl"]["weight"] == 1e-6


def test_a_decoder_only_wan_run_keeps_the_base_constants_and_measures_nothing(
    tmp_path: Path, wan_base_and_data: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    from tokenizer_posttrain.workflow.posttrain import write_latent_stats

    base, data = wan_base_and_data
    config = load_tokenizer(base).config
    clip = {"frames": 9, "size": 32, "resize_short_side": None}
    done = write_latent_stats(config, "decoder", str(base), data, tmp_path, 2, clip, workers=0)
    assert done.startswith("the encoder did not train: the base's 16 per-channel latent constants")
    assert "stay exact (nothing measured)" in capsys.readouterr().out and not list(tmp_path.iterdir())
