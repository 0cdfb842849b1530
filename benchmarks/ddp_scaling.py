"""Data-parallel scaling of the real training loop: clips/s on 1..N GPUs (not a test).

Runs :func:`tokenizer_posttrain.training.train.train`, the function ``train_tokenizer.py`` runs, with the
same Trainer, DDP strategy, LightningModule and checkpointing, under torchrun, on synthetic clips
made in loader workers (no dataset or video stack needed, so it runs on a bare GPU machine). Only
the NeMo-Run argument parsing is skipped. Rank 0 prints the median of the run's own
``train/clips_per_sec`` (global clips over the wall time of the last 10 batches) after a warm-up.

    torchrun --nproc-per-node 1 benchmarks/ddp_scaling.py --model CV8x8x8 --micro-batch 8 --steps 60
    torchrun --nproc-per-node 2 benchmarks/ddp_scaling.py --model CV8x8x8 --micro-batch 8 --steps 60

``--perceptual`` turns the VGG16 loss on. Every term that reads a weights file (perceptual, gram: VGG16; flow:
RAFT) reads one with random weights written here (timing only: the real files are the user's), so that e.g.
``loss.gram.weight=0.062`` or ``loss.flow.weight=0.01`` needs nothing else. Extra ``group.key=value``
arguments set any config field, as on the command line (e.g. ``model.compile=true model.cuda_graphs=true``).
``--accumulate N`` runs N micro-batches per optimizer step (the recipes run one clip per GPU, 8 per step on one
GPU). The printed ``cuda_graph_skips`` counts compiled graphs Inductor ran without CUDA graphs (0 when all ran).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import fields, is_dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizer_posttrain.training import config as cfg  # noqa: E402
from tokenizer_posttrain.training.acceleration import cuda_graph_skips  # noqa: E402
from tokenizer_posttrain.training.acceleration import ddp_kwargs as training_ddp_kwargs  # noqa: E402
from tokenizer_posttrain.training.train import train  # noqa: E402


def _set(obj: object, dotted: str, text: str) -> None:
    """``key.sub=value`` on nested config dataclasses; the value parsed as JSON when it parses."""
    *path, last = dotted.split(".")
    for part in path:
        obj = getattr(obj, part)
    if not is_dataclass(obj) or last not in {f.name for f in fields(obj)}:
        raise SystemExit(f"unknown config key {dotted}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    setattr(obj, last, value)


def random_vgg_file(directory: Path) -> str:
    """A VGG16 feature-extractor state dict with random weights, in the key layout the loss reads."""
    from tokenizer_posttrain.losses.perceptual import VGG16Features

    path = directory / "vgg16_random.pth"
    if not path.exists():
        torch.save(VGG16Features().state_dict(), path)
    return str(path)


def random_raft_file(directory: Path, raft: str) -> str:
    """A torchvision RAFT state dict with random weights."""
    from tokenizer_posttrain.losses.flow import build_raft

    path = directory / f"raft_{raft}_random.pth"
    if not path.exists():
        torch.save(build_raft(raft).state_dict(), path)
    return str(path)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostUsage(pl.Callback):
    """The host's side of the timed steps: CPU time of this process and its children (loader workers, also idle
    compile workers) over the wall time from step ``start`` to the end, as cores kept busy, and the children's
    summed resident memory then and at the end (a loader whose memory grows shows here). Needs psutil."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.began: tuple[float, float, float] | None = None
        self.report: dict[str, float] = {}

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        import psutil

        me = psutil.Process()
        tree = [me, *me.children(recursive=True)]
        cpu = 0.0
        rss = 0.0
        for proc in tree:
            try:
                times = proc.cpu_times()
                cpu += times.user + times.system
                if proc is not me:
                    rss += proc.memory_info().rss
            except psutil.Error:  # a worker that ended meanwhile
                pass
        return time.perf_counter(), cpu, rss / 2**20

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.began is None and trainer.global_step >= self.start:
            self.began = self._sample()

    def on_train_end(self, trainer: pl.Trainer, *args: object) -> None:
        if self.began is None:
            return
        wall, cpu, rss = self._sample()
        self.report = {
            "host_cores_busy": round((cpu - self.began[1]) / max(wall - self.began[0], 1e-9), 2),
            "children_rss_mib_start": round(self.began[2]),
            "children_rss_mib_end": round(rss),
        }


class StepProfiler(pl.Callback):
    """Profiles optimizer steps ``[start, start + count)`` of this rank with torch.profiler and writes
    where the wall time went: GPU busy time (the union of kernel and copy intervals), NCCL kernel time,
    the longest GPU idle gaps, and the costliest device and host operations."""

    def __init__(self, start: int, count: int, out: Path, name: str, rank: int, trace: bool) -> None:
        self.start, self.count, self.out, self.name, self.rank, self.trace = start, count, out, name, rank, trace
        self.prof: torch.profiler.profile | None = None
        self.done = False
        self.t0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.start and self.prof is None:
            _sync()
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if self.prof is None or self.done or trainer.global_step != self.start + self.count:
            return
        self.done = True  # several micro-batches end at the same optimizer step
        _sync()
        wall_ms = (time.perf_counter() - self.t0) * 1e3
        self.prof.stop()
        self.report(wall_ms)

    def report(self, wall_ms: float) -> None:
        assert self.prof is not None
        spans, nccl_us = [], 0.0
        for event in self.prof.events():
            # Kernels and copies only: annotations (DDP's forward, the optimizer step) span whole phases.
            if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
                spans.append((event.time_range.start, event.time_range.end))
                if "nccl" in event.name.lower():
                    nccl_us += event.time_range.elapsed_us()
        spans.sort()
        busy_us, gaps, end = 0.0, [], None
        for lo, hi in spans:
            if end is None or lo > end:
                if end is not None:
                    gaps.append((lo - end, end - spans[0][0]))
                busy_us += hi - lo
                end = hi
            elif hi > end:
                busy_us += hi - end
                end = hi
        gaps.sort(reverse=True)
        summary = {
            "run": self.name,
            "rank": self.rank,
            "steps": self.count,
            "wall_ms_per_step": round(wall_ms / self.count, 2),
            "gpu_busy_ms_per_step": round(busy_us / 1e3 / self.count, 2),
            "gpu_first_to_last_ms": round(((end or 0) - (spans[0][0] if spans else 0)) / 1e3, 1),
            "nccl_kernel_ms_per_step": round(nccl_us / 1e3 / self.count, 2),
            "longest_gpu_gaps_ms_at_ms": [(round(g / 1e3, 2), round(at / 1e3, 1)) for g, at in gaps[:12]],
        }
        averages = self.prof.key_averages()
        text = json.dumps(summary) + "\n\n" + averages.table(sort_by="device_time_total", row_limit=30)
        text += "\n\n" + averages.table(sort_by="cpu_time_total", row_limit=30)
        # Plain characters only: the device tool brings back no file named with '=' or ','.
        stem = self.out / re.sub(r"[^A-Za-z0-9._-]", "-", f"profile_{self.name}_rank{self.rank}")
        Path(f"{stem}.txt").write_text(text)
        print(json.dumps(summary), flush=True)
        if self.trace:
            raw = Path(f"{stem}.json")
            self.prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="CV8x8x8")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=256, help="clip height (and width, unless --width)")
    parser.add_argument("--width", type=int, default=None, help="clip width (default: --size)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the median")
    parser.add_argument(
        "--workers",
        type=int,
        default=12,
        help="loader workers per GPU (a synthetic 33x256x256 clip takes ~90 ms of a core)",
    )
    parser.add_argument(
        "--cached-clips",
        type=int,
        default=0,
        help="train on this many synthetic clips, each made once per worker and then served from memory "
        "(takes the clip generator's CPU time out of the measurement; 0: a fresh clip every time)",
    )
    parser.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (the recipes' default is 8)"
    )
    parser.add_argument("--perceptual", action="store_true")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many steps before the last (left out of the median)"
    )
    parser.add_argument("--trace", action="store_true", help="with --profile-steps: write rank 0's chrome trace")
    parser.add_argument("--profile-out", default=os.environ.get("OUT", tempfile.gettempdir()), help="profile folder")
    parser.add_argument(
        "--ddp",
        default=None,
        help="JSON keyword arguments of DistributedDataParallel over the ones training uses (train.ddp_kwargs), "
        "e.g. '{\"bucket_cap_mb\": 25}'",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("overrides", nargs="*", help="group.key=value config overrides")
    args = parser.parse_intermixed_args()  # overrides may come before and after options
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tag = ""  # e.g. _compile=true: the key's last part and the value
    for item in args.overrides:
        key, _, value = item.partition("=")
        tag += f"_{key.rpartition('.')[2]}={value.replace('/', '-')}"
    ddp_kwargs = json.loads(args.ddp) if args.ddp else {}
    for key, value in ddp_kwargs.items():
        tag += f"_{key}={value}"
    cached = f"_cached{args.cached_clips}" if args.cached_clips else ""
    accumulate = f"x{args.accumulate}" if args.accumulate > 1 else ""
    name = (
        f"ddp_{args.model}_{world}gpu_b{args.micro_batch}{accumulate}{'_perc' if args.perceptual else ''}{cached}{tag}"
    )
    configs = {
        "model": cfg.ModelConfig(model=args.model),
        "data": cfg.DataConfig(
            frames=args.frames,
            height=args.size,
            width=args.width or args.size,
            micro_batch_size=args.micro_batch,
            global_batch_size=args.micro_batch * world * args.accumulate,
            num_workers=args.workers,
            **({"num_train_samples": args.cached_clips, "synthetic_cache": True} if args.cached_clips else {}),
        ),
        "trainer": cfg.TrainerConfig(
            max_steps=args.steps,
            val_check_interval=10**6,
            limit_val_batches=0,
            checkpoint_every_n_steps=10**6,
        ),
        "optim": cfg.OptimConfig(),
        "resume": cfg.ResumeConfig(resume_if_exists=False),
        "log": cfg.LogConfig(log_dir=str(Path(args.out) / "ddp_runs"), name=name, export_on_end=False),
        "loss": cfg.LossConfig(perceptual_weight=0.1 if args.perceptual else 0.0),
    }
    for item in args.overrides:
        key, _, value = item.partition("=")
        group, _, rest = key.partition(".")
        _set(configs[group], rest, value)
    loss = configs["loss"]
    if loss.perceptual.weights_path is None:
        loss.perceptual.weights_path = random_vgg_file(Path(tempfile.gettempdir()))
    if loss.flow.weights_path is None:
        loss.flow.weights_path = random_raft_file(Path(tempfile.gettempdir()), loss.flow.raft)
    if ddp_kwargs and world > 1:  # on top of the settings training uses
        merged = {**training_ddp_kwargs(configs["model"]), **ddp_kwargs}
        configs["trainer"].strategy = DDPStrategy(**merged)  # type: ignore[assignment]
    rank = int(os.environ.get("RANK", "0"))
    profile_start = args.steps - args.profile_steps - 2 if args.profile_steps else args.steps
    callbacks: list[pl.Callback] = []
    try:
        import psutil  # noqa: F401 - only to know whether HostUsage can run

        usage: HostUsage | None = HostUsage(args.warmup)
        callbacks.append(usage)
    except ImportError:
        usage = None
    if args.profile_steps:
        trace = args.trace and rank == 0
        callbacks.append(StepProfiler(profile_start, args.profile_steps, Path(args.profile_out), name, rank, trace))
    run_dir = train(**configs, extra_callbacks=callbacks)
    if rank != 0:
        return
    # This run's log only: an earlier run of the same name left version_0, version_1, ...
    versions = sorted((run_dir / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    with open(versions[-1]) as f:
        rows = list(csv.DictReader(f))
    rates = [(int(r["step"]), float(r["train/clips_per_sec"])) for r in rows if r.get("train/clips_per_sec")]
    waits = [(int(r["step"]), float(r["train/data_wait"])) for r in rows if r.get("train/data_wait")]
    # A rate is over the last 10 batches: none of them profiled.
    timed = [rate for step, rate in rates if args.warmup <= step < profile_start]
    timed_waits = [wait for step, wait in waits if args.warmup <= step < profile_start]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(
        json.dumps(
            {
                "run": name,
                "gpus": world,
                "micro_batch": args.micro_batch,
                "clips_per_s": round(statistics.median(timed), 2) if timed else None,
                "clips_per_s_per_gpu": round(statistics.median(timed) / world, 2) if timed else None,
                "timed_steps": len(timed),
                "data_wait_ms": round(1000 * statistics.median(timed_waits), 1) if timed_waits else None,
                **(usage.report if usage is not None else {}),
                "peak_mem_gib_rank0": round(peak, 1),
                "cuda_graph_skips": cuda_graph_skips(),
                "overrides": args.overrides,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
