"""A new tokenizer family through the public seams only, as README's "Where a new piece goes" says: a folder
(here, this file), one :func:`register_family` call, and its test. The toy is a tiny convolutional KL-autoencoder
(a posterior mean and log-variance, its own weights file format); the test builds it by name, loads a file of it
strictly, trains it with ``train()`` (decoder side, LoRA, the adaptive GAN weight at its head) and exports it in
a format registered for it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tests.training.conftest import tiny_run
from tokenizer_posttrain import (
    FAMILIES,
    Encoding,
    TokenizerFamily,
    VideoTokenizer,
    build_tokenizer,
    get_config,
    load_tokenizer,
    register_family,
    resolve_name,
)
from tokenizer_posttrain.core.errors import ExportError
from tokenizer_posttrain.io.formats import FORMATS, ExportFormat, check_formats, register_format
from tokenizer_posttrain.losses.gan import GANConfig
from tokenizer_posttrain.losses.kl import KLConfig
from tokenizer_posttrain.network.family import clip_rule_problems

SUFFIX = ".toyweights"


@dataclass(frozen=True)
class ToyConfig:
    """The toy family's config: what :class:`~tokenizer_posttrain.network.family.NetworkConfig` asks."""

    name: str = "Toy-AE4"
    channels: int = 8
    latent_channels: int = 4
    temporal_compression: int = 1
    spatial_compression: int = 4
    in_channels: int = 3

    @property
    def full_name(self) -> str:
        return f"Example-{self.name}"

    @property
    def is_discrete(self) -> bool:
        return False

    @property
    def latent_dim(self) -> int:
        return self.latent_channels

    def latent_frames(self, frames: int) -> int:
        return frames

    def clip_problems(self, frames: int, height: int, width: int, names: tuple[str, str, str] = ("T", "H", "W")):
        return clip_rule_problems(self.temporal_compression, self.spatial_compression, frames, height, width, names)

    def replace(self, **overrides: Any) -> ToyConfig:
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return {"family": "toy", **dataclasses.asdict(self)}


class ToyAutoencoder(VideoTokenizer):
    """A convolutional KL-autoencoder: 4x4 patches in, a posterior mean and log-variance per patch out."""

    family: ClassVar[str] = "toy"
    sides: ClassVar[Mapping[str, tuple[str, ...]]] = {"encoder": ("encoder.",), "decoder": ("decoder.",)}
    last_layer: ClassVar[str] = "decoder.out"
    head: ClassVar[str] = "decoder.out"
    lora_modules: ClassVar[tuple[str, ...]] = ("decoder.*",)  # the encoder's stays as released

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        c, z, s = config.channels, config.latent_channels, config.spatial_compression
        self.encoder = nn.Sequential(nn.Conv3d(3, c, (1, s, s), stride=(1, s, s)), nn.SiLU(), nn.Conv3d(c, 2 * z, 1))
        self.decoder = nn.ModuleDict(
            {"body": nn.Sequential(nn.Conv3d(z, c, 1), nn.SiLU()), "out": nn.Conv3d(c, 3 * s * s, 1)}
        )

    def encoder_output(self, x: Tensor) -> Tensor:
        return self.encoder(x)

    def encoding_of(self, z: Tensor) -> Encoding:
        mean, logvar = z.chunk(2, dim=1)
        return Encoding(mean, mean=mean, logvar=logvar)

    def decode_unchecked(self, latent: Tensor) -> Tensor:
        return self.apply_head(self.decoder["body"](latent))

    def decode_with_head_input(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        self.check_latent(latent)
        head_input = self.decoder["body"](latent)
        return self.apply_head(head_input), head_input

    def apply_head(self, head_input: Tensor) -> Tensor:
        s = self.config.spatial_compression
        y = self.decoder["out"](head_input)  # [B, 3*s*s, T, h, w] -> [B, 3, T, h*s, w*s]
        b, _, t, h, w = y.shape
        y = y.view(b, 3, s, s, t, h, w).permute(0, 1, 4, 5, 2, 6, 3)
        return y.reshape(b, 3, t, h * s, w * s)


def read_toy(path: Path) -> dict[str, Tensor] | None:
    """The toy family's own weights file: safetensors under its own suffix (tensors only)."""
    return load_file(str(path)) if path.is_file() and path.suffix == SUFFIX else None


def write_toy(network: VideoTokenizer, folder: Path, stats: object, dtype: torch.dtype) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in network.state_dict().items()}
    save_file(state, str(folder / f"model{SUFFIX}"))
    (folder / "toy.json").write_text(json.dumps(network.config.to_dict()))
    return [f"model{SUFFIX}", "toy.json"]


TOY = TokenizerFamily(
    name="toy",
    configs={"Toy-AE4": ToyConfig()},
    prefixes=("Example-",),
    build=ToyAutoencoder,  # type: ignore[arg-type]
    config_from_dict=lambda data: ToyConfig(**data),
    sizes_of=lambda state, cfg: {"channels": int(state["encoder.0.weight"].shape[0])}
    if "encoder.0.weight" in state
    else {},
    reader=read_toy,
    posterior=True,
)
TOY_FORMAT = ExportFormat(
    name="toyformat",
    what="toy export",
    files=(f"model{SUFFIX}", "toy.json"),
    help=f"model{SUFFIX} and toy.json in OUT",
    card=lambda subfolder: f"Exported as `model{SUFFIX}`.",
    write=write_toy,
    found_in=lambda folder: (folder / f"model{SUFFIX}").is_file(),
    families=("toy",),
)


@pytest.fixture
def toy() -> Iterator[TokenizerFamily]:
    """The toy family and its format registered for one test, and gone after it."""
    register_family(TOY)
    register_format(TOY_FORMAT)
    try:
        yield TOY
    finally:
        FAMILIES.pop(TOY.name, None)
        FORMATS.pop(TOY_FORMAT.name, None)


def test_the_family_resolves_by_name_and_builds_a_checked_network(toy: TokenizerFamily) -> None:
    assert resolve_name("Example-Toy-AE4") == "Toy-AE4" == resolve_name("Toy-AE4")
    assert resolve_name("Cosmos-1.0-Tokenizer-CV8x8x8") == "CV8x8x8"  # the other family still resolves
    network = build_tokenizer("Example-Toy-AE4", channels=6)
    assert isinstance(network, ToyAutoencoder) and network.config.channels == 6
    encoding = network.encoding(torch.randn(2, 3, 3, 8, 12))
    assert encoding.latent.shape == (2, 4, 3, 2, 3) and encoding.logvar is not None
    assert torch.equal(encoding.tokens, encoding.mean)
    assert network(torch.randn(1, 3, 2, 8, 8)).shape == (1, 3, 2, 8, 8)
    with pytest.raises(ValueError, match="W=10 is not a multiple of 4"):
        network.encoding(torch.randn(1, 3, 2, 8, 10))
    with pytest.raises(ValueError, match="a tokenizer family named 'toy' is registered already"):
        register_family(dataclasses.replace(TOY))


def test_a_file_of_the_family_loads_strictly_with_its_width_inferred(toy: TokenizerFamily, tmp_path: Path) -> None:
    network = build_tokenizer("Toy-AE4", channels=6)
    save_file(network.state_dict(), str(tmp_path / f"w{SUFFIX}"))
    loaded = load_tokenizer(tmp_path / f"w{SUFFIX}")
    assert isinstance(loaded, ToyAutoencoder) and loaded.config.channels == 6
    for key, value in network.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    broken = {k: v for k, v in network.state_dict().items() if not k.startswith("decoder.out")}
    save_file(broken, str(tmp_path / f"broken{SUFFIX}"))
    with pytest.raises(ValueError, match="missing keys: decoder.out.bias, decoder.out.weight"):
        load_tokenizer(tmp_path / f"broken{SUFFIX}", "Toy-AE4", channels=6)


def test_only_the_family_s_own_formats_are_offered(toy: TokenizerFamily) -> None:
    check_formats(["toyformat"], get_config("Toy-AE4"))
    with pytest.raises(ExportError, match="its family \\(toy\\) exports toyformat"):
        check_formats(["cosmos"], get_config("Toy-AE4"))


def test_the_family_trains_and_exports_through_the_app(toy: TokenizerFamily, tmp_path: Path) -> None:
    from tokenizer_posttrain.__main__ import main
    from tokenizer_posttrain.training.train import train

    configs = tiny_run(
        tmp_path,
        steps=2,
        model={"model": "Example-Toy-AE4", "channels": 8, "trainable": "decoder", "sample_posterior": True},
        data={"frames": 3, "height": 16, "width": 16},
        loss={
            "perceptual_weight": 0.0,
            "kl": KLConfig(weight=1e-3),
            "gan": GANConfig(weight=0.1, channels=8, layers=1),
        },
        log={"latent_stats_clips": 0},
    )
    run_dir = train(**configs)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    trained = load_tokenizer(ckpt)
    assert isinstance(trained, ToyAutoencoder)
    before = build_tokenizer("Toy-AE4", channels=8)
    assert trained.state_dict()["decoder.out.weight"].shape == before.state_dict()["decoder.out.weight"].shape
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--format", "toyformat"]) == 0
    again = load_tokenizer(out / f"model{SUFFIX}")
    for key, value in trained.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x"), "--format", "cosmos"]) == 1


def test_latent_statistics_of_another_kind_are_refused_not_guessed(toy: TokenizerFamily) -> None:
    from tokenizer_posttrain.core.errors import EvaluationError
    from tokenizer_posttrain.evaluation.latent_stats import latent_statistics

    clips = [torch.rand(3, 2, 8, 8) * 2 - 1 for _ in range(2)]
    per_frame = latent_statistics(build_tokenizer("Toy-AE4"), clips, max_clips=2, positions=2)
    assert per_frame.mean.shape == (4, 2)  # the toy's 4 latent channels x 2 latent frames
    FAMILIES[TOY.name] = dataclasses.replace(TOY, latent_stats="per-token")
    with pytest.raises(EvaluationError, match="read per-token latent statistics, which this version does not"):
        latent_statistics(build_tokenizer("Toy-AE4"), clips, max_clips=2)


def test_the_family_s_sides_and_lora_modules_choose_what_trains(toy: TokenizerFamily) -> None:
    from tokenizer_posttrain.training.config import LoRAConfig
    from tokenizer_posttrain.training.trainable import configure_trainable

    network = build_tokenizer("Toy-AE4")
    assert configure_trainable(network, "decoder", LoRAConfig()) == [
        "decoder.body.0.weight",
        "decoder.body.0.bias",
        "decoder.out.weight",
        "decoder.out.bias",
    ]
    adapted = build_tokenizer("Toy-AE4")
    trained = configure_trainable(adapted, "all", LoRAConfig(rank=2))
    assert trained and all(name.startswith("decoder.") and ".lora_" in name for name in trained)
    with pytest.raises(ValueError, match="no unadapted nn.Conv3d matches targets \\['encoder.\\*'\\]"):
        configure_trainable(build_tokenizer("Toy-AE4"), "all", LoRAConfig(rank=2, targets=["encoder.*"]))
