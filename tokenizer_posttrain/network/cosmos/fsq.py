"""Finite scalar quantization (architecture doc, section 7.2-7.4)."""

from __future__ import annotations

import math

import torch
from torch import nn


class FSQuantizer(nn.Module):
    """FSQ with an implicit codebook of ``prod(levels)`` codes (64,000 for [8,8,8,5,5,5]).

    ``forward(z)`` returns ``(indices int32 [B,t,h,w], codes [B,D,t,h,w], dummy_loss)``.
    The bound and rounding run in fp32 whatever the input dtype (bf16 tanh flips indices);
    codes come back in the dtype of ``z``, so bf16 and fp32 models both decode their own
    codes (the reference casts to a fixed attribute dtype and breaks fp32 models).
    """

    def __init__(self, levels: tuple[int, ...]) -> None:
        super().__init__()
        lv = torch.tensor(levels, dtype=torch.int32)
        basis = torch.tensor([math.prod(levels[:i]) for i in range(len(levels))], dtype=torch.int32)
        self.register_buffer("_levels", lv)
        self.register_buffer("_basis", basis)
        # Stored (never used in forward) because the official checkpoints carry it.
        self.register_buffer(
            "implicit_codebook",
            self._digits_to_codes(self._index_digits(torch.arange(math.prod(levels)), lv, basis), lv).to(
                torch.bfloat16
            ),
        )

    @staticmethod
    def _index_digits(indices: torch.Tensor, levels: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        return torch.div(indices.unsqueeze(-1), basis, rounding_mode="floor") % levels

    @staticmethod
    def _digits_to_codes(digits: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        half_width = torch.div(levels, 2, rounding_mode="floor")
        return (digits - half_width) / half_width

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        levels = self._levels
        # Constants formed exactly as the reference does, so indices match bit for bit.
        half_l = (levels - 1) * (1 + 1e-3) / 2
        offset = torch.where(levels % 2 == 0, 0.5, 0.0)
        shift = torch.atanh(offset / half_l)
        half_width = torch.div(levels, 2, rounding_mode="floor")
        view = (1, -1, 1, 1, 1)

        # copy=True: on an fp32 input .float() returns z itself, and a trace would then take the type_as(z) below
        # for a cast to fp32, so a bf16-cast export would hand fp32 codes to its bf16 convolutions.
        bounded = torch.tanh(z.to(torch.float32, copy=True) + shift.view(view)) * half_l.view(view) - offset.view(view)
        # Straight-through: the value is exactly round(b) (so codes equal those decoded from
        # the indices), the gradient is that of b.
        rounded = torch.round(bounded) + (bounded - bounded.detach())
        codes = rounded / half_width.view(view)
        digits = codes * half_width.view(view) + half_width.view(view)
        indices = (digits * self._basis.view(view)).sum(dim=1).to(torch.int32)
        dummy_loss = torch.zeros_like(codes.mean(dim=(1, 2, 3), keepdim=True))
        return indices, codes.type_as(z), dummy_loss

    def indices_to_codes(self, indices: torch.Tensor) -> torch.Tensor:
        """``[B, t, h, w]`` integer indices -> fp32 codes ``[B, D, t, h, w]``."""
        digits = self._index_digits(indices.long(), self._levels, self._basis)
        # contiguous: the same memory layout as the encoder's codes gives bit-identical decodes
        return self._digits_to_codes(digits, self._levels).movedim(-1, 1).contiguous()
