"""Layer 2, the training objective: every loss term, its config and weight schedule, and :func:`build_loss`,
which makes one module returning each active term by name plus their weighted total.

To add a term: write its sub-config (a :class:`~.terms.TermConfig` whose ``build()`` returns the term) and its
class (a :class:`~.terms.LossTerm`, whose ``forward`` reads what it needs of the step's
:class:`~.context.StepContext`) in a module here, register it with one typed field of
:class:`~.loss.LossConfig`, and test it in ``tests/losses``. Nothing outside this folder changes: the trainer
logs every term as ``train/<name>`` and ``val/<name>``, and the launch asks every term that is ever on whether
it fits the clips (``TermConfig.clip_problems``). A term on VGG16 features is a :class:`~.perceptual.FeatureTerm`:
the terms of that kind active at a step share one VGG16 pass. A term that needs the network on other clips
names them in ``LossTerm.extra_inputs`` (the step runs them and hands the outputs over in the context, as
:mod:`.consistency` does); one that reads the posterior finds it in ``StepContext.posterior``, the encoder's
output in ``StepContext.latent``; one that compares with the base model keeps a frozen copy in
``LossTerm.attach`` (:mod:`.anchor`).
"""

from .context import NetworkOutput, Posterior, StepContext
from .loss import TERMS, Loss, LossConfig, build_loss
from .terms import LossTerm, Schedule, TermConfig

__all__ = [
    "TERMS",
    "Loss",
    "LossConfig",
    "LossTerm",
    "NetworkOutput",
    "Posterior",
    "Schedule",
    "StepContext",
    "TermConfig",
    "build_loss",
]
