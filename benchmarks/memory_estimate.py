"""Peak activation memory of a tokenizer's training step, estimated on the CPU without the memory
(:mod:`tokenizer_posttrain.training.memory`: fake tensors, every storage counted while it lives), beside what the
fp32 weights, gradients and AdamW's two moments take. An estimate, not a GPU's figure (that module says what it
leaves out); docs/benchmarks.md puts each beside the H200's measurement where one exists.

Per model, clip and switch set (``--paths``, ``+``-joined: ``ckpt`` = model.activation_checkpointing, ``tchunkN`` =
model.time_chunk=N, ``eager`` = neither), one clip of batch. Example::

    PYTHONPATH=. python3 benchmarks/memory_estimate.py --models Wan2.1-VAE --shapes 33x256x256 93x704x1280 \
        --paths eager ckpt ckpt+tchunk2
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.training.memory import step_activation_bytes


def optimizer_state_gib(model: str) -> float:
    """fp32 weights, gradients and AdamW's two moments."""
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_tokenizer(model).parameters())
    return 4 * 4 * parameters / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["Wan2.1-VAE", "Wan2.2-VAE"])
    parser.add_argument("--shapes", nargs="+", default=["33x256x256"], help="TxHxW clip sizes")
    parser.add_argument("--paths", nargs="+", default=["eager", "ckpt"])
    args = parser.parse_args()
    print("| model | clip | path | activations GiB | weights+grads+AdamW GiB | total GiB | estimate took |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        states = optimizer_state_gib(model)
        for text in args.shapes:
            t, h, w = (int(v) for v in text.lower().split("x"))
            for path in args.paths:
                tokens = [] if path == "eager" else path.split("+")
                chunk = next((int(tok[6:]) for tok in tokens if tok.startswith("tchunk")), 0)
                began = time.perf_counter()
                activations = step_activation_bytes(model, (t, h, w), 1, "ckpt" in tokens, chunk) / 2**30
                took = time.perf_counter() - began
                print(
                    f"| {model} | {text} | {path} | {activations:.1f} | {states:.1f} | {activations + states:.1f} | "
                    f"{took:.0f} s |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
