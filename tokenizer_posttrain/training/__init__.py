"""Layer 4, post-training: the run configs (:mod:`.config`), the LightningModule and the small pieces it
delegates to (:mod:`.module`, :mod:`.step_guard`, :mod:`.acceleration`, :mod:`.optim`, :mod:`.trainable`),
checkpoints and resume (:mod:`.checkpointing`), what a run reports (:mod:`.monitoring`), stop signals under
DDP (:mod:`.stop_signal`), and :func:`~.train.train`, the entry that builds and fits them."""
