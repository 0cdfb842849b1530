"""Layer 5, whole jobs made of the layers below: :func:`~.posttrain.posttrain` goes from a folder of videos and
a base checkpoint to shards, a baseline evaluation, a training run (after an optional sweep), an evaluation
against the baseline and an export with its model card."""
