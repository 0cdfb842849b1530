"""NeMo-Run recipes for the evaluation and the one-command workflow (run them on any executor).

import nemo_run as run
from recipes.workflows import posttrain_recipe
run.run(posttrain_recipe("/ckpts/Cosmos-1.0-Tokenizer-CV8x8x8", "/data/videos", "runs/x"),
        executor=run.LocalExecutor())
"""

import inspect

import nemo_run as run

from tokenizer_posttrain.evaluation.evaluate import evaluate
from tokenizer_posttrain.workflow.posttrain import posttrain


def evaluate_recipe(checkpoint: str, data: str, out_dir: str = "eval", baseline: str | None = None) -> run.Partial:
    """Held-out evaluation of ``checkpoint`` (against ``baseline``) on an energon dataset."""
    return run.Partial(evaluate, checkpoint=checkpoint, data=data, out_dir=out_dir, baseline=baseline)


def posttrain_recipe(base: str, videos: str, out: str, **overrides: object) -> run.Partial:
    """Shards, baseline evaluation, training, evaluation and export (optionally after a sweep).

    Every other argument of :func:`~tokenizer_posttrain.workflow.posttrain.posttrain` is set from its own default
    (so ``recipe.steps``, ``recipe.frames``... show and override), or from ``overrides``.
    """
    defaults = {
        name: param.default
        for name, param in inspect.signature(posttrain).parameters.items()
        if param.default is not inspect.Parameter.empty
    }
    return run.Partial(posttrain, base=base, videos=videos, out=out, **{**defaults, **overrides})
