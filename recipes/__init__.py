"""NeMo-Run recipe factories for tokenizer post-training (select one with ``--factory NAME``).

Importing this package registers every factory with NeMo-Run.
"""

from . import cosmos_finetune, cv8x8x8, dv8x16x16, tiny, wan21, wan22  # noqa: F401  (registration side effect)
