"""Batch keys, in one place: every data module yields ``{VIDEO: ..., LOSS_MASK: ...}``."""

VIDEO = "video"
"""``[B, 3, T, H, W]`` clip in [-1, 1] (bf16 from the loaders)."""
LOSS_MASK = "loss_mask"
"""``[B, 1, T, H, W]``: 1 where the pixel counts in the loss, 0 for padding."""
