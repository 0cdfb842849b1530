"""Whole videos through a tokenizer: any length (windows in time), any size (padding, optional tiles).

Videos are uint8 ``[T, H, W, 3]`` tensors; nothing here reads or writes files.

**Space.** H and W are padded to multiples of the spatial compression by repeating the
edge pixels (zeros would put a dark frame around the picture that the network then
reconstructs into the border) and cropped back afterwards. With ``tile`` the padded frame
is cut into ``tile`` x ``tile`` tiles overlapping by at least ``tile_overlap`` pixels, and
the tile outputs are blended with weights that fall linearly to zero across each overlap,
so no tile edge shows. Tiles bound the memory of large frames; the network's per-frame
normalisation and spatial attention see one tile at a time, so tiled output is close to,
not identical with, whole-frame output.

**Time.** The network takes ``1 + k*tc`` frames (``tc`` = temporal compression) and is
causal: the first frame of a clip is coded on its own, like an image, and each later group
of ``tc`` frames becomes one latent frame that leans on everything before it. Windows of
``window`` frames are run one at a time:

- the first window covers frames ``[0, window)``;
- every later window starts ``context`` frames *before* the first frame it is responsible
  for, and its first ``context`` output frames are dropped: they only warm the causal
  network up. Each window adds ``window - context`` new frames;
- ``context`` is 0 or ``1 + m*tc`` (1, 9, 17, ... for the 8x models), like a clip length:
  the re-read part is then the window's image frame plus ``m`` whole groups, so the kept
  frames are whole groups on the same latent grid as one long pass over the video, and
  they are coded with ``context`` frames of real past. Default: about half the window
  (9 for window 17, 17 for 33); ``context=1`` overlaps just the image frame and costs
  ``1/(window-1)`` more compute;
- ``context=0`` gives back-to-back independent windows (the official Cosmos chunking):
  every window restarts from an image frame, which shows as seams;
- the last window is padded to the next ``1 + k*tc`` frames by repeating the video's last
  frame, and cropped.

How far each choice lands from one pass over the whole clip is measured in docs/benchmarks.md
("Windows and tiles of whole-video inference").

``window=0`` is that one pass: the whole video (padded to ``1 + k*tc`` frames) as one window, what the Wan VAEs'
official code and consumers do and the default for networks that run a clip in chunks of time
(``VideoTokenizer.chunks_in_time``): they carry the causal state from chunk to chunk (``time_chunk`` latent frames
each), so the result is the whole clip's in a chunk's memory.

:func:`encode` uses the same windows with ``context=0`` by default (one latent per disjoint
clip, which is what downstream models consume) and pads every window to ``window`` frames
so that the latents stack. :func:`decode` of its output reproduces :func:`reconstruct`
with the same ``window`` and ``context``: the padding frames never reach the kept frames
of a causal network.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..network import VideoTokenizer
from .media import to_frames

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
"""Spellings (command line, NeMo-Run recipes) of the supported compute dtypes."""


def default_context(network: VideoTokenizer, window: int) -> int:
    """Re-read frames for ``window``: about half of it, as a clip length (17 -> 9, 33 -> 17, 9 -> 1)."""
    tc = network.config.temporal_compression
    return 1 + (window - 1) // 2 // tc * tc if window > 1 else 0


def _as_int(value: object, name: str) -> int:
    try:
        return operator.index(value)  # numpy and torch integer scalars too, but never a float
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


INFERENCE_TIME_CHUNK = 2
"""Latent frames per chunk of the causal pass in inference (networks that chunk): 9 frames in memory at once
(the official code holds 5), so the convolutions see fewer, longer pieces."""


def default_window(network: VideoTokenizer) -> int:
    """The whole video (0) for a network that runs it in chunks of time, else 17 frames."""
    return 0 if network.chunks_in_time else 17


def _check_window(network: VideoTokenizer, window: int, context: int | None, default: int | None) -> int:
    """Validate ``window`` and ``context``; return the context to use."""
    tc = network.config.temporal_compression
    window, context = _as_int(window, "window"), None if context is None else _as_int(context, "context")
    if window == 0:  # the whole video: nothing to re-read
        if context:
            raise ValueError(f"context={context} needs windows; window=0 runs the whole video in one pass (use 0)")
        return 0
    if window < 1 or (window - 1) % tc:
        lo = 1 + max(window - 1, 0) // tc * tc
        raise ValueError(f"window={window} is not 1+{tc}k frames for {network.config.name} (use {lo} or {lo + tc})")
    if context is None:
        context = default_context(network, window) if default is None else default
    if context < 0 or (context and (context - 1) % tc) or context >= window:
        raise ValueError(
            f"context={context} must be 0 or 1+{tc}m frames (1, {1 + tc}, {1 + 2 * tc}, ...) and smaller than the "
            f"window ({window}); e.g. {default_context(network, window)}"
        )
    return context


@dataclass(frozen=True)
class Options:
    """How :func:`reconstruct` and :func:`encode` run a video through the network (module docstring)."""

    window: int = 17
    """Frames through the network at once: ``1 + k*tc``; 0: the whole video in one causal pass (module
    docstring; :func:`default_window` gives each network's default)."""
    context: int | None = None
    """Frames each window after the first re-reads as causal warm-up: 0 or ``1 + m*tc``. None: the default,
    :func:`default_context` for :func:`reconstruct`, 0 (disjoint windows) for :func:`encode`."""
    tile: int | None = None
    """Pixels (a multiple of the spatial compression): large frames go through in feather-blended tiles."""
    tile_overlap: int = 32
    """Pixels the tiles overlap by at least."""
    dtype: torch.dtype = torch.float32
    """``torch.bfloat16`` runs under autocast over the fp32 weights."""
    device: str | torch.device = "cpu"
    """Where the network runs; it is moved there and run in eval mode (its train/eval mode restored afterwards)."""
    time_chunk: int | None = None
    """Latent frames per chunk of the causal pass, for a network that runs in chunks of time (the same result,
    less memory); None: :data:`INFERENCE_TIME_CHUNK`; 0: the whole window at once."""


def check_options(
    network: VideoTokenizer,
    options: Options = Options(),  # noqa: B008 - frozen
    encoding: bool = False,
) -> int:
    """Raise a clear ``ValueError`` for options :func:`reconstruct` (``encoding=False``) or
    :func:`encode` (``True``) would refuse; return the ``context`` they would use.

    Lets a caller fail fast, before reading a long video.
    """
    context = _check_window(network, options.window, options.context, 0 if encoding else None)
    _check_tile(network, options.tile, options.tile_overlap)
    _time_chunk(network, options.time_chunk)
    return context


def _time_chunk(network: VideoTokenizer, time_chunk: int | None) -> int:
    """The network's chunk length for ``time_chunk`` (0 for a network that does not chunk)."""
    if time_chunk is None:
        return INFERENCE_TIME_CHUNK if network.chunks_in_time else 0
    time_chunk = _as_int(time_chunk, "time_chunk")
    if time_chunk < 0:
        raise ValueError(f"time_chunk={time_chunk} must be 0 (the whole window at once) or more latent frames")
    if time_chunk and not network.chunks_in_time:
        raise ValueError(f"time_chunk={time_chunk}: {network.config.name} cannot run in chunks of time; use 0")
    return time_chunk


def _whole(window: int, frames: int, tc: int) -> int:
    """``window``, or for 0 the video's length rounded up to ``1 + k*tc`` frames."""
    return window or 1 + _round_up(max(frames - 1, 0), tc)


def _check_tile(network: VideoTokenizer, tile: int | None, overlap: int) -> None:
    sc = network.config.spatial_compression
    if tile is None:
        return
    if tile < sc or tile % sc:
        raise ValueError(f"tile={tile} must be a positive multiple of {sc} pixels for {network.config.name}")
    if overlap < 0 or overlap >= tile:
        raise ValueError(f"tile_overlap={overlap} must be at least 0 and smaller than the tile ({tile})")


def _as_video(video: Tensor | np.ndarray) -> Tensor:
    video = torch.as_tensor(video)
    if video.dtype != torch.uint8 or video.dim() != 4 or video.shape[-1] != 3 or 0 in video.shape:
        raise ValueError(
            f"expected uint8 frames [T, H, W, 3] with T, H, W >= 1, got {video.dtype} {tuple(video.shape)}"
        )
    return video


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _windows(frames: int, window: int, context: int) -> list[tuple[int, int, int]]:
    """``(start, stop, drop)`` per window: it reads frames ``[start, stop)`` and keeps ``[start + drop, stop)``."""
    spans, begin = [], 0
    while begin < frames:
        start = max(begin - context, 0)
        stop = min(start + window, frames)
        spans.append((start, stop, begin - start))
        begin = stop
    return spans


@contextmanager
def _session(
    network: VideoTokenizer, dtype: torch.dtype, device: str | torch.device, time_chunk: int | None = None
) -> Iterator[torch.device]:
    """Eval mode on ``device``, no autograd, bf16 autocast over fp32 weights when asked, the causal pass in chunks
    of ``time_chunk`` (:class:`Options`)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available (use cpu)")
    was_training, was_chunk = network.training, network.time_chunk
    network.to(device).eval()
    if network.chunks_in_time:
        network.time_chunk = _time_chunk(network, time_chunk)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            yield device
    finally:
        network.train(was_training)
        if network.chunks_in_time:
            network.time_chunk = was_chunk


def _to_network(clip: Tensor, device: torch.device, frames: int, height: int, width: int) -> Tensor:
    """uint8 ``[t, H, W, 3]`` -> ``[1, 3, frames, height, width]`` in [-1, 1], edge-padded."""
    x = clip.to(device).permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1
    t, h, w = x.shape[2:]
    return F.pad(x, (0, width - w, 0, height - h, 0, frames - t), mode="replicate")


def _ramp(n: int, fade_lo: bool, fade_hi: bool, fade: int, device: torch.device) -> Tensor:
    w = torch.ones(n, device=device)
    fade = min(fade, n)
    if fade > 0:
        up = torch.arange(1, fade + 1, device=device) / (fade + 1)
        if fade_lo:
            w[:fade] = torch.minimum(w[:fade], up)
        if fade_hi:
            w[n - fade :] = torch.minimum(w[n - fade :], up.flip(0))
    return w


def _starts(size: int, tile: int, step: int) -> list[int]:
    if size <= tile:
        return [0]
    return [*range(0, size - tile, step), size - tile]


def _tiled(
    fn: Callable[[Tensor], Tensor], x: Tensor, tile: int | None, overlap: int, align: int, scale: float
) -> Tensor:
    """``fn`` over overlapping spatial tiles of ``x`` ``[B, C, T, H, W]``, outputs feather-blended.

    ``fn`` maps a tile to an output ``scale`` times its size; tile starts are multiples of
    ``align`` so every tile sees the same patch grid as the whole frame.
    """
    height, width = x.shape[-2:]
    if tile is None or (height <= tile and width <= tile):
        return fn(x)
    step = max(align, (tile - overlap) // align * align)
    fade = round(overlap * scale)
    out = weight = None
    for top in _starts(height, tile, step):
        for left in _starts(width, tile, step):
            y = fn(x[..., top : top + tile, left : left + tile]).float()
            h, w = y.shape[-2:]
            oy, ox = round(top * scale), round(left * scale)
            if out is None:
                out = y.new_zeros(*y.shape[:-2], round(height * scale), round(width * scale))
                weight = y.new_zeros(out.shape[-2:])
            wy = _ramp(h, top > 0, top + tile < height, fade, y.device)
            wx = _ramp(w, left > 0, left + tile < width, fade, y.device)
            mask = wy[:, None] * wx[None, :]
            out[..., oy : oy + h, ox : ox + w] += y * mask
            weight[oy : oy + h, ox : ox + w] += mask
    return out / weight


def reconstruct(
    network: VideoTokenizer,
    video: Tensor,
    options: Options = Options(),  # noqa: B008 - frozen
    on_window: Callable[[int], object] | None = None,
) -> Tensor:
    """Reconstruct a uint8 video ``[T, H, W, 3]`` of any length and size; returns the same shape, on the CPU.

    ``options.window`` frames go through the network at once; each window after the first re-reads
    ``options.context`` frames (default :func:`default_context`) as causal warm-up and drops their output
    (module docstring); ``options.tile`` processes large frames in tiles (:class:`Options`). ``on_window`` is
    called after each window with the frames done so far (a progress report).
    """
    video = _as_video(video)
    context = check_options(network, options)
    cfg = network.config
    tc, sc = cfg.temporal_compression, cfg.spatial_compression
    frames, height, width = video.shape[:3]
    window = _whole(options.window, frames, tc)
    out = torch.empty_like(video, device="cpu")
    with _session(network, options.dtype, options.device, options.time_chunk) as dev:
        for start, stop, drop in _windows(frames, window, context):
            padded = 1 + _round_up(stop - start - 1, tc)
            x = _to_network(video[start:stop], dev, padded, _round_up(height, sc), _round_up(width, sc))
            y = _tiled(network, x, options.tile, options.tile_overlap, sc, 1.0)
            out[start + drop : stop] = to_frames(y[:, :, drop : stop - start, :height, :width])
            if on_window is not None:
                on_window(stop)
    return out


def encode(
    network: VideoTokenizer,
    video: Tensor,
    options: Options = Options(),  # noqa: B008 - frozen
    on_window: Callable[[int], object] | None = None,
) -> dict[str, Tensor]:
    """Encode a uint8 video ``[T, H, W, 3]`` window by window; returns CPU tensors.

    CV: ``{"latent": [n, C, t, h, w]}`` in ``options.dtype``; DV: ``{"indices": int32 [n, t, h, w]}``;
    one row per window, every window padded to ``options.window`` frames (``window=0``: one row, the whole
    video padded to ``1 + k*tc`` frames; ``window`` then records that length). Both also hold 0-dim int64
    ``frames``, ``height``, ``width``, ``window`` and ``context`` for :func:`decode`.
    ``options.context`` defaults to 0 here: disjoint windows, and ``decode`` gives what
    ``reconstruct`` with ``context=0`` gives. With ``context > 0`` the windows overlap as in
    :func:`reconstruct` and ``decode`` drops the warm-up frames again. With ``options.tile``, the
    tiles' pre-quantization latents are blended (DV quantizes the blend). ``on_window``: as in
    :func:`reconstruct`.
    """
    video = _as_video(video)
    context = check_options(network, options, encoding=True)
    cfg = network.config
    sc = cfg.spatial_compression
    frames, height, width = video.shape[:3]
    window, dtype = _whole(options.window, frames, cfg.temporal_compression), options.dtype

    def pre_quant(x: Tensor) -> Tensor:
        network.check_video(x)
        return network.encoder_output(x)

    rows = []
    with _session(network, dtype, options.device, options.time_chunk) as dev:
        for start, stop, _ in _windows(frames, window, context):
            x = _to_network(video[start:stop], dev, window, _round_up(height, sc), _round_up(width, sc))
            z = _tiled(pre_quant, x, options.tile, options.tile_overlap, sc, 1.0 / sc)
            tokens = network.encoding_of(z).tokens
            rows.append(tokens if cfg.is_discrete else tokens.to(dtype))
            if on_window is not None:
                on_window(stop)
    stacked = torch.cat(rows).cpu()
    meta = {"frames": frames, "height": height, "width": width, "window": window, "context": context}
    return {"indices" if cfg.is_discrete else "latent": stacked, **{k: torch.tensor(v) for k, v in meta.items()}}


def decode(
    network: VideoTokenizer,
    encoded: dict[str, Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tile: int | None = None,
    tile_overlap: int = 32,
    on_window: Callable[[int], object] | None = None,
    time_chunk: int | None = None,
) -> Tensor:
    """Invert :func:`encode`: uint8 video ``[frames, height, width, 3]``.

    ``tile`` (pixels of the output) decodes in feather-blended spatial tiles. ``on_window``: as in
    :func:`reconstruct`; ``time_chunk``: as in :class:`Options`.
    """
    cfg = network.config
    key, other = ("indices", "latent") if cfg.is_discrete else ("latent", "indices")
    if key not in encoded:
        hint = f"; it holds {other!r}, from a {'CV' if other == 'latent' else 'DV'} model" if other in encoded else ""
        raise ValueError(f"{cfg.name} decodes {key!r}, which the encoded data lacks{hint}")
    try:
        frames, height, width, window, context = (
            int(encoded[k]) for k in ("frames", "height", "width", "window", "context")
        )
    except KeyError as err:
        raise ValueError(
            f"encoded data lacks {err.args[0]!r}: write it with tokenizer_posttrain.evaluation.inference.encode"
        ) from err
    context = check_options(network, Options(window, context, tile, tile_overlap, time_chunk=time_chunk), encoding=True)
    rows = encoded[key]
    spans = _windows(frames, window, context)
    if rows.shape[0] != len(spans):
        raise ValueError(
            f"{rows.shape[0]} encoded windows, but {frames} frames in windows of {window} need {len(spans)}"
        )
    sc = cfg.spatial_compression
    tile_latent = None if tile is None else tile // sc
    out = torch.empty(frames, height, width, 3, dtype=torch.uint8)
    with _session(network, dtype, device, time_chunk) as dev:
        for row, (start, stop, drop) in zip(rows, spans, strict=True):
            row = row.unsqueeze(0).to(dev)
            z = network.indices_to_latent(row) if cfg.is_discrete else row.float()
            y = _tiled(network.decode, z, tile_latent, tile_overlap // sc, 1, float(sc))
            out[start + drop : stop] = to_frames(y[:, :, drop : stop - start, :height, :width])
            if on_window is not None:
                on_window(stop)
    return out
