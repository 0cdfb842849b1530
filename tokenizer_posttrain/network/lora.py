"""Low-rank adapters (LoRA) on a tokenizer's 3D convolutions, and merging them back.

Adapted convs stay ``nn.Conv3d`` subclasses with the same ``weight``/``bias`` keys, so the base weights
keep their checkpoint names; ``merge_lora`` folds the adapters in and puts plain ``nn.Conv3d`` modules
back, so the result loads strictly into, and exports like, an unadapted network.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
from torch import Tensor, nn

__all__ = ["LoRAConv3d", "apply_lora", "has_lora", "lora_state", "merge_lora"]


def _conv_like(base: nn.Conv3d, cls: type[nn.Conv3d], **extra: object) -> nn.Conv3d:
    """A ``cls`` with ``base``'s hyperparameters that adopts ``base``'s own Parameter objects."""
    # Built on the meta device: its weights are replaced at once, so allocating and
    # initialising real ones would only cost time and memory on full-size models.
    conv = cls(
        base.in_channels,
        base.out_channels,
        base.kernel_size,
        stride=base.stride,
        padding=base.padding,
        dilation=base.dilation,
        groups=base.groups,
        bias=base.bias is not None,
        padding_mode=base.padding_mode,
        device="meta",
        dtype=base.weight.dtype,
        **extra,
    )
    # Reusing the Parameters (not clones) keeps values bit-identical and keeps any outside
    # reference to them (optimizer state, tied weights) pointing at the live tensor.
    conv.weight = base.weight
    conv.bias = base.bias
    return conv.train(base.training)


class LoRAConv3d(nn.Conv3d):
    """``Conv3d`` plus a trainable low-rank update: ``conv(x) + up(down(dropout(x))) * alpha / rank``.

    Build it with :meth:`from_conv`; ``weight`` and ``bias`` keep their state_dict keys.
    """

    def __init__(self, *args: object, rank: int, alpha: float, dropout: float = 0.0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        # Same geometry as the base conv, so its output grid matches the base output exactly.
        self.lora_down = nn.Conv3d(
            self.in_channels,
            rank,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=False,
            padding_mode=self.padding_mode,
            device=device,
            dtype=dtype,
        )
        self.lora_up = nn.Conv3d(rank, self.out_channels, 1, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @classmethod
    def from_conv(cls, base: nn.Conv3d, rank: int, alpha: float, dropout: float = 0.0) -> LoRAConv3d:
        """Wrap ``base`` (its Parameters are shared, not copied) with a fresh adapter on its device."""
        conv = _conv_like(base, cls, rank=rank, alpha=alpha, dropout=dropout)
        conv.lora_down.to_empty(device=base.weight.device)
        conv.lora_up.to_empty(device=base.weight.device)
        # down: the usual Conv init, so its outputs have a sane scale; up: zero, so the
        # adapted network starts bit-identical to the original one.
        nn.init.kaiming_uniform_(conv.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(conv.lora_up.weight)
        return conv

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.lora_up(self.lora_down(self.lora_dropout(x))) * self.scaling

    def merged_delta(self) -> Tensor:
        """The fp32 update ``scaling * up @ down`` with the shape of ``weight``."""
        up = self.lora_up.weight.detach().float().flatten(1)  # [out, rank]
        down = self.lora_down.weight.detach().float()  # [rank, in, kt, kh, kw]
        return (up @ down.flatten(1)).view(up.shape[0], *down.shape[1:]) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def _adapted(network: nn.Module) -> list[tuple[str, LoRAConv3d]]:
    # The root is never adapted (it cannot be swapped in place), so every name here has a parent.
    return [(n, m) for n, m in network.named_modules() if n and isinstance(m, LoRAConv3d)]


def _replace(network: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(network.get_submodule(parent_name), child, module)


def apply_lora(
    network: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets: Sequence[str] = ("*",)
) -> list[str]:
    """Add LoRA adapters to every ``nn.Conv3d`` whose module name matches a pattern of ``targets``.

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
        if name and isinstance(m, nn.Conv3d) and id(m) not in taken  # the root cannot be swapped in place
    ]
    chosen = sorted(n for n in candidates if any(fnmatchcase(n, p) for p in targets))
    if not chosen:
        examples = ", ".join(candidates[:5]) or "none"
        raise ValueError(
            f"apply_lora: no unadapted nn.Conv3d matches targets {list(targets)}; "
            f"{len(candidates)} available, e.g. {examples}"
        )
    grouped = [n for n in chosen if network.get_submodule(n).groups != 1]
    if grouped:  # a dense low-rank update has no grouped weight to fold into; checked before any swap
        raise ValueError(f"apply_lora: grouped convolutions cannot take LoRA: {grouped[:5]}")
    for name in chosen:
        _replace(network, name, LoRAConv3d.from_conv(network.get_submodule(name), rank, alpha, dropout))
    network.requires_grad_(False)
    for _, m in _adapted(network):
        m.lora_down.requires_grad_(True)
        m.lora_up.requires_grad_(True)
    return chosen


@torch.no_grad()
def merge_lora(network: nn.Module) -> nn.Module:
    """Fold every adapter into its conv weight, in place, and restore plain ``nn.Conv3d`` modules.

    The update is computed in fp32 and the sum cast once to the weight's dtype. Afterwards the
    state_dict has exactly the keys of the original network and every parameter requires grad.
    Without adapters it changes nothing. Returns ``network``.
    """
    adapted = _adapted(network)
    for name, module in adapted:
        w = module.weight
        w.copy_((w.float() + module.merged_delta()).to(w.dtype))
        _replace(network, name, _conv_like(module, nn.Conv3d))
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
