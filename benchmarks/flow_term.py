"""The optical-flow loss term alone, forward and backward, against NeMo's way of running it (not a test).

Times one call of the term (target flows without gradient, reconstruction flows with it, the L1, and the backward
pass into the reconstruction) on ``[B, 3, T, H, W]`` bf16 videos on one GPU, for:

* ``nemo``: NeMo's tokenizer trainer's way, rebuilt here for timing: torchvision's ``RAFT.forward`` called once per
  clip in a Python loop, on bf16 weights, forward flows on the pairs of the clip, backward flows on the clip
  played backwards, trilinear rescaling; not compiled. (NeMo patches torchvision to make its coordinate grids in
  bf16; here autocast takes care of the mixed dtypes instead.)
* ``ours``: :class:`tokenizer_posttrain.losses.flow.FlowTerm` eager (all clips' frame pairs in one RAFT call, each
  frame encoded once, the last estimate upsampled only).
* ``ours+compile``: the same under ``torch.compile`` (as ``model.compile`` compiles it with the step).

A path name ending in ``+bench`` runs its path with ``torch.backends.cudnn.benchmark`` on:
cuDNN times its algorithms for each convolution shape during the warm-up calls and keeps the fastest.

RAFT has random weights (timing only); every path uses the same ones and the same reconstructions (seeded noise
per call), and prints its last call's loss value: they agree to bf16 noise. Reports the median of ``--steps``
calls after ``--warmup``, and peak memory::

    PYTHONPATH=. python3 benchmarks/flow_term.py --batch 8 --frames 33 --size 256
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tokenizer_posttrain.losses import StepContext
from tokenizer_posttrain.losses.flow import FlowConfig, FlowTerm, RAFTFlow, build_raft


class NemoStyleFlow(nn.Module):
    """NeMo's flow term as it runs there: a loop over clips, torchvision's RAFT forward per clip and direction."""

    def __init__(self, raft: nn.Module, scale: int = 2) -> None:
        super().__init__()
        self.raft = raft
        self.scale = scale

    def _forward_flows(self, video: Tensor) -> Tensor:
        flows = []
        for clip in video:  # [3, T, h, w]
            frames = clip.transpose(0, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                flows.append(self.raft(frames[:-1], frames[1:])[-1].float().transpose(0, 1))
        return torch.stack(flows)  # [B, 2, T-1, h, w]

    def bidirectional(self, video: Tensor) -> Tensor:
        t, h, w = video.shape[-3:]
        small = F.interpolate(video, (t, h // self.scale, w // self.scale), mode="trilinear")
        forward = self._forward_flows(small)
        backward = self._forward_flows(small.flip([2])).flip([2])
        both = torch.cat([forward, backward], dim=2)
        return self.scale * F.interpolate(both, (2 * (t - 1), h, w), mode="trilinear")

    def forward(self, reconstruction: Tensor, target: Tensor, mask: Tensor) -> Tensor:
        return (self.bidirectional(target) - self.bidirectional(reconstruction)).abs().mean()


def time_path(name: str, fn, video: Tensor, steps: int, warmup: int) -> dict:  # noqa: ANN001
    mask = torch.ones_like(video[:, :1])
    torch.cuda.reset_peak_memory_stats()
    times, value = [], None
    for step in range(warmup + steps):
        # The same reconstructions for every path: the last call's loss values are comparable.
        noise = torch.randn(video.shape, device=video.device, generator=torch.Generator("cuda").manual_seed(step))
        reconstruction = (video + 0.02 * noise.to(video.dtype)).requires_grad_(True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = fn(reconstruction, video, mask)
        loss.backward()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        value = float(loss.detach())
    ms = statistics.median(times) * 1e3
    b = video.shape[0]
    return {
        "path": name,
        "ms_per_call": round(ms, 1),
        "clips_per_s": round(b / (ms / 1e3), 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "loss": round(value, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--raft", default="large", choices=["large", "small"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--paths", nargs="+", default=["nemo", "ours", "ours+compile"])
    parser.add_argument("--profile", action="store_true", help="after timing, profile 2 calls of each path")
    args = parser.parse_args()
    torch.manual_seed(0)
    raft = build_raft(args.raft).cuda()
    video = torch.rand(args.batch, 3, args.frames, args.size, args.size, device="cuda") * 2 - 1
    # Smooth moving content, so RAFT's iterations see structure (random weights or not, the cost is the same).
    video = F.avg_pool3d(video, (1, 9, 9), stride=1, padding=(0, 4, 4)).clamp(-1, 1).to(torch.bfloat16)
    config = FlowConfig(0.01, raft=args.raft)
    # NeMo's path gets its own copy: RAFTFlow converts the RAFT it is given in place (bf16, NHWC).
    nemo_raft = copy.deepcopy(raft).to(torch.bfloat16)
    term = FlowTerm(config, RAFTFlow(raft, torch.bfloat16, config.flow_updates))
    term.prepare(torch.device("cuda"))
    compiled = torch.compile(term, dynamic=False)
    paths = {
        "nemo": NemoStyleFlow(nemo_raft, config.scale),
        "ours": lambda reconstruction, target, mask: term(StepContext(reconstruction, target, mask)),
        "ours+compile": lambda reconstruction, target, mask: compiled(StepContext(reconstruction, target, mask)),
    }
    for name in args.paths:
        base = name.removesuffix("+bench")
        if base not in paths:
            parser.error(f"unknown path {name!r}: use one of {sorted(paths)}, each optionally with +bench")
        torch.backends.cudnn.benchmark = name.endswith("+bench")
        print(json.dumps(time_path(name, paths[base], video, args.steps, args.warmup)), flush=True)
        if args.profile:
            profile(name, paths[base], video)


def profile(name: str, fn, video: Tensor) -> None:  # noqa: ANN001
    """The costliest GPU operations of two calls of ``fn`` (forward and backward)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    mask = torch.ones_like(video[:, :1])
    # CPU activity too: each aten operation's row names the kernels' caller and (record_shapes) its inputs.
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(2):
            reconstruction = (video + 0.02 * torch.randn_like(video)).requires_grad_(True)
            fn(reconstruction, video, mask).backward()
        torch.cuda.synchronize()
    print(f"== {name}: top GPU operations over 2 calls")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=160))
    print(f"== {name}: aten operations over 2 calls, by input shapes")
    averages = prof.key_averages(group_by_input_shape=True)
    table = averages.table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=160
    )
    print(table, flush=True)
    print(f"== {name}: aten copies by caller (the chain of enclosing operations, with their input shapes)")
    callers: dict[str, list[float]] = {}
    for event in prof.events():
        if event.name != "aten::copy_":
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None and len(chain) < 4:
            chain.append(f"{parent.name}{list(parent.input_shapes)[:2]}")
            parent = parent.cpu_parent
        total = callers.setdefault(" <- ".join(chain) or "(top level)", [0, 0.0])
        total[0] += 1
        total[1] += getattr(event, "device_time_total", 0.0) / 1000
    for chain, (count, ms) in sorted(callers.items(), key=lambda item: -item[1][1])[:15]:
        print(f"{ms:8.2f} ms {count:4d}x  {chain}")


if __name__ == "__main__":
    main()
