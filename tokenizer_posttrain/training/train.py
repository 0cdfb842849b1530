"""The training entry: build the pieces from typed configs, check them, fit, export."""

import itertools
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities import rank_zero_only

from ..core.errors import UserError
from ..data.batch import PREFETCH
from ..data.fake import SyntheticVideoDataModule, synthetic_clip
from ..losses.loss import build_loss
from ..losses.terms import Clips
from ..network import VideoTokenizer, family_of, get_config
from .acceleration import ddp_strategy, resolve_compile, tensor_core_matmuls
from .checkpointing import (
    AtomicCheckpointIO,
    FinalCheckpoint,
    OptimizerStateCheck,
    PreemptionCheckpoint,
    RngState,
    checkpoint_callback,
)
from .compile_cache import compile_cache_callback
from .config import DataConfig, LogConfig, LossConfig, ModelConfig, OptimConfig, ResumeConfig, TrainerConfig
from .console import quiet_launch, resumed_fit
from .module import TokenizerModel
from .monitoring import (
    LearningRateLogger,
    RunSummary,
    SampleTrace,
    SkippedSamples,
    ThroughputMonitor,
    loggers,
    progress_callback,
)
from .resume import (
    LAST_CKPT,
    check_same_run,
    check_same_stream,
    checkpoint_step,
    current_settings,
    find_resume_checkpoint,
    readable_checkpoints,
    remove_partial_saves,
)
from .run_lock import run_folder_lock
from .step_guard import NonFiniteLossError
from .stop_signal import HostStopAgreement

T = TypeVar("T")


@dataclass
class Parallelism:
    accelerator: str
    devices: int
    num_nodes: int
    accumulate_grad_batches: int

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def resolve_parallelism(trainer: TrainerConfig, data: DataConfig) -> Parallelism:
    """Accelerator, devices, nodes and gradient accumulation, checked before any work starts."""
    accelerator = "gpu" if trainer.accelerator in ("gpu", "cuda") else trainer.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "gpu" and not torch.cuda.is_available():
        warnings.warn(
            "trainer.accelerator=gpu but no CUDA GPU is visible: training on the CPU "
            "(slow; set trainer.accelerator=cpu to silence this).",
            stacklevel=2,
        )
        accelerator = "cpu"
    num_nodes = trainer.num_nodes if trainer.num_nodes is not None else int(os.environ.get("SLURM_NNODES", "1"))
    if "LOCAL_WORLD_SIZE" in os.environ:  # launched by torchrun: one process per device
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        if trainer.devices != "auto" and int(trainer.devices) != devices:
            raise ValueError(
                f"trainer.devices={trainer.devices} but torchrun started {devices} processes "
                "per node; make --nproc-per-node and trainer.devices agree"
            )
    elif trainer.devices != "auto":
        devices = int(trainer.devices)
    else:
        devices = torch.cuda.device_count() if accelerator == "gpu" else 1
    per_step = data.micro_batch_size * devices * num_nodes
    if data.global_batch_size % per_step:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} is not a multiple of data.micro_batch_size "
            f"({data.micro_batch_size}) x data-parallel size ({devices * num_nodes}) = {per_step}; "
            f"use a global batch of {max(per_step, data.global_batch_size // per_step * per_step)} "
            "or change the micro batch"
        )
    return Parallelism(accelerator, devices, num_nodes, data.global_batch_size // per_step)


def check_clip_shape(model: ModelConfig, data: DataConfig) -> None:
    """Fail before launch when the clip shape cannot go through the tokenizer (or when model.sample_posterior
    asks a tokenizer without a posterior, model.time_chunk one that cannot chunk, or model.latent_noise a discrete
    one)."""
    cfg = get_config(model.model)
    if model.sample_posterior and not family_of(cfg).posterior:
        raise ValueError(
            f"model.sample_posterior=true: {cfg.full_name} has no posterior to sample (only the VAE families do); "
            "set model.sample_posterior=false"
        )
    if model.latent_noise.ever_on and cfg.is_discrete:
        raise ValueError(
            f"model.latent_noise: {cfg.full_name} decodes discrete codes, not continuous latents a world model "
            "would hand it noisy; set model.latent_noise.weight=0"
        )
    if model.time_chunk:
        with torch.device("meta"):
            chunks_in_time = family_of(cfg).build(cfg).chunks_in_time
        if not chunks_in_time:
            raise ValueError(
                f"model.time_chunk={model.time_chunk}: {cfg.full_name} cannot run a clip in chunks of time "
                "(the Wan VAEs can); set model.time_chunk=0"
            )
    problems = cfg.clip_problems(data.frames, data.height, data.width, ("data.frames", "data.height", "data.width"))
    if problems:
        raise ValueError(f"the clip shape does not fit {cfg.name}: {'; '.join(problems)}")


def clip_sizes(data: DataConfig, multiple_of: int) -> list[tuple[int, int]]:
    """Every (height, width) the run's training clips take: the crop, or each aspect bucket's."""
    if not (data.aspect_buckets and data.path is not None):
        return [(data.height, data.width)]
    from ..data.task_encoder import ASPECT_BUCKETS, ClipSpec

    spec = ClipSpec(
        frames=data.frames, height=data.height, width=data.width, aspect_buckets=True, multiple_of=multiple_of
    )
    return [spec.bucket_size(name) for name in ASPECT_BUCKETS]


def clip_shapes(model: ModelConfig, data: DataConfig) -> list[tuple[int, int, int]]:
    """Every (frames, height, width) the run's training clips take (:func:`clip_sizes` at the model's
    spatial compression)."""
    spatial = get_config(model.model).spatial_compression
    return [(data.frames, height, width) for height, width in clip_sizes(data, spatial)]


def check_loss_clips(model: ModelConfig, data: DataConfig, loss: LossConfig) -> None:
    """Fail before launch when a term that is ever on cannot work on the clips: loss.consistency's windows,
    loss.flow's frame sizes for RAFT."""
    cfg = get_config(model.model)
    clips = Clips(
        data.frames,
        tuple(clip_sizes(data, cfg.spatial_compression)),
        cfg.temporal_compression,
        not cfg.is_discrete,
        family_of(cfg).posterior,
        encoder_trains=model.trainable != "decoder",
    )
    problems = loss.clip_problems(clips)
    if problems:
        raise ValueError(
            f"the loss does not fit {cfg.name} clips of {data.frames}x{data.height}x{data.width}: "
            + "; ".join(problems)
        )


def build_datamodule(
    data: DataConfig,
    model: ModelConfig,
    seed: int,
    skip_pickled_states: bool = False,
    restart_stream: str | None = None,
) -> pl.LightningDataModule:
    """Synthetic clips when ``data.path`` is None, else the energon video dataset at that path
    (``skip_pickled_states``: ``resume.skip_pickled_states``, for its loader position in old checkpoints;
    ``restart_stream``: why its saved position is dropped, see :func:`~.resume.check_same_stream`)."""
    if data.crops_per_decode > 1 and data.path is None:
        warnings.warn("data.crops_per_decode has no effect on synthetic clips (no data.path)", stacklevel=2)
    elif data.crops_per_decode > 1 and data.aspect_buckets and data.resize_short_side is None:
        warnings.warn(
            "data.crops_per_decode with data.aspect_buckets: each video is scaled to just cover its bucket, so "
            "the crops of one decode differ by a few pixels at most; set data.resize_short_side for room to move",
            stacklevel=2,
        )
    if data.path is None:
        return SyntheticVideoDataModule(
            frames=data.frames,
            height=data.height,
            width=data.width,
            micro_batch_size=data.micro_batch_size,
            num_workers=data.num_workers,
            num_train_samples=data.num_train_samples,
            cache=data.synthetic_cache,
            seed=data.seed,
        )
    # The video stack (energon, PyAV) only for real data: synthetic runs need just torch.
    from ..data.energon import EnergonVideoDataModule
    from ..data.task_encoder import ClipSpec

    spec = ClipSpec(
        frames=data.frames,
        height=data.height,
        width=data.width,
        resize_short_side=data.resize_short_side,
        hflip=data.hflip,
        start=data.start,
        keyframe_window=data.keyframe_window,
        decode=data.decode,
        crops_per_decode=data.crops_per_decode,
        aspect_buckets=data.aspect_buckets,
        multiple_of=get_config(model.model).spatial_compression,
    )
    return EnergonVideoDataModule(
        data.path,
        spec,
        micro_batch_size=data.micro_batch_size,
        num_workers=data.num_workers,
        prefetch=PREFETCH if data.prefetch is None else data.prefetch,
        shuffle_buffer_size=data.shuffle_buffer_size,
        max_samples_per_sequence=data.max_samples_per_sequence,
        seed=seed,
        skip_pickled_states=skip_pickled_states,
        restart_stream=restart_stream,
    )


def check_data(data: DataConfig, world_size: int, seed: int, processes: int = 1, multiple_of: int = 8) -> DataConfig:
    """Preflight of a real dataset: refuse to start when its videos cannot give the clips, or its loader's
    batches in flight would not fit in shared memory (``processes``: training processes on this machine;
    ``multiple_of``: the model's spatial compression, which aspect buckets round to). Returns ``data`` with
    ``data.prefetch`` resolved (:func:`~tokenizer_posttrain.data.preflight.loader_prefetch`)."""
    if data.path is None:
        return data
    from ..data.preflight import check_gpu_decoding, check_worker_share, loader_prefetch, preflight

    check_worker_share(data.path, world_size, data.num_workers)
    # bf16 clips of the largest shape the run takes; the all-ones loss mask is one stored element.
    pixels = max(height * width for height, width in clip_sizes(data, multiple_of))
    batch_bytes = data.micro_batch_size * 3 * data.frames * pixels * 2
    prefetch = loader_prefetch(batch_bytes, data.num_workers, data.prefetch, processes)
    if data.decode == "gpu":
        check_gpu_decoding(data.path, data.num_workers, seed)
    problems = preflight(
        data.path,
        data.frames,
        data.height,
        data.width,
        data.resize_short_side,
        data.preflight_samples,
        data.max_skip_fraction,
        seed,
    )
    if problems:
        warnings.warn(
            "training will skip these (damaged shards, unusable sampled videos):\n  " + "\n  ".join(problems[:10]),
            stacklevel=2,
        )
    return replace(data, prefetch=prefetch)


CPU_STATS_CLIPS = 16
"""End-of-run latent statistics clips on a CPU: enough for a usable ``mean_std.pt`` in seconds on the tiny models;
a real run measures them on a GPU, or sets ``log.latent_stats_clips``."""


def default_stats_clips(log: LogConfig) -> int:
    """Clips for the end-of-run latent statistics: ``log.latent_stats_clips``, else as many as agree to 1% on a GPU
    (:data:`~..evaluation.latent_stats.STATS_CLIPS`) and a few on a CPU, where each clip costs seconds."""
    from ..evaluation.latent_stats import STATS_CLIPS

    if log.latent_stats_clips is not None:
        return log.latent_stats_clips
    return STATS_CLIPS if torch.cuda.is_available() else CPU_STATS_CLIPS


def export_latent_stats(
    network: VideoTokenizer,
    model: ModelConfig,
    data: DataConfig,
    log: LogConfig,
    export_dir: Path,
    ckpt_dir: Path,
) -> str:
    """Write the latent statistics files of the family (:data:`~..evaluation.latent_stats.STATS_FILES`) into the
    export of a continuous tokenizer: Cosmos' ``mean_std.pt`` and ``image_mean_std.pt``, which the Cosmos world
    models' tokenizer loader requires, or the Wan VAE's ``video_mean_std.pt`` and ``images_mean_std.pt``, which
    Cosmos-Predict2.5 reads on top of the hard-coded constants. The base's files when only the decoder trained
    (the latent space did not move; a base without files keeps its constants and nothing is written), else
    measured on the run's own data (synthetic clips without ``data.path``), their shift from the base printed.
    Returns the line for the run summary; where they cannot be measured, that line gives the command that writes
    them."""
    from ..evaluation.latent_shift import shift_from_base, shift_line
    from ..evaluation.latent_stats import (
        carry_base_stats,
        dataset_latent_stats,
        default_stats_workers,
        kept_base_stats,
        stats_files,
    )
    from ..evaluation.latent_stats import latent_statistics as measure
    from ..io.export import CHUNK_FRAMES
    from .acceleration import fast_encoder

    config = network.config
    copied = carry_base_stats(model.trainable, model.jit_ckpt_pth, export_dir, config)
    if copied:
        return (
            f"latent statistics ({', '.join(p.name for p in copied)}): the encoder did not train, copied from the base"
        )
    kept = kept_base_stats(model.trainable, config)
    if kept is not None:
        return f"latent statistics: {kept}"
    video_file = stats_files(config).video
    later = (
        f"python -m tokenizer_posttrain export --checkpoint {ckpt_dir / LAST_CKPT} --out {export_dir} "
        "--latent-stats DATA (DATA: a prepared dataset of your videos)"
    )
    clips = default_stats_clips(log)
    if clips == 0:
        return f"no {video_file} in the export (log.latent_stats_clips=0); to write it: {later}"
    print(f"latent statistics: measuring on {clips} clips (log.latent_stats_clips sets how many)", flush=True)
    cuda = torch.cuda.is_available()
    try:
        if data.path is None:
            synthetic = (synthetic_clip(data.frames, data.height, data.width, data.seed + i) for i in itertools.count())
            stats = measure(
                network,
                synthetic,
                clips,
                # On the GPU in bf16, as dataset_latent_stats does: fp32 on the CPU took 7 min for 400 clips.
                device="cuda" if cuda else "cpu",
                dtype=torch.bfloat16 if cuda else torch.float32,
            )
        else:
            stats = dataset_latent_stats(
                network,
                data.path,
                clips,
                min(data.height, data.width),
                # 121-frame chunks as the world models encode, where the GPU makes them cheap.
                frames=CHUNK_FRAMES if cuda else data.frames,
                fallback_frames=data.frames,
                resize_short_side=data.resize_short_side,
                workers=default_stats_workers(),
                accelerate=fast_encoder,
            )
    except (UserError, OSError, RuntimeError) as err:  # e.g. out of GPU memory: the trained run stays a success
        warnings.warn(f"the latent statistics could not be measured: {err}", stacklevel=2)
        return f"no {video_file} in the export (not measured: see the warning above); to write it: {later}"
    files = ", ".join(p.name for p in stats.write(export_dir))
    shift = shift_from_base(stats, config, model.jit_ckpt_pth)
    if shift is not None:
        print(shift_line(shift), flush=True)
    source = "synthetic clips" if data.path is None else f"clips of {data.path}"
    return f"latent statistics ({files}): measured on {stats.clips} {source}"


def _forward_sigusr1_as_sigterm() -> None:
    # Clusters send SIGUSR1 ahead of preemption. Under SLURM Lightning handles it (checkpoint and
    # requeue); elsewhere we treat it like SIGTERM: finish the batch, write last.ckpt, exit.
    if "SLURM_JOB_ID" not in os.environ and hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))


class LaunchProblems(UserError):
    """Everything that stops a launch, found before any work and reported at once."""


class _Problems:
    """Collects the failures of independent launch checks, so one launch reports them all."""

    def __init__(self) -> None:
        self.found: list[Exception] = []

    def check(self, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except (UserError, ValueError, OSError) as err:
            if str(err) not in map(str, self.found):  # a later check may meet an earlier one's problem again
                self.found.append(err)
            return None

    def raise_any(self, held: list[warnings.WarningMessage]) -> None:
        """Raise what was found; else pass on the warnings ``held`` back while checking (a failed launch
        shows only its problems: a warning about random weights would bury them)."""
        if not self.found:
            for w in held:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            return
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise LaunchProblems(
                f"{len(self.found)} problems stop this launch:\n" + "\n".join(f"  - {p}" for p in self.found)
            )


def _stopped_for_bad_steps(stop: NonFiniteLossError, ckpt_dir: Path, max_bad_steps: int) -> NonFiniteLossError:
    """The stop for NaN/Inf steps, naming the checkpoint that holds the last good weights: the newest written
    before the first bad step (skipped steps leave the weights alone, so a checkpoint written during the bad
    steps holds the weights that gave the first NaN)."""
    saved = readable_checkpoints(ckpt_dir)
    good = [(step, path) for step, path in saved if step < stop.first]
    if good:
        step, path = good[0]
        where = (
            f"The newest checkpoint from before them is {path} (step {step}): lower optim.lr (or check the data "
            "with python -m data_tools check, or use trainer.precision=32-true) and resume from it with "
            f"resume.resume_from_path={path}"
        )
        if saved[0][0] > step:
            where += f" (a plain relaunch would resume {saved[0][1]}, written during the bad steps)"
    else:
        where = (
            f"No checkpoint was written before step {stop.first}: lower optim.lr (or check the data with "
            "python -m data_tools check) and start a new run with another log.name"
        )
    return NonFiniteLossError(
        f"{max_bad_steps} steps in a row (steps {stop.first}-{stop.last}) had a NaN/Inf loss or gradient "
        f"(trainer.max_bad_steps={max_bad_steps}); stopped. {where}",
        first=stop.first,
        last=stop.last,
    )


@dataclass
class _Launch:
    """What the checks before a launch found and built, for the fit that follows."""

    ckpt_path: str | None
    done: int
    """The step the resumed checkpoint reached (0 for a new run)."""
    max_steps: int
    model: ModelConfig
    data: DataConfig
    """``data`` with what the checks resolved (``data.prefetch``)."""
    par: Parallelism | None = None
    restart_stream: str | None = None
    module: TokenizerModel | None = None
    compile_cache: object | None = None

    @property
    def finished(self) -> bool:
        """The resumed checkpoint already reached ``trainer.max_steps``."""
        return self.ckpt_path is not None and 0 < self.max_steps <= self.done


def _check_launch(
    model: ModelConfig,
    data: DataConfig,
    trainer: TrainerConfig,
    optim: OptimConfig,
    resume: ResumeConfig,
    loss: LossConfig,
    run_dir: Path,
    problems: _Problems,
    dry: bool = False,
) -> _Launch:
    """Every check that needs no training, each on its own so that one launch reports all its problems in
    ``problems``; builds the module (which loads the weights) on the way. ``dry``: for ``--dryrun``, nothing is
    made that a real launch would keep (the compile cache's key)."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_path = problems.check(lambda: find_resume_checkpoint(ckpt_dir, resume))
    launch = _Launch(ckpt_path, checkpoint_step(ckpt_path) if ckpt_path else 0, trainer.max_steps, model, data)
    if launch.finished:
        return launch
    if ckpt_path and not resume.allow_changes:
        problems.check(lambda: check_same_run(ckpt_path, current_settings(model, data, loss)))
    problems.check(lambda: check_clip_shape(model, data))
    problems.check(lambda: check_loss_clips(model, data, loss))
    par = launch.par = problems.check(lambda: resolve_parallelism(trainer, data))
    if ckpt_path and par is not None:
        launch.restart_stream = problems.check(
            lambda: check_same_stream(ckpt_path, data, par.world_size, resume.allow_changes)
        )
    model = launch.model = resolve_compile(model, par.accelerator if par else "cpu")
    spatial = get_config(model.model).spatial_compression
    checked = problems.check(
        lambda: check_data(data, par.world_size if par else 1, trainer.seed, par.devices if par else 1, spatial)
    )
    launch.data = checked or data
    pl.seed_everything(trainer.seed, workers=True, verbose=False)
    problems.check(lambda: build_loss(loss))  # its weight files on their own: the module stops at the first
    if trainer.max_steps > 0:
        for note in loss.unreached_changes(trainer.max_steps):
            warnings.warn(note, stacklevel=2)
    # Built before the verdict: it loads the checkpoint (its fit).
    launch.module = problems.check(
        lambda: TokenizerModel(model, optim, loss, trainer.max_bad_steps, trainer.gradient_clip_val)
    )
    if not dry:
        launch.compile_cache = problems.check(
            lambda: compile_cache_callback(model, data, loss, str(trainer.precision), run_dir, clip_shapes(model, data))
        )
    return launch


def _launch_lines(launch: _Launch, trainer: TrainerConfig, resume: ResumeConfig, run_dir: Path) -> list[str]:
    """The launch in a few lines: the model and its weights, the data, the run folder, new or resumed."""
    model, data, par = launch.model, launch.data, launch.par
    cfg = get_config(model.model)
    width = f" at width {model.channels}" if model.channels is not None else ""
    weights = f"weights {model.jit_ckpt_pth}" if model.jit_ckpt_pth else "RANDOM weights (model.jit_ckpt_pth not set)"
    trains = "" if model.trainable == "all" else f", trains {model.trainable}"
    if model.lora.rank > 0:
        trains += f", LoRA rank {model.lora.rank}"
    clips = f"{data.frames}x{data.height}x{data.width}"
    source = f"{data.path}" if data.path is not None else "built-in synthetic clips (no data.path)"
    batch = f"batch {data.global_batch_size}"
    if par is not None:
        batch += f" ({data.micro_batch_size} per device x {par.world_size} x {par.accumulate_grad_batches} accumulated)"
    where = f"{par.world_size} x {par.accelerator}" if par is not None else "?"
    if launch.ckpt_path:
        state = f"resuming from {launch.ckpt_path}, step {launch.done}"
        if launch.restart_stream:
            state += " (data stream restarts)"
    else:
        state = "new run"
    return [
        f"model: {cfg.name}{width}, {weights}{trains}",
        f"data: {source}, clips {clips}, {batch}",
        f"run: {run_dir} ({state}), to step {trainer.max_steps} on {where}",
    ]


def check_launch(
    model: ModelConfig,
    data: DataConfig,
    trainer: TrainerConfig,
    optim: OptimConfig,
    resume: ResumeConfig,
    log: LogConfig,
    loss: LossConfig = LossConfig(),  # noqa: B008 - an immutable-by-use default
    extra_callbacks: Sequence[pl.Callback] = (),
) -> list[str]:
    """``--dryrun``: run every check of :func:`train` that needs no training (the clip shape, the batch split,
    the data and its preflight, the weight files, a resumed run's settings) without writing anything, and return
    the launch's summary lines; raises what a real launch would refuse to start with."""
    run_dir = Path(log.log_dir) / log.name
    problems = _Problems()
    with quiet_launch(), warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        launch = _check_launch(model, data, trainer, optim, resume, loss, run_dir, problems, dry=True)
    if launch.finished and not resume.resume_past_end:
        problems.found.append(_finished_error(launch, trainer))
    with quiet_launch():
        problems.raise_any(held)
    if launch.finished:
        return [f"nothing to do: {launch.ckpt_path} is at step {launch.done}, trainer.max_steps={trainer.max_steps}"]
    return _launch_lines(launch, trainer, resume, run_dir)


def _finished_error(launch: _Launch, trainer: TrainerConfig) -> ValueError:
    return ValueError(
        f"{launch.ckpt_path} already reached step {launch.done} >= trainer.max_steps={trainer.max_steps}; "
        "raise trainer.max_steps or start a new run with another log.name"
    )


def _missing_parts(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove what a failed launch made and left empty: the run folder ``folders[0]`` with its empty sub-folders,
    then each parent it had to make (``folders[1:]``), deepest first, while it is empty. Only empty folders go, so
    anything written stays; a parent's other sub-folders (another run started there meanwhile) are never swept."""
    if not folders:
        return
    run_dir = folders[0]
    if run_dir.is_dir() and not run_dir.is_symlink():
        for sub in sorted(run_dir.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            try:
                sub.rmdir()
            except OSError:  # not empty: something was written there
                pass
    for folder in folders[1:]:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty, or not ours to remove
            return


def train(
    model: ModelConfig,
    data: DataConfig,
    trainer: TrainerConfig,
    optim: OptimConfig,
    resume: ResumeConfig,
    log: LogConfig,
    loss: LossConfig = LossConfig(),  # noqa: B008 - an immutable-by-use default
    extra_callbacks: Sequence[pl.Callback] = (),
) -> Path:
    """Post-train a Cosmos tokenizer; returns the run folder (checkpoints/, csv/, export/).

    ``extra_callbacks`` join the run's own (benchmarks add a profiler this way).
    """
    run_dir = Path(log.log_dir) / log.name
    made = _missing_parts(run_dir) if rank_zero_only.rank == 0 else []
    try:
        with quiet_launch():
            return _train(model, data, trainer, optim, resume, log, loss, extra_callbacks, run_dir)
    except BaseException:
        _remove_empty(made)
        raise


def _train(
    model: ModelConfig,
    data: DataConfig,
    trainer: TrainerConfig,
    optim: OptimConfig,
    resume: ResumeConfig,
    log: LogConfig,
    loss: LossConfig,
    extra_callbacks: Sequence[pl.Callback],
    run_dir: Path,
) -> Path:
    with run_folder_lock(run_dir):
        started = time.time()
        ckpt_dir = run_dir / "checkpoints"
        if rank_zero_only.rank == 0:
            remove_partial_saves(ckpt_dir)
        problems = _Problems()
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
            launch = _check_launch(model, data, trainer, optim, resume, loss, run_dir, problems)
        ckpt_path, done = launch.ckpt_path, launch.done
        if launch.finished:
            if not resume.resume_past_end:
                raise _finished_error(launch, trainer)
            problems.raise_any(held)
            print(
                f"Nothing to do: {ckpt_path} is at step {done}, trainer.max_steps={trainer.max_steps}; raise "
                "trainer.max_steps to train on, or start a new run with another log.name (the run folder is left "
                f"as it is; to export this checkpoint again: python -m tokenizer_posttrain export --checkpoint "
                f"{ckpt_path} --out DIR)",
                flush=True,
            )
            return run_dir
        problems.raise_any(held)
        par, module, model, compile_cache = launch.par, launch.module, launch.model, launch.compile_cache
        assert par is not None and module is not None
        module.hparams["data"] = asdict(data)  # for the model card of the export and the check on resume
        datamodule = build_datamodule(
            launch.data, model, trainer.seed, resume.skip_pickled_states, launch.restart_stream
        )
        limit_val_batches = trainer.limit_val_batches
        if data.path is not None and not datamodule.has_validation:
            warnings.warn(f"{data.path} has no val split: validation is off", stacklevel=2)
            limit_val_batches = 0
        summary = RunSummary()
        periodic = checkpoint_callback(ckpt_dir, trainer.checkpoint_every_n_steps, trainer.checkpoint_keep)
        callbacks = [
            periodic,
            FinalCheckpoint(ckpt_dir / LAST_CKPT, periodic),
            PreemptionCheckpoint(ckpt_dir / LAST_CKPT),
            summary,
            SkippedSamples(data.max_skip_fraction, data.crops_per_decode if data.path else 1),
            SampleTrace(run_dir / "samples"),
            LearningRateLogger(),
            ThroughputMonitor(),
            progress_callback(),  # the Rich bar in a terminal, plain lines in a log file
            RngState(skip_pickled=resume.skip_pickled_states),
            OptimizerStateCheck(),
            HostStopAgreement(),
            *extra_callbacks,
        ]
        if compile_cache is not None:
            callbacks.append(compile_cache)
        if model.ema_decay is not None:
            # Lightning's EMA: validation, the final weights (hence the export) and checkpoints use the average.
            callbacks.append(EMAWeightAveraging(decay=model.ema_decay, use_buffers=False))

        lightning_trainer = pl.Trainer(
            accelerator=par.accelerator,
            devices=par.devices,
            num_nodes=par.num_nodes,
            strategy=ddp_strategy(trainer, model) if par.world_size > 1 else "auto",
            precision=trainer.precision,
            max_epochs=trainer.max_epochs,
            max_steps=trainer.max_steps,
            # Both count optimizer steps on the command line; Lightning counts micro-batches.
            val_check_interval=trainer.val_check_interval * par.accumulate_grad_batches,
            check_val_every_n_epoch=None,
            limit_val_batches=limit_val_batches,
            # Both data modules shard the stream over the ranks themselves.
            use_distributed_sampler=False,
            log_every_n_steps=trainer.log_every_n_steps,
            accumulate_grad_batches=par.accumulate_grad_batches,
            # No gradient_clip_val: the module clips (see TokenizerModel.gradient_clip_val).
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
            logger=loggers(run_dir, log.name),
            default_root_dir=str(run_dir),
            enable_model_summary=False,
        )
        if lightning_trainer.is_global_zero:
            print("\n".join(_launch_lines(launch, trainer, resume, run_dir)), flush=True)
        _forward_sigusr1_as_sigterm()
        try:
            # weights_only: Lightning would otherwise unpickle the whole file, running any code planted in it.
            tf32 = par.accelerator == "gpu" and str(trainer.precision).startswith("bf16")
            with tensor_core_matmuls(tf32), resumed_fit(ckpt_path is not None):
                lightning_trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        except NonFiniteLossError as stop:
            raise _stopped_for_bad_steps(stop, ckpt_dir, trainer.max_bad_steps) from None

        if lightning_trainer.is_global_zero:
            export_dir = None
            notes: list[str] = []
            if log.export_on_end:
                from ..io.formats import write_native

                export_dir = write_native(module.network, run_dir / "export")
                if not module.network.is_discrete:
                    notes.append(export_latent_stats(module.network, model, data, log, export_dir, ckpt_dir))
            if compile_cache is not None:
                notes.append(compile_cache.summary())
            summary.report(
                run_dir,
                lightning_trainer.global_step,
                time.time() - started,
                ckpt_dir,
                export_dir,
                [note for note in notes if note],
            )
        return run_dir
