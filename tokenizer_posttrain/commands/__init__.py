"""Subcommands of ``python -m tokenizer_posttrain``: each module has ``register(subparsers)``."""
