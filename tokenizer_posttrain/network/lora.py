"""Low-rank adapters (LoRA) on a tokenizer's 3D convolutions, and merging them back.

A conv is adapted in place: the module object stays, its class becomes a subclass of both
:class:`LoRAConv3d` and its own class, and it gains ``lora_down``/``lora_up`` children. So a conv
subclass keeps its own ``forward`` (causal time padding, a feature cache), attributes and hooks, and
``weight``/``bias`` keep their checkpoint names and their Parameter objects. ``merge_lora`` folds the
adapters in, drops the children and gives each conv its own class back, so the result loads strictly
into, and exports like, an unadapted network.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["LoRAConv3d", "apply_lora", "has_lora", "lora_state", "merge_lora"]

_ADAPTER_CHILDREN = ("lora_down", "lora_up", "lora_dropout")
_ADAPTER_ATTRIBUTES = ("lora_rank", "lora_alpha", "lora_scaling")


class LoRAConv3d(nn.Conv3d):
    """A conv plus a trainable low-rank update: ``conv(x) + up(down(dropout(x))) * alpha / rank``.

    Not built directly: :func:`apply_lora` turns an ``nn.Conv3d`` into one in place, as ``LoRAConv3d``
    itself for a plain ``nn.Conv3d`` and as a class ``(LoRAConv3d, <its class>)`` for a subclass.

    The update is added in ``_conv_forward``, which ``nn.Conv3d.forward`` calls after whatever a
    subclass's ``forward`` did first (padding, caching), so the update sees the same input as the
    base weight. A subclass whose ``forward`` calls ``F.conv3d`` itself, never reaching
    ``_conv_forward``, would silently skip the update.
    """

    lora_base_class: ClassVar[type[nn.Conv3d]] = nn.Conv3d
    """The class the conv had before adaptation; ``merge_lora`` gives it back."""
    # Prefixed names: a conv subclass may well have its own ``rank`` or ``scaling``.
    lora_rank: int
    lora_alpha: float
    lora_scaling: float
    lora_down: nn.Conv3d
    lora_up: nn.Conv3d
    lora_dropout: nn.Module

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        out = super()._conv_forward(input, weight, bias)
        # The down path is this conv's own convolution (its class's, padding_mode included) with the
        # down weight, so both paths share one output grid whatever the class does with its geometry.
        # Calling lora_down would not be: a non-"zeros" padding_mode pads by amounts torch fixes at
        # __init__, which a subclass that resets ``padding`` afterwards leaves out of step with it.
        # For a plain conv the two are the same conv3d call, so outputs are bit-identical either way.
        down = super()._conv_forward(self.lora_dropout(input), self.lora_down.weight, None)
        return out + self.lora_up(down) * self.lora_scaling

    def merged_delta(self) -> Tensor:
        """The fp32 update ``scaling * up @ down`` with the shape of ``weight``."""
        up = self.lora_up.weight.detach().float().flatten(1)  # [out, rank]
        down = self.lora_down.weight.detach().float()  # [rank, in, kt, kh, kw]
        return (up @ down.flatten(1)).view(up.shape[0], *down.shape[1:]) * self.lora_scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_rank}, alpha={self.lora_alpha}"

    def __reduce_ex__(self, protocol: Any) -> Any:
        if type(self) is LoRAConv3d:
            return super().__reduce_ex__(protocol)
        # A class made by _lora_class has no importable name, so pickling (a whole-module torch.save,
        # spawned workers) names the class it adapts and makes it again on load.
        return (_new_adapted, (type(self).lora_base_class,), self.__getstate__())


@functools.cache
def _lora_class(base: type[nn.Conv3d]) -> type[LoRAConv3d]:
    """The adapted class of ``base``, made once per class so every adapted conv of it shares one type."""
    if base is nn.Conv3d:
        return LoRAConv3d
    # LoRAConv3d first: its _conv_forward wraps the base class's, and the base class's forward runs.
    namespace = {"lora_base_class": base, "__module__": __name__, "__qualname__": f"LoRA{base.__qualname__}"}
    return type(f"LoRA{base.__name__}", (LoRAConv3d, base), namespace)


def _new_adapted(base: type[nn.Conv3d]) -> LoRAConv3d:
    cls = _lora_class(base)
    return cls.__new__(cls)  # unpickling restores the state with __setstate__


def _adapt(conv: nn.Conv3d, rank: int, alpha: float, dropout: float) -> None:
    """Turn ``conv`` into its LoRA class in place and add a fresh adapter on its device and dtype."""
    weight = conv.weight
    # Built on the meta device and filled below: the constructors' own initialisation would be
    # thrown away. The geometry mirrors the base conv, so the down weight reads as its conv's.
    down = nn.Conv3d(
        conv.in_channels,
        rank,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        bias=False,
        padding_mode=conv.padding_mode,
        device="meta",
        dtype=weight.dtype,
    )
    up = nn.Conv3d(rank, conv.out_channels, 1, bias=False, device="meta", dtype=weight.dtype)
    down.to_empty(device=weight.device)
    up.to_empty(device=weight.device)
    # down: the usual Conv init, so its outputs have a sane scale; up: zero, so the adapted
    # network starts bit-identical to the original one.
    nn.init.kaiming_uniform_(down.weight, a=math.sqrt(5))
    nn.init.zeros_(up.weight)
    conv.__class__ = _lora_class(type(conv))
    conv.lora_rank, conv.lora_alpha, conv.lora_scaling = rank, alpha, alpha / rank
    conv.lora_down = down.train(conv.training)
    conv.lora_up = up.train(conv.training)
    conv.lora_dropout = (nn.Dropout(dropout) if dropout > 0 else nn.Identity()).train(conv.training)


def _merge(conv: LoRAConv3d) -> None:
    """Fold ``conv``'s adapter into its weight in place and give it back its own class."""
    w = conv.weight
    w.copy_((w.float() + conv.merged_delta()).to(w.dtype))
    for name in _ADAPTER_CHILDREN + _ADAPTER_ATTRIBUTES:
        delattr(conv, name)
    conv.__class__ = type(conv).lora_base_class


def _adapted(network: nn.Module) -> list[tuple[str, LoRAConv3d]]:
    # The root is never adapted (it has no name for targets to match), so every name here is non-empty.
    return [(n, m) for n, m in network.named_modules() if n and isinstance(m, LoRAConv3d)]


def apply_lora(
    network: nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] = ("*",),
    allowed: Sequence[str] = ("*",),
) -> list[str]:
    """Add LoRA adapters to every ``nn.Conv3d`` (subclasses too) whose module name matches ``targets``, among
    those that match ``allowed`` (the family's :attr:`~.family.VideoTokenizer.lora_modules`).

    Patterns are ``fnmatch`` style and case-sensitive (``"decoder.*"``, ``"*.attn_1.*"``). Afterwards
    only adapter parameters require grad; every other parameter of ``network`` is frozen. Convs
    already adapted are left as they are, so calls can add adapters of another rank elsewhere.
    Returns the sorted names of the modules adapted by this call.

    Raises ``ValueError`` (before changing anything) for ``rank < 1``, a dropout outside [0, 1),
    a matched grouped conv, or when no conv matches.
    """
    if rank < 1:
        raise ValueError(f"apply_lora: rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"apply_lora: dropout must be in [0, 1), got {dropout}")
    if isinstance(targets, str):  # a lone pattern would otherwise be split into characters
        targets = (targets,)
    # Adapted convs and the adapters' own convs are never (re)adapted.
    taken = {id(c) for _, m in _adapted(network) for c in (m, m.lora_down, m.lora_up)}
    candidates = [
        name
        for name, m in network.named_modules()
        if name  # the root has no name to match
        and isinstance(m, nn.Conv3d)
        and id(m) not in taken
        and any(fnmatchcase(name, p) for p in allowed)
    ]
    chosen = sorted(n for n in candidates if any(fnmatchcase(n, p) for p in targets))
    if not chosen:
        examples = ", ".join(candidates[:5]) or "none"
        raise ValueError(
            f"apply_lora: no unadapted nn.Conv3d matches targets {list(targets)}; "
            f"{len(candidates)} available, e.g. {examples}"
        )
    grouped = [n for n in chosen if network.get_submodule(n).groups != 1]
    if grouped:  # a dense low-rank update has no grouped weight to fold into; checked before any change
        raise ValueError(f"apply_lora: grouped convolutions cannot take LoRA: {grouped[:5]}")
    for name in chosen:
        _adapt(network.get_submodule(name), rank, alpha, dropout)
    network.requires_grad_(False)
    for _, m in _adapted(network):
        m.lora_down.requires_grad_(True)
        m.lora_up.requires_grad_(True)
    return chosen


@torch.no_grad()
def merge_lora(network: nn.Module) -> nn.Module:
    """Fold every adapter into its conv weight, in place, and give each conv back its own class.

    The update is computed in fp32 and the sum cast once to the weight's dtype. Afterwards the
    state_dict has exactly the keys of the original network, every parameter is the Parameter object
    it was (an optimizer's state still points at it) and every parameter requires grad. Without
    adapters it changes nothing. Returns ``network``.
    """
    adapted = _adapted(network)
    for _, module in adapted:
        _merge(module)
    if adapted:
        network.requires_grad_(True)
    return network


def lora_state(network: nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors (``<name>.lora_down.weight``, ``<name>.lora_up.weight``), detached.

    Small enough to checkpoint often; load it back with ``load_state_dict(..., strict=False)``
    into a network adapted with the same targets and rank.
    """
    out: dict[str, Tensor] = {}
    for name, m in _adapted(network):
        out[f"{name}.lora_down.weight"] = m.lora_down.weight.detach()
        out[f"{name}.lora_up.weight"] = m.lora_up.weight.detach()
    return out


def has_lora(network: nn.Module) -> bool:
    """Whether ``network`` holds any unmerged adapter."""
    return bool(_adapted(network))
