"""The seam of the objective: one config with a sub-config per term, and the module built from it."""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from .consistency import ConsistencyConfig, ConsistencyTerm, ConsistencyWindows
from .flow import FlowConfig, FlowTerm
from .gan import GANConfig
from .gram import GramConfig, GramTerm
from .high_freq import HighFreqConfig, HighFreqLoss
from .l1 import L1Config, L1Loss
from .perceptual import FeatureTerm, PerceptualConfig, PerceptualTerm, SharedVGG16
from .terms import Clips, LossTerm, TermConfig

TERMS: dict[str, type[LossTerm]] = {
    "l1": L1Loss,
    "perceptual": PerceptualTerm,
    "gram": GramTerm,
    "high_freq": HighFreqLoss,
    "flow": FlowTerm,
    "consistency": ConsistencyTerm,
}
"""Term name (also its ``LossConfig`` field and its ``train/<name>`` metric) -> class, in the order the
total sums them."""
SHORTHANDS = {"l1_weight": "l1", "perceptual_weight": "perceptual"}
"""The flat ``loss.<term>_weight`` settings of earlier releases -> their term."""


@dataclass
class LossConfig:
    """The training objective: a weighted sum of terms, each with a weight schedule (``loss.<term>.*``)."""

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
    gan: GANConfig = field(default_factory=GANConfig)
    """Adversarial fine-tuning: a discriminator trained beside the tokenizer and a generator term (the Cosmos
    paper's fine-tuning stage; no released trainer has it); weight 0 (default): off, nothing built. Not a term of
    this module: the training step runs it (it has its own network and optimizer)."""
    l1_weight: Optional[float] = None
    """Shorthand for loss.l1.weight (kept from earlier releases); moved into loss.l1 when the config is made."""
    perceptual_weight: Optional[float] = None
    """Shorthand for loss.perceptual.weight (kept from earlier releases); moved into loss.perceptual likewise."""

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
        problems = [p for name in TERMS for p in self.term(name).problems(f"loss.{name}")]
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
        return sorted({0, *(b for name in TERMS for b in self.term(name).boundaries)})

    def weights_at(self, step: int) -> dict[str, float]:
        """Name -> weight of the terms with a non-zero weight at optimizer step ``step``, in summing order."""
        weights = {name: self.term(name).weight_at(step) for name in TERMS}
        return {name: w for name, w in weights.items() if w != 0}

    def clip_problems(self, clips: Clips) -> list[str]:
        """What stops a term that is ever on from working on the run's ``clips`` (each term's own check, asked
        in summing order), each naming the setting and what to set."""
        return [
            p for name in TERMS if self.term(name).ever_on for p in self.term(name).clip_problems(f"loss.{name}", clips)
        ]

    def unreached_changes(self, max_steps: int) -> list[str]:
        """One line per term whose schedule changes at a step that a run of ``max_steps`` optimizer steps
        (0 ... max_steps - 1) never reaches: the weight it keeps, and whether the term is ever on."""
        notes = []
        for name in TERMS:
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
        self.terms = nn.ModuleDict(
            {name: cls(config.term(name)) for name, cls in TERMS.items() if config.term(name).ever_on}
        )
        self.feature_terms = frozenset(name for name, term in self.terms.items() if isinstance(term, FeatureTerm))
        self.vgg = SharedVGG16(config.perceptual) if self.feature_terms else None

    def prepare(self, step: int, device: torch.device) -> dict[str, float]:
        """Build and move to ``device`` the terms active at optimizer step ``step`` (and the VGG16 if one of
        them needs it); their weights."""
        weights = self.config.weights_at(step)
        for name in weights:
            self.terms[name].prepare(device)
        if self.vgg is not None and self.feature_terms.intersection(weights):
            self.vgg.prepare(device)
        return weights

    def consistency(self, weights: dict[str, float]) -> Optional[ConsistencyTerm]:
        """The consistency term when ``weights`` (from :meth:`prepare`) has it on: then the step cuts the clip's
        windows (:meth:`ConsistencyTerm.cut`) and runs the network on them; else None (no extra pass)."""
        term = self.terms["consistency"] if "consistency" in weights else None
        assert term is None or isinstance(term, ConsistencyTerm)
        return term

    def forward(
        self,
        reconstruction: Tensor,
        target: Tensor,
        mask: Tensor,
        weights: dict[str, float],
        windows: Optional[ConsistencyWindows] = None,
    ) -> dict[str, Tensor]:
        """``{term: value, ..., "loss": sum of weight x value}`` over the terms of ``weights``
        (from :meth:`prepare`); ``windows``: the network's outputs on the clip's windows, when
        :meth:`consistency` is on."""
        terms: dict[str, Tensor] = {}
        total: Tensor | None = None
        on_features = [name for name in weights if name in self.feature_terms]
        shared: dict[str, Tensor] = {}
        if on_features:
            assert self.vgg is not None
            values = self.vgg(reconstruction, target, mask, [self.terms[name] for name in on_features])
            shared = dict(zip(on_features, values, strict=True))
        for name, weight in weights.items():
            if name in shared:
                value = shared[name]
            elif name == "consistency":
                if windows is None:
                    raise ValueError("loss.consistency is on at this step but no window outputs were given")
                value = self.terms[name](windows, mask)
            else:
                value = self.terms[name](reconstruction, target, mask)
            terms[name] = value
            total = weight * value if total is None else total + weight * value
        if total is None:
            raise ValueError("no loss term is active at this step")
        terms["loss"] = total
        return terms


def build_loss(config: LossConfig) -> Loss:
    """The loss module of ``config``; every term that will ever be on checks its files now (a missing VGG16
    file fails here, at launch, saying where to put it), and builds its networks when first needed."""
    loss = Loss(config)
    for term in loss.terms.values():
        term.check()
    if loss.vgg is not None:
        loss.vgg.check()
    return loss
