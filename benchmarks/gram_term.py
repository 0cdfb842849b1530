"""The Gram term alone, on VGG16-sized features, forward and backward: the term's own backward pass against
autograd's (not a test).

Times one call of the Gram statistics and value of all five VGG16 layers (NHWC bf16 features of ``--frames``
frames of ``--size`` pixels, as the perceptual pass hands them over, all positions counted) and the backward
pass into the reconstruction's features, for:

* ``term``: :func:`tokenizer_posttrain.losses.gram.weighted_gram_difference` (the difference of the Gram sums as
  one product of ``w (r - t)`` and ``r + t`` with fp32 output; a backward pass of one product of ``r``);
* ``autograd``: the same product in bf16, symmetrised, differentiated by autograd (two products of the
  features' size in the backward pass, their two inputs kept): the form before;

each eager and under ``torch.compile``. Before timing, each path's Gram difference and gradient on the first
frames are compared with fp64 (relative error of the Frobenius norm). Median of ``--steps`` calls after
``--warmup``, peak memory::

    PYTHONPATH=. python3 benchmarks/gram_term.py --frames 264 --size 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from tokenizer_posttrain.losses.gram import GramConfig, GramTerm, weighted_gram_difference

CHANNELS = (64, 128, 256, 512, 512)
"""VGG16's channels at relu1_2 ... relu5_3; each layer halves the size of the one before."""


def previous_difference(reconstruction: Tensor, target: Tensor, weight: Tensor) -> Tensor:
    """The form before, NHWC only: the symmetric part of ``(w (r - t)) (r + t)ᵀ`` in bf16, autograd's backward."""
    rec, tgt, weight = (f.permute(0, 2, 3, 1).flatten(1, 2) for f in (reconstruction, target, weight))
    weight = weight.to(rec.dtype)
    product = torch.matmul(((rec - tgt) * weight).transpose(1, 2), rec + tgt).float()
    return (product + product.transpose(1, 2)) / 2


def term_value(difference: Callable[[Tensor, Tensor, Tensor], Tensor], clips: int):  # noqa: ANN201
    """The Gram term's value from ``difference``, with :class:`GramTerm`'s own reduction."""
    term = GramTerm(GramConfig(0.062))

    def value(reconstruction: list[Tensor], target: list[Tensor], weights: list[Tensor]) -> Tensor:
        stats: list[Tensor] = []
        for rec, tgt, weight in zip(reconstruction, target, weights, strict=True):
            stats += [difference(rec, tgt, weight), weight.sum(dim=(1, 2, 3))]
        return term.value([tuple(stats)], clips)

    return value


def features(frames: int, size: int, seed: int, device: str = "cuda") -> list[Tensor]:
    generator = torch.Generator(device).manual_seed(seed)
    out = []
    for layer, channels in enumerate(CHANNELS):
        side = size >> layer
        x = torch.rand(frames, side, side, channels, device=device, generator=generator)
        out.append(x.to(torch.bfloat16).permute(0, 3, 1, 2))  # NHWC memory, NCHW shape
    return out


def errors(difference: Callable[[Tensor, Tensor, Tensor], Tensor], frames: int, size: int, device: str) -> dict:
    """Relative errors against fp64 of the Gram difference and of the gradient, on ``frames`` frames."""
    target = features(frames, size, 0, device)
    # A good reconstruction: 1% off the target (where the difference's digits matter).
    rec = [(t.float() * (1 + 0.01 * torch.randn_like(t.float()))).to(torch.bfloat16) for t in target]
    out = {}
    for name, index in (("layer1", 0), ("layer4", 3)):
        r = rec[index].detach().clone().requires_grad_(True)
        w = torch.ones_like(r[:, :1], dtype=torch.float32)
        got = difference(r, target[index], w)
        upstream = torch.randn_like(got)
        (got * upstream).sum().backward()
        r64 = r.detach().double().requires_grad_(True)
        t64 = target[index].double()
        exact = torch.einsum("nchw,ndhw->ncd", r64, r64) - torch.einsum("nchw,ndhw->ncd", t64, t64)
        (exact * upstream.double()).sum().backward()
        out[f"{name}_value_err"] = float((got.detach().double() - exact).norm() / exact.norm())
        out[f"{name}_grad_err"] = float((r.grad.double() - r64.grad).norm() / r64.grad.norm())
    return out


def time_path(name: str, fn: Callable, frames: int, size: int, steps: int, warmup: int) -> dict:
    target = features(frames, size, 0)
    rec = [(t.float() * (1 + 0.01 * torch.randn_like(t.float()))).to(torch.bfloat16) for t in target]
    weights = [torch.ones_like(t[:, :1], dtype=torch.float32) for t in target]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for step in range(warmup + steps):
        leaves = [r.detach().requires_grad_(True) for r in rec]
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(leaves, target, weights).backward()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "path": name,
        "ms_per_call": round(statistics.median(times) * 1e3, 2),
        "extra_peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=264, help="frames of the batch (8 clips of 33: 264)")
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True  # as a bf16-mixed fit on a GPU runs (training.acceleration)
    forms = {"term": weighted_gram_difference, "autograd": previous_difference}
    for name, difference in forms.items():
        for label, form in ((name, difference), (f"{name}+compile", torch.compile(difference, dynamic=False))):
            print(json.dumps({"path": label, **errors(form, 4, args.size, "cuda")}), flush=True)
    for name, difference in forms.items():
        value = term_value(difference, args.clips)
        for compiled in (False, True):
            fn = torch.compile(value, dynamic=False) if compiled else value
            label = f"{name}+compile" if compiled else name
            print(json.dumps(time_path(label, fn, args.frames, args.size, args.steps, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
