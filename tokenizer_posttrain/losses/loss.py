"""The seam of the objective: one config with a sub-config per term, and the module built from it.

A term is registered by one typed field of :class:`LossConfig` whose value is a :class:`~.terms.TermConfig`
(its ``build()`` names the term's class): the field's name is the term's name (``loss.<name>.*`` overrides, the
``train/<name>`` metric), the fields' order the order the total sums them in. The field is the registration
because NeMo-Run's overrides and the settings' documentation (``--help``, docs/overrides.md) read typed fields
and the strings under them from the source, which a table filled at run time would not have.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from .anchor import LatentAnchorConfig
from .consistency import ConsistencyConfig
from .context import NetworkOutput, NetworkPass, StepContext
from .flow import FlowConfig
from .gan import GANConfig
from .gram import GramConfig
from .high_freq import HighFreqConfig
from .kl import KLConfig
from .l1 import L1Config
from .perceptual import FeatureTerm, PerceptualConfig, SharedVGG16
from .terms import Clips, TermConfig


@functools.cache
def term_fields(config_class: type) -> dict[str, type[TermConfig]]:
    """Term name -> config class of every :class:`~.terms.TermConfig` field of the dataclass ``config_class``
    (:class:`LossConfig` or a subclass of it), in the order the total sums them."""
    return {
        f.name: f.default_factory
        for f in dataclasses.fields(config_class)
        if isinstance(f.default_factory, type) and issubclass(f.default_factory, TermConfig)
    }


SHORTHANDS = {"l1_weight": "l1", "perceptual_weight": "perceptual"}
"""The flat ``loss.<term>_weight`` settings of earlier releases -> their term."""


@dataclass
class LossConfig:
    """The training objective: a weighted sum of terms, each with a weight schedule (``loss.<term>.*``).

    Each field typed with a :class:`~.terms.TermConfig` is a term, summed in field order: a new term is one such
    field, with the string under it that documents the setting."""

    l1: L1Config = field(default_factory=L1Config)
    """L1 reconstruction (weight 1)."""
    perceptual: PerceptualConfig = field(default_factory=PerceptualConfig)
    """VGG16 perceptual term (weight 0.1); weight 0 needs no VGG16 file (unless loss.gram is on)."""
    gram: GramConfig = field(default_factory=GramConfig)
    """Gram-matrix loss on the VGG16 features of loss.perceptual (its layers and layer weights, one VGG pass for
    both; NVIDIA's trainers use 0 before step 500000, then 0.062); weight 0 (default): off."""
    high_freq: HighFreqConfig = field(default_factory=HighFreqConfig)
    """L1 between the frames' Laplacians, for edges and fine detail (NVIDIA's trainer); weight 0 (default): off."""
    flow: FlowConfig = field(default_factory=FlowConfig)
    """L1 between the bidirectional RAFT optical flows of input and reconstruction, for motion (NVIDIA's trainers: 0
    before step 250000, then 0.01); needs torchvision's RAFT file; weight 0 (default): off, nothing read or built."""
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    """Overlapping windows of a clip (``window`` frames every ``step``), reconstructed on their own, must agree on
    their shared frames and CV latents (NVIDIA's trainers ship it off); weight 0 (default): off, no extra pass."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL divergence of a VAE encoder's posterior from the unit Gaussian, summed over each clip's latent (the Wan
    VAEs; the wan21 recipes set 1e-6, the latent-diffusion VAEs' weight); weight 0 (default): off. Tokenizers
    without a posterior (Cosmos) refuse it at launch."""
    latent_anchor: LatentAnchorConfig = field(default_factory=LatentAnchorConfig)
    """Hold a training encoder's output near the frozen base encoder's, in units of each latent channel's spread,
    so a world model trained on the base's latents keeps working (README, "Keeping a world model's latents
    valid"); weight 0 (default): off, no base copy. Refused with model.trainable=decoder (the latents stay anyway)."""
    gan: GANConfig = field(default_factory=GANConfig)
    """Adversarial fine-tuning: a discriminator trained beside the tokenizer and a generator term (the Cosmos
    paper's fine-tuning stage; no released trainer has it); weight 0 (default): off, nothing built. Not a term of
    this module: the training step runs it (it has its own network and optimizer)."""
    l1_weight: Optional[float] = None
    """Shorthand for loss.l1.weight (kept from earlier releases); moved into loss.l1 when the config is made."""
    perceptual_weight: Optional[float] = None
    """Shorthand for loss.perceptual.weight (kept from earlier releases); moved into loss.perceptual likewise."""

    @property
    def term_names(self) -> list[str]:
        """The name of every term of this config, in summing order (:func:`term_fields`)."""
        return list(term_fields(type(self)))

    def __post_init__(self) -> None:
        for alias, term in SHORTHANDS.items():
            value, config = getattr(self, alias), getattr(self, term)
            if value is not None:
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ValueError(f"invalid loss.{alias}={value!r}: must be finite and >= 0")
                if config.values:
                    raise ValueError(f"invalid loss.{alias}={value!r}: loss.{term} has a schedule (values); drop one")
                config = dataclasses.replace(config, weight=float(value))
                setattr(self, term, config)
            # Consumed: the term's config holds the weight, so a later dataclasses.replace() cannot apply it twice.
            setattr(self, alias, None)
        problems = [p for name in self.term_names for p in self.term(name).problems(f"loss.{name}")]
        problems += self.gan.problems("loss.gan")
        if not problems:
            off = [step for step in self.schedule_starts() if not self.weights_at(step)]
            if off:
                problems.append(f"every loss term has weight 0 at step {off[0]}; give some term a positive weight")
        if problems:
            raise ValueError("invalid loss settings: " + "; ".join(problems))

    def term(self, name: str) -> TermConfig:
        """The sub-config of term ``name``."""
        return getattr(self, name)

    def schedule_starts(self) -> list[int]:
        """The first step of every interval in which no term's weight changes."""
        return sorted({0, *(b for name in self.term_names for b in self.term(name).boundaries)})

    def weights_at(self, step: int) -> dict[str, float]:
        """Name -> weight of the terms with a non-zero weight at optimizer step ``step``, in summing order."""
        weights = {name: self.term(name).weight_at(step) for name in self.term_names}
        return {name: w for name, w in weights.items() if w != 0}

    def clip_problems(self, clips: Clips) -> list[str]:
        """What stops a term that is ever on from working on the run's ``clips`` (each term's own check, asked
        in summing order), each naming the setting and what to set."""
        return [
            p
            for name in self.term_names
            if self.term(name).ever_on
            for p in self.term(name).clip_problems(f"loss.{name}", clips)
        ]

    def unreached_changes(self, max_steps: int) -> list[str]:
        """One line per term whose schedule changes at a step that a run of ``max_steps`` optimizer steps
        (0 ... max_steps - 1) never reaches: the weight it keeps, and whether the term is ever on."""
        notes = []
        for name in self.term_names:
            config = self.term(name)
            unreached = [i for i, boundary in enumerate(config.boundaries) if boundary >= max_steps]
            if not config.values or not unreached:
                continue
            first = unreached[0]
            kept, then = config.values[first], config.values[first + 1]
            never = " (the term is never on)" if not any(w != 0 for w in config.values[: first + 1]) else ""
            notes.append(
                f"loss.{name}.boundaries={config.boundaries}: trainer.max_steps={max_steps} ends before step "
                f"{config.boundaries[first]}, where the weight would change from {kept} to {then}; it stays "
                f"{kept}{never}"
            )
        return notes

    def to_dict(self) -> dict:
        """The settings as plain data (for checkpoints' hyperparameters)."""
        return dataclasses.asdict(self)


TERMS = term_fields(LossConfig)
"""Term name -> config class of every term :class:`LossConfig` has, in the order the total sums them."""


class Loss(nn.Module):
    """Every term of a :class:`LossConfig` that is ever on; ``forward`` returns the active terms by name
    and their weighted total under ``"loss"``, all fp32 scalars.

    Pure tensor code between :meth:`prepare` calls (no device moves, no file reads), so it compiles
    together with the network. A term whose weight is 0 at a step is not computed at that step. The terms on
    VGG16 features (:class:`~.perceptual.FeatureTerm`: perceptual, gram) active at a step share one VGG16 pass
    (:attr:`vgg`, set by ``loss.perceptual``), which exists only if one of them is ever on.
    """

    def __init__(self, config: LossConfig) -> None:
        super().__init__()
        self.config = config
        on = [name for name in config.term_names if config.term(name).ever_on]
        self.terms = nn.ModuleDict({name: config.term(name).build() for name in on})
        self.feature_terms = frozenset(name for name, term in self.terms.items() if isinstance(term, FeatureTerm))
        self.vgg = SharedVGG16(config.perceptual) if self.feature_terms else None

    def attach(self, network: nn.Module) -> None:
        """Hand every term the network to train, before training changes it (:meth:`~.terms.LossTerm.attach`)."""
        for term in self.terms.values():
            term.attach(network)

    def prepare(self, step: int, device: torch.device) -> dict[str, float]:
        """Build and move to ``device`` the terms active at optimizer step ``step`` (and the VGG16 if one of
        them needs it); their weights."""
        weights = self.config.weights_at(step)
        for name in weights:
            self.terms[name].prepare(device)
        if self.vgg is not None and self.feature_terms.intersection(weights):
            self.vgg.prepare(device)
        return weights

    def extra_passes(self, target: Tensor, weights: dict[str, float], run: NetworkPass) -> dict[str, NetworkOutput]:
        """``run`` (the step's network) on the clips that the terms of ``weights`` ask for
        (:meth:`~.terms.LossTerm.extra_inputs`), each name once: the ``extras`` of the step's context. Empty, at
        no cost, when no active term asks."""
        passes: dict[str, NetworkOutput] = {}
        for name in weights:
            for key, clips in self.terms[name].extra_inputs(target).items():
                if key not in passes:
                    passes[key] = run(clips)
        return passes

    def reconstruction_only(self, weights: dict[str, float]) -> bool:
        """Whether every term of ``weights`` reads the network through the reconstruction alone
        (:attr:`~.terms.LossTerm.reconstruction_only`)."""
        return all(self.terms[name].reconstruction_only for name in weights)

    def forward(self, context: StepContext, weights: dict[str, float]) -> dict[str, Tensor]:
        """``{term: value, ..., "loss": sum of weight x value}`` over the terms of ``weights``
        (from :meth:`prepare`), each reading what it needs of the step's ``context``."""
        terms: dict[str, Tensor] = {}
        total: Tensor | None = None
        shared = self._feature_values(context, weights)
        for name, weight in weights.items():
            value = shared[name] if name in shared else self.terms[name](context)
            terms[name] = value
            total = weight * value if total is None else total + weight * value
        if total is None:
            raise ValueError("no loss term is active at this step")
        terms["loss"] = total
        return terms

    def _feature_values(self, context: StepContext, weights: dict[str, float]) -> dict[str, Tensor]:
        """The values of the VGG16 feature terms of ``weights``, from their one shared VGG16 pass."""
        on_features = [name for name in weights if name in self.feature_terms]
        if not on_features:
            return {}
        assert self.vgg is not None
        features = [self.terms[name] for name in on_features]
        values = self.vgg(context.reconstruction, context.target, context.mask, features)
        return dict(zip(on_features, values, strict=True))


def build_loss(config: LossConfig) -> Loss:
    """The loss module of ``config``; every term that will ever be on checks its files now (a missing VGG16
    file fails here, at launch, saying where to put it), and builds its networks when first needed."""
    loss = Loss(config)
    for term in loss.terms.values():
        term.check()
    if loss.vgg is not None:
        loss.vgg.check()
    return loss
