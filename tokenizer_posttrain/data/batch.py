"""Batch keys, in one place: every data module yields a plain dict with these keys; the default clip, and the loader's
prefetch default."""

VIDEO = "video"
"""``[B, 3, T, H, W]`` clip in [-1, 1] (bf16 from the loaders)."""
LOSS_MASK = "loss_mask"
"""``[B, 1, T, H, W]``: 1 where the pixel counts in the loss, 0 for padding."""
ASPECT_RATIO = "aspect_ratio"
"""``[B]`` width / height of each clip (energon data only)."""
KEYS = "keys"
"""Sample keys of the clips (energon data only)."""
SKIPPED = "skipped"
"""``"<key>: <reason>"`` for each video the loader skipped since its previous batch (energon only)."""
DAMAGED_SHARD = "damaged tar shard"
"""Starts the reason of a skip whose tar shard could not be read there (cut short or damaged): the
``<key>`` is the shard's name; the message says which samples of it are lost."""
IN_DAMAGED_SHARD = "in the damaged part of its tar shard"
"""Starts the reason of each later skip of a sample after that point (``<key>`` is ``<shard>#<n>``)."""

CLIP_FRAMES = 33
"""Frames of the default training clip (1 + 8k, for the 8x temporal models): the one default the training
config, the data modules, the posttrain workflow and evaluation all start from."""
CLIP_SIZE = 256
"""Height and width of the default training clip's crop."""
PREFETCH = 6
"""Batches each loader worker may prepare ahead by default (energon's ``prefetch_factor``): torch's 2 starved the
step on real footage, since batches are handed over in order and a worker whose clips decoded slowly holds up
the others (docs/benchmarks.md, "Real footage in the loop")."""
