"""Training-step speed, model FLOP utilisation and peak memory of the tokenizers on one GPU.

One step is the trainer's own ``TokenizerModel`` step, driven through the hooks Lightning calls with
``trainer.precision=bf16-mixed`` (see :class:`Stepper`): fp32 master weights, bf16 autocast, L1 (+ 0.1 x VGG16
perceptual), the NaN/Inf verdict read a step late, the gradient norm, clipping to 1.0 and a fused AdamW step.
Paths are ``eager`` (the plain network) or ``+``-joined levers, each a ``model.*`` setting of the trainer:
``compile`` (``model.compile``), ``cl`` (``model.channels_last``), ``ckpt`` (``model.activation_checkpointing``),
``cg`` (with ``compile``: ``model.cuda_graphs``), ``chunkN`` (``loss.perceptual.frame_chunk=N``), ``tchunkN``
(``model.time_chunk=N``: the Wan VAEs' causal pass in chunks of N latent frames), and ``bench`` (cudnn.benchmark,
not a trainer setting).

* clips/s: median over timed steps (each ends synchronised, as the trainer's per-step checks do).
* MFU: FLOPs of the tokenizer's forward and backward (torch.utils.flop_counter on the meta device;
  no recomputation, no VGG) per second, over a bf16 8192^3 matrix-product rate measured in the same run.
* peak memory: torch.cuda.max_memory_allocated over the warm-up and timed steps.
* ``--check``: the first case of each (model, loss, path) that is not eager also runs eager on the same
  weights and clip, and reports the relative difference of the loss and of all gradients (and, for scale,
  that of eager bf16 against eager fp32).
* ``--bench-off``: paths with ``bench`` are timed again with ``cudnn.benchmark`` off (no recompilation).

The VGG16 has random (He-initialised) weights, written to a temporary file the loss reads like the ImageNet
file: the real file is not needed for timing. Example (one H200)::

    PYTHONPATH=. python3 benchmarks/train_step.py --models CV8x8x8 --batches 8 --paths eager compile+cl+bench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
from tokenizer_posttrain.losses import LossConfig
from tokenizer_posttrain.losses.perceptual import PerceptualConfig, VGG16Features
from tokenizer_posttrain.network import VideoTokenizer, build_tokenizer
from tokenizer_posttrain.training import acceleration
from tokenizer_posttrain.training.config import ModelConfig, OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel

PERCEPTUAL_WEIGHT = 0.1
LEVERS = ("compile", "cl", "bench", "ckpt", "cg")


@dataclass(frozen=True)
class Levers:
    """The levers of a path, parsed from a spec such as ``compile+cl+bench+chunk4``."""

    name: str
    compile: bool = False
    channels_last: bool = False
    cudnn_benchmark: bool = False
    checkpointing: bool = False
    frame_chunk: int | None = None
    cuda_graphs: bool = False
    time_chunk: int = 0


def parse_levers(spec: str) -> Levers:
    """``eager`` or ``+``-joined levers (``compile``, ``cl``, ``bench``, ``ckpt``, ``chunkN``, ``tchunkN``)."""
    tokens = [] if spec == "eager" else spec.split("+")
    chunk, time_chunk = None, 0
    for token in tokens:
        if token.startswith("chunk") and token[5:].isdigit():
            chunk = int(token[5:])
        elif token.startswith("tchunk") and token[6:].isdigit():
            time_chunk = int(token[6:])
        elif token not in LEVERS:
            raise SystemExit(
                f"unknown lever {token!r} in path {spec!r}; use eager or {'+'.join(LEVERS)}+chunkN+tchunkN"
            )
    if "cg" in tokens and "compile" not in tokens:
        raise SystemExit(f"path {spec!r}: cg (CUDA graphs) needs compile")
    flags = [lever in tokens for lever in ("compile", "cl", "bench", "ckpt")]
    return Levers(spec, *flags, frame_chunk=chunk, cuda_graphs="cg" in tokens, time_chunk=time_chunk)


@dataclass
class Result:
    model: str
    shape: str
    batch: int
    loss: str
    path: str
    clips_per_s: float | None = None
    step_ms: float | None = None
    tflop_per_clip: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    warmup_s: float | None = None
    check: dict = field(default_factory=dict)
    note: str = ""


def parse_shape(text: str) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in text.lower().split("x"))
    return t, h, w


def network_tflop_per_clip(name: str, shape: tuple[int, int, int], channels: int | None) -> float:
    """FLOPs of one clip's forward and backward through the tokenizer, counted on the meta device."""
    with torch.device("meta"):
        net = build_tokenizer(name, **({"channels": channels} if channels else {}))
        video = torch.randn(1, 3, *shape)
    with FlopCounterMode(display=False) as counter:
        net(video).float().abs().mean().backward()
    return counter.get_total_flops() / 1e12


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Median bf16 rate of an ``n``^3 matrix product on random data (the MFU denominator)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def random_vgg_file(directory: Path) -> Path:
    """A VGG16 weights file (torchvision's key layout) with He-normal weights: activations of all five taps
    stay O(1), and the loss reads it the way it reads the ImageNet file."""
    vgg = VGG16Features()
    generator = torch.Generator().manual_seed(0)
    for module in vgg.modules():
        if isinstance(module, nn.Conv2d):
            fan_in = module.in_channels * 9
            module.weight.data = torch.randn(module.weight.shape, generator=generator) * math.sqrt(2 / fan_in)
            module.bias.data.zero_()
    path = directory / "vgg16_random.pth"
    torch.save(vgg.state_dict(), path)
    return path


class Stepper:
    """One path's training step: the trainer's own ``TokenizerModel``, driven through the hooks Lightning calls
    in one optimizer step (zero_grad, training_step under bf16 autocast, backward, on_before_optimizer_step with
    its NaN/Inf verdict, gradient norm and clipping to 1.0, fused AdamW), so this times the code the trainer runs.
    """

    def __init__(
        self,
        model: str,
        channels: int | None,
        path: Levers,
        vgg_file: Path | None,
        device: torch.device,
        backend: str = "inductor",
    ) -> None:
        self.path, self.device = path, device
        torch.backends.cudnn.benchmark = path.cudnn_benchmark
        if path.compile:
            torch._dynamo.reset()  # a fresh cache per case: no recompile limit, no stale guards
        model_config = ModelConfig(
            model=model,
            channels=channels,
            compile=path.compile,
            cuda_graphs=path.cuda_graphs,
            channels_last=path.channels_last,
            activation_checkpointing=path.checkpointing,
            time_chunk=path.time_chunk,
        )
        perceptual = PerceptualConfig(
            weight=PERCEPTUAL_WEIGHT if vgg_file else 0.0,
            weights_path=str(vgg_file) if vgg_file else None,
            frame_chunk=path.frame_chunk,
        )
        optim = OptimConfig(lr=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # random weights (load_state_dict follows), self.log without a trainer
            acceleration.COMPILE_BACKEND = acceleration.SEGMENT_BACKEND = backend
            loss = LossConfig(perceptual=perceptual)
            self.module = TokenizerModel(model_config, optim, loss, gradient_clip_val=1.0)
        self.module.to(device)
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def network(self) -> VideoTokenizer:
        return self.module.network

    def forward_backward(self, video_bf16: Tensor, mask: Tensor, autocast: bool = True) -> Tensor:
        """``training_step`` (under bf16 autocast, as Lightning's bf16-mixed) and its backward."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = self.module.training_step({VIDEO: video_bf16, LOSS_MASK: mask}, 0)
        self.module.on_before_backward(loss)
        loss.backward()
        return loss.detach()

    def step(self, video: Tensor, mask: Tensor) -> None:
        if self.optimizer is None:
            self.optimizer = self.module.configure_optimizers()["optimizer"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log of the progress-bar loss without a trainer
            self.module.optimizer_zero_grad(0, 0, self.optimizer)
            self.forward_backward(video, mask)
            self.module.on_before_optimizer_step(self.optimizer)
            self.optimizer.step()

    def close(self) -> None:
        self.module.guard.settle(self.module, keep_last=0, to_bar=False)
        self.module.acceleration.release(self.network)
        self.optimizer = None
        self.network.zero_grad(set_to_none=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gradients(network: nn.Module) -> Tensor:
    return torch.cat([p.grad.float().flatten() for p in network.parameters() if p.grad is not None])


def relative(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_against_eager(
    stepper: Stepper, weights: dict[str, Tensor], vgg_file: Path | None, video: Tensor, mask: Tensor
) -> dict[str, float]:
    """Loss and gradients of ``stepper``'s path against the eager path (bf16 and fp32) on the same weights."""
    results = {}
    eager = Stepper(
        stepper.network.config.name, stepper.network.config.channels, Levers("eager"), vgg_file, stepper.device
    )
    for name, autocast in (("eager_fp32", False), ("eager_bf16", True)):
        eager.network.load_state_dict(weights)
        eager.network.zero_grad(set_to_none=True)
        results[name] = (eager.forward_backward(video, mask, autocast=autocast), gradients(eager.network))
    eager.close()
    del eager
    stepper.network.load_state_dict(weights)
    stepper.network.zero_grad(set_to_none=True)
    loss, grads = stepper.forward_backward(video, mask), gradients(stepper.network)
    stepper.network.zero_grad(set_to_none=True)
    ref_loss, ref_grads = results["eager_bf16"]
    fp32_loss, fp32_grads = results["eager_fp32"]
    return {
        "loss_rel": relative(loss, ref_loss),
        "grad_rel": relative(grads, ref_grads),
        "bf16_vs_fp32_loss_rel": relative(ref_loss, fp32_loss),
        "bf16_vs_fp32_grad_rel": relative(ref_grads, fp32_grads),
    }


def run_case(
    result: Result,
    weights: dict[str, Tensor],
    path: Levers,
    vgg_file: Path | None,
    shape: tuple[int, int, int],
    args: argparse.Namespace,
    check: bool,
) -> None:
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    video = (torch.rand(result.batch, 3, *shape, generator=generator) * 2 - 1).to(device, torch.bfloat16)
    mask = torch.ones(result.batch, 1, *shape, device=device, dtype=torch.bfloat16)
    stepper = Stepper(result.model, args.channels, path, vgg_file, device, args.backend)
    stepper.network.load_state_dict(weights)
    try:
        if check:
            result.check = check_against_eager(stepper, weights, vgg_file, video, mask)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(args.warmup):  # compilation, cuDNN autotuning, optimizer state allocation
            stepper.step(video, mask)
        synchronize(device)
        result.warmup_s = time.perf_counter() - start
        step_s = median_step_time(stepper, video, mask, args.steps)
        result.step_ms = step_s * 1e3
        result.clips_per_s = result.batch / step_s
        if device.type == "cuda":
            result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        if path.cudnn_benchmark and args.bench_off:
            # The same compiled code with cuDNN's heuristic algorithm choice: the lever without a recompile.
            torch.backends.cudnn.benchmark = False
            stepper.step(video, mask)
            clips = result.batch / median_step_time(stepper, video, mask, args.steps)
            result.note = f"cudnn.benchmark off: {clips:.1f} clips/s"
        if args.profile:
            print_profile(stepper, video, mask, device, f"{result.model} {result.loss} b{result.batch} {path.name}")
    except torch.cuda.OutOfMemoryError:
        result.note = "OOM"
    finally:
        stepper.close()
        del stepper
        if device.type == "cuda":
            torch.cuda.empty_cache()


def median_step_time(stepper: Stepper, video: Tensor, mask: Tensor, steps: int) -> float:
    """Median seconds of ``steps`` training steps, each timed to its end on the device."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        stepper.step(video, mask)
        synchronize(stepper.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_profile(stepper: Stepper, video: Tensor, mask: Tensor, device: torch.device, title: str) -> None:
    """The kernels of one more step that take the most device time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        stepper.step(video, mask)
        synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile of one step, {title}:")
    print(profiler.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90), flush=True)


def format_table(results: list[Result], peak: float | None) -> str:
    head = "| model | clip | batch | loss | path | clips/s | step ms | TFLOP/clip | MFU % | peak GiB | check |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in results:
        check = ""
        if r.check:
            check = f"{r.check['loss_rel']:.1e} / {r.check['grad_rel']:.1e}"
            check += f" (bf16 vs fp32: {r.check['bf16_vs_fp32_loss_rel']:.1e} / {r.check['bf16_vs_fp32_grad_rel']:.1e})"
        check = "; ".join(part for part in (check, r.note) if part)
        mfu = None if r.mfu is None else 100 * r.mfu
        lines.append(
            f"| {r.model} | {r.shape} | {r.batch} | {r.loss} | {r.path} | {num(r.clips_per_s, '.1f')} | "
            f"{num(r.step_ms, '.0f')} | {num(r.tflop_per_clip, '.3g')} | {num(mfu, '.1f')} | "
            f"{num(r.peak_gib, '.1f')} | {check} |"
        )
    if peak is not None:
        lines.append(f"\nbf16 matmul peak (8192^3, random data, median of 20): {peak:.0f} TFLOP/s")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["CV8x8x8", "DV8x16x16"])
    parser.add_argument("--shapes", nargs="+", default=["33x256x256"], help="TxHxW clip sizes")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--losses", nargs="+", default=["l1", "l1+vgg"], choices=["l1", "l1+vgg"])
    parser.add_argument("--paths", nargs="+", default=["eager", "compile+cl+bench"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case (compile happens here)")
    parser.add_argument("--check", action="store_true", help="compare each non-eager path with eager once")
    parser.add_argument("--budget", type=float, default=540, help="seconds; later cases are skipped after it")
    parser.add_argument("--channels", type=int, default=None, help="base width (16: tiny, for a CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bench-off", action="store_true", help="also time paths with bench without cudnn.benchmark")
    parser.add_argument("--profile", action="store_true", help="print the costliest kernels of one step per case")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: quick CPU smoke)")
    parser.add_argument("--json", default=None, help="results file (default $OUT/train_step.json when OUT is set)")
    return parser.parse_args()


def cases(args: argparse.Namespace) -> list[tuple[str, str, str, int, str]]:
    """(model, shape, loss, batch, path) in the order given: later ones are the first to fall to the budget."""
    return [
        (model, shape, loss, batch, path)
        for model in args.models
        for shape in args.shapes
        for loss in args.losses
        for batch in args.batches
        for path in args.paths
    ]


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    if peak is not None:
        print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    results: list[Result] = []
    weights_of: dict[str, dict[str, Tensor]] = {}
    vgg_file = None
    scratch = tempfile.TemporaryDirectory()
    flops: dict[tuple[str, str], float] = {}
    checked: set[tuple[str, str, str]] = set()
    for model, shape_text, loss, batch, path_spec in cases(args):
        result = Result(model, shape_text, batch, loss, path_spec)
        results.append(result)
        if time.perf_counter() - started > args.budget:
            result.note = "skipped (time budget)"
            continue
        path, shape = parse_levers(path_spec), parse_shape(shape_text)
        if model not in weights_of:  # the same random weights for every path of a model
            torch.manual_seed(0)
            net = build_tokenizer(model, **({"channels": args.channels} if args.channels else {}))
            weights_of[model] = {k: v.clone() for k, v in net.state_dict().items()}
        if loss == "l1+vgg" and vgg_file is None:
            vgg_file = random_vgg_file(Path(scratch.name))
        if (model, shape_text) not in flops:
            flops[model, shape_text] = network_tflop_per_clip(model, shape, args.channels)
        check = args.check and path_spec != "eager" and (model, loss, path_spec) not in checked
        if check:
            checked.add((model, loss, path_spec))
        run_case(result, weights_of[model], path, vgg_file if loss == "l1+vgg" else None, shape, args, check)
        result.tflop_per_clip = flops[model, shape_text]
        if result.clips_per_s is not None and peak is not None:
            result.mfu = result.clips_per_s * result.tflop_per_clip / peak
        elapsed = time.perf_counter() - started
        progress = f"[warm-up {result.warmup_s or 0:.0f} s, {elapsed:.0f} s]"
        print(format_table([result], None).splitlines()[-1], progress, flush=True)
    table = format_table(results, peak)
    out = args.json or (os.path.join(os.environ["OUT"], "train_step.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"peak_tflops": peak, "results": [asdict(r) for r in results]}, indent=1))
    print("\n" + table)


if __name__ == "__main__":
    main()
