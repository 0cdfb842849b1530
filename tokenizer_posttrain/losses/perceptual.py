"""Perceptual loss of the Cosmos tokenizer post-training recipe: L1 between VGG16 features of frames; and the
one VGG16 pass that it shares with the other terms on VGG16 features (:class:`FeatureTerm`, e.g. the Gram loss).

The VGG16 trunk is torchvision's own (``torchvision.models.vgg16``'s ``features`` up to relu5_3), so the ImageNet
weights torchvision caches (``vgg16-397923af.pth``) load as they are. Nothing is downloaded at run time.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .context import StepContext
from .terms import LossTerm, TermConfig
from .weight_files import DOWNLOADS, find_weights_file, read_state_dict, state_problems

VGG16_FILE = "vgg16-397923af.pth"
VGG16_URL = f"{DOWNLOADS}/{VGG16_FILE}"
TAPS = (3, 8, 15, 22, 29)
"""Indices in ``features`` of relu1_2, relu2_2, relu3_3, relu4_3 and relu5_3."""
DEFAULT_LAYER_WEIGHTS = (1 / 2.6, 1 / 4.8, 1 / 3.7, 1 / 5.6, 10 / 1.5)
LPIPS_SHIFT = (-0.030, -0.088, -0.188)
LPIPS_SCALE = (0.458, 0.448, 0.450)
_OFF = (
    "or turn off the terms that read it: loss.perceptual.weight=0 and loss.gram.weight=0 (and "
    "loss.<term>.values=[] loss.<term>.boundaries=[] if scheduled)"
)


class VGG16Features(nn.Module):
    """torchvision's VGG16 convolutional trunk up to relu5_3 (its ``features[:30]``, without the last max-pool),
    under torchvision's ``features.N`` parameter names.

    It is a fixed feature extractor: it always stays in eval mode, whatever ``train()`` is asked. A new one holds
    random weights (PyTorch's default initialisation of each convolution) until a state dict is loaded.
    """

    def __init__(self) -> None:
        super().__init__()
        # Imported here: torchvision adds about a second to the import of the package, and only the VGG16
        # terms need it.
        from torchvision.models import vgg16

        # Built on the meta device, then given memory for the trunk only: the whole VGG16 would allocate and
        # initialise its 124M-parameter classifier just to drop it (over a second and about 0.5 GB).
        device = torch.get_default_device()
        with torch.device("meta"):
            trunk = vgg16(weights=None).features[: TAPS[-1] + 1]
        self.features = trunk.to_empty(device=device)
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):
                layer.reset_parameters()
        self.train(False)

    def train(self, mode: bool = True) -> "VGG16Features":
        # A frozen loss network: Lightning's model.train() must not flip it back to training mode.
        return super().train(False)

    def forward(self, x: Tensor, channels_multiple: int = 1) -> list[Tensor]:
        """Activations after relu1_2, relu2_2, relu3_3, relu4_3 and relu5_3 of images ``x`` ``[N, 3, H, W]``.

        ``channels_multiple``: zero-pad the 3 input channels (and conv1_1's weights) to a multiple of it.
        """
        taps = []
        # torchvision's ReLUs work in place, on the convolution's output; each tapped ReLU output is then only
        # read (by a max-pool, or nothing after relu5_3), so the taps keep their values.
        for index, layer in enumerate(self.features):
            x = _padded_conv(layer, x, channels_multiple) if index == 0 and channels_multiple > 1 else layer(x)
            if index in TAPS:
                taps.append(x)
        return taps


def _padded_conv(conv: nn.Conv2d, x: Tensor, multiple: int) -> Tensor:
    """``conv(x)`` with the input channels zero-padded, and the weights likewise, to a multiple of ``multiple``.

    cuDNN's NHWC tensor-core kernels want channel counts in multiples of 8; with the 3 colour channels it
    falls back to slower ones, for conv1_1's forward and for the gradient it passes to the reconstruction.
    Zero channels times zero weights add nothing: the same result.
    """
    extra = -x.shape[1] % multiple
    if extra == 0:
        return conv(x)
    memory_format = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else None
    x = F.pad(x, (0, 0, 0, 0, 0, extra))
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    weight = F.pad(conv.weight, (0, 0, 0, 0, 0, extra))
    return F.conv2d(x, weight, conv.bias, conv.stride, conv.padding)


def find_vgg16_weights(path: str | None = None) -> Path:
    """The VGG16 weight file: ``path`` if given, else torchvision's cache file under ``torch.hub.get_dir()``.

    Raises ``FileNotFoundError`` saying where to put the file when it is missing.
    """
    return find_weights_file(
        VGG16_FILE, path, "the perceptual and Gram losses (ImageNet VGG16)", "loss.perceptual.weights_path", _OFF
    )


def read_vgg16_features(path: str | Path, mmap: bool = False) -> dict[str, Tensor]:
    """The ``features.*`` weights of a torchvision VGG16 file, checked against the network's keys and shapes.

    The file's ``classifier.*`` keys are ignored. Missing, unexpected or wrongly shaped feature keys raise
    ``ValueError`` naming the file and the keys. ``mmap`` maps the file instead of reading it (for checks).
    """
    state = read_state_dict(path, "VGG16", mmap=mmap)
    features = {key: value for key, value in state.items() if not isinstance(key, str) or key.startswith("features.")}
    with torch.device("meta"):
        expected = VGG16Features().state_dict()
    problems = state_problems(features, expected)
    if problems:
        raise ValueError(f"{path} does not hold torchvision's VGG16 features: " + "; ".join(problems))
    return features


def load_vgg16_features(path: str | Path) -> "VGG16Features":
    """Load the ``features.*`` weights of a torchvision VGG16 file strictly (see :func:`read_vgg16_features`);
    returns a frozen, eval-mode network."""
    net = VGG16Features()
    net.load_state_dict(read_vgg16_features(path), strict=True)
    return net.requires_grad_(False)


def _frames(video: Tensor) -> Tensor:
    """``[B, C, T, H, W]`` -> ``[B*T, C, H, W]``: the VGG sees every frame as an image."""
    b, c, t, h, w = video.shape
    return video.transpose(1, 2).reshape(b * t, c, h, w)


class FeatureTerm(LossTerm):
    """A term computed from the VGG16 features (relu1_2 ... relu5_3) of every frame of input and reconstruction.

    The :class:`~.loss.Loss` runs one :class:`VGG16Pass` for all such terms active at a step: each term reduces
    every chunk of frames to statistics (:meth:`statistics`), then the statistics of all chunks, in frame order,
    to its value (:meth:`value`). So the VGG16 runs once per step however many of these terms are on.
    """

    def statistics(
        self, reconstruction: list[Tensor], target: list[Tensor], weights: list[Tensor]
    ) -> tuple[Tensor, ...]:
        """What the term needs of one chunk of ``N`` frames: per layer the features of reconstruction and target
        ``[N, C, h, w]`` and the mask at that resolution ``[N, 1, h, w]`` (the fraction of counted pixels under
        each feature)."""
        raise NotImplementedError

    def value(self, chunks: list[tuple[Tensor, ...]], clips: int) -> Tensor:
        """The fp32 scalar term from the :meth:`statistics` of every chunk (in frame order); the videos held
        ``clips`` clips, each of ``frames / clips`` frames."""
        raise NotImplementedError

    def forward(self, context: StepContext) -> Tensor:
        raise RuntimeError(f"{type(self).__name__} is computed in the VGG16 pass of the Loss module (Loss.vgg)")


class VGG16Pass(nn.Module):
    """One VGG16 pass over the frames of input and reconstruction, shared by the :class:`FeatureTerm` s given.

    Inputs are rescaled with LPIPS's per-channel shift and scale, which map [-1, 1] videos onto the statistics
    of the ImageNet-normalised images the VGG16 weights were trained on. ``frame_chunk`` runs the VGG over at
    most that many frames at a time; when gradients are needed each chunk is recomputed in the backward pass
    (activation checkpointing), so the memory for the VGG's activations is bounded by one chunk.
    """

    def __init__(self, vgg: VGG16Features, frame_chunk: int | None = None, channels_last: bool = False) -> None:
        super().__init__()
        _check_frame_chunk(frame_chunk)
        self.vgg = vgg
        self.frame_chunk = frame_chunk
        # NHWC images: the layout tensor-core convolutions work in (the result is the same).
        self.channels_last = channels_last
        # Not persistent: constants, not state worth checkpointing; buffers so they follow .to(device).
        self.register_buffer("shift", torch.tensor(LPIPS_SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(LPIPS_SCALE).view(1, 3, 1, 1), persistent=False)

    def forward(
        self, reconstruction: Tensor, target: Tensor, mask: Tensor | None, terms: Sequence[FeatureTerm]
    ) -> list[Tensor]:
        """The value of each of ``terms`` for videos ``[B, 3, T, H, W]`` in [-1, 1]; ``mask`` ``[B, 1, T, H, W]``,
        1 = counts (None: every pixel)."""
        shape = tuple(reconstruction.shape)
        if shape != tuple(target.shape) or len(shape) != 5 or shape[1] != 3:
            raise ValueError(f"expected equal [B, 3, T, H, W] videos, got {shape} and {tuple(target.shape)}")
        b, _, t, h, w = shape
        recon, tgt = _frames(reconstruction), _frames(target)
        mask = torch.ones((), device=recon.device) if mask is None else mask.float()
        frames_mask = _frames(mask.expand(b, 1, t, h, w))
        chunk = self.frame_chunk or recon.shape[0]
        # Without chunks one pass holds the activations anyway; checkpointing would only add a recomputation.
        recompute = chunk < recon.shape[0] and torch.is_grad_enabled() and recon.requires_grad

        def statistics(recon: Tensor, target: Tensor, mask: Tensor) -> list[tuple[Tensor, ...]]:
            return self._statistics(terms, recon, target, mask)

        parts = []
        for start in range(0, recon.shape[0], chunk):
            args = (recon[start : start + chunk], tgt[start : start + chunk], frames_mask[start : start + chunk])
            parts.append(checkpoint(statistics, *args, use_reentrant=False) if recompute else statistics(*args))
        return [term.value([part[index] for part in parts], b) for index, term in enumerate(terms)]

    def _statistics(
        self, terms: Sequence[FeatureTerm], recon: Tensor, target: Tensor, mask: Tensor
    ) -> list[tuple[Tensor, ...]]:
        """Every term's statistics of one chunk of frames."""
        multiple = 8 if self.channels_last else 1
        with torch.no_grad():
            target_features = self.vgg(self._normalize(target), multiple)
        features = self.vgg(self._normalize(recon), multiple)
        # The mask at each layer's resolution: the fraction of counted pixels under each feature.
        weights = [F.adaptive_avg_pool2d(mask, f.shape[-2:]) for f in features]
        return [term.statistics(features, target_features, weights) for term in terms]

    def _normalize(self, x: Tensor) -> Tensor:
        x = (x.to(self.shift.dtype) - self.shift) / self.scale
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


def _check_frame_chunk(frame_chunk: int | None) -> None:
    if frame_chunk is not None and frame_chunk < 1:
        raise ValueError(f"frame_chunk must be a positive number of frames or None, got {frame_chunk}")


def checked_layer_weights(layer_weights: Sequence[float]) -> tuple[float, ...]:
    """One float per VGG16 layer (tapped activation), else ``ValueError``."""
    if len(layer_weights) != len(TAPS):
        raise ValueError(f"layer_weights needs {len(TAPS)} values (one per VGG16 layer), got {len(layer_weights)}")
    return tuple(float(weight) for weight in layer_weights)


class PerceptualDistance(FeatureTerm):
    """Weighted sum over the five VGG16 layers of the (masked) mean absolute feature difference of all frames."""

    def __init__(self, layer_weights: Sequence[float] = DEFAULT_LAYER_WEIGHTS) -> None:
        super().__init__()
        self.layer_weights = checked_layer_weights(layer_weights)

    def statistics(
        self, reconstruction: list[Tensor], target: list[Tensor], weights: list[Tensor]
    ) -> tuple[Tensor, ...]:
        """Per layer: the sum of mask-weighted |feature difference| and the sum of the weights (its normaliser)."""
        numerators, denominators = [], []
        for rec, tgt, weight in zip(reconstruction, target, weights, strict=True):
            # Channels first: the contiguous axis of NHWC features; one weighted sum over all elements was
            # far slower under Inductor (docs/benchmarks.md).
            distance = (rec.float() - tgt.float()).abs().sum(dim=1)  # [N, H, W]
            numerators.append((distance * weight[:, 0]).sum())
            denominators.append(weight.sum() * rec.shape[1])
        return torch.stack(numerators), torch.stack(denominators)

    def value(self, chunks: list[tuple[Tensor, ...]], clips: int) -> Tensor:
        # Sums, not means, are accumulated so that the chunk size cannot change the result.
        numerator, denominator = (sum(sums) for sums in zip(*chunks, strict=True))
        weights = torch.tensor(self.layer_weights, device=numerator.device)
        # A fully masked batch has nothing to compare: 0, not 0/0.
        return (weights * numerator / denominator.clamp_min(1e-12)).sum()


class PerceptualLoss(VGG16Pass):
    """The perceptual distance (:class:`PerceptualDistance`) on a VGG16 pass of its own: for evaluation and
    tests; training runs the terms through the Loss module's shared pass."""

    def __init__(
        self,
        weights_path: str | None = None,
        layer_weights: Sequence[float] = DEFAULT_LAYER_WEIGHTS,
        frame_chunk: int | None = None,
        vgg: VGG16Features | None = None,
        channels_last: bool = False,
    ) -> None:
        distance = PerceptualDistance(layer_weights)
        _check_frame_chunk(frame_chunk)
        # ``vgg`` (a ready network, e.g. random weights for timing) skips reading the weights file.
        vgg = vgg if vgg is not None else load_vgg16_features(find_vgg16_weights(weights_path))
        super().__init__(vgg, frame_chunk, channels_last)
        self.distance = distance

    def forward(self, reconstruction: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        """fp32 scalar loss of videos ``[B, 3, T, H, W]`` in [-1, 1]; ``mask`` ``[B, 1, T, H, W]``, 1 = counts."""
        return super().forward(reconstruction, target, mask, [self.distance])[0]


@dataclass
class PerceptualConfig(TermConfig):
    """VGG16 feature L1 (relu1_2..relu5_3, LPIPS input scaling) of the Cosmos post-training recipe; its VGG16
    settings also serve loss.gram. With both at weight 0 no weights file is needed."""

    weight: float = 0.1
    weights_path: Optional[str] = None
    """torchvision's ImageNet VGG16 file (vgg16-397923af.pth); None looks in the torch hub cache. Also read by
    loss.gram."""
    frame_chunk: Optional[int] = None
    """Run the VGG over at most this many frames at once (saves memory, same result); for loss.gram too."""

    def build(self) -> "PerceptualTerm":
        return PerceptualTerm(self)

    def problems(self, key: str) -> list[str]:
        problems = super().problems(key)
        if self.frame_chunk is not None and self.frame_chunk < 1:
            problems.append(f"{key}.frame_chunk={self.frame_chunk} must be a positive number of frames")
        return problems


class PerceptualTerm(PerceptualDistance):
    """:class:`PerceptualDistance` (the Cosmos recipe's layer weights) as a loss term; the Loss module's
    :class:`SharedVGG16` computes it together with the other VGG16 terms."""

    def __init__(self, config: PerceptualConfig) -> None:
        super().__init__(DEFAULT_LAYER_WEIGHTS)
        self.config = config


class SharedVGG16(nn.Module):
    """The VGG16 pass of every :class:`FeatureTerm` of a Loss, set by ``loss.perceptual`` (``weights_path``,
    ``frame_chunk``) whether or not the perceptual term itself is on: the weights file is found at launch
    (:meth:`check`), the network read and built the first time one of these terms has a non-zero weight.

    ``channels_last`` (set by the acceleration switches) feeds the VGG NHWC images.
    """

    def __init__(self, config: PerceptualConfig) -> None:
        super().__init__()
        self.config = config
        self.channels_last = False
        self.network: VGG16Pass | None = None

    def check(self) -> None:
        # The file's keys and shapes, read through a memory map: a wrong file fails at launch, and the
        # network itself is still built only when first needed.
        read_vgg16_features(find_vgg16_weights(self.config.weights_path), mmap=True)

    def prepare(self, device: torch.device) -> None:
        if self.network is None:
            vgg = load_vgg16_features(find_vgg16_weights(self.config.weights_path))
            self.network = VGG16Pass(vgg, frame_chunk=self.config.frame_chunk)
        self.network.channels_last = self.channels_last
        self.network.to(device)

    def forward(
        self, reconstruction: Tensor, target: Tensor, mask: Tensor, terms: Sequence[FeatureTerm]
    ) -> list[Tensor]:
        if self.network is None:
            raise RuntimeError("SharedVGG16.prepare() must run before the first forward")
        return self.network(reconstruction, target, mask, terms)
