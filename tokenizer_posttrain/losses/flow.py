"""Optical-flow loss of NVIDIA's Cosmos tokenizer trainers: the motion between neighbouring frames, measured by
torchvision's RAFT on input and reconstruction, must agree.

Both videos are scaled down by ``scale`` (bilinear), RAFT measures the flow from every frame to the next (forward)
and from every frame to the one before (backward), the flows are scaled back up to the clip's size (and their
vectors by ``scale``), and the term is the L1 between the flows of input and reconstruction, averaged over the two
flow components and the pixels of the frame pairs that count (both frames unmasked). Gradients reach the
reconstruction through RAFT; RAFT itself is frozen, in eval mode, and held outside the training module (no
checkpoint keys, no DDP buckets, no optimizer state).

RAFT runs from torchvision's modules (the weights and layers are torchvision's) under a forward pass of ours, for
speed: every frame of a clip goes through the feature and context encoders once (torchvision's forward encodes
each frame of each pair, four times a frame for both directions), coordinates are made on the GPU in fp32 (no CPU
tensors, which keep a compiled step from CUDA graphs), only the last flow estimate is upsampled, and the recurrent
cells' convolutions are taken apart by input so that the context's share of their gates, the same in every update,
is computed once (:class:`_FactoredGRU`), and the gates' gradients go back channels-last (:class:`_NHWCGradient`).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .context import StepContext
from .l1 import masked_mean
from .terms import Clips, LossTerm, TermConfig
from .weight_files import find_weights_file, read_state_dict, state_problems

RAFT_FILES = {"large": "raft_large_C_T_SKHT_V2-ff5fadd5.pth", "small": "raft_small_C_T_V2-01064c6d.pth"}
"""torchvision's cache file of each RAFT (its default weights: the ones ``raft_large(pretrained=True)`` loads)."""
RAFT_MIN_SIZE = 128
"""The smallest side RAFT takes: its correlation pyramid halves a 1/8-resolution map three times."""
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def raft_size_problem(size: int, scale: int) -> str | None:
    """Why a clip side of ``size`` pixels scaled down by ``scale`` cannot go through RAFT, or None."""
    scaled = size / scale
    if size % scale or size // scale % 8 or scaled < RAFT_MIN_SIZE:
        return f"{size} / {scale} = {scaled:g} pixels, but RAFT needs a multiple of 8 of at least {RAFT_MIN_SIZE}"
    return None


@dataclass
class FlowConfig(TermConfig):
    """L1 between the bidirectional RAFT optical flows of input and reconstruction (NVIDIA's trainers: 0 before
    step 250000, then 0.01). Needs torchvision's RAFT weights file; weight 0 (default): off, no file read."""

    raft: str = "large"
    """RAFT variant: ``large`` (the trainers') or ``small`` (about a fifth of the compute)."""
    weights_path: Optional[str] = None
    """torchvision's RAFT weights file (``raft_large_C_T_SKHT_V2-ff5fadd5.pth`` or
    ``raft_small_C_T_V2-01064c6d.pth``); None looks in the torch hub cache."""
    scale: int = 2
    """RAFT sees the frames scaled down by this factor (the trainers' 2); each side divided by it must be a
    multiple of 8 and at least 128 pixels."""
    dtype: str = "bfloat16"
    """RAFT's weights and convolutions: ``bfloat16`` (the trainers') or ``float32``."""
    flow_updates: int = 12
    """RAFT's refinement iterations (torchvision's and the trainers' 12)."""
    checkpoint_activations: bool = False
    """Recompute RAFT's activations on the reconstruction in the backward pass instead of keeping them (less
    memory, one more RAFT pass)."""

    def build(self) -> "FlowTerm":
        return FlowTerm(self)

    def problems(self, key: str) -> list[str]:
        problems = super().problems(key)
        if self.raft not in RAFT_FILES:
            problems.append(f"{key}.raft={self.raft!r} must be one of {sorted(RAFT_FILES)}")
        if not _is_int(self.scale) or self.scale < 1:
            problems.append(f"{key}.scale={self.scale!r} must be an integer >= 1")
        if self.dtype not in DTYPES:
            problems.append(f"{key}.dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if not _is_int(self.flow_updates) or self.flow_updates < 1:
            problems.append(f"{key}.flow_updates={self.flow_updates!r} must be an integer >= 1")
        if not isinstance(self.checkpoint_activations, bool):
            problems.append(f"{key}.checkpoint_activations={self.checkpoint_activations!r} must be true or false")
        return problems

    def clip_problems(self, key: str, clips: Clips) -> list[str]:
        """RAFT needs two frames, and frame sizes (each of the crop's or aspect buckets') it can take at this
        scale."""
        frames = clips.frames
        problems = [] if frames >= 2 else [f"{key} needs clips of at least 2 frames (data.frames={frames})"]
        if not _is_int(self.scale) or self.scale < 1:
            return problems  # named by problems()
        for height, width in clips.sizes:
            for name, size in (("height", height), ("width", width)):
                problem = raft_size_problem(size, self.scale)
                if problem:
                    problems.append(
                        f"clip {name} {problem} ({key}.scale={self.scale}); use clips of "
                        f"{RAFT_MIN_SIZE * self.scale}+ pixels in steps of {8 * self.scale}, or a smaller {key}.scale"
                    )
        return problems


def build_raft(raft: str = "large") -> nn.Module:
    """torchvision's RAFT (``large`` or ``small``) with random weights, frozen and in eval mode."""
    from torchvision.models.optical_flow import raft_large, raft_small

    network = (raft_large if raft == "large" else raft_small)(weights=None, progress=False)
    return network.eval().requires_grad_(False)


def find_raft_weights(raft: str = "large", path: str | None = None) -> Path:
    """The RAFT weights file: ``path`` if given, else torchvision's cache file under ``torch.hub.get_dir()``.

    Raises ``FileNotFoundError`` saying which file to put where when it is missing.
    """
    what = f"the optical-flow loss (loss.flow, RAFT {raft})"
    off = "or turn the term off: loss.flow.weight=0 (and loss.flow.values=[] loss.flow.boundaries=[] if scheduled)"
    return find_weights_file(RAFT_FILES[raft], path, what, "loss.flow.weights_path", off)


def read_raft_state(path: str | Path, raft: str = "large", mmap: bool = False) -> dict[str, Tensor]:
    """The weights of a torchvision RAFT file, checked against the network's keys and shapes; ``ValueError``
    naming the file and the keys that do not fit. ``mmap`` maps the file instead of reading it (for checks)."""
    state = read_state_dict(path, "RAFT", mmap=mmap)
    with torch.device("meta"):
        expected = build_raft(raft).state_dict()
    problems = state_problems(state, expected)
    if problems:
        shown = problems[:6] + ([f"... {len(problems) - 6} more"] if len(problems) > 6 else [])
        raise ValueError(
            f"{path} does not hold torchvision's RAFT {raft} weights (loss.flow.raft={raft}): " + "; ".join(shown)
        )
    return state


def load_raft(path: str | Path, raft: str = "large") -> nn.Module:
    """torchvision's RAFT with the weights of ``path`` (checked by :func:`read_raft_state`), frozen, eval mode."""
    network = build_raft(raft)
    network.load_state_dict(read_raft_state(path, raft), strict=True)
    return network


def _coordinates(n: int, h: int, w: int, device: torch.device) -> Tensor:
    """``[n, 2, h, w]`` fp32 pixel coordinates, x (column) first, as RAFT counts them; channels-last."""
    rows = torch.arange(h, device=device, dtype=torch.float32).view(h, 1).expand(h, w)
    cols = torch.arange(w, device=device, dtype=torch.float32).view(1, w).expand(h, w)
    return torch.stack([cols, rows], dim=-1).expand(n, h, w, 2).contiguous().permute(0, 3, 1, 2)


class _NHWCGradient(torch.autograd.Function):
    """The identity, whose backward pass hands its gradient on channels-last.

    Where a gradient comes back NCHW to a convolution's NHWC output (Inductor's slice backward of the gates sliced by
    channel, instance norm's backward, the upsampling's softmax), cuDNN's backward convolution converts it with a
    slow aten copy at every call (docs/benchmarks.md, "Flow term alone"). Asked for here, the conversion happens
    inside Inductor's fused kernel that makes the gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


def _nhwc_gradient(x: Tensor) -> Tensor:
    return _NHWCGradient.apply(x)


def _nhwc_output(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
    """A forward hook: the module's output NHWC."""
    return _nhwc(output)


def _nhwc_input_gradient(module: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A forward pre-hook: the gradient of the module's first input goes back channels-last."""
    return (_nhwc_gradient(inputs[0]), *inputs[1:])


def _nhwc(x: Tensor) -> Tensor:
    # cuDNN's tensor-core convolutions work in NHWC: fed NCHW, they convert every input and output (in a profile
    # of the compiled term on an H200, those conversions took 28% of its GPU time).
    return x.contiguous(memory_format=torch.channels_last)


class RAFTFlow(nn.Module):
    """Bidirectional optical flow of every pair of neighbouring frames, from a torchvision RAFT's modules.

    ``forward(frames [N, T, 3, h, w] in [-1, 1])`` -> ``[N, 2 (T - 1), 2, h, w]`` fp32: the flows from frame ``t`` to
    ``t + 1`` for every ``t``, then from ``t + 1`` to ``t``; the same numbers as torchvision's ``RAFT(image1,
    image2)[-1]`` on each pair. ``dtype`` is the convolutions' (autocast; the weights are stored in it), while
    coordinates and flows stay fp32. Always in eval mode (its context encoder's batch norms keep their statistics).
    ``raft`` itself is converted (dtype, NHWC, hooks that keep its instance norms' outputs and input gradients
    NHWC) and frozen in place.
    """

    def __init__(self, raft: nn.Module, dtype: torch.dtype = torch.bfloat16, flow_updates: int = 12) -> None:
        super().__init__()
        from torchvision.models.optical_flow._utils import upsample_flow

        # RAFT's convex upsampling, torchvision's own (bound here: no import inside the compiled forward).
        self._upsample = upsample_flow
        self.raft = raft.to(dtype).to(memory_format=torch.channels_last).requires_grad_(False)
        for module in self.raft.modules():
            # Instance norm (the feature encoder's) returns NCHW whatever its input, and its backward pass hands
            # back an NCHW gradient: the convolutions beside it would convert their inputs and gradients at every
            # call (aten copies; docs/benchmarks.md, "Measurements the source code cites").
            if not isinstance(module, nn.InstanceNorm2d):
                continue
            if _nhwc_output not in module._forward_hooks.values():
                module.register_forward_hook(_nhwc_output)
            if _nhwc_input_gradient not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_nhwc_input_gradient)
        self.dtype = dtype
        self.flow_updates = flow_updates
        self.train(False)

    def train(self, mode: bool = True) -> "RAFTFlow":
        # A frozen loss network: whatever a trainer asks, batch norm must not switch to batch statistics.
        return super().train(False)

    def forward(self, frames: Tensor) -> Tensor:
        n, t, c, h, w = frames.shape
        for size in (h, w):  # static shapes: a check at trace time, nothing in a compiled graph
            problem = raft_size_problem(size, 1)
            if problem:
                raise ValueError(f"loss.flow: RAFT got frames of {h}x{w} (after loss.flow.scale): {problem}")
        corr_block = self.raft.corr_block
        with torch.autocast(frames.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            images = _nhwc(frames.reshape(n * t, c, h, w).to(self.dtype))
            # Each frame encoded once; pairs are picked from the encodings (forward pairs, then backward pairs).
            features = self.raft.feature_encoder(images).unflatten(0, (n, t))
            context = self.raft.context_encoder(images).unflatten(0, (n, t))
            first = _nhwc(torch.cat([features[:, :-1], features[:, 1:]], dim=1).flatten(0, 1))
            second = _nhwc(torch.cat([features[:, 1:], features[:, :-1]], dim=1).flatten(0, 1))
            context = _nhwc(torch.cat([context[:, :-1], context[:, 1:]], dim=1).flatten(0, 1))
            hidden_size = self.raft.update_block.hidden_state_size
            hidden, context = context.split([hidden_size, context.shape[1] - hidden_size], dim=1)
            hidden, context = torch.tanh(hidden), F.relu(context)
            pyramid = _correlation_pyramid(first, second, corr_block.num_levels)
            pairs, _, h8, w8 = first.shape
            coords0 = _coordinates(pairs, h8, w8, frames.device)
            coords1 = coords0
            update = self.raft.update_block
            grus = _factored_grus(update.recurrent_block, hidden_size, context.shape[1])
            # The context does not change over the updates: its share of every gate is computed once.
            context_gates = [gru.context_gates(context) for gru in grus]
            for _ in range(self.flow_updates):
                # As torchvision's RAFT: no gradient through the running estimate, only through each update.
                coords1 = coords1.detach()
                correlation = _look_up(pyramid, coords1, corr_block.radius)
                motion = update.motion_encoder(coords1 - coords0, correlation)
                for gru, gates in zip(grus, context_gates, strict=True):
                    hidden = gru(hidden, motion, gates)
                coords1 = coords1 + update.flow_head(hidden).float()
            # The upsampling's softmax hands the mask's gradient back NCHW; its convolution would convert it.
            mask_predictor = self.raft.mask_predictor
            up_mask = None if mask_predictor is None else _nhwc_gradient(mask_predictor(hidden)).float()
        flow = self._upsample(coords1 - coords0, up_mask)
        return flow.unflatten(0, (n, 2 * (t - 1)))


class _FactoredGRU:
    """One of torchvision's ``ConvGRU`` cells (RAFT's recurrent block) with each gate's convolution taken apart by
    its input channels: hidden state, context, motion features (the order of torchvision's concatenations).

    A convolution of concatenated inputs is the sum of the convolutions of each input with its slice of the weights,
    so the gates are the same numbers (up to rounding); but the context's share is the same in all of an estimate's
    updates and is computed once (:meth:`context_gates`), a third of the cell's work in each update, forward and
    backward, and the gates that read the same input share one convolution. Built from the cell's weights as they
    are now (at each forward pass: nothing to keep in step when weights are loaded), in their dtype and NHWC.
    """

    def __init__(self, gru: nn.Module, hidden: int, context: int) -> None:
        z, r, q = gru.convz, gru.convr, gru.convq
        self.hidden = hidden
        self.padding = z.padding
        self.hidden_zr = _nhwc(torch.cat([z.weight[:, :hidden], r.weight[:, :hidden]]))
        self.hidden_q = _nhwc(q.weight[:, :hidden])
        cut = hidden + context
        self.context = _nhwc(torch.cat([conv.weight[:, hidden:cut] for conv in (z, r, q)]))
        self.motion = _nhwc(torch.cat([conv.weight[:, cut:] for conv in (z, r, q)]))
        self.bias = torch.cat([z.bias, r.bias, q.bias])

    def context_gates(self, context: Tensor) -> Tensor:
        """The context's share of the z, r and q gates, with their biases: ``[N, 3 hidden, h, w]``."""
        return _nhwc_gradient(F.conv2d(context, self.context, self.bias, padding=self.padding))

    def __call__(self, hidden: Tensor, motion: Tensor, context_gates: Tensor) -> Tensor:
        """The cell's next hidden state, as ``ConvGRU.forward(hidden, cat([context, motion]))``."""
        n = self.hidden
        inputs = _nhwc_gradient(F.conv2d(motion, self.motion, padding=self.padding) + context_gates)
        z, r = torch.sigmoid(inputs[:, : 2 * n] + F.conv2d(hidden, self.hidden_zr, padding=self.padding)).split(n, 1)
        q = torch.tanh(inputs[:, 2 * n :] + F.conv2d(r * hidden, self.hidden_q, padding=self.padding))
        return (1 - z) * hidden + z * q


def _factored_grus(block: nn.Module, hidden: int, context: int) -> list[_FactoredGRU]:
    """The cells of torchvision's ``RecurrentBlock`` in order (RAFT small has one; its second is a pass-through)."""
    cells = [block.convgru1, block.convgru2]
    return [_FactoredGRU(cell, hidden, context) for cell in cells if isinstance(cell, nn.Module)]


def _correlation_pyramid(first: Tensor, second: Tensor, levels: int) -> list[Tensor]:
    """RAFT's all-pairs correlation of two ``[N, C, h, w]`` feature maps, ``[N h w, 1, h, w]``, and its
    ``levels - 1`` successive 2x average poolings."""
    n, c, h, w = first.shape
    # [N, h w, C] x [N, C, h w]: views of NHWC feature maps, no copies.
    rows, cols = first.permute(0, 2, 3, 1).flatten(1, 2), second.permute(0, 2, 3, 1).flatten(1, 2).transpose(1, 2)
    volume = torch.matmul(rows, cols) / c**0.5
    pyramid = [volume.reshape(n * h * w, 1, h, w)]
    for _ in range(levels - 1):
        pyramid.append(F.avg_pool2d(pyramid[-1], kernel_size=2, stride=2))
    # fp32 once, not at every one of the updates' look-ups (grid_sample runs in fp32 under autocast anyway).
    return [level.float() for level in pyramid]


def _look_up(pyramid: list[Tensor], coords: Tensor, radius: int) -> Tensor:
    """RAFT's correlation features: each level of the pyramid sampled (bilinear) on the ``(2 radius + 1)^2``
    grid around ``coords`` ``[N, 2, h, w]`` (halved per level), channels in torchvision's order."""
    n, _, h, w = coords.shape
    side = 2 * radius + 1
    offsets = torch.arange(-radius, radius + 1, device=coords.device, dtype=torch.float32)
    # torchvision's neighbourhood: the first offset moves x along the window's rows, the second y along columns.
    delta = torch.stack(torch.meshgrid(offsets, offsets, indexing="ij"), dim=-1).view(1, side, side, 2)
    centres = coords.permute(0, 2, 3, 1).reshape(n * h * w, 1, 1, 2)
    sampled = []
    for volume in pyramid:
        vh, vw = volume.shape[-2:]
        points = centres + delta
        # Absolute pixel positions -> grid_sample's [-1, 1] with align_corners=True.
        grid = torch.cat([2 * points[..., :1] / (vw - 1) - 1, 2 * points[..., 1:] / (vh - 1) - 1], dim=-1)
        values = F.grid_sample(volume, grid, mode="bilinear", align_corners=True)
        sampled.append(values.view(n, h, w, side * side))
        centres = centres / 2
    return torch.cat(sampled, dim=-1).permute(0, 3, 1, 2)  # NHWC in memory, as the convolutions take it


def bidirectional_flow(video: Tensor, network: nn.Module, scale: int) -> Tensor:
    """``[B, 3, T, H, W]`` -> ``[B, 2, 2 (T - 1), H, W]`` fp32: ``network``'s forward then backward flows of the
    video scaled down by ``scale``, scaled back up (size and vectors), as NVIDIA's trainers compute them."""
    b, c, t, h, w = video.shape
    frames = video.transpose(1, 2)
    if scale > 1:
        small = F.interpolate(frames.reshape(b * t, c, h, w), size=(h // scale, w // scale), mode="bilinear")
        frames = small.unflatten(0, (b, t))
    flow = network(frames).float()  # [B, 2 (T-1), 2, h, w]
    if scale > 1:
        flow = scale * F.interpolate(flow.flatten(0, 1), size=(h, w), mode="bilinear").unflatten(0, flow.shape[:2])
    return flow.transpose(1, 2)


def pair_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    """``[B, 1, T, H, W]`` pixel mask -> ``[B, 1, 2 (T - 1), H, W]``: 1 where a pixel counts in both frames of a
    pair, for the forward pairs, then the backward ones."""
    b, _, t, h, w = shape
    mask = mask.float().expand(b, 1, t, h, w)
    both = mask[:, :, :-1] * mask[:, :, 1:]
    return torch.cat([both, both], dim=2)


class FlowTerm(LossTerm):
    """Mask-weighted L1 between the :func:`bidirectional_flow` of input and reconstruction.

    ``network`` replaces RAFT (any module with :class:`RAFTFlow`'s ``forward``); without it, the weights file is
    found at launch (:meth:`check`) and RAFT built the first time the term is on (:meth:`prepare`).
    """

    def __init__(self, config: FlowConfig, network: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.config = config
        self.injected = network is not None
        self.network = network

    def check(self) -> None:
        if not self.injected:
            read_raft_state(find_raft_weights(self.config.raft, self.config.weights_path), self.config.raft, mmap=True)

    def prepare(self, device: torch.device) -> None:
        if self.network is None:
            raft = load_raft(find_raft_weights(self.config.raft, self.config.weights_path), self.config.raft)
            self.network = RAFTFlow(raft, DTYPES[self.config.dtype], self.config.flow_updates)
        self.network.to(device)

    def forward(self, context: StepContext) -> Tensor:
        if self.network is None:
            raise RuntimeError("FlowTerm.prepare() must run before the first forward")
        reconstruction, target, mask = context.reconstruction, context.target, context.mask
        if reconstruction.shape[2] < 2:
            raise ValueError(f"loss.flow needs clips of at least 2 frames, got {tuple(reconstruction.shape)}")
        scale = self.config.scale
        with torch.no_grad():
            target_flow = bidirectional_flow(target, self.network, scale)
        if self.config.checkpoint_activations and torch.is_grad_enabled() and reconstruction.requires_grad:
            flow = checkpoint(bidirectional_flow, reconstruction, self.network, scale, use_reentrant=False)
        else:
            flow = bidirectional_flow(reconstruction, self.network, scale)
        return masked_mean((flow - target_flow).abs(), pair_mask(mask, reconstruction.shape))
