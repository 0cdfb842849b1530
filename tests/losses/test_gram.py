"""The Gram-matrix loss: hand-computed values, masking, chunking, gradients, and its share of the VGG16 pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.losses.test_perceptual import SCALE, SHIFT, masked_frames_case, videos
from tokenizer_posttrain.losses import LossConfig, StepContext, build_loss
from tokenizer_posttrain.losses.gram import (
    GramConfig,
    GramTerm,
    gram_distance,
    weighted_gram_difference,
)
from tokenizer_posttrain.losses.perceptual import (
    DEFAULT_LAYER_WEIGHTS,
    PerceptualConfig,
    VGG16Pass,
    load_vgg16_features,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vgg(weights_file: Path) -> VGG16Pass:
    return VGG16Pass(load_vgg16_features(weights_file))


def gram_loss(vgg: VGG16Pass, recon: torch.Tensor, target: torch.Tensor, mask=None, temporal=True) -> torch.Tensor:  # noqa: ANN001
    return vgg(recon, target, mask, [GramTerm(GramConfig(1.0, temporal=temporal))])[0]


def reference(weights_file: Path, recon: torch.Tensor, target: torch.Tensor, temporal: bool) -> torch.Tensor:
    """NVIDIA's trainers' formula without a mask, written out: Grams of the features over (t x) h x w,
    mean squared difference, layer-weighted sum, mean over clips (or frames)."""
    b, _, t, _, _ = recon.shape
    net = load_vgg16_features(weights_file)
    frames = [((v.transpose(1, 2).flatten(0, 1)) - SHIFT) / SCALE for v in (recon, target)]
    total = torch.zeros(())
    with torch.no_grad():
        for weight, rec, tgt in zip(DEFAULT_LAYER_WEIGHTS, *(net(f) for f in frames), strict=True):
            n, c, h, w = rec.shape
            if temporal:  # [B, C, T*h*w]: one Gram per clip
                rec, tgt = (f.view(b, t, c, h * w).transpose(1, 2).reshape(b, c, t * h * w) for f in (rec, tgt))
            else:
                rec, tgt = (f.view(n, c, h * w) for f in (rec, tgt))
            grams = [torch.einsum("ncp,ndp->ncd", f, f) / f.shape[-1] for f in (rec, tgt)]
            total = total + weight * (grams[0] - grams[1]).square().mean()
    return total


def test_a_gram_matrix_by_hand() -> None:
    # One channel, two positions: Gram = mean of f^2. Reconstruction (1, 1) -> 1, target (0, 2) -> 2.
    rec, tgt = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2), torch.tensor([0.0, 2.0]).view(1, 1, 1, 2)
    ones = torch.ones(1, 1, 1, 2)
    difference = weighted_gram_difference(rec, tgt, ones)
    assert difference.item() == 2.0 - 4.0
    assert gram_distance(difference, ones.sum(dim=(1, 2, 3))).item() == 1.0
    # Counting only the second position: Grams 1 and 4, difference 9.
    half = torch.tensor([0.0, 1.0]).view(1, 1, 1, 2)
    assert gram_distance(weighted_gram_difference(rec, tgt, half), half.sum(dim=(1, 2, 3))).item() == 9.0


def test_the_gram_difference_is_the_einsum_of_the_features() -> None:
    rec, tgt = torch.randn(3, 4, 5, 6), torch.randn(3, 4, 5, 6)
    weight = torch.rand(3, 1, 5, 6)
    expected = sum(sign * torch.einsum("nchw,ndhw,nhw->ncd", f, f, weight[:, 0]) for sign, f in ((1, rec), (-1, tgt)))
    torch.testing.assert_close(weighted_gram_difference(rec, tgt, weight), expected)
    nhwc = [f.contiguous(memory_format=torch.channels_last) for f in (rec, tgt)]
    torch.testing.assert_close(weighted_gram_difference(*nhwc, weight), expected)
    # Either layout on either side: the layout picks the product's orientation, never the result.
    torch.testing.assert_close(weighted_gram_difference(nhwc[0], tgt, weight), expected)
    torch.testing.assert_close(weighted_gram_difference(rec, nhwc[1], weight), expected)


def test_nhwc_features_keep_their_memory_order() -> None:
    # NHWC features are used as [N, h*w, C] views: no copy into channels-first order (a strided transpose
    # under Inductor) before the product.
    from tokenizer_posttrain.losses.gram import _positions

    features = torch.randn(2, 4, 3, 5).contiguous(memory_format=torch.channels_last)
    view = _positions(features, nhwc=True)
    assert view.shape == (2, 15, 4) and view.is_contiguous() and view.data_ptr() == features.data_ptr()


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_the_gram_differences_backward_pass_is_autograds(layout: torch.memory_format) -> None:
    # The one-product backward pass against finite differences and against autograd of the einsum, in either
    # layout (fp64), with fractional weights.
    rec = torch.randn(2, 3, 4, 5, dtype=torch.float64).contiguous(memory_format=layout).requires_grad_(True)
    tgt = torch.randn(2, 3, 4, 5, dtype=torch.float64).contiguous(memory_format=layout)
    weight = torch.rand(2, 1, 4, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda r: weighted_gram_difference(r, tgt, weight), (rec,))
    upstream = torch.randn(2, 3, 3, dtype=torch.float64)  # not symmetric: both of its triangles must count
    (weighted_gram_difference(rec, tgt, weight) * upstream).sum().backward()
    reference = rec.detach().clone().requires_grad_(True)
    (torch.einsum("nchw,ndhw,nhw->ncd", reference, reference, weight[:, 0]) * upstream).sum().backward()
    torch.testing.assert_close(rec.grad, reference.grad)
    assert rec.grad.stride() == rec.stride()
    with pytest.raises(ValueError, match="only the reconstruction's features"):
        weighted_gram_difference(rec, tgt.clone().requires_grad_(True), weight)
    with pytest.raises(ValueError, match=r"weights must be \[N, 1, h, w\]"):
        weighted_gram_difference(rec, tgt, weight.expand(2, 3, 4, 5))
    with torch.no_grad():  # nothing to lose without gradients
        weighted_gram_difference(rec, tgt.clone().requires_grad_(True), weight)


def test_fp16_features_keep_their_small_gradient() -> None:
    # The Gram term's gradient is about 1 / (positions x C^2): under 16-mixed's loss scale (65536, as
    # GradScaler starts) it fits fp16, but the product's incoming gradient, one clip's Gram matrix of 4 frames
    # of 64 channels, would flush to zero in fp16.
    generator = torch.Generator().manual_seed(0)
    tgt = torch.rand(4, 64, 64, 64, generator=generator)
    rec = tgt * (1 + 0.01 * torch.randn(tgt.shape, generator=generator))
    rec, tgt = rec.half().float(), tgt.half().float()  # the same values in both dtypes
    weight = torch.ones(4, 1, 64, 64)
    grads = []
    for dtype in (torch.float32, torch.float16):
        leaf = rec.to(dtype).detach().clone().requires_grad_(True)
        difference = weighted_gram_difference(leaf, tgt.to(dtype), weight)
        (65536 * gram_distance(difference, weight.sum(dim=(1, 2, 3)), clips=1)).backward()
        grads.append(leaf.grad.float())
    assert (grads[1] != 0).float().mean() > 0.99
    torch.testing.assert_close(grads[1], grads[0], rtol=0.01, atol=1e-6)


def test_a_small_gram_difference_keeps_its_digits_over_a_whole_frame() -> None:
    # 256x256 positions whose two Gram sums nearly cancel (1% noise): the difference as one product keeps its
    # digits; two fp32 sums subtracted kept only about 98% of them on an H200 (docs/benchmarks.md).
    generator = torch.Generator().manual_seed(1)
    tgt = torch.rand(1, 4, 256, 256, generator=generator).bfloat16()
    rec = (tgt.float() * (1 + 0.01 * torch.randn(tgt.shape, generator=generator))).bfloat16()
    exact = sum(sign * torch.einsum("nchw,ndhw->ncd", f.double(), f.double()) for sign, f in ((1, rec), (-1, tgt)))
    got = weighted_gram_difference(rec, tgt, torch.ones(1, 1, 256, 256))
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.005


def test_bf16_features_keep_the_digits_of_a_small_gram_difference() -> None:
    # A good reconstruction: features 1% off the target's. Two bf16 Gram products subtracted would keep almost
    # none of the difference's digits (bf16 rounds the Grams by about 0.4%); one product of the difference does.
    generator = torch.Generator().manual_seed(0)
    tgt = torch.rand(2, 8, 16, 16, generator=generator)
    rec = tgt * (1 + 0.01 * torch.randn(tgt.shape, generator=generator))
    rec, tgt = rec.bfloat16(), tgt.bfloat16()
    weight = torch.ones(2, 1, 16, 16)
    exact = sum(sign * torch.einsum("nchw,ndhw->ncd", f.double(), f.double()) for sign, f in ((1, rec), (-1, tgt)))
    got = weighted_gram_difference(rec, tgt, weight)
    assert got.dtype == torch.float32
    error = ((got.double() - exact).norm() / exact.norm()).item()
    naive = sum(sign * torch.matmul(f.flatten(2), f.flatten(2).transpose(1, 2)) for sign, f in ((1, rec), (-1, tgt)))
    naive_error = ((naive.double() - exact).norm() / exact.norm()).item()
    assert error < 0.01 < naive_error


@pytest.mark.parametrize("temporal", [True, False])
def test_matches_the_trainers_formula_without_a_mask(weights_file: Path, vgg: VGG16Pass, temporal: bool) -> None:
    target, noise = videos(b=2, t=3)
    recon = target + 0.2 * noise
    expected = reference(weights_file, recon, target, temporal)
    assert expected > 0
    torch.testing.assert_close(gram_loss(vgg, recon, target, temporal=temporal), expected, rtol=1e-4, atol=0)
    ones = torch.ones(2, 1, 3, 16, 16)
    torch.testing.assert_close(gram_loss(vgg, recon, target, ones, temporal), expected, rtol=1e-4, atol=0)


def test_channels_last_features_give_the_same_value_and_gradients(weights_file: Path, vgg: VGG16Pass) -> None:
    target, noise = videos(b=2, t=3)
    mask = (torch.rand(2, 1, 3, 16, 16, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    nhwc = VGG16Pass(load_vgg16_features(weights_file), channels_last=True)
    values, grads = [], []
    for net in (vgg, nhwc):
        recon = (target + 0.2 * noise).requires_grad_(True)
        value = gram_loss(net, recon, target, mask)
        value.backward()
        values.append(value.detach())
        grads.append(recon.grad)
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-9)


def test_zero_for_identical_videos(vgg: VGG16Pass) -> None:
    target, _ = videos()
    assert gram_loss(vgg, target, target).item() == 0
    assert gram_loss(vgg, target, target, temporal=False).item() == 0


@pytest.mark.parametrize("temporal", [True, False])
def test_masked_out_pixels_change_nothing(vgg: VGG16Pass, temporal: bool) -> None:
    target, recon, mask, changed = masked_frames_case()
    masked = gram_loss(vgg, recon, target, mask, temporal)
    torch.testing.assert_close(gram_loss(vgg, changed, target, mask, temporal), masked)
    assert gram_loss(vgg, changed, target, temporal=temporal) != gram_loss(vgg, recon, target, temporal=temporal)
    # Nothing counted: 0, not NaN.
    assert gram_loss(vgg, recon, target, torch.zeros_like(mask), temporal).item() == 0


def test_a_masked_out_feature_position_changes_nothing() -> None:
    # At feature level (where a mask of padding becomes weights 0): a weight-0 position does not enter the Gram.
    features = [torch.randn(2, 4, 3, 3) for _ in range(5)]
    target = [torch.randn(2, 4, 3, 3) for _ in range(5)]
    weights = [torch.ones(2, 1, 3, 3) for _ in range(5)]
    for weight in weights:
        weight[1, :, 0, 0] = 0
    term = GramTerm(GramConfig(1.0))
    before = term.value([term.statistics(features, target, weights)], clips=1)
    for f in features:
        f[1, :, 0, 0] = 100.0
    torch.testing.assert_close(term.value([term.statistics(features, target, weights)], clips=1), before)


def test_frame_chunks_give_the_same_value_and_gradients(weights_file: Path) -> None:
    # float64, as the perceptual test: float32 rounding could flip a max-pool choice between the two runs.
    target, noise = (v.double() for v in videos(b=2, t=3))
    mask = (torch.rand(2, 1, 3, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3).double()
    values, grads = [], []
    for chunk in (None, 2):  # chunks of 2 frames cut the clips of 3
        recon = (target + 0.1 * noise).requires_grad_(True)
        value = VGG16Pass(load_vgg16_features(weights_file), frame_chunk=chunk).double()(
            recon, target, mask, [GramTerm(GramConfig(1.0))]
        )[0]
        value.backward()
        values.append(value.detach())
        grads.append(recon.grad)
    torch.testing.assert_close(values[1], values[0], rtol=1e-10, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-15)


def test_gradients_reach_the_reconstruction_only(vgg: VGG16Pass) -> None:
    target, noise = videos()
    recon = (target + 0.1 * noise).requires_grad_(True)
    gram_loss(vgg, recon, target).backward()
    assert recon.grad is not None and recon.grad.abs().sum() > 0
    assert all(p.grad is None for p in vgg.parameters())


def test_bf16_autocast_returns_fp32(vgg: VGG16Pass) -> None:
    target, noise = videos(b=1, t=2)
    recon = target + 0.3 * noise
    reference_value = gram_loss(vgg, recon, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = gram_loss(vgg, recon, target)
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, reference_value, rtol=0.1, atol=0)


def test_perceptual_and_gram_share_one_vgg16_pass(weights_file: Path) -> None:
    path = str(weights_file)
    loss = build_loss(LossConfig(perceptual=PerceptualConfig(0.1, weights_path=path), gram=GramConfig(0.5)))
    weights = loss.prepare(0, CPU)
    assert weights == {"l1": 1.0, "perceptual": 0.1, "gram": 0.5}
    assert loss.vgg is not None and loss.vgg.network is not None
    calls = []
    hook = loss.vgg.network.vgg.register_forward_hook(lambda *_: calls.append(1))
    target, noise = videos(b=1, t=2)
    recon, mask = target + 0.1 * noise, torch.ones(1, 1, 2, 16, 16)
    terms = loss(StepContext(recon, target, mask), weights)
    hook.remove()
    assert len(calls) == 2  # the target's features and the reconstruction's, once each
    alone = VGG16Pass(load_vgg16_features(weights_file))
    torch.testing.assert_close(terms["gram"], gram_loss(alone, recon, target, mask))
    total = terms["l1"] + 0.1 * terms["perceptual"] + 0.5 * terms["gram"]
    torch.testing.assert_close(terms["loss"], total)


def test_gram_alone_still_needs_and_builds_the_vgg16(weights_file: Path, tmp_path: Path) -> None:
    # loss.perceptual at weight 0 sets the network for loss.gram: its file is checked at launch.
    missing = PerceptualConfig(0.0, weights_path=str(tmp_path / "gone.pth"))
    with pytest.raises(FileNotFoundError, match="gone.pth") as err:
        build_loss(LossConfig(perceptual=missing, gram=GramConfig(0.5)))
    assert "loss.gram.weight=0" in str(err.value)
    loss = build_loss(LossConfig(perceptual=PerceptualConfig(0.0, weights_path=str(weights_file)), gram=GramConfig(1)))
    assert set(loss.terms) == {"l1", "gram"} and loss.vgg is not None
    weights = loss.prepare(0, CPU)
    assert loss.vgg.network is not None
    target, noise = videos(b=1, t=2)
    terms = loss(StepContext(target + 0.1 * noise, target, torch.ones(1, 1, 2, 16, 16)), weights)
    assert set(terms) == {"l1", "gram", "loss"} and terms["gram"] > 0


def test_weight_zero_builds_nothing() -> None:
    loss = build_loss(LossConfig(perceptual_weight=0.0, gram=GramConfig(0.0, temporal=False)))
    assert "gram" not in loss.terms and loss.vgg is None
    assert GramConfig().weight == 0.0 and not GramConfig().ever_on


def test_a_scheduled_gram_term_joins_at_its_boundary(weights_file: Path) -> None:
    perceptual = PerceptualConfig(0.0, weights_path=str(weights_file))
    loss = build_loss(LossConfig(perceptual=perceptual, gram=GramConfig(boundaries=[3], values=[0.0, 0.2])))
    assert loss.vgg is not None
    assert loss.prepare(2, CPU) == {"l1": 1.0} and loss.vgg.network is None
    assert loss.prepare(3, CPU) == {"l1": 1.0, "gram": 0.2} and loss.vgg.network is not None
