"""The diffusers format both ways: folders that diffusers' AutoencoderKLCosmos loads without a word and that
compute what our networks compute, and diffusers' own folders read back strictly as a starting point."""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import diffusers.utils.logging as diffusers_logging
import pytest
import torch
from diffusers import AutoencoderKLCosmos
from safetensors.torch import load_file, save_file

from tests.conftest import run_script
from tokenizer_posttrain.core.errors import CheckpointError, ExportError
from tokenizer_posttrain.evaluation.latent_stats import LatentStats
from tokenizer_posttrain.io.checkpoint import expected_shapes, load_tokenizer, read_weights
from tokenizer_posttrain.io.config_json import ALTERED
from tokenizer_posttrain.io.diffusers_format import (
    DIFFUSERS_WEIGHTS,
    diffusers_config,
    diffusers_names,
    write_diffusers,
)
from tokenizer_posttrain.network import build_tokenizer, get_config
from tokenizer_posttrain.network.cosmos import REGISTRY, CausalVideoTokenizer
from tokenizer_posttrain.network.lora import apply_lora, merge_lora

CONTINUOUS = [name for name, cfg in REGISTRY.items() if not cfg.is_discrete]
ENVIRONMENT = ("`accelerate` was not found",)
"""diffusers' only warning that is about the environment (accelerate is not installed here), not about the files."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(name: str, channels: int = 8, seed: int = 0) -> CausalVideoTokenizer:
    """A small network of the real architecture, random and seeded, its norms off their 1/0 initialisation."""
    torch.manual_seed(seed)
    net = build_tokenizer(name, channels=channels).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return net


def random_stats(net: CausalVideoTokenizer, positions: int = 16) -> LatentStats:
    """Latent statistics as the export computes them: [C, T] per channel and latent-frame position."""
    gen = torch.Generator().manual_seed(1)
    c = net.config.latent_channels
    mean, std = torch.randn(c, positions, generator=gen), torch.rand(c, positions, generator=gen) + 0.5
    return LatentStats(mean, std, mean[:, 0].clone(), std[:, 0].clone(), clips=4)


def clip(net: CausalVideoTokenizer, seed: int = 2) -> torch.Tensor:
    """The smallest clip with three latent frames (so causal attention over time has work to do)."""
    tc, sc = net.config.temporal_compression, net.config.spatial_compression
    return torch.rand(1, 3, 1 + 2 * tc, 2 * sc, 2 * sc, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@contextmanager
def diffusers_messages() -> Iterator[list[str]]:
    """Every log record (INFO and up) diffusers emits inside the block and every Python warning, as text."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger("diffusers")  # does not propagate to the root logger, so caplog cannot see it
    verbosity = diffusers_logging.get_verbosity()
    root.addHandler(handler)
    diffusers_logging.set_verbosity_info()
    messages: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        root.removeHandler(handler)
        diffusers_logging.set_verbosity(verbosity)
    messages += [f"{r.levelname}: {r.getMessage()}" for r in records]
    messages += [f"WARNING: {w.message}" for w in caught]


def load_in_diffusers(folder: Path) -> AutoencoderKLCosmos:
    """``AutoencoderKLCosmos.from_pretrained(folder)`` as a user calls it; asserts that diffusers says nothing
    about the files: no warning at all (but the environment's), and its two lines of a complete load."""
    with diffusers_messages() as messages:
        vae = AutoencoderKLCosmos.from_pretrained(folder).eval()
    problems = [m for m in messages if not m.startswith("INFO") and not any(e in m for e in ENVIRONMENT)]
    assert not problems, problems
    info = " ".join(messages)
    assert "All model checkpoint weights were used" in info, messages
    assert "All the weights of AutoencoderKLCosmos were initialized from the model checkpoint" in info, messages
    return vae


@pytest.mark.parametrize("name", CONTINUOUS)
def test_a_written_folder_loads_in_diffusers_without_a_word_and_computes_what_ours_does(
    name: str, tmp_path: Path
) -> None:
    net = tiny(name, channels=16 if name == "CV8x8x8" else 8)
    stats = random_stats(net, positions=1 + 120 // net.config.temporal_compression)  # a 121-frame chunk
    folder = write_diffusers(net, tmp_path / "vae", stats)
    assert {p.name for p in folder.iterdir()} == {"config.json", DIFFUSERS_WEIGHTS}
    vae = load_in_diffusers(folder)
    x = clip(net)
    with torch.no_grad():
        latent = net.encode(x)
        posterior = vae.encode(x).latent_dist  # an IdentityDistribution: mode and sample are the latent itself
        assert rel(posterior.mode(), latent) <= 1e-4 and rel(posterior.sample(), latent) <= 1e-4
        assert rel(vae.decode(latent).sample, net.decode(latent)) <= 1e-4
        assert rel(vae(x).sample, net(x)) <= 1e-4  # the round trip
    # And back: our loader reads the folder as it was written, every weight bit for bit.
    back = load_tokenizer(folder)
    assert back.config == net.config
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in net.state_dict().items())


def test_latent_statistics_go_into_the_config_in_the_order_diffusers_pipelines_read_them(tmp_path: Path) -> None:
    net = tiny("CV8x8x8")
    stats = random_stats(net)
    config = json.loads((write_diffusers(net, tmp_path, stats) / "config.json").read_text())
    # diffusers' Cosmos pipelines (pipeline_cosmos_video2world.py, pipeline_cosmos_text2world.py) read them so:
    latents = torch.randn(2, 16, 5, 4, 4)
    mean = torch.tensor(config["latents_mean"]).view(1, config["latent_channels"], -1, 1, 1)[:, :, : latents.size(2)]
    std = torch.tensor(config["latents_std"]).view(1, config["latent_channels"], -1, 1, 1)[:, :, : latents.size(2)]
    assert torch.equal(mean, stats.mean[None, :, :5, None, None])
    assert torch.equal(std, stats.std[None, :, :5, None, None])
    assert config["latents_mean"] == stats.mean.flatten().tolist()  # channel-major: each channel's frames in a row


def test_without_statistics_the_config_says_null_and_a_warning_says_why(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"no latent statistics, so latents_mean and latents_std are null"):
        folder = write_diffusers(tiny("CV8x8x8"), tmp_path, None)
    # null, not left out: a missing field would give NVIDIA's CV8x8x8 statistics, silently wrong for this tokenizer
    assert load_in_diffusers(folder).config.latents_mean is None


def test_lora_adapters_are_merged_into_the_written_weights(tmp_path: Path) -> None:
    net = tiny("CV8x8x8")
    apply_lora(net, rank=2, alpha=4.0)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_up" in n:
                p.normal_(std=0.05)  # adapters start at zero: give them something to merge
    back = load_tokenizer(write_diffusers(net, tmp_path, random_stats(net)))
    merged = merge_lora(copy.deepcopy(net))
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in merged.state_dict().items())


def diffusers_tiny(name: str, seed: int = 3) -> AutoencoderKLCosmos:
    """A randomly initialised small AutoencoderKLCosmos, built by diffusers, of the registry model ``name``."""
    config = {k: v for k, v in diffusers_config(get_config(name, channels=8)).items() if not k.startswith("_")}
    torch.manual_seed(seed)
    vae = AutoencoderKLCosmos(**config, latents_mean=None, latents_std=None).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return vae


@pytest.mark.parametrize("name", ["CV8x8x8", "CV4x8x8-LowRes"])
def test_a_folder_diffusers_saved_is_a_starting_point_that_computes_what_diffusers_does(
    name: str, tmp_path: Path
) -> None:
    vae = diffusers_tiny(name)
    vae.save_pretrained(tmp_path)
    net = load_tokenizer(tmp_path).eval()  # model.jit_ckpt_pth=<folder>, the model read from its config.json
    assert net.config == get_config(name, channels=8)
    assert load_tokenizer(tmp_path / DIFFUSERS_WEIGHTS, name, channels=8).config == net.config  # the file, by name
    x = clip(net)
    with torch.no_grad():
        latent = vae.encode(x).latent_dist.mode()
        assert rel(net.encode(x), latent) <= 1e-4
        assert rel(net.decode(latent), vae.decode(latent).sample) <= 1e-4
        assert rel(net(x), vae(x).sample) <= 1e-4


@pytest.mark.parametrize("name", CONTINUOUS)
def test_at_full_size_our_keys_mapped_are_diffusers_keys_and_shapes(name: str) -> None:
    config = REGISTRY[name]  # the released width: built on the meta device, no weight materialised
    fields = {k: v for k, v in diffusers_config(config).items() if not k.startswith("_")}
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in AutoencoderKLCosmos(**fields).state_dict().items()}
    shapes = expected_shapes(config)
    names = diffusers_names(shapes, config)
    ours = {names[k]: shape for k, shape in shapes.items() if names[k] is not None}
    assert ours == theirs
    assert sorted(k for k, v in names.items() if v is None) == sorted(k for k in shapes if "patcher3d." in k)
    if name == "CV8x8x8":  # what diffusers and its conversion script build for NVIDIA's CV8x8x8
        default = {k: list(v) if isinstance(v, tuple) else v for k, v in AutoencoderKLCosmos().config.items()}
        assert {k: default[k] for k in fields} == fields


def test_discrete_tokenizers_are_refused_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    net = build_tokenizer("DV8x16x16", channels=8)
    with pytest.raises(ExportError, match=r"^no diffusers format for DV8x16x16 \(channels=8\): a discrete") as err:
        write_diffusers(net, tmp_path / "vae", None)
    assert "\n" not in str(err.value) and not (tmp_path / "vae").exists()


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ({"legacy_mode": True}, "legacy_mode=True puts the decoder's temporal upsampling"),
        ({"z_channels": 8}, "z_channels x z_factor = 8 x 1 channels, not latent_channels=16"),
        ({"z_factor": 2}, "z_channels x z_factor = 16 x 2 channels"),
    ],
)
def test_networks_diffusers_cannot_build_are_refused_in_one_line(overrides: dict, refused: str) -> None:
    with pytest.raises(ExportError, match=refused) as err:
        diffusers_config(get_config("CV8x8x8", **overrides))
    assert "\n" not in str(err.value)


def test_legacy_mode_without_temporal_upsampling_is_the_same_network_and_is_written() -> None:
    assert diffusers_config(get_config("CV4x8x8", legacy_mode=True)) == diffusers_config(get_config("CV4x8x8"))


def _edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        state = load_file(str(folder / DIFFUSERS_WEIGHTS))
        edit(state)
        save_file(state, str(folder / DIFFUSERS_WEIGHTS))

    return apply


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return apply


KEY = "decoder.up_blocks.1.upsamplers.0.conv1.weight"


def _tampered_folder(tmp_path: Path, tamper: Callable[[Path], None]) -> Path:
    """A tiny CV8x8x8 written as a diffusers folder (``tmp_path/vae``), then changed by ``tamper``."""
    folder = tmp_path / "vae"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no statistics: beside the point here
        write_diffusers(tiny("CV8x8x8", channels=16), folder, None)
    tamper(folder)
    return folder


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_edit_weights(lambda s: s.__setitem__(KEY.replace("conv1", "conv9"), s.pop(KEY))),
         rf"missing keys: {KEY}; unexpected keys: {KEY.replace('conv1', 'conv9')}"),
        (_edit_weights(lambda s: s.pop(KEY)), rf"missing keys: {KEY}$"),
        (_edit_weights(lambda s: s.__setitem__(KEY, s[KEY][:, :, :1].contiguous())),
         rf"wrong shapes: {KEY} \(64, 64, 1, 1, 1\) \(expected \(64, 64, 3, 1, 1\)\)"),
        (lambda f: (f / DIFFUSERS_WEIGHTS).unlink(), rf"but no {DIFFUSERS_WEIGHTS}: copy the weights file"),
        (lambda f: (f / DIFFUSERS_WEIGHTS).rename(f / "diffusion_pytorch_model.bin"),
         r"diffusion_pytorch_model.bin is not read: only one safetensors file, never a pickle"),
        (lambda f: (f / DIFFUSERS_WEIGHTS).write_bytes((f / DIFFUSERS_WEIGHTS).read_bytes()[:5000]),
         rf"cannot read .*{DIFFUSERS_WEIGHTS}: .* The file looks truncated or corrupt"),
        (_edit_config(decode_block_out_channels=[32, 64, 64, 32]),
         r"decode_block_out_channels=\[32, 64, 64, 32\] does not mirror .* \(expected \[32, 64, 64, 64\]\)"),
        (_edit_config(encoder_block_out_channels=[8, 16, 32, "32"]), r"encoder_block_out_channels=.* is not a list"),
        (_edit_config(patch_type="rearrange"), r"patch_type='rearrange'; the Cosmos tokenizers patch with 'haar'"),
        (_edit_config(attention_resolutions=[64]), r"puts attention inside the levels at resolution \[64\]"),
        (_edit_config(temporal_compression_ratio=2), r"no Cosmos tokenizer compresses 2x8x8 with patch_size 4"),
        # A Cosmos config that names diffusers' Wan class is read as a Wan folder, which it is not.
        (
            _edit_config(_class_name="AutoencoderKLWan"),
            r"patch_size=4, but the Wan2.1 VAE has null .* no Wan VAE that tokenizer-posttrain reads",
        ),
        (lambda f: (f / "config.json").write_text("{"),
         r"config.json is not valid JSON \(Expecting .* at line 1, column 2\); copy, download or export the folder"),
    ],
)  # fmt: skip
def test_a_tampered_diffusers_folder_is_refused_in_one_line_naming_what_is_wrong(
    tamper: Callable[[Path], None], message: str, tmp_path: Path
) -> None:
    folder = _tampered_folder(tmp_path, tamper)
    with pytest.raises(CheckpointError, match=message) as err:
        read_weights(folder)
    assert "\n" not in str(err.value)


_FIX = "copy, download or export the folder again"


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        # Before: the layout of a hundred million blocks was built until the memory ran out.
        (_edit_config(num_layers=100_000_000), "num_layers=100000000 is not an integer from 1 to 16;"),
        # Before: tracebacks from torch's size arithmetic.
        (_edit_config(latent_channels=1_000_000_000), "latent_channels=1000000000 is not an integer from 1 to 4096;"),
        (_edit_config(encoder_block_out_channels=[2**30, 2**31, 2**32, 2**32],
                      decode_block_out_channels=[2**31, 2**32, 2**32, 2**32]),
         r"encoder_block_out_channels=\[1073741824, .* is not a list of 2 to 9 integers from 1 to 16384;"),
        (_edit_config(in_channels=10**6), "in_channels=1000000 is not an integer from 1 to 64;"),
        # Before: loaded (resolution only places attention), or refused with a million values in the message.
        (_edit_config(resolution=10**30), "resolution=1000000000000000000000000000000 is not an integer from 1 to"),
        (_edit_config(attention_resolutions=list(range(1, 10**6))),
         r"attention_resolutions=\[1, 2, .*\.\.\. \(\d+ characters\) is not a list of 0 to 64 integers"),
        (_edit_config(patch_size=4.0), "patch_size=4.0 is not a power of two from 1 to 16;"),
        # Before: "holds no tokenizer checkpoint", as if the folder had no diffusers files.
        (lambda f: (f / "config.json").write_text("[]"), r"config.json holds a JSON array, not an object of settings"),
        (lambda f: ((f / "config.json").unlink(), os.mkfifo(f / "config.json")), r"config.json is a FIFO, not a"),
    ],
)  # fmt: skip
def test_a_diffusers_config_out_of_range_is_refused_in_one_line_before_anything_is_built(
    tamper: Callable[[Path], None], message: str, tmp_path: Path
) -> None:
    folder = _tampered_folder(tmp_path, tamper)
    with pytest.raises(CheckpointError, match=message) as refused:
        load_tokenizer(folder)
    assert str(refused.value).startswith(str(folder / "config.json")) and "\n" not in str(refused.value)
    assert str(refused.value).endswith((_FIX, ALTERED))


def test_the_export_command_refuses_a_diffusers_config_out_of_range_in_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizer_posttrain.__main__ import main

    folder = _tampered_folder(tmp_path, _edit_config(num_layers=100_000_000))
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder / 'config.json'}: num_layers=100000000 is not an integer from 1 to 16; ")
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "out").exists()


_WITHOUT_DIFFUSERS = """
import sys, warnings
sys.modules["diffusers"] = None  # any import of diffusers now fails
import torch
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.io.diffusers_format import write_diffusers
from tokenizer_posttrain.network import build_tokenizer
net = build_tokenizer("CV8x8x8", channels=8)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    write_diffusers(net, sys.argv[1], None)
back = load_tokenizer(sys.argv[1]).state_dict()
assert all(torch.equal(v, back[k]) for k, v in net.state_dict().items())
"""


def test_writing_and_reading_need_no_diffusers(tmp_path: Path) -> None:
    done = run_script("-c", _WITHOUT_DIFFUSERS, str(tmp_path / "vae"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
