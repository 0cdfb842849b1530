"""The export formats, one table: what ``export``, the posttrain workflow and the model card loop over.

Each :class:`ExportFormat` says what it writes (:attr:`~ExportFormat.write`), which networks it can hold
(:attr:`~ExportFormat.check`), how a folder of it is recognised and read back, and the model card's sentence
about it. A new format is one :func:`register_format` call (or one entry in :data:`FORMATS`) and its test: the
``--format`` values, the refusals, the files written and the card follow from the entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import ExportError
from ..network import FAMILIES, VideoTokenizer, family_of
from ..network.family import NetworkConfig
from .checkpoint import load_tokenizer
from .diffusers_format import (
    DIFFUSERS_CLASS,
    DIFFUSERS_WEIGHTS,
    PIPELINE_SUBFOLDER,
    LatentMoments,
    diffusers_class,
    diffusers_config,
    write_diffusers,
)
from .export import export_state_dict, export_tokenizer, prepared_copy
from .layout import CONFIG_JSON, JIT_AUTOENCODER, JIT_DECODER, JIT_ENCODER, SAFETENSORS
from .wan_diffusers import WAN21 as WAN21_VARIANT
from .wan_diffusers import WAN22 as WAN22_VARIANT
from .wan_diffusers import WAN_DIFFUSERS_CLASS, write_wan_diffusers

Writer = Callable[[VideoTokenizer, Path, LatentMoments | None, torch.dtype], list[str]]
"""``write(network, folder, stats, dtype)``: writes the format into ``folder``; the files written, relative to
``folder`` (as the export's closing line names them)."""


def _accepts_any(config: NetworkConfig) -> None:
    """The check of a format that holds every network."""


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its ``--format`` name and everything the export, the workflow and the card ask of it."""

    name: str
    """The ``--format`` value (no comma: the values are a comma-separated list)."""
    what: str
    """How messages name a folder of it: ``{out} holds a {what}``, ``the {what} goes to ...``."""
    files: tuple[str, ...]
    """The files it writes at the top of its folder; two formats in one folder must not share one."""
    help: str
    """Its part of ``export --format``'s help."""
    card: Callable[[str], str]
    """``card(subfolder)``: the model card's sentence about its files; ``subfolder`` is ``""`` when they are in
    the export folder itself, else the folder inside it that holds them."""
    write: Writer
    """See :data:`Writer`."""
    found_in: Callable[[Path], bool]
    """Whether a folder already holds one (an export must not overwrite it with another format's files)."""
    families: tuple[str, ...] = ()
    """The tokenizer families (:class:`~..network.TokenizerFamily` names) whose networks it holds; empty: any
    family (a format that stores only the state dict and the config)."""
    check: Callable[[NetworkConfig], None] = _accepts_any
    """Refuses, with an :class:`~..core.errors.ExportError` in one line, a network this format cannot hold
    (diffusers: a discrete tokenizer); called before any work."""
    read_back: Callable[[Path], VideoTokenizer] = load_tokenizer
    """Loads a folder of it again, strictly (what a test or a check after writing compares with)."""
    subfolder: str = ""
    """Where it goes inside the export folder when another format holds that folder (``""``: beside it)."""
    needs_stats: str = ""
    """Why it cannot be written without the latent statistics (``""``: it can)."""
    stats_beside: bool = False
    """Whether the latent statistics files (``mean_std.pt``, ``image_mean_std.pt``) go beside its files."""

    def holds(self, family: str) -> bool:
        """Whether networks of tokenizer family ``family`` can be written in this format."""
        return not self.families or family in self.families


def _write_cosmos(network: VideoTokenizer, folder: Path, stats: LatentMoments | None, dtype: torch.dtype) -> list[str]:
    # The statistics files are the caller's (stats_beside): a run may copy its base's instead.
    export_tokenizer(network, folder, dtype=dtype)
    return list(_COSMOS_FILES)


def _cosmos_card(subfolder: str) -> str:
    return (
        "Exported by tokenizer-posttrain in the official Cosmos layout: `encoder.jit`, `decoder.jit` and "
        "`autoencoder.jit` load with plain `torch.jit.load` and follow the official call contract; "
        "`model.safetensors` holds the same weights."
    )


def _write_diffusers(
    network: VideoTokenizer, folder: Path, stats: LatentMoments | None, dtype: torch.dtype
) -> list[str]:
    if family_of(network.config).name in _WAN_VARIANTS:
        return _write_wan_diffusers(network, folder, stats, dtype)
    write_diffusers(network, folder, stats, dtype=dtype)
    return [f"{CONFIG_JSON} ({DIFFUSERS_CLASS}, latents_mean/latents_std)", DIFFUSERS_WEIGHTS]


def per_channel(stats: LatentMoments) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of latent statistics kept per channel and latent-frame position (``[C, T]``), each
    position counted alike: what pipelines that normalise with one value per channel read."""
    mean, std = stats.mean.detach().double().cpu(), stats.std.detach().double().cpu()
    pooled = mean.mean(dim=1)
    variance = (std.square() + mean.square()).mean(dim=1) - pooled.square()
    return pooled.tolist(), variance.clamp_min(0).sqrt().tolist()


_WAN_VARIANTS = {"wan21": WAN21_VARIANT, "wan22": WAN22_VARIANT}
"""The Wan families -> the VAE :mod:`.wan_diffusers` writes for each (one diffusers class holds both)."""


def _write_wan_diffusers(
    network: VideoTokenizer, folder: Path, stats: LatentMoments | None, dtype: torch.dtype
) -> list[str]:
    if stats is None:
        raise ExportError(f"not writing {folder}: a diffusers AutoencoderKLWan folder needs the latent statistics")
    net = prepared_copy(network, folder, dtype)
    mean, std = per_channel(stats)
    cfg = net.config
    variant = _WAN_VARIANTS[family_of(cfg).name]
    # Wan2.2's decoder has a width of its own (256 against the encoder's 160 in the release).
    dec_dim = getattr(cfg, "dec_channels", None)
    written = write_wan_diffusers(
        net.state_dict(), cfg.channels, cfg.latent_dim, folder, mean, std, dtype, variant=variant, dec_dim=dec_dim
    )
    return [
        f"{name} ({WAN_DIFFUSERS_CLASS}, latents_mean/latents_std)" if name == CONFIG_JSON else name for name in written
    ]


def _diffusers_card(subfolder: str) -> str:
    where = f"`{subfolder}/` holds them" if subfolder else "Exported by tokenizer-posttrain"
    return (
        f"{where} as a diffusers folder (`{DIFFUSERS_CLASS}` for Cosmos, `{WAN_DIFFUSERS_CLASS}` for the Wan VAEs), "
        "which the class's `from_pretrained` loads and a diffusers pipeline takes as its `vae`; its `config.json` "
        "holds the latent statistics (`latents_mean`, `latents_std`)."
    )


def _check_diffusers(config: NetworkConfig) -> None:
    if family_of(config).name == "cosmos":
        diffusers_config(config)  # ExportError: DV, or another network diffusers cannot build


_COSMOS_FILES = (JIT_ENCODER, JIT_DECODER, JIT_AUTOENCODER, SAFETENSORS, CONFIG_JSON)

COSMOS = ExportFormat(
    name="cosmos",
    what="Cosmos export",
    files=_COSMOS_FILES,
    help="encoder.jit, decoder.jit, autoencoder.jit, model.safetensors, config.json in OUT",
    card=_cosmos_card,
    write=_write_cosmos,
    found_in=lambda folder: (folder / JIT_AUTOENCODER).is_file(),
    families=("cosmos",),
    stats_beside=True,
)
DIFFUSERS = ExportFormat(
    name="diffusers",
    what="diffusers folder",
    files=(CONFIG_JSON, DIFFUSERS_WEIGHTS),
    help="a diffusers folder in OUT (AutoencoderKLCosmos for Cosmos CV models, AutoencoderKLWan for the Wan "
    "VAEs: config.json with latents_mean/latents_std, diffusion_pytorch_model.safetensors) that from_pretrained "
    "loads and the pipelines take as their vae; needs --latent-stats",
    card=_diffusers_card,
    write=_write_diffusers,
    # diffusers_class raises for a diffusers folder whose config.json is damaged: never overwritten unseen.
    found_in=lambda folder: bool(diffusers_class(folder)),
    check=_check_diffusers,
    families=("cosmos", "wan21", "wan22"),
    subfolder=PIPELINE_SUBFOLDER,
    needs_stats="diffusers' Cosmos pipelines normalize latents with the latents_mean/latents_std of the vae's "
    "config.json, which come from the latent statistics",
)

WAN21_PTH = "Wan2.1_VAE.pth"
"""The name Wan gives the file; Cosmos-Predict2.5 ships the same dict as ``tokenizer.pth`` (any name loads)."""
WAN22_PTH = "Wan2.2_VAE.pth"
"""The name Wan2.2-TI2V-5B gives the file, which the Cosmos 3 recipes take as their video encoder."""


def _wan_format(family: str, pth: str, release: str, consumers: str) -> ExportFormat:
    """A Wan VAE's own format: its state dict as the plain ``.pth`` Wan's code loads strictly, and ours."""

    def write(network: VideoTokenizer, folder: Path, stats: LatentMoments | None, dtype: torch.dtype) -> list[str]:
        export_state_dict(network, folder, pth, dtype=dtype)
        return [pth, SAFETENSORS, CONFIG_JSON]

    def card(subfolder: str) -> str:
        return (
            f"Exported by tokenizer-posttrain in Wan's own layout: `{pth}` is the plain state dict that {consumers} "
            "load strictly; `model.safetensors` holds the same weights."
        )

    return ExportFormat(
        name=family,
        what=f"{release} VAE export",
        files=(pth, SAFETENSORS, CONFIG_JSON),
        help=f"{pth} (the state dict {consumers} load), model.safetensors, config.json in OUT: {release} VAE only",
        card=card,
        write=write,
        found_in=lambda folder: (folder / pth).is_file(),
        families=(family,),
        stats_beside=True,
    )


WAN21 = _wan_format(
    "wan21", WAN21_PTH, "Wan2.1", "Wan2.1's `WanVAE` and Cosmos-Predict2.5 / Transfer2.5 (as `tokenizer.pth`)"
)
WAN22 = _wan_format("wan22", WAN22_PTH, "Wan2.2", "Wan2.2's `Wan2_2_VAE` (and with it the Cosmos 3 recipes)")

FORMATS: dict[str, ExportFormat] = {fmt.name: fmt for fmt in (COSMOS, WAN21, WAN22, DIFFUSERS)}
"""Every export format by name, in the order they are written (and named in the card and the messages): each
family's own format before the formats several families share."""
DEFAULT_FORMAT = COSMOS.name
"""The default family's own format. ``export`` without ``--format`` and the posttrain workflow write the model's
(:func:`native_format`)."""


def register_format(fmt: ExportFormat) -> ExportFormat:
    """Add ``fmt`` to :data:`FORMATS` (after the others); returns it. A name already taken, or one with a comma
    or blank, is a :class:`ValueError`."""
    if fmt.name in FORMATS:
        raise ValueError(f"export format {fmt.name!r} is registered already")
    if not fmt.name or "," in fmt.name or fmt.name.strip() != fmt.name:
        raise ValueError(f"export format name {fmt.name!r}: a --format value needs a name without commas or blanks")
    FORMATS[fmt.name] = fmt
    return fmt


def format_choices() -> str:
    """The ``--format`` values for people: ``cosmos, diffusers or both`` (with more formats, ``a, b, c or
    several``)."""
    names = list(FORMATS)
    if len(names) == 1:
        return names[0]
    return f"{', '.join(names[:-1])}, {names[-1]} or {'both' if len(names) == 2 else 'several'}"


def unknown_formats(names: Iterable[str]) -> list[str]:
    """The names in ``names`` that are no export format, in their order, each once."""
    return [name for name in dict.fromkeys(names) if name not in FORMATS]


def parse_formats(value: str | Iterable[str]) -> tuple[str, ...]:
    """Export format names, from a comma-separated string (``--format cosmos,diffusers``) or a list of names:
    each once, in :data:`FORMATS`' order (whatever order they are given in). An unknown name is a
    :class:`ValueError` naming the first."""
    parts = value.split(",") if isinstance(value, str) else value
    names = tuple(dict.fromkeys(name.strip() for name in parts))
    unknown = unknown_formats(names)
    if unknown:
        raise ValueError(f"unknown format {unknown[0]!r} in {value!r}: use {format_choices()}")
    return tuple(name for name in FORMATS if name in names)


def check_formats(names: Iterable[str], config: NetworkConfig) -> None:
    """Refuse (:class:`~..core.errors.ExportError`, from the first format that does) a network of ``config``
    that one of the formats ``names`` cannot hold (one its family does not offer, or one whose check refuses
    it): before any work, so that nothing trains for an export that would fail."""
    family = family_of(config).name
    for name in parse_formats(names):
        if not FORMATS[name].holds(family):
            offered = [fmt.name for fmt in FORMATS.values() if fmt.holds(family)]
            raise ExportError(
                f"--format {name}: a {config.full_name} network cannot be written as a {FORMATS[name].what}; "
                f"its family ({family}) exports {' or '.join(offered) or 'no format yet'}"
            )
        FORMATS[name].check(config)


def placements(names: Iterable[str]) -> list[tuple[ExportFormat, str]]:
    """(format, subfolder) of each format in ``names``, in :data:`FORMATS`' order: the first writes into the
    export folder itself (subfolder ``""``), each other one into its :attr:`~ExportFormat.subfolder`."""
    chosen = [FORMATS[name] for name in parse_formats(names)]
    return [(fmt, fmt.subfolder if i else "") for i, fmt in enumerate(chosen)]


def formats_metavar() -> str:
    """``--format``'s metavar: a value, or several joined by commas (``{cosmos,wan21,wan22,diffusers}[,...]``)."""
    return "{" + ",".join(FORMATS) + "}[,...]"


def formats_help() -> str:
    """``--format``'s help: the default, each format's :attr:`~ExportFormat.help`, then where a format goes when
    written with a family's own one."""
    natives = {family: _native(family) for family in FAMILIES}
    own = [f"{fmt.name} for {family}" for family, fmt in natives.items() if fmt is not None]
    parts = [f"default: the model family's own format ({', '.join(own)})"]
    parts += [f"{fmt.name}: {fmt.help}" for fmt in FORMATS.values()]
    parts += [
        f"with another: the {fmt.what} in OUT/{fmt.subfolder}/ (e.g. --format {DEFAULT_FORMAT},{fmt.name})"
        for fmt in FORMATS.values()
        if fmt.subfolder
    ]
    return "; ".join(parts)


def native_format(config: NetworkConfig) -> ExportFormat:
    """What a run's ``export/`` folder holds: the first format made for ``config``'s family (Cosmos: the official
    ``.jit`` layout), else the first that holds any family."""
    family = family_of(config).name
    fmt = _native(family)
    if fmt is None:
        raise ExportError(f"no export format holds a {config.full_name} network (family {family})")
    return fmt


def _native(family: str) -> ExportFormat | None:
    """The first format made for ``family``, else the first that holds any family (None: no format holds it)."""
    own = [fmt for fmt in FORMATS.values() if family in fmt.families]
    anyone = [fmt for fmt in FORMATS.values() if not fmt.families]
    return (own or anyone or [None])[0]


def write_native(network: VideoTokenizer, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``network`` into ``folder`` in its :func:`native_format` (without latent statistics); ``folder``."""
    native_format(network.config).write(network, folder, None, dtype)
    return folder
