"""NeMo-Run recipes for the evaluation and the one-command workflow (run them on any executor).

import nemo_run as run
from recipes.workflows import posttrain_recipe
run.run(posttrain_recipe("/ckpts/Cosmos-1.0-Tokenizer-CV8x8x8", "/data/videos", "runs/x"),
        executor=run.LocalExecutor())
"""

import nemo_run as run

from tokenizer_posttrain.evaluate import evaluate
from tokenizer_posttrain.workflow import posttrain


def evaluate_recipe(checkpoint: str, data: str, out_dir: str = "eval", baseline: str | None = None) -> run.Partial:
    """Held-out evaluation of ``checkpoint`` (against ``baseline``) on an energon dataset."""
    return run.Partial(evaluate, checkpoint=checkpoint, data=data, out_dir=out_dir, baseline=baseline)


def posttrain_recipe(base: str, videos: str, out: str, steps: int = 2000, sweep: bool = False) -> run.Partial:
    """Shards, baseline evaluation, training, evaluation and export (optionally after a sweep)."""
    return run.Partial(posttrain, base=base, videos=videos, out=out, steps=steps, frames=33, size=256, sweep=sweep)
