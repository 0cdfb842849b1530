"""Typed configs of a training run: the components a recipe exposes for overrides.

Each dataclass is one override group on the command line (``model.*``, ``data.*``,
``trainer.*``, ``optim.*``, ``resume.*``, ``log.*``; ``loss.*`` is the losses' own
:class:`~tokenizer_posttrain.losses.LossConfig`). Checks live in ``__post_init__``
so a bad value fails before any work starts, with the key named.
"""

import math
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Optional

from ..data.batch import CLIP_FRAMES, CLIP_SIZE
from ..data.clip_start import CLIP_STARTS, DECODERS
from ..losses.loss import LossConfig  # the loss.* group lives with the terms it configures
from ..losses.terms import Schedule

__all__ = [
    "DataConfig",
    "LoRAConfig",
    "LogConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ResumeConfig",
    "TrainerConfig",
]

_PRECISIONS = ("bf16-mixed", "bf16-true", "32-true", "32", "16-mixed")


def _require(ok: bool, key: str, value: object, what: str) -> None:
    if not ok:
        raise ValueError(f"invalid {key}={value!r}: {what}")


MAX_PREFETCH = 64
"""The most batches a loader worker may prepare ahead: 6 keep a GPU fed on real footage (docs/data.md, "Real footage");
torch's loader queues every one of them at its start, so a huge value is a hang where no shared-memory check
catches it first."""


def _integer_from(value: object, lowest: int) -> bool:
    """Whether ``value`` is an int (not a bool, which is one in Python) of at least ``lowest``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= lowest


def _finite(value: object) -> bool:
    """Whether ``value`` is a finite number: inf and nan pass every ``>`` check of a bound on one side."""
    return isinstance(value, (int, float)) and math.isfinite(value)


_COMPILE_SCOPES = ("step", "blocks")
_TRAINABLE = ("all", "decoder", "encoder")
_SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the convolutions (merged into the weights at export)."""

    rank: int = 0
    """Adapter rank; 0 = no LoRA (train the weights themselves)."""
    alpha: float = 16.0
    """Scale: adapters add (alpha / rank) * up(down(x))."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    targets: list[str] = field(default_factory=lambda: ["*"])
    """fnmatch patterns of convolution module names, e.g. ['decoder.*'] or ['*.attn_1.*']."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "model.lora.rank", self.rank, "must be >= 0")
        _require(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "must be in [0, 1)")
        _require(_finite(self.alpha) and self.alpha > 0, "model.lora.alpha", self.alpha, "must be a positive number")
        _require(bool(self.targets), "model.lora.targets", self.targets, "give at least one pattern")


@dataclass
class LatentNoiseConfig(Schedule):
    """Gaussian noise on the latent the decoder reads while training (continuous models), so the decoder learns to
    tolerate latents close to, not equal to, its encoder's: what a world model hands it. ``weight`` is the noise's
    std in units of each latent channel's spread (``network.channel_scale``: Wan's normalisation constants, else the
    batch's per-channel std), on a schedule like a loss term's. 0 (default): off. ``evaluate`` reports the PSNR
    from noised latents beside the clean one, so the effect is measured."""


@dataclass
class ModelConfig:
    """What to train."""

    model: str = "Cosmos-1.0-Tokenizer-CV8x8x8"
    """Model name: any name of a family in tokenizer_posttrain.network (Cosmos: Cosmos-1.0-Tokenizer-CV8x8x8,
    -CV8x16x16, -CV4x8x8, -CV4x8x8-LowRes, -DV8x16x16, -DV8x8x8, -DV4x8x8, -DV4x8x8-LowRes; Wan: Wan2.1-VAE,
    Wan2.2-VAE); the Cosmos-0.1- prefix and the short names (CV8x8x8) work too."""
    jit_ckpt_pth: Optional[str] = None
    """Checkpoint folder (autoencoder.jit, or encoder.jit + decoder.jit) or file (.jit,
    .safetensors, .ckpt; Wan: Wan2.1_VAE.pth, Wan2.2_VAE.pth, a diffusers vae/ folder). None trains from random
    weights (with a warning)."""
    channels: Optional[int] = None
    """Base width override; 16 gives the tiny models used on CPUs and in tests."""
    trainable: str = "all"
    """all | decoder | encoder. 'decoder' keeps the latent space (and the tokens) unchanged, so
    diffusion or autoregressive models trained on the original tokenizer stay valid."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (model.lora.rank > 0 turns them on; only adapters then train)."""
    sample_posterior: bool = False
    """VAEs (the Wan families): decode a sample of the encoder's posterior while training (mean + std x noise,
    as a VAE is trained), instead of its mean (what inference decodes). Validation decodes the mean either way.
    Tokenizers without a posterior (Cosmos) refuse it at launch."""
    latent_noise: LatentNoiseConfig = field(default_factory=LatentNoiseConfig)
    """Noise on the latent the decoder reads while training, in units of each channel's spread
    (model.latent_noise.weight, or a schedule: .boundaries/.values); off by default; continuous models only."""
    ema_decay: Optional[float] = None
    """Keep an exponential moving average of the weights with this decay (e.g. 0.999); it is
    used for validation and export."""
    compile: bool = False
    """torch.compile the training forward (network and loss); the first step of each clip shape
    compiles (docs/benchmarks.md says how long). Checkpoint keys are unchanged."""
    compile_scope: str = "step"
    """With model.compile: 'step' compiles network and losses as one graph; 'blocks' compiles each
    ResNet block, resampler, attention, stem and head, and the losses, on their own, so DDP can
    all-reduce gradients while the backward pass still runs (docs/benchmarks.md compares them)."""
    compile_cache: str = "run"
    """Where the compiled step is kept for later launches of the run (a resume, a requeue on another node):
    'run' = <run folder>/compile_cache/, a folder path, or 'none' (off). Written by rank 0, loaded by every rank
    only when signed with your key (docs/multi-gpu.md, "The compile cache", says why and what invalidates it)."""
    cuda_graphs: bool = False
    """Replay the compiled step as CUDA graphs (torch.compile's reduce-overhead mode), so the host
    launches a step's thousands of kernels in one call; needs model.compile=true and
    model.compile_scope=step (else ignored, with a warning). Gradients then stay allocated and are
    zeroed in place each step (a CUDA graph overwrites its outputs at its next replay)."""
    channels_last: bool = False
    """Lay activations out channels-last (torch.channels_last_3d; NHWC for the VGG16), the layout
    of cuDNN's tensor-core convolutions. Same results; pays with model.compile (slower in eager)."""
    activation_checkpointing: bool = False
    """Keep only the input of each ResNet block, resampler, stem and head for the backward pass
    and recompute the rest: far less memory for long or large clips, same results."""
    time_chunk: int = 0
    """Latent frames per chunk of a clip's causal pass (Wan VAEs; 0 = the whole clip at once): each chunk runs
    with the previous one's causal state and is recomputed in the backward pass, so only one chunk's activations
    are held at a time. Same results; for clips too long or large to train whole (720p), with
    model.activation_checkpointing=true inside each chunk."""

    @property
    def replays_cuda_graphs(self) -> bool:
        """Whether the training step runs as CUDA graphs: ``cuda_graphs`` takes effect only on the
        step compiled whole (``train.resolve_compile`` warns when it is set but cannot)."""
        return self.cuda_graphs and self.compile and self.compile_scope == "step"

    def __post_init__(self) -> None:
        from ..network import resolve_name

        resolve_name(self.model)
        _require(self.trainable in _TRAINABLE, "model.trainable", self.trainable, f"use one of {', '.join(_TRAINABLE)}")
        _require(
            self.ema_decay is None or 0 < self.ema_decay < 1, "model.ema_decay", self.ema_decay, "must be in (0, 1)"
        )
        _require(
            self.channels is None or self.channels > 0, "model.channels", self.channels, "must be a positive integer"
        )
        for key in ("compile", "cuda_graphs", "channels_last", "activation_checkpointing"):
            value = getattr(self, key)
            _require(isinstance(value, bool), f"model.{key}", value, "use true or false")
        _require(self.compile_scope in _COMPILE_SCOPES, "model.compile_scope", self.compile_scope, "use step or blocks")
        _require(
            not (self.time_chunk and self.compile and self.compile_scope == "step"),
            "model.compile_scope",
            self.compile_scope,
            f"with model.time_chunk={self.time_chunk}, set model.compile_scope=blocks (a step compiled whole cannot "
            "carry the chunks' causal state, and would run uncompiled)",
        )
        noise_problems = self.latent_noise.problems("model.latent_noise")
        if noise_problems:
            raise ValueError("invalid model settings: " + "; ".join(noise_problems))
        _require(
            isinstance(self.time_chunk, int) and not isinstance(self.time_chunk, bool) and self.time_chunk >= 0,
            "model.time_chunk",
            self.time_chunk,
            "use 0 (the whole clip) or a number of latent frames per chunk",
        )
        _require(
            isinstance(self.compile_cache, str) and self.compile_cache.strip() != "",
            "model.compile_cache",
            self.compile_cache,
            "use run, none or a folder path",
        )


@dataclass
class DataConfig:
    """Where clips come from and how they are batched."""

    path: Optional[str] = None
    """Energon dataset folder of <key>.mp4 shards (python -m data_tools make-shards VIDEOS OUT makes
    one); None trains on synthetic moving patterns (no data needed)."""
    global_batch_size: int = 8
    """Clips per optimizer step over all GPUs; gradient accumulation makes up the rest."""
    micro_batch_size: int = 1
    """Clips per GPU per forward pass."""
    num_workers: int = 2
    """Data loader worker processes per GPU."""
    crops_per_decode: int = 1
    """Random crops cut from each decoded stretch of frames, each a clip of its own (same frames, own offset and
    flip): the decoding, most of the loader's work, is paid once for all of them. They land side by side in a
    micro-batch (data.micro_batch_size must be a multiple), so a batch holds fewer distinct stretches of video
    (docs/data.md, "Several crops per decode"). Real data only: synthetic clips are made one by one."""
    prefetch: Optional[int] = None
    """Batches each loader worker may prepare ahead (energon's prefetch_factor). The loader hands batches over
    in order, so while it waits for one worker's batch the others can only work this far ahead; each costs a
    micro-batch of shared memory (/dev/shm). None: 6 (data.batch.PREFETCH), or as many as fit in the shared
    memory free at launch (warned); a number that does not fit is refused. No effect with num_workers=0."""
    frames: int = CLIP_FRAMES
    """Frames per clip: 1 + k x the model's temporal compression (1 + 8k for the 8x models, 1 + 4k for the 4x
    ones and the Wan2.1 VAE)."""
    height: int = CLIP_SIZE
    """Crop height (the pixel budget's height with aspect_buckets)."""
    width: int = CLIP_SIZE
    """Crop width."""
    resize_short_side: Optional[int] = None
    """Resize frames (while decoding) so the short side has this length, before cropping."""
    hflip: bool = False
    """Flip half of the clips horizontally."""
    start: str = "uniform"
    """Where clips start: ``uniform`` (every frame alike) or ``keyframe`` (at a keyframe or up to
    data.keyframe_window frames after it: no decoding of frames a clip does not use, much faster on long-GOP
    footage, at the cost of clips that start at the same few places; docs/data.md, "Clip starts")."""
    keyframe_window: int = 4
    """With data.start=keyframe: the frames after a keyframe a clip may start at (0: only at keyframes)."""
    decode: str = "cpu"
    """Where the loader decodes video: ``cpu`` (FFmpeg's software decoders) or ``gpu`` (the GPU's video
    decoder, NVDEC, through FFmpeg; checked at launch; each worker then holds a CUDA context, and energon's
    forked workers may not get one: then data.num_workers=0 decodes in the training process)."""
    aspect_buckets: bool = False
    """Crop at the aspect bucket (1:1, 4:3, 3:4, 16:9, 9:16) nearest each video, at the pixel budget
    height x width; each batch holds one bucket."""
    shuffle_buffer_size: int = 100
    """Energon: samples mixed in the shuffle buffer."""
    max_samples_per_sequence: int = 100
    """Energon: samples read in a row from one shard before switching."""
    max_skip_fraction: float = 0.05
    """Stop (with the file names) when more than this fraction of videos are unusable."""
    preflight_samples: int = 16
    """Videos probed before launch to check they can give the clip shape (0 disables)."""
    num_train_samples: int = 10_000
    """Synthetic data only: clips per epoch."""
    synthetic_cache: bool = False
    """Synthetic data only: each loader worker keeps the clips it made and serves them again, so
    the clip generator's CPU time stays out of speed measurements (use few num_train_samples)."""
    seed: int = 1234
    """Synthetic data only: base seed of the clip generator."""

    def __post_init__(self) -> None:
        for key in ("global_batch_size", "micro_batch_size", "frames", "height", "width", "num_train_samples"):
            value = getattr(self, key)
            _require(value > 0, f"data.{key}", value, "must be positive")
        _require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0")
        crops = self.crops_per_decode
        _require(_integer_from(crops, 1), "data.crops_per_decode", crops, "must be a positive number of crops")
        _require(
            self.micro_batch_size % crops == 0,
            "data.crops_per_decode",
            crops,
            f"data.micro_batch_size={self.micro_batch_size} must be a multiple of it (the crops of one decode "
            "share a micro-batch)",
        )
        _require(
            self.prefetch is None or (_integer_from(self.prefetch, 1) and self.prefetch <= MAX_PREFETCH),
            "data.prefetch",
            self.prefetch,
            f"must be a number of batches from 1 to {MAX_PREFETCH}, or null (as many as fit, up to 6)",
        )
        _require(
            isinstance(self.synthetic_cache, bool), "data.synthetic_cache", self.synthetic_cache, "use true or false"
        )
        _require(
            0 <= self.max_skip_fraction <= 1, "data.max_skip_fraction", self.max_skip_fraction, "must be in [0, 1]"
        )
        _require(self.start in CLIP_STARTS, "data.start", self.start, f"use one of {', '.join(CLIP_STARTS)}")
        _require(self.decode in DECODERS, "data.decode", self.decode, f"use one of {', '.join(DECODERS)}")
        _require(
            _integer_from(self.keyframe_window, 0),
            "data.keyframe_window",
            self.keyframe_window,
            "must be an integer >= 0",
        )
        _require(
            self.resize_short_side is None or self.resize_short_side > 0,
            "data.resize_short_side",
            self.resize_short_side,
            "must be positive",
        )


@dataclass
class TrainerConfig:
    """Lightning Trainer settings (NeMo's defaults)."""

    devices: str = "auto"
    """GPUs (or CPU processes) per node: 'auto' or a number."""
    num_nodes: Optional[int] = None
    """Nodes; None reads SLURM_NNODES at launch (default 1)."""
    accelerator: str = "gpu"
    """'gpu' (falls back to 'cpu' with a warning when there is none) or 'cpu'."""
    strategy: str = "ddp"
    """Used with more than one process: 'ddp' (our tuned DistributedDataParallel) or any Lightning strategy name."""
    precision: str = "bf16-mixed"
    """bf16-mixed keeps fp32 master weights under bf16 autocast; also bf16-true or 32-true."""
    max_epochs: int = 10000
    """Epochs when trainer.max_steps is -1 (synthetic data: data.num_train_samples clips each)."""
    max_steps: int = -1
    """Optimizer steps; -1 runs max_epochs."""
    val_check_interval: int = 100
    """Validate every N optimizer steps."""
    limit_val_batches: int = 1
    """Validation batches per validation (0 turns validation off)."""
    log_every_n_steps: int = 1
    """Write the training scalars every N optimizer steps."""
    gradient_clip_val: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    checkpoint_every_n_steps: int = 100
    """Write a checkpoint every N optimizer steps."""
    checkpoint_keep: int = 3
    """Step checkpoints kept, newest first (last.ckpt is kept in addition)."""
    seed: int = 1234
    """Seed of weights initialisation, LoRA dropout, augmentation and the energon shuffle."""
    max_bad_steps: int = 10
    """Steps with a NaN/Inf loss or gradient are skipped; this many in a row stop the run."""

    def __post_init__(self) -> None:
        _require(self.max_bad_steps > 0, "trainer.max_bad_steps", self.max_bad_steps, "must be positive")
        _require(
            self.devices == "auto" or (self.devices.isdigit() and int(self.devices) > 0),
            "trainer.devices",
            self.devices,
            "use 'auto' or a positive number",
        )
        _require(
            self.accelerator in ("gpu", "cpu", "cuda", "auto"),
            "trainer.accelerator",
            self.accelerator,
            "use 'gpu' or 'cpu'",
        )
        _require(
            self.precision in _PRECISIONS, "trainer.precision", self.precision, f"use one of {', '.join(_PRECISIONS)}"
        )
        _require(
            self.max_steps == -1 or self.max_steps > 0, "trainer.max_steps", self.max_steps, "must be positive or -1"
        )
        for key in (
            "max_epochs",
            "val_check_interval",
            "log_every_n_steps",
            "checkpoint_every_n_steps",
            "checkpoint_keep",
        ):
            value = getattr(self, key)
            _require(value > 0, f"trainer.{key}", value, "must be positive")
        _require(self.limit_val_batches >= 0, "trainer.limit_val_batches", self.limit_val_batches, "must be >= 0")
        _require(
            _finite(self.gradient_clip_val) and self.gradient_clip_val >= 0,
            "trainer.gradient_clip_val",
            self.gradient_clip_val,
            "must be a finite number >= 0 (0 disables clipping)",
        )


@dataclass
class OptimConfig:
    """AdamW with the Cosmos post-training defaults."""

    lr: float = 1e-4
    """Peak learning rate of AdamW (fused on CUDA)."""
    adam_beta1: float = 0.5
    """AdamW's first-moment decay (0.5 in the Cosmos recipe)."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    lr_groups: Optional[dict[str, float]] = None
    """Learning rate per parameter-name prefix, e.g. {'decoder.': 1e-4, 'encoder.': 1e-5}; the
    longest matching prefix wins, other parameters use optim.lr."""
    schedule: str = "constant"
    """After warmup: constant | cosine | linear (decaying to min_lr_ratio x lr at trainer.max_steps)."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many optimizer steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear decay, as a fraction of each group's lr."""

    def __post_init__(self) -> None:
        _require(_finite(self.lr) and self.lr > 0, "optim.lr", self.lr, "must be a positive, finite number")
        _require(self.schedule in _SCHEDULES, "optim.schedule", self.schedule, f"use one of {', '.join(_SCHEDULES)}")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        for prefix, lr in (self.lr_groups or {}).items():
            _require(_finite(lr) and lr > 0, f"optim.lr_groups[{prefix!r}]", lr, "must be a positive, finite number")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            _require(0 <= value < 1, f"optim.{key}", value, "must be in [0, 1)")
        _require(
            _finite(self.weight_decay) and self.weight_decay >= 0,
            "optim.weight_decay",
            self.weight_decay,
            "must be a finite number >= 0",
        )
        _require(_finite(self.adam_eps) and self.adam_eps > 0, "optim.adam_eps", self.adam_eps, "must be positive")


@dataclass
class ResumeConfig:
    """AutoResume: continue from the run folder's last checkpoint."""

    resume_if_exists: bool = True
    """Resume from <run>/checkpoints/last.ckpt when it exists."""
    resume_past_end: bool = True
    """A relaunch of a run that already reached trainer.max_steps says so and ends at once, exit code 0, without
    training or exporting again; False makes that an error (exit 1)."""
    resume_from_path: Optional[str] = None
    """Resume from this Lightning checkpoint instead."""
    allow_changes: bool = False
    """Resume even when the checkpoint was written with other model, data or loss settings (by default
    such a launch stops and lists the differences)."""
    skip_pickled_states: bool = False
    """Resume a checkpoint of an earlier release whose random states and energon loader position are pickled,
    without them (they are never unpickled: that can run code planted in a file); random numbers and the data
    stream then start afresh, so the resume is not exact."""


@dataclass
class LogConfig:
    """Where a run writes checkpoints, logs and its export."""

    log_dir: str = "outputs"
    """Folder that holds the run folders."""
    name: str = "cosmos_tokenizer"
    """Run name: the run folder is <log_dir>/<name>."""
    export_on_end: bool = True
    """Export the model in its family's own format to <run>/export when training ends (Cosmos:
    encoder.jit/decoder.jit/autoencoder.jit; Wan: Wan2.1_VAE.pth or Wan2.2_VAE.pth), with model.safetensors and
    config.json."""
    latent_stats_clips: Optional[int] = None
    """Clips the end-of-run export of a continuous tokenizer measures mean_std.pt on (the latent statistics the
    Cosmos world models normalize with) when its encoder trained; drawn from data.path, or synthetic clips without
    it. None: 400 on a GPU, 16 on a CPU. 0: none written (the run summary gives the command that writes them)."""

    def __post_init__(self) -> None:
        # An absolute name replaces log_dir in <log_dir>/<name>, and '..' climbs out of it: the run (its
        # checkpoints, and the cleanup of partial saves) would land in a folder nobody asked for.
        parts = PurePath(self.name).parts if isinstance(self.name, str) else ()
        _require(
            bool(parts) and not PurePath(self.name).is_absolute() and ".." not in parts,
            "log.name",
            self.name,
            "the run folder is <log.log_dir>/<log.name>, so the name must stay inside log.log_dir: not empty, not "
            "absolute, no '..' (e.g. log.name=my_run, or a sub-folder such as log.name=team/my_run)",
        )
        clips = self.latent_stats_clips
        _require(
            clips is None or (isinstance(clips, int) and not isinstance(clips, bool) and clips >= 0),
            "log.latent_stats_clips",
            clips,
            "must be None (automatic), 0 (none) or a positive number of clips",
        )
