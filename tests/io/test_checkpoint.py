"""Strict loading from every supported source, and clear errors for every bad one."""

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import reference_io, reference_weights
from tokenizer_posttrain.io.checkpoint import (
    MODEL_FLAG,
    TRAIN_OVERRIDES,
    CheckpointError,
    ModelSettingNames,
    load_tokenizer,
)
from tokenizer_posttrain.network import build_tokenizer


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


@pytest.mark.parametrize("name", ["CV8x8x8", "DV8x16x16"])
def test_model_is_inferred_from_the_layout(name: str) -> None:
    net = load_tokenizer(reference_weights(name))
    assert net.config.name == name and net.config.channels == 16


def test_jit_folder_loads_as_fp32_master_weights(
    exported_dirs: dict[str, Path], model_name: str, tmp_path: Path
) -> None:
    folder = exported_dirs[model_name]
    whole = load_tokenizer(folder / "autoencoder.jit")
    assert all(p.dtype == torch.float32 for p in whole.parameters())  # the files are bf16
    # encoder.jit + decoder.jit alone are enough and give the same weights
    halves = tmp_path / "halves"
    halves.mkdir()
    for f in ("encoder.jit", "decoder.jit"):
        shutil.copy(folder / f, halves / f)
    from_halves = load_tokenizer(halves, f"Cosmos-1.0-Tokenizer-{model_name}", channels=16)
    assert _same_weights(whole, from_halves)
    # and the bf16 weights still reproduce the reference closely
    io = reference_io(model_name)
    with torch.no_grad():
        rec = whole(io["input"])
    assert ((rec - io["reconstruction"]).norm() / io["reconstruction"].norm()).item() < 0.05


def test_half_a_folder_is_an_error(exported_dirs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(exported_dirs["CV8x8x8"] / "encoder.jit", tmp_path / "encoder.jit")
    with pytest.raises(CheckpointError, match="has encoder.jit but no decoder.jit"):
        load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match="holds only the encoder"):
        load_tokenizer(tmp_path / "encoder.jit")


def test_empty_folder_says_what_it_expected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="expected autoencoder.jit, or encoder.jit"):
        load_tokenizer(tmp_path)


def test_wrong_model_names_both(exported_dirs: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(exported_dirs["DV8x16x16"], "Cosmos-1.0-Tokenizer-CV8x8x8", channels=16)
    message = str(err.value)
    assert "this is a DV8x16x16 (channels=16) checkpoint, you asked for CV8x8x8 (channels=16)" in message
    assert "unexpected keys: decoder.up.2.upsample.conv2.conv3d.bias" in message  # names the keys
    assert "(11 in all)" in message
    assert "quant_conv.conv3d.weight (6, 16, 1, 1, 1) (expected (16, 16, 1, 1, 1))" in message


def test_wrong_width_says_so() -> None:
    with pytest.raises(CheckpointError, match=r"CV8x8x8 \(channels=16\) checkpoint, you asked for CV8x8x8"):
        load_tokenizer(reference_weights("CV8x8x8"), "CV8x8x8")


@pytest.mark.parametrize(
    "names, fix",
    [
        (TRAIN_OVERRIDES, "you asked for CV8x8x8: set model.channels=16. "),
        (MODEL_FLAG, "you asked for CV8x8x8: leave out --model: the checkpoint's model and width are then read"),
        # A caller that does not say how its user sets the model gets both spellings.
        (None, "set model.channels=16 (train_tokenizer.py), or leave out --model (the other commands then read"),
    ],
)
def test_wrong_width_names_the_setting_that_fixes_it(names: ModelSettingNames | None, fix: str) -> None:
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(reference_weights("CV8x8x8"), "CV8x8x8", setting_names=names)
    assert fix in str(err.value)


@pytest.mark.parametrize(
    "names, fix",
    [
        (TRAIN_OVERRIDES, "you asked for CV8x8x8: set model.model=Cosmos-1.0-Tokenizer-DV8x16x16 model.channels=16. "),
        (MODEL_FLAG, "you asked for CV8x8x8: leave out --model: "),
    ],
)
def test_wrong_model_and_width_names_both_settings(names: ModelSettingNames, fix: str) -> None:
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(reference_weights("DV8x16x16"), "CV8x8x8", setting_names=names)
    assert fix in str(err.value)


def test_wrong_model_of_the_right_width_names_the_model_setting(exported_dirs: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(exported_dirs["DV8x16x16"], "CV8x8x8", setting_names=MODEL_FLAG, channels=16)
    assert "you asked for CV8x8x8 (channels=16): pass --model DV8x16x16, or leave out --model" in str(err.value)
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(exported_dirs["DV8x16x16"], "CV8x8x8", setting_names=TRAIN_OVERRIDES, channels=16)
    assert "(channels=16): set model.model=Cosmos-1.0-Tokenizer-DV8x16x16. The weights" in str(err.value)


def test_truncated_checkpoint_is_reported(exported_dirs: dict[str, Path], tmp_path: Path) -> None:
    data = (exported_dirs["CV8x8x8"] / "autoencoder.jit").read_bytes()
    (tmp_path / "autoencoder.jit").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_tokenizer(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(reference_weights("CV8x8x8").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_tokenizer(tmp_path / "model.safetensors")


def test_unknown_layout_names_the_closest_model(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = build_tokenizer("CV8x8x8", channels=16).state_dict()
    del state["decoder.conv_out.1.conv3d.bias"]
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "odd.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(tmp_path / "odd.safetensors")
    assert "Closest is CV8x8x8 (channels=16)" in str(err.value)
    assert "decoder.conv_out.1.conv3d.bias" in str(err.value) and "extra.weight" in str(err.value)


def test_missing_path() -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer("/no/such/checkpoint.jit")


class _Planted:
    """Unpickling this writes a marker file: what a crafted checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "code ran"))


def _training_checkpoint(**entries: object) -> dict:
    net = build_tokenizer("CV8x8x8", channels=16)
    state = {f"network.{k}": v for k, v in net.state_dict().items()}
    return {"state_dict": state, "tokenizer_config": net.config.to_dict(), "global_step": 3, **entries}


def test_a_checkpoint_holding_an_object_is_refused_in_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    torch.save(_training_checkpoint(hyper_parameters={"model": _Planted(marker)}), tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError) as refused:
        load_tokenizer(tmp_path / "last.ckpt")
    message = str(refused.value)
    assert message.startswith(f"refusing to load {tmp_path / 'last.ckpt'}: it holds a pickled Python object")
    assert "truncated" not in message and "\n" not in message
    assert not marker.exists()


@pytest.mark.parametrize(
    ("entries", "named"),
    [
        ({"hyper_parameters": b"\x80\x04."}, "entry hyper_parameters is of type bytes, expected dict"),
        ({"hyper_parameters": {"model": b"\x80\x04."}}, "entry hyper_parameters.model is of type bytes, expected dict"),
        ({"hyper_parameters": {"model": {"lora": 3}}}, "entry hyper_parameters.model.lora is of type int"),
        ({"callbacks": {"ModelCheckpoint": b"\x80\x04."}}, "entry callbacks['ModelCheckpoint'] is of type bytes"),
        ({"optimizer_states": [b"\x80\x04."]}, "entry optimizer_states[0] is of type bytes, expected dict"),
        ({"loops": b"\x80\x04."}, "entry loops is of type bytes, expected dict"),
        ({"global_step": "3"}, "entry global_step is of type str, expected int"),
    ],
)
def test_entries_of_the_wrong_type_are_refused_naming_them(tmp_path: Path, entries: dict, named: str) -> None:
    from tokenizer_posttrain.io.checkpoint import read_checkpoint
    from tokenizer_posttrain.io.model_card import checkpoint_card

    path = tmp_path / "last.ckpt"
    torch.save(_training_checkpoint(**entries), path)
    # Every reader of a training checkpoint: export and evaluate (load_tokenizer), resume, the model card.
    readers = (load_tokenizer, read_checkpoint, lambda p: checkpoint_card(p, "CV8x8x8", None, False))
    for read in readers:
        with pytest.raises(CheckpointError) as refused:
            read(path)
        assert str(refused.value).startswith(f"{path}: {named}")
        assert "not written by tokenizer-posttrain" in str(refused.value)


def test_a_bytes_entry_of_no_use_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save(_training_checkpoint(planted=b"\x80\x04.", callbacks={"ModelCheckpoint": {"planted": b"."}}), path)
    assert load_tokenizer(path).config.name == "CV8x8x8"


def test_lora_adapters_without_their_settings_are_one_line(tmp_path: Path) -> None:
    # Before: a KeyError or ZeroDivisionError traceback folding the adapters.
    state = {"network.decoder.conv_out.weight": torch.zeros(3, 4, 1, 1, 1)}
    state["network.decoder.conv_out.lora_down.weight"] = torch.zeros(2, 4, 1, 1, 1)
    for lora, said in (
        ({}, "no usable hyper_parameters.model.lora alpha and rank (None, None)"),
        ({"alpha": 1.0, "rank": 0}, "(1.0, 0)"),
        ({"alpha": 1.0, "rank": 2}, "the LoRA adapter 'decoder.conv_out' lacks its up or base weight"),
    ):
        torch.save({"state_dict": state, "hyper_parameters": {"model": {"lora": lora}}}, tmp_path / "l.ckpt")
        with pytest.raises(CheckpointError, match=re.escape(said)):
            load_tokenizer(tmp_path / "l.ckpt")
