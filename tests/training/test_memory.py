"""The activation-memory estimate: storages counted while they live, and the switches ranked as they save."""

from __future__ import annotations

import torch

from tokenizer_posttrain.training.memory import LiveStorages, step_activation_bytes


def test_storages_count_while_they_live() -> None:
    counter = LiveStorages()
    with counter:
        a = torch.ones(1024)  # 4 KiB
        b = torch.ones(2048)  # 8 KiB
        view = b[:10]  # no new storage
        del a
        c = torch.ones(512)  # 2 KiB
    assert counter.peak == 12 * 1024
    assert counter.live == 10 * 1024
    del b, view, c
    assert counter.live == 0


def test_recomputed_blocks_and_chunks_of_time_each_lower_the_peak() -> None:
    # Wan2.1 alone: the chunks are the same code in Wan2.2 (its outputs and gradients in chunks: test_chunks.py),
    # and each estimate walks every operation of the step on fake tensors (seconds, whatever the clip's size).
    model = "Wan2.1-VAE"
    clip = (33, 32, 32)  # measured: 45 / 12 / 6.8 MB

    def peak(**switches: object) -> int:
        return step_activation_bytes(model, clip, channels=8, **switches)

    plain, blocks = peak(), peak(activation_checkpointing=True)
    chunks = peak(activation_checkpointing=True, time_chunk=2)
    # Chunks keep their inputs and handed-on frames (copies, gradients too), and run their backward passes one
    # after the other: below the blocks' peak, not the sum of every chunk's.
    assert blocks < plain / 2
    assert chunks < 0.75 * blocks, (plain, blocks, chunks)


def test_a_cosmos_model_is_estimated_too() -> None:
    assert step_activation_bytes("CV8x8x8", (9, 32, 32), channels=16) > 0
