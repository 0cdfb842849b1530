"""LoRA adapters: exact start, exact merge back to the official keys, training only the adapters."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.lora import LoRAConv3d, apply_lora, has_lora, lora_state, merge_lora

# The smallest clips each tiny model accepts with more than one latent frame. CPU conv3d gets
# slow fast with size (a 16x16 CV clip costs ~30x an 8x8 one), so tests keep to these.
CLIP = {"CV8x8x8": (1, 3, 9, 8, 8), "DV8x16x16": (1, 3, 9, 16, 16)}


def _tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_tokenizer(name, channels=16).eval()


def _clip(name: str) -> Tensor:
    return torch.rand(*CLIP[name], generator=torch.Generator().manual_seed(1)) * 2 - 1


def _run(net: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return net(x)


def _conv_names(net: nn.Module) -> list[str]:
    return sorted(n for n, m in net.named_modules() if isinstance(m, nn.Conv3d))


def _perturb_adapters(net: nn.Module, std: float = 0.02) -> None:
    # Small enough that the tiny nets stay in range, large enough to move every output.
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, LoRAConv3d):
                m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=gen) * std)


def _assert_official_layout(net: nn.Module, name: str) -> None:
    fresh = build_tokenizer(name, channels=16).state_dict()
    merged = net.state_dict()
    assert list(merged) == list(fresh)  # same keys, same order
    assert all(merged[k].shape == fresh[k].shape and merged[k].dtype == fresh[k].dtype for k in fresh)
    assert all(type(m) is nn.Conv3d for m in net.modules() if isinstance(m, nn.Conv3d))
    build_tokenizer(name, channels=16).load_state_dict(merged, strict=True)


@pytest.mark.parametrize("name", ["CV8x8x8", "DV8x16x16"])
def test_starts_equal_and_merges_back_exactly(name: str) -> None:
    net, x = _tiny(name), _clip(name)
    reference = _run(net, x)

    adapted = apply_lora(net, rank=4, alpha=8.0)
    assert adapted == _conv_names(_tiny(name))  # "*" takes every conv, names sorted
    assert has_lora(net)
    assert torch.equal(_run(net, x), reference)

    adapters = lora_state(net)
    assert set(adapters) == {f"{n}.lora_{s}.weight" for n in adapted for s in ("down", "up")}
    assert set(net.state_dict()) == set(build_tokenizer(name, channels=16).state_dict()) | set(adapters)

    _perturb_adapters(net)
    unmerged = _run(net, x)
    assert not torch.allclose(unmerged, reference, atol=1e-3)

    assert merge_lora(net) is net
    assert not has_lora(net) and lora_state(net) == {}
    assert all(p.requires_grad for p in net.parameters())
    torch.testing.assert_close(_run(net, x), unmerged, rtol=1e-4, atol=1e-5)
    _assert_official_layout(net, name)


def test_merge_formula_and_dtype() -> None:
    net = nn.Sequential(nn.Conv3d(5, 7, (3, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1))).to(torch.bfloat16)
    original = net[0].weight.detach().clone()
    apply_lora(net, rank=3, alpha=6.0)
    lora = net[0]
    assert lora.lora_down.weight.dtype == lora.lora_up.weight.dtype == torch.bfloat16
    assert lora.lora_down.weight.shape == (3, 5, 3, 3, 3) and lora.lora_up.weight.shape == (7, 3, 1, 1, 1)
    assert lora.lora_down.stride == lora.stride and lora.lora_down.padding == lora.padding
    assert lora.lora_down.weight.abs().sum() > 0 and lora.lora_up.weight.abs().sum() == 0
    _perturb_adapters(net, std=0.5)
    up, down = lora.lora_up.weight.float()[:, :, 0, 0, 0], lora.lora_down.weight.float()
    expected = (original.float() + 2.0 * torch.einsum("or,rithw->oithw", up, down)).to(torch.bfloat16)
    merge_lora(net)
    assert type(net[0]) is nn.Conv3d and net[0].weight.dtype == torch.bfloat16
    assert torch.equal(net[0].weight, expected)


def test_only_adapters_train() -> None:
    net, x = _tiny("CV8x8x8"), _clip("CV8x8x8")
    before = _run(net, x)
    apply_lora(net, rank=2, alpha=4.0, dropout=0.1)
    base = {k: v.clone() for k, v in net.state_dict().items() if ".lora_" not in k}
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state(net))

    net.train()
    (net(x) - x).square().mean().backward()
    for n, p in net.named_parameters():
        if n in trainable:
            assert p.grad is not None
        else:
            assert p.grad is None, n
    # With up = 0 only up gets a signal on the first step (down's gradient flows through up). The
    # 8x8 clip leaves one latent pixel, so spatial attention is over one token and q, k get none.
    silent = {n for n, p in net.named_parameters() if n.endswith("lora_up.weight") and not p.grad.any()}
    assert all(".attn_1.0.q." in n or ".attn_1.0.k." in n for n in silent)

    torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1).step()
    net.eval()
    assert not torch.allclose(_run(net, x), before, atol=1e-4)
    after = net.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())


def test_targets_select_modules() -> None:
    net = _tiny("CV8x8x8")
    decoder = apply_lora(net, rank=2, alpha=2.0, targets=("decoder.*",))
    assert decoder and all(n.startswith("decoder.") for n in decoder)
    assert all(not isinstance(m, LoRAConv3d) for m in net.encoder.modules())
    # A later call adapts what is left, never an adapter or an already adapted conv.
    attention = apply_lora(net, rank=3, alpha=2.0, targets="*.attn_1.*")
    assert attention and all(n.startswith("encoder.mid.attn_1.") for n in attention)
    assert all(n.rsplit(".", 2)[-2] in ("q", "k", "v", "proj_out") for n in attention)
    assert {n.rsplit(".", 2)[0] for n in lora_state(net)} == set(decoder) | set(attention)
    with pytest.raises(ValueError, match=r"decoder\.\*"):
        apply_lora(net, rank=2, alpha=2.0, targets=("decoder.*",))


def test_bad_arguments_raise() -> None:
    net = _tiny("CV8x8x8")
    with pytest.raises(ValueError, match=r"no_such_layer\*.*encoder\.conv_in\.0\.conv3d"):
        apply_lora(net, rank=2, alpha=2.0, targets=("no_such_layer*",))
    with pytest.raises(ValueError, match="rank"):
        apply_lora(net, rank=0, alpha=2.0)
    with pytest.raises(ValueError, match="dropout"):
        apply_lora(net, rank=2, alpha=2.0, dropout=1.0)
    assert not has_lora(net) and all(p.requires_grad for p in net.parameters())


def test_strided_downsampling_convs() -> None:
    net, x = _tiny("CV8x8x8"), _clip("CV8x8x8")
    reference = _run(net, x)
    names = apply_lora(net, rank=3, alpha=3.0, targets=("*downsample*",))
    assert names and all(".downsample." in n for n in names)
    strides = {net.get_submodule(n).stride for n in names}
    assert (1, 2, 2) in strides and (2, 1, 1) in strides  # spatial and temporal downsampling
    assert torch.equal(_run(net, x), reference)
    _perturb_adapters(net, std=0.1)
    unmerged = _run(net, x)
    assert not torch.allclose(unmerged, reference, atol=1e-3)
    merge_lora(net)
    torch.testing.assert_close(_run(net, x), unmerged, rtol=1e-4, atol=1e-5)
    _assert_official_layout(net, "CV8x8x8")


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_deepcopy_and_trace_after_merge() -> None:
    net, x = _tiny("CV8x8x8"), _clip("CV8x8x8")
    apply_lora(net, rank=2, alpha=2.0, dropout=0.1)
    _perturb_adapters(net)
    clone = copy.deepcopy(net)
    assert has_lora(clone)
    for (n, a), b in zip(net.named_parameters(), clone.parameters(), strict=True):
        assert a is not b and torch.equal(a, b) and a.requires_grad == b.requires_grad, n

    merge_lora(clone)
    assert has_lora(net)  # the original keeps its own adapters and base weights
    eager = _run(clone, x)
    torch.testing.assert_close(eager, _run(net, x), rtol=1e-4, atol=1e-5)
    traced = torch.jit.trace(clone, x)
    assert torch.equal(traced(x), eager)


class _TimeCausalConv3d(nn.Conv3d):
    """A conv subclass that pads time on the past side only, in its own forward, as Wan's VAE convs do.

    ``padding`` is zeroed after construction and the real padding kept in ``_padding``; ``cache_x``
    stands in for frames from an earlier chunk.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        t, h, w = self.padding
        self._padding = (w, w, h, h, 2 * t, 0)  # F.pad order: W, H, then T (past, future)
        self.padding = (0, 0, 0)

    def forward(self, x: Tensor, cache_x: Tensor | None = None) -> Tensor:
        pad = list(self._padding)
        if cache_x is not None:
            x = torch.cat([cache_x, x], dim=2)
            pad[4] -= cache_x.shape[2]
        return super().forward(F.pad(x, pad))


def _causal_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        _TimeCausalConv3d(3, 6, 3, padding=1), nn.SiLU(), _TimeCausalConv3d(6, 5, 3, stride=(1, 2, 2), padding=1)
    ).eval()


def _frames(t: int = 7) -> Tensor:
    return torch.rand(1, 3, t, 6, 6, generator=torch.Generator().manual_seed(3)) * 2 - 1


def test_conv_subclass_keeps_its_forward_and_class() -> None:
    net, x = _causal_net(), _frames()
    reference, keys, params = _run(net, x), list(net.state_dict()), dict(net.named_parameters())
    calls = []
    net[0].register_forward_hook(lambda *_: calls.append(1))  # hooks stay: the module object stays

    assert apply_lora(net, rank=2, alpha=4.0) == ["0", "2"]
    conv = net[0]
    assert isinstance(conv, LoRAConv3d) and isinstance(conv, _TimeCausalConv3d) and type(net[2]) is type(conv)
    assert conv.padding == conv.lora_down.padding == (0, 0, 0) and conv._padding == (1, 1, 1, 1, 2, 0)
    assert all(net.get_parameter(n) is p for n, p in params.items())  # the same Parameter objects, not copies
    assert torch.equal(_run(net, x), reference)  # up = 0: exactly the base output
    assert calls

    _perturb_adapters(net, std=0.5)
    unmerged = _run(net, x)
    assert unmerged.shape == reference.shape and not torch.allclose(unmerged, reference, atol=1e-3)
    # Causal: a change from frame 4 on leaves every earlier output frame as it was.
    later = x.clone()
    later[:, :, 4:] += 1
    changed = _run(net, later)
    assert torch.equal(changed[:, :, :4], unmerged[:, :, :4]) and not torch.equal(changed, unmerged)
    # The subclass's own cache path still works with the adapter in: two cached frames replace the padding.
    with torch.no_grad():
        chunk = net[0](x[:, :, 3:], cache_x=x[:, :, 1:3])
        torch.testing.assert_close(chunk, net[0](x)[:, :, 3:], rtol=0, atol=1e-6)

    assert merge_lora(net) is net and not has_lora(net)
    assert all(type(m) is _TimeCausalConv3d for m in (net[0], net[2]))
    assert not any(hasattr(net[0], a) for a in ("lora_down", "lora_rank", "lora_scaling"))
    merged = dict(net.named_parameters())
    assert list(net.state_dict()) == keys and list(merged) == list(params)
    assert all(merged[n] is p for n, p in params.items())  # an optimizer's state still points at them
    torch.testing.assert_close(_run(net, x), unmerged, rtol=1e-4, atol=1e-5)
    _causal_net().load_state_dict(net.state_dict(), strict=True)


@pytest.mark.parametrize("padding_mode", ["replicate", "circular", "reflect"])
def test_padding_modes_start_equal_and_merge(padding_mode: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(3, 4, 3, stride=(1, 2, 2), padding=(1, 2, 1), padding_mode=padding_mode))
    x = _frames()
    reference = _run(net, x)
    apply_lora(net, rank=2, alpha=2.0)
    assert net[0].lora_down.padding_mode == padding_mode
    assert torch.equal(_run(net, x), reference)
    _perturb_adapters(net, std=0.5)
    unmerged = _run(net, x)
    assert not torch.allclose(unmerged, reference, atol=1e-3)
    merge_lora(net)
    assert type(net[0]) is nn.Conv3d
    torch.testing.assert_close(_run(net, x), unmerged, rtol=1e-4, atol=1e-5)


def test_adapted_subclass_copies_pickles_and_compiles() -> None:
    net, x = _causal_net(), _frames()
    apply_lora(net, rank=2, alpha=4.0, dropout=0.1)
    _perturb_adapters(net, std=0.5)
    expected = _run(net, x)

    clone = copy.deepcopy(net)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for other in (clone, loaded):
        assert type(other[0]) is type(net[0]) and other[0].lora_down is not net[0].lora_down
        assert torch.equal(_run(other, x), expected)
    merge_lora(loaded)
    assert type(loaded[0]) is _TimeCausalConv3d and has_lora(net) and has_lora(clone)

    compiled = torch.compile(net, backend="eager", fullgraph=True)
    assert torch.equal(_run(compiled, x), expected)
