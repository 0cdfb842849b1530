"""Data: batches reach the LightningModule as plain dicts keyed by :mod:`.batch`."""
