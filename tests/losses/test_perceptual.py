"""The VGG16 perceptual loss: torchvision's key layout, strict loading, masking, chunking, autocast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenizer_posttrain.losses import LossConfig, build_loss
from tokenizer_posttrain.losses.perceptual import (
    TAPS,
    VGG16_FILE,
    PerceptualConfig,
    PerceptualLoss,
    VGG16Features,
    VGG16Pass,
    find_vgg16_weights,
    load_vgg16_features,
)

# torchvision's VGG16 ``features`` keys and shapes, derived independently of the module from configuration D.
CONFIG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def torchvision_feature_shapes() -> dict[str, tuple[int, ...]]:
    shapes, index, channels = {}, 0, 3
    for width in CONFIG_D:
        if width == "M":
            index += 1
            continue
        shapes[f"features.{index}.weight"] = (width, channels, 3, 3)
        shapes[f"features.{index}.bias"] = (width,)
        index, channels = index + 2, width
    return shapes


CLASSIFIER_SHAPES = {
    "classifier.0.weight": (4096, 25088),
    "classifier.0.bias": (4096,),
    "classifier.3.weight": (4096, 4096),
    "classifier.3.bias": (4096,),
    "classifier.6.weight": (1000, 4096),
    "classifier.6.bias": (1000,),
}
SHIFT = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
SCALE = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)


def random_vgg16_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    state = {}
    for key, shape in torchvision_feature_shapes().items():
        # He-scaled weights keep the activations of all five layers away from 0 and from overflow.
        scale = (2 / (shape[1] * 9)) ** 0.5 if len(shape) == 4 else 0.01
        state[key] = torch.randn(shape, generator=generator) * scale
    for key, shape in CLASSIFIER_SHAPES.items():
        # Real shapes at the cost of one float: torch.save stores the 1-element storage of an expanded view.
        state[key] = torch.ones(1).expand(shape)
    return state


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loss(weights_file: Path) -> PerceptualLoss:
    return PerceptualLoss(str(weights_file))


def videos(b: int = 2, t: int = 2, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    target = torch.rand(b, 3, t, size, size, generator=generator) * 2 - 1
    noise = torch.randn(b, 3, t, size, size, generator=generator)
    return target, noise


def test_state_dict_matches_torchvision_layout() -> None:
    from torchvision.models import vgg16

    state = VGG16Features().state_dict()
    assert {key: tuple(value.shape) for key, value in state.items()} == torchvision_feature_shapes()
    assert len(state) == 26
    # The features.* of what torchvision's VGG16 saves (the layout of its weight file).
    with torch.device("meta"):
        saved = {key: tuple(value.shape) for key, value in vgg16(weights=None).state_dict().items()}
    assert {key: shape for key, shape in saved.items() if key.startswith("features.")} == torchvision_feature_shapes()
    assert {key: shape for key, shape in saved.items() if key.startswith("classifier.")} == CLASSIFIER_SHAPES


def test_taps_are_the_relus_after_the_last_conv_of_each_block() -> None:
    layers = list(VGG16Features().features)
    assert len(layers) == 30  # conv1_1 ... relu5_3: torchvision's features without the last max-pool
    for tap, width in zip(TAPS, (64, 128, 256, 512, 512), strict=True):
        assert isinstance(layers[tap], torch.nn.ReLU)
        conv = layers[tap - 1]
        assert isinstance(conv, torch.nn.Conv2d) and conv.out_channels == width
        assert (conv.kernel_size, conv.stride, conv.padding) == ((3, 3), (1, 1), (1, 1))
    # A new network's weights are initialised (PyTorch's default, within 1/sqrt(fan_in)), not left empty.
    for conv in (layer for layer in layers if isinstance(layer, torch.nn.Conv2d)):
        bound = (conv.in_channels * 9) ** -0.5
        assert 0 < conv.weight.abs().max() <= bound and conv.bias.abs().max() <= bound
    pools = [index for index, layer in enumerate(layers) if isinstance(layer, torch.nn.MaxPool2d)]
    assert pools == [tap + 1 for tap in TAPS[:-1]]


def test_load_ignores_classifier_and_freezes(weights_file: Path) -> None:
    net = load_vgg16_features(weights_file)
    expected = torch.load(weights_file, weights_only=True)
    for key, value in net.state_dict().items():
        assert torch.equal(value, expected[key])
    assert not any(p.requires_grad for p in net.parameters())
    assert not net.train().training and not net.training


def test_forward_taps_relu_outputs(loss: PerceptualLoss) -> None:
    features = loss.vgg(torch.randn(1, 3, 32, 32))
    shapes = [(1, 64, 32, 32), (1, 128, 16, 16), (1, 256, 8, 8), (1, 512, 4, 4), (1, 512, 2, 2)]
    assert [tuple(f.shape) for f in features] == shapes
    assert all(f.min() >= 0 for f in features)


def test_zero_for_identical_and_grows_with_error(loss: PerceptualLoss) -> None:
    target, noise = videos()
    assert loss(target, target).item() == 0
    values = [loss((target + eps * noise).clamp(-1, 1), target).item() for eps in (0.02, 0.1, 0.5)]
    assert 0 < values[0] < values[1] < values[2]


def test_gradients_reach_reconstruction_only(loss: PerceptualLoss) -> None:
    target, noise = videos()
    recon = (target + 0.1 * noise).requires_grad_(True)
    loss(recon, target).backward()
    assert recon.grad is not None and recon.grad.abs().sum() > 0
    assert all(p.grad is None for p in loss.vgg.parameters())


def test_layer_weights_applied(weights_file: Path) -> None:
    target, noise = videos(b=1)
    recon = target + 0.2 * noise
    frames = [v.transpose(1, 2).flatten(0, 1) for v in (recon, target)]
    net = load_vgg16_features(weights_file)
    with torch.no_grad():
        per_layer = [
            (rec - tgt).abs().mean() for rec, tgt in zip(*(net((f - SHIFT) / SCALE) for f in frames), strict=True)
        ]
    for layer in range(5):
        layer_weights = [0.0] * 5
        layer_weights[layer] = 3.0
        single = PerceptualLoss(str(weights_file), layer_weights=layer_weights)
        torch.testing.assert_close(single(recon, target), 3.0 * per_layer[layer], rtol=1e-5, atol=0)


def masked_frames_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target, reconstruction, mask, changed): two 3-frame clips with one frame each masked out, and the
    reconstruction with just those frames replaced (a term honouring the mask gives both the same value)."""
    target, noise = videos(b=2, t=3, size=16)
    recon = target + 0.1 * noise
    mask = torch.ones(2, 1, 3, 16, 16)
    mask[0, :, 1] = 0
    mask[1, :, 2] = 0
    changed = recon.clone()
    changed[0, :, 1] = torch.rand(3, 16, 16) * 2 - 1
    changed[1, :, 2] = -1
    return target, recon, mask, changed


def test_masked_frames_do_not_count(loss: PerceptualLoss) -> None:
    target, recon, mask, changed = masked_frames_case()
    torch.testing.assert_close(loss(changed, target, mask), loss(recon, target, mask))
    assert loss(changed, target) != loss(recon, target)
    # An all-ones mask is the unmasked loss; an all-zeros mask is 0, not NaN.
    torch.testing.assert_close(loss(recon, target, torch.ones_like(mask)), loss(recon, target))
    assert loss(recon, target, torch.zeros_like(mask)).item() == 0


def test_frame_chunk_matches_one_pass(weights_file: Path, loss: PerceptualLoss) -> None:
    target, noise = videos(b=2, t=3)
    recon = target + 0.1 * noise
    mask = (torch.rand(2, 1, 3, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    for chunk in (1, 2):
        chunked = PerceptualLoss(str(weights_file), frame_chunk=chunk)
        torch.testing.assert_close(chunked(recon, target, mask), loss(recon, target, mask), rtol=1e-5, atol=0)
        with torch.no_grad():  # the path without recomputation
            torch.testing.assert_close(chunked(recon, target), loss(recon, target), rtol=1e-5, atol=0)


def test_frame_chunk_gradients_match_one_pass(weights_file: Path) -> None:
    # In float64: in float32 a batch of 1 may take another conv kernel, and its rounding can flip a max-pool
    # argmax or the sign of a ~0 difference, which moves a few gradient entries by far more than the rounding.
    target, noise = (v.double() for v in videos(b=2, t=3))
    mask = (torch.rand(2, 1, 3, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3).double()
    grads = []
    for chunk in (None, 1, 2):
        recon = (target + 0.1 * noise).requires_grad_(True)
        PerceptualLoss(str(weights_file), frame_chunk=chunk).double()(recon, target, mask).backward()
        grads.append(recon.grad)
    for grad in grads[1:]:
        torch.testing.assert_close(grad, grads[0], rtol=1e-9, atol=1e-15)


def test_bf16_autocast_returns_fp32(loss: PerceptualLoss) -> None:
    target, noise = videos(b=1, t=2)
    recon = target + 0.2 * noise
    reference = loss(recon, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(recon, target)
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, reference, rtol=5e-2, atol=0)


def test_missing_cache_file_says_where_to_put_it(empty_hub: Path) -> None:
    cache = empty_hub / "checkpoints" / VGG16_FILE
    for attempt in (find_vgg16_weights, lambda: build_loss(LossConfig(perceptual=PerceptualConfig(weight=1.0)))):
        with pytest.raises(FileNotFoundError) as error:
            attempt()
        message = str(error.value)
        assert str(cache) in message
        assert "loss.perceptual.weights_path" in message
        assert "loss.perceptual.weight=0" in message


def test_missing_explicit_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="loss.perceptual.weight=0"):
        find_vgg16_weights(str(tmp_path / "nowhere.pth"))


def test_default_cache_file_is_used(empty_hub: Path, weights_file: Path) -> None:
    cache = empty_hub / "checkpoints" / VGG16_FILE
    cache.parent.mkdir(parents=True)
    cache.symlink_to(weights_file)
    assert find_vgg16_weights() == cache
    vgg = build_loss(LossConfig(perceptual=PerceptualConfig(weight=0.5, frame_chunk=4))).vgg
    assert vgg is not None
    vgg.prepare(torch.device("cpu"))
    assert isinstance(vgg.network, VGG16Pass) and vgg.network.frame_chunk == 4


def test_missing_or_misshapen_feature_key(tmp_path: Path) -> None:
    state = random_vgg16_state()
    del state["features.28.bias"]
    torch.save(state, tmp_path / "missing.pth")
    with pytest.raises(ValueError, match=r"features\.28\.bias") as error:
        load_vgg16_features(tmp_path / "missing.pth")
    assert "missing.pth" in str(error.value)
    state = random_vgg16_state()
    state["features.0.weight"] = torch.zeros(64, 3, 5, 5)
    torch.save(state, tmp_path / "shape.pth")
    with pytest.raises(ValueError, match=r"features\.0\.weight has shape \(64, 3, 5, 5\)"):
        load_vgg16_features(tmp_path / "shape.pth")


def test_zero_weight_builds_nothing(empty_hub: Path) -> None:
    assert "perceptual" not in build_loss(LossConfig(perceptual_weight=0)).terms
    assert "perceptual" not in build_loss(LossConfig(perceptual=PerceptualConfig(0.0, weights_path="/no.pth"))).terms


def test_ready_network_and_channels_last_give_the_same_loss(weights_file: Path, loss: PerceptualLoss) -> None:
    target, noise = videos(b=1, t=2)
    recon = target + 0.1 * noise
    nhwc = PerceptualLoss(vgg=load_vgg16_features(weights_file), channels_last=True)
    torch.testing.assert_close(nhwc(recon, target), loss(recon, target), rtol=1e-5, atol=0)


@pytest.mark.parametrize("content", [b"garbage, not a torch file", None])
def test_a_broken_vgg16_file_is_one_line_naming_it(tmp_path: Path, content: bytes | None) -> None:
    from tokenizer_posttrain.core.errors import CheckpointError
    from tokenizer_posttrain.losses.perceptual import read_vgg16_features

    path = tmp_path / "vgg16-397923af.pth"
    if content is None:  # a pickled object, not weights: refused without running it
        torch.save({"features.0.weight": torch.zeros(1), "x": __import__("os").system}, path)
    else:
        path.write_bytes(content)
    for mmap in (True, False):
        with pytest.raises(CheckpointError, match=str(path)) as err:
            read_vgg16_features(path, mmap=mmap)
        assert "\n" not in str(err.value)
