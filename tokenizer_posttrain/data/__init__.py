"""Layer 2, clips for training and evaluation: energon shards of videos decoded into clips (:mod:`.energon`,
:mod:`.task_encoder`, :mod:`.clip_decode`), synthetic clips (:mod:`.fake`), the dataset's layout on disk and the
checks before launch (:mod:`.layout`, :mod:`.preflight`, :mod:`.probe`). Batches reach the LightningModule as
plain dicts keyed by :mod:`.batch`."""
