"""Post-train a Cosmos tokenizer: the same command line as NeMo's script.

    torchrun --nproc-per-node 8 train_tokenizer.py --yes \
        model.model=Cosmos-1.0-Tokenizer-CV8x8x8 model.jit_ckpt_pth=/ckpts/CV8x8x8 trainer.max_steps=1000

``--factory tiny`` runs a tiny model on the CPU; docs/overrides.md lists every override.
"""

import sys

import recipes
from tokenizer_posttrain.commands.train_cli import run_cli
from tokenizer_posttrain.training.train import check_launch, train

if __name__ == "__main__":
    sys.exit(run_cli(train, default_factory=recipes.cv8x8x8.cv8x8x8, dry_run=check_launch))
