"""Layer 2, the training objective: every loss term, its config and weight schedule, and :func:`build_loss`,
which makes one module returning each active term by name plus their weighted total.

To add a term: write its sub-config and class (a :class:`~.terms.LossTerm`) in a module here, give
:class:`~.loss.LossConfig` a field for the config and :data:`~.loss.TERMS` one line, and test it in
``tests/losses``. Nothing outside this folder changes: the trainer logs every term as ``train/<name>``
and ``val/<name>``. A term on VGG16 features is a :class:`~.perceptual.FeatureTerm`: the terms of that kind
active at a step share one VGG16 pass. The exception to "nothing outside changes" is
:mod:`.consistency`: its windows need the network, so the training step runs them and hands the outputs to
``Loss.forward(..., windows=)``; the term's math stays here.
"""

from .loss import TERMS, Loss, LossConfig, build_loss
from .terms import LossTerm, TermConfig

__all__ = ["TERMS", "Loss", "LossConfig", "LossTerm", "TermConfig", "build_loss"]
