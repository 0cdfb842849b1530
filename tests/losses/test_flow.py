"""The optical-flow term: our RAFT pass against torchvision's, the term by hand with a flow network of ours, the mask,
gradients, dtype, activation checkpointing, and the RAFT file (found at launch, built when first on, clear errors)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from tokenizer_posttrain.losses import LossConfig, StepContext, build_loss
from tokenizer_posttrain.losses.flow import (
    RAFT_FILES,
    FlowConfig,
    FlowTerm,
    RAFTFlow,
    _coordinates,
    _correlation_pyramid,
    _look_up,
    _nhwc_gradient,
    bidirectional_flow,
    build_raft,
    find_raft_weights,
    load_raft,
    read_raft_state,
)
from tokenizer_posttrain.losses.terms import Clips

CPU = torch.device("cpu")


class ShiftFlow(nn.Module):
    """A flow network of ours for known answers: the whole-frame horizontal shift (in -3 ... 3 pixels) that best
    maps each frame onto its neighbour, as a constant flow."""

    def forward(self, frames: Tensor) -> Tensor:
        n, t, _, h, w = frames.shape
        first = torch.cat([frames[:, :-1], frames[:, 1:]], dim=1)
        second = torch.cat([frames[:, 1:], frames[:, :-1]], dim=1)
        shifts = torch.arange(-3, 4)
        errors = torch.stack([(first.roll(int(s), dims=-1) - second).abs().mean(dim=(2, 3, 4)) for s in shifts])
        best = shifts[errors.argmin(dim=0)].float()  # [N, 2 (T-1)]
        flow = torch.zeros(n, 2 * (t - 1), 2, h, w)
        flow[:, :, 0] = best[..., None, None]
        return flow


def moving_video(frames: int, size: int, pixels_per_frame: int) -> Tensor:
    """``[1, 3, T, size, size]``: a random image rolled right by ``pixels_per_frame`` each frame."""
    image = torch.rand(1, 3, 1, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return torch.cat([image.roll(i * pixels_per_frame, dims=-1) for i in range(frames)], dim=2)


def smooth_frames(n: int, t: int, size: int = 128) -> Tensor:
    """``[n, t, 3, size, size]`` frames in [-1, 1] with structure RAFT can follow: blurred noise, moving."""
    noise = torch.rand(n, 1, 3, size // 8, size // 8, generator=torch.Generator().manual_seed(1))
    base = torch.nn.functional.interpolate(noise.flatten(0, 1), size=(size, size), mode="bicubic").unflatten(0, (n, 1))
    return torch.cat([base.roll(2 * i, dims=-1) for i in range(t)], dim=1).clamp(0, 1) * 2 - 1


@pytest.fixture(scope="module")
def raft_small() -> nn.Module:
    torch.manual_seed(0)
    return build_raft("small")


@pytest.fixture(scope="module")
def raft_small_file(tmp_path_factory: pytest.TempPathFactory, raft_small: nn.Module) -> Path:
    path = tmp_path_factory.mktemp("raft") / RAFT_FILES["small"]
    torch.save(raft_small.state_dict(), path)
    return path


def test_the_look_up_reads_whole_pixel_windows_and_zeros_off_the_map() -> None:
    torch.manual_seed(0)
    n, h, w = 2, 16, 24
    pyramid = _correlation_pyramid(torch.randn(n, 32, h, w), torch.randn(n, 32, h, w), 4)
    coords = _coordinates(n, h, w, CPU).clone()
    # Whole pixels with the window's top row off the map; one far outside it; a half-pixel shift.
    coords[0, :, 0, 0] = torch.tensor([3.0, 0.0])
    coords[0, :, 0, 2] = torch.tensor([-40.0, 5.0])
    coords[0, :, 0, 3] = torch.tensor([7.5, 6.0])
    values = _look_up(pyramid, coords, 4)
    assert values.shape == (n, 4 * 81, h, w)
    # The first level's window at (x=3, y=0): map pixel (y + j - 4, x + i - 4) at channel 9 i + j, up to
    # grid_sample's rounding of its [-1, 1] coordinates.
    window = values[0, :81, 0, 0].view(9, 9)
    level = pyramid[0][0, 0]
    torch.testing.assert_close(window[1:, 4:], level[0:5, 0:8].T, rtol=1e-5, atol=1e-6)
    assert window[0].abs().max() < 1e-6 and window[:, :4].abs().max() < 1e-6  # x < 0, y < 0
    assert values[0, :, 0, 2].abs().max() < 1e-6
    # Half a pixel in x: the mean of the two neighbouring columns.
    half = values[0, :81, 0, 3].view(9, 9)
    third = pyramid[0][3, 0]
    torch.testing.assert_close(half[4, 4], (third[6, 7] + third[6, 8]) / 2, rtol=1e-5, atol=1e-6)


def test_the_look_up_compiles_to_the_same_gradients() -> None:
    torch.manual_seed(0)
    n, h, w = 2, 16, 16
    pyramid = _correlation_pyramid(torch.randn(n, 8, h, w), torch.randn(n, 8, h, w), 2)
    pyramid = [level.requires_grad_(True) for level in pyramid]
    coords = _coordinates(n, h, w, CPU) + 3 * torch.randn(n, 2, h, w)
    upstream = torch.randn(n, 2 * 25, h, w)

    def run(look_up: object) -> list[Tensor]:
        return list(torch.autograd.grad((look_up(pyramid, coords, 2) * upstream).sum(), pyramid))

    torch._dynamo.reset()
    compiled = run(torch.compile(_look_up, backend="aot_eager", fullgraph=True))
    for mine, reference in zip(compiled, run(_look_up), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_gate_gradient_goes_back_channels_last_and_unchanged(compiled: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 5, requires_grad=True)
    upstream = torch.randn(2, 6, 4, 5)

    def run(fn: object) -> tuple[Tensor, Tensor]:
        y = fn(x * 2)  # a non-leaf, as the gates are
        (grad,) = torch.autograd.grad((y[:, :4] * upstream[:, :4]).sum() + y[:, 4:].pow(2).sum(), x)
        return y, grad

    torch._dynamo.reset()
    ours = torch.compile(_nhwc_gradient, backend="aot_eager", fullgraph=True) if compiled else _nhwc_gradient
    y, grad = run(ours)
    reference_y, reference_grad = run(lambda t: t)
    torch.testing.assert_close(y, reference_y, rtol=0, atol=0)
    torch.testing.assert_close(grad, reference_grad, rtol=0, atol=0)
    # What reaches the gates' producer (cuDNN's backward convolution there) is channels-last.
    seen = []
    h = x * 2
    h.register_hook(lambda g: seen.append(g.is_contiguous(memory_format=torch.channels_last)))
    (_nhwc_gradient(h)[:, :4] * upstream[:, :4]).sum().backward()
    assert seen == [True]


def test_rafts_encodings_stay_channels_last(raft_small: nn.Module) -> None:
    network = RAFTFlow(copy.deepcopy(raft_small), torch.float32)
    RAFTFlow(network.raft, torch.float32)  # converting a RAFT twice hooks its norms once
    norms = [m for m in network.raft.modules() if isinstance(m, nn.InstanceNorm2d)]
    assert norms and all(len(m._forward_hooks) == 1 and len(m._forward_pre_hooks) == 1 for m in norms)
    images = torch.randn(2, 3, 128, 128).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    seen, gradients = [], []

    def record_input_gradient(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        inputs[0].register_hook(gradients.append)

    for m in norms:
        m.register_forward_hook(lambda module, inputs, output: seen.append(output))
        # Ahead of ours: the convolution's output, whose gradient is what the convolution's backward pass gets.
        m.register_forward_pre_hook(record_input_gradient, prepend=True)
    features = network.raft.feature_encoder(images)
    assert features.is_contiguous(memory_format=torch.channels_last)
    assert seen and all(output.is_contiguous(memory_format=torch.channels_last) for output in seen)
    features.square().sum().backward()
    assert len(gradients) == len(norms)
    assert all(g.is_contiguous(memory_format=torch.channels_last) for g in gradients)


def test_our_raft_pass_compiles_as_one_graph_with_the_same_flows(raft_small: nn.Module) -> None:
    # As model.compile runs it: one graph (hooks, the factored cells and the gradient-layout identities traced).
    torch.manual_seed(0)
    network = RAFTFlow(copy.deepcopy(raft_small), torch.float32, flow_updates=2)
    frames = (torch.rand(1, 3, 3, 128, 128) * 2 - 1).requires_grad_(True)
    eager = network(frames)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), frames)
    torch._dynamo.reset()
    compiled = torch.compile(network, backend="aot_eager", fullgraph=True)(frames)
    (compiled_grad,) = torch.autograd.grad(compiled.square().sum(), frames)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    scale = float(eager_grad.abs().max())
    assert scale > 0, scale
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-3, atol=1e-6 * scale)


def test_a_batch_of_clips_gives_each_clips_own_flows(raft_small: nn.Module) -> None:
    # Frames of all clips go through RAFT together: no pair may mix frames of two clips.
    torch.manual_seed(0)
    network = RAFTFlow(copy.deepcopy(raft_small), torch.float32, flow_updates=2)
    frames = torch.rand(2, 3, 3, 128, 128) * 2 - 1
    together = network(frames)
    apart = torch.cat([network(clip[None]) for clip in frames])
    assert together.shape == (2, 4, 2, 128, 128)
    torch.testing.assert_close(together, apart, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("raft", ["small", "large"])
def test_our_raft_pass_gives_torchvisions_flows(raft: str) -> None:
    torch.manual_seed(0)
    network = build_raft(raft)
    frames = smooth_frames(1, 3)
    updates = 3
    ours = RAFTFlow(network, torch.float32, flow_updates=updates)(frames)  # [1, 4, 2, H, W]
    pairs = [(0, 1), (1, 2), (1, 0), (2, 1)]  # forward pairs, then backward pairs
    with torch.no_grad():
        theirs = [network(frames[:, a], frames[:, b], num_flow_updates=updates)[-1] for a, b in pairs]
    assert ours.shape == (1, 4, 2, 128, 128) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, torch.stack(theirs, dim=1), rtol=1e-4, atol=1e-4)


def test_identical_videos_give_zero(raft_small: nn.Module) -> None:
    video = smooth_frames(1, 3).transpose(1, 2)
    term = FlowTerm(FlowConfig(1.0, scale=1, dtype="float32"), RAFTFlow(raft_small, torch.float32, 2))
    assert term(StepContext(video, video, torch.ones(1, 1, 3, 128, 128))).item() == 0.0


@pytest.mark.parametrize(("scale", "pixels"), [(1, 1), (2, 2)])
def test_a_shift_the_reconstruction_lost_costs_its_flow(scale: int, pixels: int) -> None:
    # The input moves `pixels` right per frame, the reconstruction stands still: the flows differ by `pixels`
    # in x (forward +pixels, backward -pixels) and 0 in y, so the mean over both components is pixels / 2.
    target = moving_video(frames=3, size=16, pixels_per_frame=pixels)
    still = target[:, :, :1].expand_as(target)
    term = FlowTerm(FlowConfig(1.0, scale=scale), ShiftFlow())
    flow = bidirectional_flow(target, ShiftFlow(), scale)
    assert flow.shape == (1, 2, 4, 16, 16)
    assert torch.equal(flow[0, 0, :, 0, 0], torch.tensor([1.0, 1.0, -1.0, -1.0]) * pixels)
    value = term(StepContext(still, target, torch.ones(1, 1, 3, 16, 16)))
    assert value.item() == pytest.approx(pixels / 2)


def test_only_pairs_whose_pixels_count_in_both_frames_count() -> None:
    target = moving_video(frames=3, size=16, pixels_per_frame=1)
    reconstruction = target.clone()
    reconstruction[:, :, 2] = reconstruction[:, :, 1]  # frame 2 stands still: pair (1, 2) loses its motion
    term = FlowTerm(FlowConfig(1.0, scale=1), ShiftFlow())
    everything = term(StepContext(reconstruction, target, torch.ones(1, 1, 3, 16, 16)))
    assert everything.item() == pytest.approx(0.5 * 2 / 4)  # 2 of the 4 pair flows (each direction) differ
    mask = torch.ones(1, 1, 3, 16, 16)
    mask[:, :, 2, :, :8] = 0  # half of frame 2 masked: pair (1, 2) still counts on the other half
    assert term(StepContext(reconstruction, target, mask)).item() == pytest.approx(0.5 * 2 * 128 / (2 * 256 + 2 * 128))
    mask[:, :, 2] = 0  # frame 2 gone: only pair (0, 1), which agrees
    assert term(StepContext(reconstruction, target, mask)).item() == 0.0
    assert term(StepContext(reconstruction, target, torch.zeros_like(mask))).item() == 0.0  # nothing counts: 0, not NaN


def test_gradients_reach_the_reconstruction_not_raft(raft_small: nn.Module) -> None:
    target = smooth_frames(1, 2).transpose(1, 2)
    reconstruction = (target + 0.1 * torch.randn_like(target)).requires_grad_(True)
    network = RAFTFlow(raft_small, torch.float32, 2)
    context = StepContext(reconstruction, target, torch.ones(1, 1, 2, 128, 128))
    value = FlowTerm(FlowConfig(1.0, scale=1), network)(context)
    value.backward()
    assert value.item() > 0
    assert reconstruction.grad is not None and reconstruction.grad.abs().sum() > 0
    assert torch.isfinite(reconstruction.grad).all()
    assert all(not p.requires_grad and p.grad is None for p in network.parameters())
    assert not network.training and not network.train().training  # batch norms keep their statistics


def test_activation_checkpointing_gives_the_same_value_and_gradient(raft_small: nn.Module) -> None:
    target = smooth_frames(1, 2).transpose(1, 2)
    noise = 0.1 * torch.randn(target.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for recompute in (False, True):
        reconstruction = (target + noise).requires_grad_(True)
        config = FlowConfig(1.0, scale=1, checkpoint_activations=recompute)
        value = FlowTerm(config, RAFTFlow(raft_small, torch.float32, 2))(
            StepContext(reconstruction, target, torch.ones(1, 1, 2, 128, 128))
        )
        value.backward()
        results.append((value.detach(), reconstruction.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_bf16_raft_keeps_fp32_flows_close_to_fp32_raft(raft_small: nn.Module) -> None:
    frames = smooth_frames(1, 2)
    exact = RAFTFlow(raft_small, torch.float32, 2)
    half = RAFTFlow(build_raft("small"), torch.bfloat16, 2)
    half.load_state_dict(exact.state_dict())
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        a, b = exact(frames), half(frames)
    assert b.dtype == torch.float32
    assert (a - b).abs().mean() < 0.05 * a.abs().mean() + 1e-3


@pytest.mark.parametrize(
    "off",
    [FlowConfig(0.0), FlowConfig(boundaries=[2, 4], values=[0.0, 0.0, 0.0])],
    ids=["weight", "schedule"],
)
def test_a_term_at_weight_zero_builds_nothing_and_reads_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, off: FlowConfig
) -> None:
    from torchvision.models import optical_flow

    from tokenizer_posttrain.losses import flow, weight_files

    # Every way to a RAFT or to a weights file, recorded and passed on: a missing file alone would only show that
    # nothing was read where the term raises, not that nothing was built or read anywhere. torchvision's
    # constructors catch a RAFT built through any import of ours.
    calls: list[str] = []

    def spy(module: object, name: str) -> None:
        original = getattr(module, name)

        def recorded(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    for name in (
        "build_raft",
        "load_raft",
        "find_raft_weights",
        "read_raft_state",
        "find_weights_file",
        "read_state_dict",
    ):
        spy(flow, name)
    spy(optical_flow, "raft_small")
    spy(optical_flow, "raft_large")
    spy(weight_files, "load_torch_file")
    config = dataclasses.replace(off, weights_path=str(tmp_path / "nowhere.pth"))
    loss = build_loss(LossConfig(perceptual_weight=0.0, flow=config))
    assert "flow" not in loss.terms
    video = torch.rand(1, 3, 2, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for step in (0, 2, 4, 100):  # before, at and after every boundary of the schedule
        weights = loss.prepare(step, CPU)
        assert weights == {"l1": 1.0}
        assert set(loss(StepContext(video.flip(-1), video, torch.ones(1, 1, 2, 8, 8)), weights)) == {"l1", "loss"}
    assert calls == []


def test_the_torch_hub_cache_file_is_used_when_no_path_is_given(empty_hub: Path, raft_small_file: Path) -> None:
    cache = empty_hub / "checkpoints" / RAFT_FILES["small"]
    cache.parent.mkdir(parents=True)
    cache.symlink_to(raft_small_file)
    assert find_raft_weights("small") == cache
    config = FlowConfig(0.01, raft="small", dtype="float32")  # fp32: the file's weights compare exactly
    loss = build_loss(LossConfig(perceptual_weight=0.0, flow=config))  # checks the cache file at launch
    term = loss.terms["flow"]
    assert isinstance(term, FlowTerm) and term.network is None
    # Another seed than the file's: a RAFT built with random weights instead of the file's cannot pass below.
    torch.manual_seed(1)
    loss.prepare(0, CPU)
    assert isinstance(term.network, RAFTFlow)
    built = term.network.raft.state_dict()
    saved = torch.load(raft_small_file, map_location="cpu", weights_only=True)
    assert built.keys() == saved.keys()
    assert all(torch.equal(built[key], saved[key]) for key in saved)


def test_a_scheduled_flow_term_is_found_at_launch_and_built_when_first_on(raft_small_file: Path) -> None:
    config = FlowConfig(boundaries=[3], values=[0.0, 0.01], raft="small", weights_path=str(raft_small_file))
    loss = build_loss(LossConfig(perceptual_weight=0.0, flow=config))
    term = loss.terms["flow"]
    assert isinstance(term, FlowTerm) and term.network is None
    assert "flow" not in loss.prepare(2, CPU) and term.network is None
    assert loss.prepare(3, CPU)["flow"] == 0.01 and isinstance(term.network, RAFTFlow)
    assert {p.dtype for p in term.network.parameters()} == {torch.bfloat16}
    with pytest.raises(FileNotFoundError, match=r"nowhere\.pth \(loss\.flow\.weights_path\)"):
        missing = FlowConfig(0.01, weights_path=str(raft_small_file.parent / "nowhere.pth"))
        build_loss(LossConfig(perceptual_weight=0.0, flow=missing))


def test_a_missing_cache_file_says_which_file_goes_where(tmp_path: Path) -> None:
    previous = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))
    try:
        with pytest.raises(FileNotFoundError) as err:
            find_raft_weights("large")
    finally:
        torch.hub.set_dir(previous)
    message = str(err.value)
    assert f"https://download.pytorch.org/models/{RAFT_FILES['large']}" in message
    assert str(tmp_path / "hub" / "checkpoints" / RAFT_FILES["large"]) in message
    assert "loss.flow.weights_path" in message and "loss.flow.weight=0" in message and "\n" not in message


def test_a_file_of_the_other_raft_is_refused_naming_keys(tmp_path: Path, raft_small_file: Path) -> None:
    with pytest.raises(ValueError, match=r"does not hold torchvision's RAFT large weights \(loss\.flow\.raft=large\)"):
        other = FlowConfig(0.01, raft="large", weights_path=str(raft_small_file))
        build_loss(LossConfig(perceptual_weight=0.0, flow=other))
    planted = tmp_path / "planted.pth"
    torch.save({"feature_encoder.convnormrelu.0.weight": torch.zeros(1), "extra": nn.Linear(1, 1)}, planted)
    with pytest.raises(Exception, match=r"as torchvision's RAFT weights: it holds a pickled Python object"):
        build_loss(LossConfig(perceptual_weight=0.0, flow=FlowConfig(0.01, raft="small", weights_path=str(planted))))


def test_settings_and_clip_sizes_are_checked_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"loss\.flow\.raft='huge' must be one of \['large', 'small'\]"):
        LossConfig(flow=FlowConfig(0.01, raft="huge"))
    with pytest.raises(ValueError, match=r"loss\.flow\.scale=0 must be an integer >= 1"):
        LossConfig(flow=FlowConfig(0.01, scale=0))
    with pytest.raises(ValueError, match=r"loss\.flow\.dtype='float16'"):
        LossConfig(flow=FlowConfig(0.01, dtype="float16"))
    config = FlowConfig(0.01)
    assert config.clip_problems("loss.flow", Clips(33, ((256, 256),), 8, True)) == []
    assert config.clip_problems("loss.flow", Clips(33, ((720, 1280),), 8, True)) == []
    (height,) = config.clip_problems("loss.flow", Clips(33, ((200, 256),), 8, True))
    assert height.startswith("clip height 200 / 2 = 100 pixels, but RAFT needs a multiple of 8 of at least 128")
    assert "(loss.flow.scale=2); use clips of 256+ pixels in steps of 16" in height
    assert len(config.clip_problems("loss.flow", Clips(1, ((250, 256),), 8, True))) == 2
    assert FlowConfig(0.01, scale=1).clip_problems("loss.flow", Clips(2, ((128, 136),), 8, True)) == []
    for bad in ({"scale": 1.5}, {"scale": "2"}, {"flow_updates": 2.5}, {"checkpoint_activations": "yes"}):
        (problem,) = FlowConfig(0.01, **bad).problems("loss.flow")  # type: ignore[arg-type]
        assert problem.startswith(f"loss.flow.{next(iter(bad))}=")


def test_raft_refuses_frames_its_pyramid_cannot_take(raft_small: nn.Module) -> None:
    # 192x336 at scale 2 (the 16:9 bucket of a 256 budget): 96 pixels high, below RAFT's 128.
    with pytest.raises(ValueError, match=r"RAFT got frames of 96x168 \(after loss\.flow\.scale\): 96 / 1 = 96"):
        bidirectional_flow(torch.zeros(1, 3, 2, 192, 336), RAFTFlow(raft_small, torch.float32, 1), 2)


def test_a_weights_file_with_non_tensors_is_named_not_a_crash(tmp_path: Path, raft_small: nn.Module) -> None:
    state = {k: v for k, v in raft_small.state_dict().items() if not k.endswith("num_batches_tracked")}
    without_counters = tmp_path / "no_counters.pth"
    torch.save(state, without_counters)
    assert read_raft_state(without_counters, "small")  # torch fills batch norms' counters in
    bad = tmp_path / "bad.pth"
    torch.save({**state, "feature_encoder.convnormrelu.0.weight": 3}, bad)
    with pytest.raises(ValueError, match=r"feature_encoder\.convnormrelu\.0\.weight is a int, not a tensor"):
        read_raft_state(bad, "small")
    load_raft(without_counters, "small")
