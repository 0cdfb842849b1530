"""Whole-video inference: windows in time, padding and tiles in space, encode/decode and the CLI."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY, reference_weights
from tests.videos import frames_array
from tokenizer_posttrain.evaluation import inference
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.network.cosmos import CausalVideoTokenizer

MODELS = ("CV8x8x8", "DV8x16x16")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def nets() -> dict[str, CausalVideoTokenizer]:
    return {name: load_tokenizer(reference_weights(name), channels=TINY[name]).eval() for name in MODELS}


@pytest.fixture(scope="module")
def tame(nets: dict[str, CausalVideoTokenizer]) -> dict[str, CausalVideoTokenizer]:
    """The random reference models with their last layer scaled down.

    Their raw outputs reach |2|, so most pixels clip to 0 or 255 and hide every difference
    this file wants to measure; x0.2 keeps them inside [-1, 1] (the output is linear in it).
    """
    out = {}
    for name, net in nets.items():
        net = copy.deepcopy(net)
        with torch.no_grad():
            last = net.decoder.conv_out[1].conv3d
            last.weight.mul_(0.2)
            last.bias.mul_(0.2)
        out[name] = net
    return out


def smooth_video(frames: int, height: int, width: int) -> torch.Tensor:
    """uint8 ``[T, H, W, 3]``: slowly drifting colour gradients."""
    t = torch.arange(frames, dtype=torch.float32).view(-1, 1, 1, 1)
    y = torch.arange(height, dtype=torch.float32).view(1, -1, 1, 1)
    x = torch.arange(width, dtype=torch.float32).view(1, 1, -1, 1)
    c = torch.tensor([1.0, 0.7, 0.4]).view(1, 1, 1, 3)
    v = 128 + 90 * torch.sin(0.08 * (x + 0.5 * y) * c + 0.15 * t * c) + 20 * torch.cos(0.1 * y - 0.1 * t)
    return v.round().clamp(0, 255).to(torch.uint8)


def one_pass(net: CausalVideoTokenizer, video: torch.Tensor) -> torch.Tensor:
    """The network over the whole clip at once (T must be 1+8k, H and W multiples of 16)."""
    with torch.no_grad():
        y = net(video.permute(3, 0, 1, 2)[None].float() / 127.5 - 1)
    return ((y[0] + 1) * 127.5).round().clamp(0, 255).permute(1, 2, 3, 0)


# -- the core ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("size", [(1, 40, 72), (5, 37, 50), (17, 40, 72), (30, 37, 50)])
def test_reconstruct_keeps_length_and_size(nets: dict, name: str, size: tuple[int, int, int]) -> None:
    video = torch.from_numpy(frames_array(*size))
    out = inference.reconstruct(nets[name], video)
    assert out.shape == video.shape and out.dtype == torch.uint8


@pytest.mark.parametrize("window", [1, 9, 17, 33])
def test_windows_keep_every_frame_once_on_the_latent_grid(window: int) -> None:
    contexts = [0] + list(range(1, window, 8))
    for frames in range(1, 80):
        for context in contexts:
            spans = inference._windows(frames, window, context)
            kept = [t for start, stop, drop in spans for t in range(start + drop, stop)]
            assert kept == list(range(frames)), (frames, context)
            assert all(0 < stop - start <= window for start, stop, _ in spans)
            if context:
                # Later windows keep whole latent groups of one pass (1..8, 9..16, ...).
                assert all((start + drop) % 8 == 1 and drop == context for start, _, drop in spans[1:])


@pytest.mark.parametrize("name", MODELS)
def test_windowed_follows_one_pass_when_windows_overlap(tame: dict, name: str) -> None:
    net, video = tame[name], smooth_video(49, 32, 48)
    ref = one_pass(net, video)
    gap, near = {}, [17, 18, 19]  # the frames right after the first seam
    for context in (0, 1, 9):
        out = inference.reconstruct(net, video, inference.Options(window=17, context=context)).float()
        # Causal: the first window is exactly the start of one pass over the whole clip.
        assert (out[:17] - ref[:17]).abs().max() <= 1
        gap[context] = ((out[17:] - ref[17:]).abs().mean().item(), (out[near] - ref[near]).abs().mean().item())
    # Independent windows restart from an image frame off the latent grid; overlapping ones stay on it.
    for context in (1, 9):
        assert gap[context][0] < 0.3 * gap[0][0], gap
        assert gap[context][1] < 0.3 * gap[0][1], gap


@pytest.mark.parametrize(
    ("fn", "align", "scale"),
    [
        (lambda x: torch.tanh(3 * x) - 0.25, 8, 1.0),  # per pixel, like nothing a tile edge can change
        (lambda x: F.avg_pool3d(x, (1, 8, 8)), 8, 1 / 8),  # encoder-like: 8x smaller
        (lambda x: x.repeat_interleave(16, -1).repeat_interleave(16, -2), 1, 16.0),  # decoder-like
    ],
)
def test_tiles_blend_back_to_the_whole_frame(fn, align: int, scale: float) -> None:  # noqa: ANN001
    x = torch.randn(1, 3, 2, 40, 72) if align == 8 else torch.randn(1, 6, 2, 5, 9)
    tile, overlap = (24, 8) if align == 8 else (3, 1)
    torch.testing.assert_close(inference._tiled(fn, x, tile, overlap, align, scale), fn(x))
    torch.testing.assert_close(inference._tiled(fn, x, None, overlap, align, scale), fn(x))


@pytest.mark.parametrize("name", MODELS)
def test_tiled_model_keeps_sizes(tame: dict, name: str) -> None:
    net, video = tame[name], smooth_video(9, 50, 83)
    key = "latent" if name.startswith("CV") else "indices"
    whole, encoded = inference.reconstruct(net, video).float(), inference.encode(net, video)
    tiled = inference.reconstruct(net, video, inference.Options(tile=48, tile_overlap=32))
    assert tiled.shape == video.shape and tiled.dtype == torch.uint8
    # Per-frame GroupNorm and spatial attention see one tile at a time, so tiles cannot equal the
    # whole frame; a briefly trained CV8x8x8 differs by about one grey level (module docstring),
    # these random weights by up to ~30, so this bound only catches misplaced tiles.
    assert (tiled.float() - whole).abs().mean() < 40
    tiled_encoded = inference.encode(net, video, inference.Options(tile=48, tile_overlap=32))
    assert tiled_encoded[key].shape == encoded[key].shape and tiled_encoded[key].dtype == encoded[key].dtype
    assert inference.decode(net, tiled_encoded, tile=48, tile_overlap=32).shape == video.shape
    # A tile as large as the (padded) frame is no tiling at all.
    whole_frame = inference.Options(tile=96, tile_overlap=32)
    assert torch.equal(inference.reconstruct(net, video, whole_frame), whole.to(torch.uint8))
    assert torch.equal(inference.encode(net, video, whole_frame)[key], encoded[key])


def test_bf16_autocast_is_close_to_fp32(tame: dict) -> None:
    net, video = tame["CV8x8x8"], smooth_video(9, 32, 32)
    full = inference.reconstruct(net, video).float()
    half = inference.reconstruct(net, video, inference.Options(dtype=torch.bfloat16)).float()
    assert (half - full).abs().mean() < 3
    assert next(net.parameters()).dtype == torch.float32  # autocast, not a cast of the weights
    assert inference.encode(net, video, inference.Options(dtype=torch.bfloat16))["latent"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", MODELS)
def test_encode_decode_is_reconstruct(nets: dict, name: str) -> None:
    net, video = nets[name], torch.from_numpy(frames_array(30, 37, 50))
    encoded = inference.encode(net, video)
    if name.startswith("CV"):
        assert encoded["latent"].shape == (2, 16, 3, 5, 7) and encoded["latent"].dtype == torch.float32
    else:
        assert encoded["indices"].shape == (2, 3, 3, 4) and encoded["indices"].dtype == torch.int32
    assert {k: int(v) for k, v in encoded.items() if v.dim() == 0} == {
        "frames": 30,
        "height": 37,
        "width": 50,
        "window": 17,
        "context": 0,
    }
    decoded = inference.decode(net, encoded)
    assert decoded.shape == video.shape and decoded.dtype == torch.uint8
    assert (decoded.int() - inference.reconstruct(net, video, inference.Options(context=0)).int()).abs().max() <= 1
    # With overlapping windows the latents overlap too, and decode drops the warm-up again.
    overlapping = inference.encode(net, video, inference.Options(context=9))
    assert overlapping["latent" if name.startswith("CV") else "indices"].shape[0] == 3
    assert (inference.decode(net, overlapping).int() - inference.reconstruct(net, video).int()).abs().max() <= 1


def test_decode_refuses_data_it_cannot_decode(nets: dict) -> None:
    encoded = inference.encode(nets["CV8x8x8"], torch.from_numpy(frames_array(1, 16, 16)))
    with pytest.raises(ValueError, match="decodes 'indices'.*'latent'"):
        inference.decode(nets["DV8x16x16"], encoded)
    with pytest.raises(ValueError, match="lacks 'frames'"):
        inference.decode(nets["CV8x8x8"], {"latent": encoded["latent"]})
    with pytest.raises(ValueError, match="windows"):
        inference.decode(nets["CV8x8x8"], {**encoded, "frames": torch.tensor(40)})


def test_bad_options_raise_clear_errors(nets: dict) -> None:
    net, video = nets["CV8x8x8"], torch.from_numpy(frames_array(3, 16, 16))
    for kwargs, message in [
        ({"window": 16}, r"window=16 is not 1\+8k frames .*use 9 or 17"),
        ({"context": 8}, r"context=8 must be 0 or 1\+8m"),
        ({"window": 9, "context": 9}, "smaller than the window"),
        ({"tile": 20}, "tile=20 must be a positive multiple of 8"),
        ({"tile": 32, "tile_overlap": 32}, "tile_overlap=32"),
        ({"dtype": torch.float16}, "dtype must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            inference.reconstruct(net, video, inference.Options(**kwargs))
    with pytest.raises(ValueError, match=r"uint8 frames \[T, H, W, 3\]"):
        inference.reconstruct(net, video.float())


# -- the command line ------------------------------------------------------------------------


def test_wan_windows_of_1_plus_4k_frames_and_tiles() -> None:
    from tests.evaluation.wan_base import tiny_wan

    network = tiny_wan()
    video = frames_array(11, 20, 28)
    # Windows of 5 frames re-reading 1: 1 + 4k, as the 4x temporal compression asks; sizes cropped back.
    assert inference.reconstruct(network, video, inference.Options(window=5, context=1)).shape == (11, 20, 28, 3)
    with pytest.raises(ValueError, match=r"window=6 is not 1\+4k frames for Wan2.1-VAE \(use 5 or 9\)"):
        inference.check_options(network, inference.Options(window=6))
    # Encode in tiles (the posterior's moments blended), decode in tiles: the video's size again, and with
    # disjoint whole-frame windows, what reconstruct gives.
    tiled = inference.encode(network, video, inference.Options(window=5, tile=16, tile_overlap=8))
    assert tiled["latent"].shape == (3, 16, 2, 3, 4)
    assert inference.decode(network, tiled, tile=16, tile_overlap=8).shape == (11, 20, 28, 3)
    whole = inference.decode(network, inference.encode(network, video, inference.Options(window=5)))
    direct = inference.reconstruct(network, video, inference.Options(window=5, context=0))
    assert (whole.int() - direct.int()).abs().max() <= 1


def test_a_wan_video_goes_through_in_one_causal_pass_in_chunks_of_time() -> None:
    from tests.evaluation.wan_base import tiny_wan

    network = tiny_wan()
    video = frames_array(11, 16, 24)  # padded to 13 frames: 4 latent frames
    assert inference.default_window(network) == 0
    whole = inference.Options(window=0, time_chunk=0)
    one_pass = inference.reconstruct(network, video, whole)
    for time_chunk in (None, 1):  # the default (2 latent frames), the official code's chunks
        chunked = inference.reconstruct(network, video, inference.Options(window=0, time_chunk=time_chunk))
        assert (chunked.int() - one_pass.int()).abs().max() <= 1
    assert network.time_chunk == 0  # the session's chunking is undone
    encoded = inference.encode(network, video, inference.Options(window=0))
    assert encoded["latent"].shape == (1, 16, 4, 2, 3) and int(encoded["window"]) == 13
    assert (inference.decode(network, encoded, time_chunk=1).int() - one_pass.int()).abs().max() <= 1
    with pytest.raises(ValueError, match=r"context=5 needs windows; window=0 runs the whole video"):
        inference.check_options(network, inference.Options(window=0, context=5))


def test_time_chunks_are_refused_for_a_network_that_cannot_chunk(nets: dict) -> None:
    with pytest.raises(ValueError, match=r"time_chunk=2: CV8x8x8 cannot run in chunks of time; use 0"):
        inference.check_options(nets["CV8x8x8"], inference.Options(time_chunk=2))
