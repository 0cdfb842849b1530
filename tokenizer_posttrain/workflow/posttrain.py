"""The one-command post-training workflow, as a plain typed function (CLI and NeMo-Run share it).

Steps: shards (unless ``videos`` is already an energon dataset) -> baseline evaluation ->
training (with its preflight) -> export with latent statistics -> evaluation against the baseline -> model card.
With ``sweep``, short runs over learning rate and what trains pick the configuration first.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import time
from pathlib import Path
from typing import Literal, Optional

import torch

from ..core.errors import CheckpointError, DataError, DriftedFromBaseError, UserError, WorseThanBaseError
from ..data.batch import CLIP_FRAMES, CLIP_SIZE
from ..data.layout import dataset_splits
from ..evaluation.evaluate import EVAL_CLIPS_PER_VIDEO
from ..evaluation.latent_shift import shift_from_base, shift_line
from ..evaluation.latent_stats import (
    STATS_CLIPS,
    base_latent_stats,
    carry_base_stats,
    dataset_latent_stats,
    files_note,
    kept_base_stats,
    read_latent_stats,
    stats_folder,
)
from ..evaluation.latent_stats import stats_files as stats_files_of
from ..evaluation.report import (
    EXIT_DRIFTED,
    EXIT_WORSE,
    LATENT_DRIFT_LIMIT,
    MIN_VERDICT_CLIPS,
    NOISED,
    SPREAD_SIGMAS,
    Verdict,
    card_sections,
    drift_warning,
    exit_code,
    measured_drift,
    verdict,
)
from ..io.checkpoint import MODEL_FLAG, load_tokenizer, read_weights, resolve_config
from ..io.diffusers_format import normalizes
from ..io.export import CHUNK_FRAMES
from ..io.formats import (
    FORMATS,
    check_formats,
    format_choices,
    native_format,
    parse_formats,
    placements,
    unknown_formats,
    write_native,
)
from ..io.model_card import checkpoint_card
from ..losses.anchor import LatentAnchorConfig
from ..losses.gan import GANConfig
from ..losses.kl import VAE_KL_WEIGHT, KLConfig
from ..losses.perceptual import find_vgg16_weights
from ..network import family_of, get_config
from ..network.family import NetworkConfig
from ..training.acceleration import fast_encoder
from ..training.config import OptimConfig, ResumeConfig
from ..training.run_config import (
    data_config,
    instance,
    loss_config,
    model_config,
    train_arguments,
    trainer_config,
)

INTERRUPTED = 130
"""make-shards' exit status after Ctrl-C."""


def gan_config(weight: float, start: int) -> GANConfig:
    """posttrain's adversarial stage: ``weight`` (0: off), discriminator and generator term from step ``start``."""
    config = GANConfig(weight, disc_start=start, gen_start=start)
    problems = config.problems("--gan-weight/--gan-start: loss.gan")
    if problems:
        raise UserError("; ".join(problems))
    return config


def prepare_data(videos: Path, run_dir: Path, val_fraction: float) -> Path:
    """An energon dataset: ``videos`` itself when prepared, else shards made in ``run_dir/data`` by data_tools'
    ``make-shards`` (in this process; what it prints is kept back, and shown in the :class:`DataError` when it
    fails)."""
    if dataset_splits(videos):
        return videos
    # data_tools sits beside the package, packaged with it (pyproject): imported only when shards are made.
    from data_tools.__main__ import make_shards_command
    from data_tools.make_shards import Options

    out = run_dir / "data"
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = make_shards_command(videos, out, Options(val_fraction=val_fraction))
    except Exception as err:  # what a separate make-shards process would have died of: still the data step's error
        print(f"{type(err).__name__}: {err}", file=stderr)
        status = 1
    if status == INTERRUPTED:
        raise KeyboardInterrupt  # Ctrl-C stops posttrain, as it does at every other step
    if status != 0:
        output = f"{stdout.getvalue()[-2000:]}{stderr.getvalue()[-2000:]}"
        raise DataError(f"making shards from {videos} failed:\n{output}")
    return out


def perceptual_weight_or_default(requested: float | None) -> float:
    """The requested weight; by default 0.1 when the VGG16 file is there, else 0 with a notice."""
    if requested is not None:
        return requested
    try:
        find_vgg16_weights()
    except FileNotFoundError:
        print(
            "note: no VGG16 weights found, training with L1 only (pass --perceptual-weight 0.1 and put "
            "vgg16-397923af.pth in the torch hub cache to use the perceptual loss)",
            flush=True,
        )
        return 0.0
    return 0.1


STATS_CLIPS_MIN = 16
"""Fewest clips posttrain's default measures the latent statistics on (about 5% between two seeds)."""
STATS_SHARE = 4
"""posttrain's default statistics clips: the clips training saw (steps x batch size) over this, between
:data:`STATS_CLIPS_MIN` and :data:`~..evaluation.latent_stats.STATS_CLIPS`: a short trial run gets rough
statistics in seconds instead of a quarter of an hour, the default 2000-step run the full 400."""


def default_stats_clips(steps: int, batch_size: int) -> int:
    """The statistics clips of a run of ``steps`` optimizer steps of ``batch_size`` clips (see :data:`STATS_SHARE`)."""
    return max(STATS_CLIPS_MIN, min(STATS_CLIPS, steps * batch_size // STATS_SHARE))


FLAGS = {
    "trainer.max_steps": "--steps",
    "optim.lr": "--lr",
    "model.trainable": "--trainable",
    "model.lora.rank": "--lora-rank",
    "model.jit_ckpt_pth": "--base",
    "model.model": "--model",
    "data.frames": "--frames",
    "data.height": "--size",
    "data.width": "--size",
    "data.resize_short_side": "--resize-short-side",
    "data.micro_batch_size": "--batch-size",
    "data.global_batch_size": "--batch-size",
    "data.num_workers": "--num-workers",
    "data.path": "--videos",
    "trainer.accelerator": "--accelerator",
    "loss.perceptual_weight": "--perceptual-weight",
    "loss.gan.weight": "--gan-weight",
    "loss.gan.disc_start": "--gan-start",
    "loss.gan.gen_start": "--gan-start",
    "loss.latent_anchor.weight": "--latent-anchor",
}
"""The training settings posttrain sets from its own options: messages of the training run name the option."""
_OTHER_RUN = (
    (re.compile(r"(choose )?another run folder with log\.name=\.\.\."), "choose another --out"),
    (re.compile(r"(start )?a new run with another log\.name(=\.\.\.)?"), "start afresh with another --out"),
    (re.compile(r",? or resume with (these changes anyway with )?resume\.allow_changes=true( \([^)]*\))?"), ""),
)


def in_posttrain_terms(message: str) -> str:
    """A training run's message with the settings posttrain sets named by posttrain's options (``--steps``, not
    ``trainer.max_steps``), a new run folder as another ``--out``, and the fixes posttrain has no option for
    (``resume.allow_changes``) left out."""
    for pattern, replacement in _OTHER_RUN:
        message = pattern.sub(replacement, message)
    keys = sorted(FLAGS, key=len, reverse=True)  # model.lora.rank before a shorter key it starts with
    return re.sub("|".join(re.escape(k) for k in keys), lambda m: FLAGS[m.group(0)], message)


def _train_variant(
    model_name: str,
    channels: int,
    base: str,
    data_path: str,
    run_dir: str,
    name: str,
    steps: int,
    lr: float,
    trainable: str,
    lora_rank: int,
    frames: int,
    size: int,
    resize_short_side: Optional[int],
    batch_size: int,
    num_workers: int,
    accelerator: str,
    perceptual: float,
    gan_weight: float = 0.0,
    gan_start: int = 0,
    latent_anchor: float = 0.0,
) -> Path:
    """Train one configuration into ``run_dir/name`` and export its last checkpoint to ``run_dir/name/export``
    (without latent statistics: posttrain measures them with its own options); returns the export folder. A run
    folder whose checkpoint already reached ``steps`` with these settings is exported as it is.

    Plain arguments only: NeMo-Run serialises the sweep's tasks."""
    from ..training.resume import check_same_run, checkpoint_step, current_settings, find_resume_checkpoint
    from ..training.train import train

    has_val = "val" in dataset_splits(data_path)
    # The same assembly as the recipes' (run_config), with the dataclasses made at once instead of run.Configs.
    # A VAE trains as the recipes train it: decoding posterior samples, under the KL term (1e-6).
    vae = family_of(get_config(model_name)).posterior
    model = model_config(
        instance, model_name, base, channels, trainable=trainable, lora_rank=lora_rank, sample_posterior=vae
    )
    data = data_config(
        instance,
        frames,
        size,
        batch_size,
        batch_size,
        num_workers,
        path=str(data_path),
        resize_short_side=resize_short_side,
    )
    kl = {"kl": KLConfig(weight=VAE_KL_WEIGHT)} if vae else {}
    # The anchor holds a training encoder: a decoder-only variant (the sweep's) has none to hold.
    anchor = {"latent_anchor": LatentAnchorConfig(weight=latent_anchor)} if trainable != "decoder" else {}
    loss = loss_config(instance, perceptual_weight=perceptual, gan=gan_config(gan_weight, gan_start), **kl, **anchor)
    ckpt_dir = Path(run_dir) / name / "checkpoints"
    try:
        done = find_resume_checkpoint(ckpt_dir, ResumeConfig())
        if done is not None and checkpoint_step(done) >= steps:
            # The training run would only say so, in its own settings' names: say it in ours, and export.
            check_same_run(done, current_settings(model, data, loss))
            print(
                f"training: {Path(run_dir) / name} already reached step {checkpoint_step(done)} of --steps {steps}; "
                "not trained again (another --out starts afresh, more --steps trains on)",
                flush=True,
            )
        else:
            trainer = trainer_config(
                instance,
                steps,
                accelerator,
                val_check_interval=max(1, steps // 4) if has_val else steps,
                checkpoint_every_n_steps=max(1, steps // 4),
                devices="1",
            )
            arguments = train_arguments(
                instance,
                model,
                data,
                trainer,
                loss,
                name,
                str(run_dir),
                optim={"lr": lr, "schedule": "cosine", "warmup_steps": max(1, steps // 20)},
                # No export at the end: its latent statistics would be measured twice, the second time with
                # posttrain's --stats-clips; posttrain exports the last checkpoint below.
                log={"export_on_end": False},
            )
            train(**arguments)
            done = find_resume_checkpoint(ckpt_dir, ResumeConfig())
    except (UserError, ValueError) as err:
        raise UserError(in_posttrain_terms(str(err))) from None
    if done is None:
        raise CheckpointError(f"the training run in {Path(run_dir) / name} left no checkpoint in {ckpt_dir}")
    return write_native(load_tokenizer(done), Path(run_dir) / name / "export")


def posttrain(
    base: str,
    videos: str,
    out: str,
    model: Optional[str] = None,
    steps: int = 2000,
    lr: float = 1e-4,
    trainable: Literal["all", "decoder", "encoder"] = "all",
    lora_rank: int = 0,
    frames: int = CLIP_FRAMES,
    size: int = CLIP_SIZE,
    resize_short_side: Optional[int] = None,
    batch_size: int = 1,
    num_workers: int = 2,
    accelerator: Literal["auto", "gpu", "cpu"] = "auto",
    perceptual_weight: Optional[float] = None,
    gan_weight: float = 0.0,
    gan_start: Optional[int] = None,
    latent_anchor: float = 0.0,
    val_fraction: float = 0.1,
    eval_clips: int = 32,
    sweep: bool = False,
    sweep_steps: int = 50,
    sweep_lrs: Optional[list[float]] = None,
    max_drift: float = LATENT_DRIFT_LIMIT,
    allow_worse: bool = False,
    allow_drift: bool = False,
    stats_clips: Optional[int] = None,
    formats: Optional[list[str]] = None,
) -> dict:
    """Post-train ``base`` on ``videos``: shards, baseline evaluation, training, evaluation, export with a model
    card. Returns the summary (also written to ``out/summary.json``).

    The verdict compares the held-out PSNR clip by clip: "better" or "WORSE than the base" when the mean change
    is larger than the clips' own spread (2 standard errors) on at least 8 clips, else "inconclusive" with the
    reason; "DRIFTED from the base" when the latent drift (DV: token flip rate) is above ``max_drift`` and PSNR is
    not worse. The model card and ``summary.json`` record it, and after writing every file it raises (see
    :func:`check_verdict`) :class:`~tokenizer_posttrain.core.errors.WorseThanBaseError` when worse (unless
    ``allow_worse``; exit code 3) or :class:`DriftedFromBaseError` when the drift is over the limit (unless
    ``allow_drift``; exit code 4).

    Args:
        base: base checkpoint (a folder with autoencoder.jit, or encoder.jit + decoder.jit, or a file), e.g. the
            quick start's outputs/tiny_cv8x8x8/export on a CPU
        videos: folder of videos, or an energon dataset made by data_tools
        out: run folder (shards, evaluations, the training run, export/)
        model: model name when the checkpoint does not say (default: inferred from it)
        steps: optimizer steps of the training run
        lr: peak learning rate (cosine schedule after a warmup of steps/20)
        trainable: what trains: all, decoder (latent space unchanged) or encoder
        lora_rank: LoRA adapters of this rank instead of the weights themselves (0: none)
        frames: frames per clip (1 + 8k), for training and evaluation
        size: square crop side (a multiple of the spatial compression), for training and evaluation
        resize_short_side: resize frames to this short side before cropping
        batch_size: clips per optimizer step (one GPU or the CPU)
        num_workers: data loader worker processes
        accelerator: auto, gpu or cpu
        perceptual_weight: weight of the VGG16 perceptual term (default: 0.1 when the VGG16 file is in the
            torch hub cache, else 0 with a notice)
        gan_weight: weight of the adversarial stage (loss.gan.weight; its other settings at their defaults,
            README "Adversarial fine-tuning"); 0: off
        gan_start: optimizer step from which the discriminator and the generator term train (default: half the
            steps, so that the reconstruction terms settle first)
        latent_anchor: weight of loss.latent_anchor, which holds the training encoder's output near the base's (README
            "Keeping a world model's latents valid"); 0: off; not applied where only the decoder trains
        val_fraction: held-out share of the videos when making shards
        eval_clips: held-out clips to evaluate, before and after: up to 8 per held-out video (the first centred,
            the others at random starts and crops of fixed seeds); a verdict needs at least 8
        sweep: first try lr x (all, decoder, LoRA) for sweep_steps each and keep the best
        sweep_steps: optimizer steps of each sweep run
        sweep_lrs: learning rates the sweep tries (default: lr/3, lr, 3 lr)
        max_drift: held-out latent drift (relative L2 of the latent; DV: token flip rate) above which the verdict
            is drifted (exit code 4; --max-latent-drift is its earlier name); the sweep keeps only configurations
            within it. The default 0.05 is a conservative rule of thumb: about 5 percent of a channel's spread in the
            normalised latents a world model reads (docs/export.md)
        allow_worse: finish with exit code 0 even when the post-trained tokenizer is worse than the base on
            the held-out clips (otherwise exit code 3, its files kept)
        allow_drift: finish with exit code 0 even when the latents drifted past --max-drift (otherwise exit
            code 4, its files kept)
        stats_clips: training clips encoded for the latent statistics of a continuous tokenizer (Cosmos:
            mean_std.pt and image_mean_std.pt in the export; the Wan2.1 VAE: Cosmos-Predict2.5's video_mean_std.pt
            and images_mean_std.pt, and their per-channel shift from the hard-coded constants in the report, the
            summary and the model card; 121-frame clips where the videos are long enough). Default: a quarter
            of the clips training sees (steps x batch size), at least 16 and at most 400 (400 make two seeds
            agree to 1 percent). When only the decoder trained and the base folder has them, the base's files are
            copied instead (a Wan base without them keeps its constants, and nothing is measured)
        formats: export formats: the model family's own (Cosmos: the .jit files, model.safetensors and the
            statistics; the Wan2.1 VAE: Wan2.1_VAE.pth and model.safetensors: always written, the evaluation reads
            them) and diffusers (adds a diffusers folder, export/vae/, with latents_mean/latents_std from the
            statistics; continuous tokenizers only)
    """
    from ..evaluation.evaluate import evaluate

    started = time.monotonic()
    # Absolute from here on: the model card, the report and summary.json are read from other folders.
    base = str(Path(base).expanduser().resolve())
    for rate in (lr, *(sweep_lrs or [])):  # before any work: a bad rate would fail only at the training step
        OptimConfig(lr=rate)
    gan_start = steps // 2 if gan_start is None else gan_start
    gan_config(gan_weight, gan_start)  # bad GAN settings fail now, before any work
    anchor_problems = LatentAnchorConfig(weight=latent_anchor).problems("--latent-anchor: loss.latent_anchor")
    if anchor_problems:
        raise UserError("; ".join(anchor_problems))
    unknown = sorted(unknown_formats(formats or []))
    if unknown:
        raise UserError(f"--formats {' '.join(formats)}: unknown format {unknown[0]!r}; use {format_choices()}")
    if stats_clips is not None and stats_clips < 1:
        raise UserError(f"--stats-clips {stats_clips}: must be at least 1 (leave it out for the default)")
    config = resolve_config(read_weights(base), model, {}, MODEL_FLAG)
    native = native_format(config).name  # the run's export writes it; the evaluation reads it
    formats = formats or [native]
    written = parse_formats([native, *formats])
    check_formats(formats, config)  # a network a chosen format cannot hold (diffusers: DV): before any work
    check_base_stats(
        config,
        base,
        compared=sweep or trainable != "decoder",
        diffusers=any(FORMATS[name].needs_stats for name in formats),
    )
    run_dir = Path(out).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    clock = time.monotonic()
    data_path = prepare_data(Path(videos), run_dir, val_fraction).resolve()
    timings["shards"] = time.monotonic() - clock
    clip = {"frames": frames, "size": size, "resize_short_side": resize_short_side}
    perceptual = perceptual_weight_or_default(perceptual_weight)
    # What every training run of this workflow shares (the sweep's too): the clip, and the settings below.
    common = {**clip, "batch_size": batch_size, "num_workers": num_workers, "accelerator": accelerator}
    common.update(perceptual=perceptual, gan_weight=gan_weight, gan_start=gan_start, latent_anchor=latent_anchor)
    judging = dict(max_clips=eval_clips, drift_limit=max_drift, **clip)
    print(f"[1/4] baseline evaluation of {base}", flush=True)
    clock = time.monotonic()
    # Without the noised decodes: the evaluation against the baseline measures the base's again, beside the model's.
    before = evaluate(base, str(data_path), str(run_dir / "eval_baseline"), noise_levels=[], **judging)
    timings["baseline_eval"] = time.monotonic() - clock
    held_out = f"{_count(before['n_clips'], 'held-out clip')} of {_count(before['n_videos'], 'video')}"
    print(f"base: PSNR {before['metrics']['psnr']:.2f} dB on {held_out}", flush=True)
    chosen = {"lr": lr, "trainable": trainable, "lora_rank": lora_rank}
    if sweep:
        clock = time.monotonic()
        chosen = run_sweep(
            config,
            base,
            data_path,
            run_dir,
            sweep_steps,
            sweep_lrs or [lr / 3, lr, lr * 3],
            max_drift,
            eval_clips,
            clip,
            common,
        )
        timings["sweep"] = time.monotonic() - clock
    print(f"[2/4] training {config.name} for {steps} steps with {chosen}", flush=True)
    clock = time.monotonic()
    export = _train_variant(
        config.full_name, config.channels, base, str(data_path), str(run_dir), "train", steps, **chosen, **common
    )
    timings["train"] = time.monotonic() - clock
    export_dir = run_dir / "export"
    if export_dir.exists():
        shutil.rmtree(export_dir)
    shutil.copytree(export, export_dir)
    clock = time.monotonic()
    clips = stats_clips if stats_clips is not None else default_stats_clips(steps, batch_size)
    stats_files = write_latent_stats(
        config, chosen["trainable"], base, data_path, export_dir, clips, clip, num_workers, stats_clips is None
    )
    timings["latent_stats"] = time.monotonic() - clock
    # What the export's consumers normalize with: its files, else (decoder-only Wan) the base's constants.
    export_stats = read_latent_stats(export_dir, config)
    if export_stats is None and kept_base_stats(chosen["trainable"], config):
        export_stats = base_latent_stats(config)
    for fmt, subfolder in placements(written):
        if fmt.name == native:
            continue  # the training run's export wrote it
        fmt.write(load_tokenizer(export_dir), export_dir / subfolder, export_stats, torch.float32)
        print(f"{fmt.what}: {export_dir / subfolder}", flush=True)
    print("[3/4] evaluation against the baseline", flush=True)
    clock = time.monotonic()
    after = evaluate(str(export_dir), str(data_path), str(run_dir / "eval"), baseline=base, **judging)
    timings["eval"] = time.monotonic() - clock
    print("[4/4] model card and summary", flush=True)
    # The verdict compares the clips of one evaluation clip by clip: the baseline's PSNR there is the first
    # evaluation's (the same clips, drawn from the same seeds).
    judged = verdict(after)
    drift = drift_warning(after)
    (export_dir / "README.md").write_text(
        checkpoint_card(
            run_dir / "train" / "checkpoints" / "last.ckpt",
            config.full_name,
            after,
            ema=False,
            global_step=steps,
            verdict=judged.line,
            formats=written,
            sections=card_sections(after),
            channels=config.channels,
            drift=drift,
            latent_stats=None if config.is_discrete else _stats_row(config, stats_files),
        )
    )
    comparison = after.get("comparison") or {}
    timings["total"] = time.monotonic() - started
    summary = {
        "verdict": judged.word,
        "verdict_line": judged.line,
        "verdict_reason": judged.reason,
        "psnr_before": after["baseline_metrics"]["psnr"],
        "psnr_after": after["metrics"]["psnr"],
        "psnr_change": judged.change,
        "psnr_change_spread": None if judged.spread is None else SPREAD_SIGMAS * judged.spread,
        "held_out_clips": after["n_clips"],
        "held_out_videos": after["n_videos"],
        "latent_drift": comparison.get("latent_drift", comparison.get("token_flip_rate")),
        "drift_limit": max_drift,
        "drift_warning": drift,
        # PSNR decoded from noised latents, {"0.05": dB, ...} by noise level (continuous models; else None).
        "psnr_noised_before": after["baseline_metrics"].get(NOISED),
        "psnr_noised_after": after["metrics"].get(NOISED),
        "base": str(Path(base).resolve()),
        "model": config.name,
        "channels": config.channels,
        "videos": str(Path(videos).resolve()),
        "data": str(data_path),
        "steps": steps,
        "chosen": chosen,
        "run": str(run_dir),
        "export": str(export_dir),
        "latent_stats": stats_files,
        # Per channel, how far the export's latent statistics moved from what the base's world models normalize
        # with (its files, or its family's hard-coded constants); None when not measured.
        "latent_stats_shift": after.get("latent_stats_shift"),
        "report": str(run_dir / "eval" / "report.md"),
        "timings_s": {name: round(seconds, 1) for name, seconds in timings.items()},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"PSNR on held-out clips: {summary['psnr_before']:.2f} dB -> {summary['psnr_after']:.2f} dB",
        *_noised_line(summary["psnr_noised_before"], summary["psnr_noised_after"]),
        f"post-trained tokenizer: {judged.line}",
    ]
    if judged.word == "inconclusive":
        lines.append(f"for a verdict: {_verdict_hint(judged.clips)}")
    if drift and judged.word != "drifted":  # a drifted verdict says it already
        lines.append(f"warning: {drift} (the limit is --max-drift; --trainable decoder keeps the latents as they are)")
    minutes = ", ".join(f"{name} {seconds / 60:.1f}" for name, seconds in timings.items())
    lines += [f"time (min): {minutes}", f"export: {export_dir}", f"report: {summary['report']}"]
    print("\n".join(lines), flush=True)
    check_verdict(judged, run_dir, allow_worse, allow_drift)
    return summary


def _noised_line(before: dict | None, after: dict | None) -> list[str]:
    """The terminal's line of the PSNR from noised latents, base -> post-trained by level; none when not measured."""
    if not after:
        return []
    levels = ", ".join(
        f"{level}: {'-' if (before or {}).get(level) is None else f'{before[level]:.2f}'} -> {value:.2f} dB"
        for level, value in after.items()
    )
    return [f"PSNR from noised latents (latent + level x channel std x noise): {levels}"]


def check_verdict(judged: Verdict, run_dir: Path, allow_worse: bool = False, allow_drift: bool = False) -> None:
    """Raise what the verdict ends the workflow with (every file written before): :class:`WorseThanBaseError`
    (exit code 3) when worse unless ``allow_worse``, else :class:`DriftedFromBaseError` (exit code 4) when the
    drift is over its limit unless ``allow_drift`` (:func:`~..evaluation.report.exit_code` decides)."""
    code = exit_code(judged, allow_worse, allow_drift)
    if code == EXIT_WORSE:
        raise WorseThanBaseError(
            f"the post-trained tokenizer is WORSE than the base: held-out PSNR {judged.before:.2f} -> "
            f"{judged.after:.2f} dB (export, report and summary kept in {run_dir}); try a lower --lr, more --steps "
            "or --sweep, or pass --allow-worse to accept it"
        )
    if code == EXIT_DRIFTED and judged.drift is not None:
        raise DriftedFromBaseError(
            f"the post-trained tokenizer DRIFTED from the base: held-out {judged.drift.text} (PSNR "
            f"{judged.before:.2f} -> {judged.after:.2f} dB; export, report and summary kept in {run_dir}); a world "
            "model trained on the base's latents would need fine-tuning on them: try --trainable decoder (latents "
            "unchanged), --latent-anchor 1 (the encoder held near the base's), a lower --lr, fewer --steps or "
            "--sweep; a larger --max-drift or --allow-drift accepts it"
        )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"


def _verdict_hint(clips: int) -> str:
    """What gives an inconclusive verdict a chance, in posttrain's options."""
    more = (
        f"at least {MIN_VERDICT_CLIPS} held-out clips (--eval-clips; up to {EVAL_CLIPS_PER_VIDEO} per held-out "
        "video, so with few videos hold out more with --val-fraction)"
    )
    if clips < MIN_VERDICT_CLIPS:
        return more
    return "more held-out clips narrow the spread (--eval-clips, --val-fraction); more --steps may move PSNR further"


def check_base_stats(config: NetworkConfig, base: str, compared: bool, diffusers: bool) -> None:
    """Refuse, in one line and before any work, the base's latent statistics (the files of its family beside
    ``base``: ``mean_std.pt`` and ``image_mean_std.pt`` for Cosmos) that the workflow would refuse only after
    training: a file that is not a (mean, std) pair of tensors (the evaluation against the base reads it, and so
    does the copy into a decoder-only export), statistics of another number of channels than ``config``'s latent
    when they are ``compared`` with the post-trained encoder's or written into a ``diffusers`` config, and values
    that cannot normalize a latent (NaN, infinite, a std <= 0). A discrete tokenizer's are never read."""
    if config.is_discrete:
        return
    # CheckpointError for a pickled object, garbage, or not a pair of tensors
    stats = read_latent_stats(base, config)
    if stats is None:
        return
    files = stats_files_of(config)
    path, channels = stats_folder(base) / files.video, config.latent_dim
    fix = (
        f"compute them again (export --latent-stats DATA), or move {files.video} and {files.image} out of {path.parent}"
    )
    if stats.mean.shape[0] != channels and (compared or diffusers):
        use = "compares them with the post-trained encoder's" if compared else "writes them into the diffusers config"
        raise CheckpointError(
            f"{path} holds statistics of {stats.mean.shape[0]} latent channels (read as [channels, T]: "
            f"{list(stats.mean.shape)}), but {config.name} has {channels} and the workflow {use}; save them as a "
            f"[{channels}, T] pair, or {fix}"
        )
    pairs = ((files.video, stats.mean, stats.std), (files.image, stats.image_mean, stats.image_std))
    for name, mean, std in pairs:
        if not normalizes(mean, std):
            raise CheckpointError(
                f"{path.parent / name} holds NaN or infinite statistics or a std <= 0, which cannot normalize a "
                f"latent: {fix}"
            )


def _stats_row(config: NetworkConfig, done: str) -> str:
    """The model card's row on the latent statistics: what :func:`write_latent_stats` did, and where they are."""
    return f"{done}; {files_note(config)}" if done.startswith("computed") else done


def write_latent_stats(
    config: NetworkConfig,
    trainable: str,
    base: str,
    data_path: Path,
    export_dir: Path,
    clips: int,
    clip: dict,
    workers: int,
    default: bool = False,
) -> str:
    """Write the family's latent statistics files (Cosmos: ``mean_std.pt`` and ``image_mean_std.pt``; the Wan VAE:
    ``video_mean_std.pt`` and ``images_mean_std.pt``) into the export of a continuous tokenizer: the base's files
    when only the decoder trained (the latent space did not move; a family's hard-coded constants are then kept
    and nothing is written when the base has no files), else computed from ``clips`` clips of the training data
    (``clip``: the training clip's ``frames``, ``size`` and ``resize_short_side``; 121-frame chunks where the
    videos are long enough), said with the option that sets how many (``default``: the count is posttrain's
    default), and their shift from the base printed. Returns what was done, for the summary and the card."""
    if config.is_discrete:
        print(f"latent statistics: none for {config.name} (world models read its token indices)", flush=True)
        return "none (discrete tokenizer)"
    copied = carry_base_stats(trainable, base, export_dir, config)
    if copied:
        names = ", ".join(p.name for p in copied)
        print(f"latent statistics: the encoder did not train, copied {names} from {stats_folder(base)}", flush=True)
        return f"copied from {stats_folder(base)}"
    kept = kept_base_stats(trainable, config)
    if kept is not None:
        print(f"latent statistics: {kept}", flush=True)
        return kept
    why = f"by default a quarter of the clips training saw, {STATS_CLIPS_MIN} to {STATS_CLIPS}; " if default else ""
    print(
        f"latent statistics: encoding {clips} training clips of up to {CHUNK_FRAMES}x{clip['size']}x{clip['size']} "
        f"(--stats-clips N: {why}{STATS_CLIPS} make two seeds agree to 1%)",
        flush=True,
    )
    network = load_tokenizer(export_dir)
    stats = dataset_latent_stats(
        network,
        data_path,
        clips,
        clip["size"],
        fallback_frames=clip["frames"],
        resize_short_side=clip["resize_short_side"],
        workers=workers,
        accelerate=fast_encoder,
    )
    stats.write(export_dir)
    shift = shift_from_base(stats, config, base)
    if shift is not None:
        print(shift_line(shift), flush=True)
    return f"computed from {stats.clips} training clips"


def run_sweep(
    config: NetworkConfig,
    base: str,
    data_path: Path,
    run_dir: Path,
    steps: int,
    lrs: list[float],
    max_drift: float,
    eval_clips: int,
    clip: dict,
    common: dict,
) -> dict:
    """Short runs over learning rate x (all, decoder, LoRA) as one NeMo-Run experiment; the best by
    held-out PSNR among those whose latent drift (DV: token flip rate) is within ``max_drift`` wins (the verdict's
    test, :attr:`~..evaluation.report.Drift.over`; a run whose drift was not measured counts as within)."""
    import nemo_run as run

    from ..evaluation.evaluate import evaluate

    variants = [
        {"trainable": "all", "lora_rank": 0},
        {"trainable": "decoder", "lora_rank": 0},
        {"trainable": "all", "lora_rank": 8},
    ]
    grid = [{"lr": lr, **v} for lr in lrs for v in variants]
    names = [f"sweep_{i:02d}" for i in range(len(grid))]
    with run.Experiment("posttrain-sweep", executor=run.LocalExecutor(), log_level="WARN") as exp:
        for name, choice in zip(names, grid, strict=True):
            exp.add(
                run.Partial(
                    _train_variant,
                    config.full_name,
                    config.channels,
                    base,
                    str(data_path),
                    str(run_dir / "sweep"),
                    name,
                    steps,
                    **choice,
                    **common,
                ),
                name=name,
            )
        exp.run(direct=True, sequential=True)
    scored = []
    for name, choice in zip(names, grid, strict=True):
        export = run_dir / "sweep" / name / "export"
        if not export.is_dir():
            print(f"sweep {name} {choice}: failed, skipped", flush=True)
            continue
        result = evaluate(
            str(export),
            str(data_path),
            str(run_dir / "sweep" / name / "eval"),
            baseline=base,
            max_clips=eval_clips,
            drift_limit=max_drift,
            noise_levels=[],  # the choice reads PSNR and drift only
            **clip,
        )
        drift = measured_drift(result)
        value = 0.0 if drift is None else drift.value
        print(f"sweep {name} {choice}: psnr {result['metrics']['psnr']:.2f} dB, drift {value:.4f}", flush=True)
        scored.append((drift is None or not drift.over, result["metrics"]["psnr"], choice))
    if not scored:
        raise UserError(f"every sweep run failed; see the logs under {run_dir / 'sweep'}")
    best = max(scored, key=lambda item: (item[0], item[1]))
    (run_dir / "sweep" / "choice.json").write_text(json.dumps({"chosen": best[2], "within_drift": best[0]}) + "\n")
    return best[2]
