"""Export a tokenizer to the official file set: three TorchScript files, safetensors, config.

``encoder.jit``, ``decoder.jit`` and ``autoencoder.jit`` hold the official key layouts and
call contracts (architecture doc, section 8), so post-trained weights drop into existing
Cosmos inference and diffusion pipelines; they load with plain ``torch.jit.load`` and need
nothing from this package.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ..core.errors import ExportError
from ..core.files import atomic_path
from ..network import VideoTokenizer, family_of
from ..network.lora import merge_lora
from .layout import CONFIG_JSON, CONFIG_KEY, JIT_AUTOENCODER, JIT_DECODER, JIT_ENCODER, SAFETENSORS

CHUNK_FRAMES = 121
"""Frames of the chunk Cosmos world models (and diffusers' Cosmos pipelines, by default) encode at once; latent
statistics cover its latent frames."""


def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    # A kill during export must never leave a half-written file under the final name.
    with atomic_path(path) as tmp:
        write(str(tmp))


def _trace(module: nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notices
        return torch.jit.trace(module, example, check_trace=False)


def refuse_non_finite(network: VideoTokenizer, out_dir: str | Path) -> None:
    """:class:`ExportError` (naming ``out_dir`` and the first such tensor) when ``network`` has NaN or Inf weights."""
    state = network.state_dict()
    broken = [name for name, value in state.items() if value.is_floating_point() and not value.isfinite().all()]
    if broken:
        raise ExportError(
            f"not exporting to {out_dir}: {len(broken)} of {len(state)} weight tensors hold NaN or Inf "
            f"(first: {broken[0]}); the training diverged: export an earlier checkpoint "
            "(RUN/checkpoints/step=N.ckpt) and lower optim.lr"
        )


def prepared_copy(network: VideoTokenizer, out_dir: str | Path, dtype: torch.dtype) -> VideoTokenizer:
    """What every export format writes: a copy of ``network`` on the CPU in eval mode, cast to ``dtype``, LoRA
    adapters merged; ``network`` itself is left as it was. Non-finite weights are refused (:func:`refuse_non_finite`)
    before anything is written."""
    refuse_non_finite(network, out_dir)
    net = copy.deepcopy(network).to("cpu", dtype).eval()
    merge_lora(net)  # adapters fold into the weights: the files need nothing extra
    return net


def export_tokenizer(
    network: VideoTokenizer,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``encoder.jit``, ``decoder.jit``, ``autoencoder.jit``, ``model.safetensors`` and
    ``config.json`` for ``network`` into ``out_dir``; returns ``out_dir``.

    The network is copied to the CPU in eval mode, LoRA adapters merged, cast to ``dtype`` and traced (the
    official files are bf16; fp32, the default, keeps every bit of the trained weights). A network with NaN
    or Inf weights is refused (:class:`ExportError`) and nothing is written.
    """
    net = prepared_copy(network, out_dir, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = net.config
    frames = 1 + cfg.temporal_compression
    size = 2 * cfg.spatial_compression
    video = torch.zeros(1, cfg.in_channels, frames, size, size, dtype=dtype)
    with torch.no_grad():
        latent_example = net.encoding(video).tokens  # DV: indices, which is what decoder.jit takes

    family = family_of(cfg)
    if family.official_modules is None:
        raise ExportError(f"not exporting to {out}: the {family.name} family has no official traced files")
    modules = family.official_modules(net)
    with torch.no_grad():
        for name, layout, example in (
            (JIT_ENCODER, modules["encoder"], video),
            (JIT_DECODER, modules["decoder"], latent_example),
            (JIT_AUTOENCODER, modules["autoencoder"], video),
        ):
            traced = _trace(layout, example)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _atomic_write(out / name, traced.save)

    _write_weights(net, out, dtype)
    return out


def _write_weights(net: VideoTokenizer, out: Path, dtype: torch.dtype, pth: str | None = None) -> dict[str, Tensor]:
    """``model.safetensors`` and ``config.json`` (our record of the network, which ``load_tokenizer`` reads) of the
    prepared ``net`` into ``out``, and with ``pth`` the same tensors as a plain ``torch.save``d dict (the file
    a family's own loader reads strictly); the state dict written."""
    cfg = net.config
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    if pth is not None:
        # A plain dict of tensors: it loads with torch.load(weights_only=True), and our reader runs nothing in it.
        _atomic_write(out / pth, lambda p: torch.save(state, p))
    _atomic_write(out / SAFETENSORS, lambda p: save_file(state, p, metadata={"model": cfg.full_name}))
    meta = {"model": cfg.full_name, "dtype": str(dtype).removeprefix("torch."), CONFIG_KEY: cfg.to_dict()}
    _atomic_write(out / CONFIG_JSON, lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))
    return state


def export_state_dict(
    network: VideoTokenizer, out_dir: str | Path, pth: str, dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``pth`` (the network's state dict as a plain ``torch.save``d dict of tensors, in the family's official
    key layout: what the Wan VAEs' own code and Cosmos-Predict2.5 load strictly), ``model.safetensors`` and
    ``config.json`` into ``out_dir``; returns it. Copied, merged and refused as :func:`export_tokenizer` does."""
    net = prepared_copy(network, out_dir, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(net, out, dtype, pth)
    return out
