"""Strict checkpoint loading: official ``.jit`` folders, our exports, Lightning checkpoints.

Every load is ``strict=True``. When keys or shapes disagree, the error names them and says
which model the file looks like, instead of training a half-random network (which is
what a ``strict=False`` load does silently).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch.loops.progress import _ProcessedTracker
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from ..core.errors import CheckpointError
from ..core.untrusted import load_torch_file, special_file
from ..network import FAMILIES, VideoTokenizer, build_network, config_from_dict, get_config
from ..network.family import FAMILY_KEY, NetworkConfig
from .config_json import MAX_BLOCKS, MAX_LEVELS, MAX_WIDTH, read_config_json, shown, tokenizer_settings
from .diffusers_format import DIFFUSERS_WEIGHTS, diffusers_class, read_diffusers
from .jit_archive import read_jit_state
from .layout import (
    CONFIG_JSON,
    CONFIG_KEY,
    JIT_AUTOENCODER,
    JIT_DECODER,
    JIT_ENCODER,
    LIGHTNING_PREFIX,
    SAFETENSORS,
    LayoutDiff,
    Weights,
    describe_config,
    diff_layout,
    expected_shapes,
    load_safetensors,
)
from .wan_diffusers import is_wan_diffusers, read_wan_diffusers


def _normalize_key(key: str) -> str:
    # The decoder layout holds the shared quantizer under inv_quant.
    return key.replace("inv_quant.quantizer.", "quantizer.", 1) if key.startswith("inv_quant.") else key


def _read_jit(path: Path) -> dict[str, Tensor]:
    # Never torch.jit.load: it runs the archive's code (io.jit_archive says why and how it is read instead).
    return {_normalize_key(k): v for k, v in read_jit_state(path).items()}


def _read_safetensors(path: Path) -> Weights:
    if path.name == DIFFUSERS_WEIGHTS and is_wan_diffusers(path.parent):
        return read_wan_diffusers(path.parent)
    if path.name == DIFFUSERS_WEIGHTS and diffusers_class(path.parent):
        return read_diffusers(path.parent)
    config = None
    meta = path.with_name(CONFIG_JSON)
    if meta.exists() or meta.is_symlink():  # a FIFO or a dangling link too: refused in one line, never waited on
        settings = read_config_json(meta, "export the tokenizer again, or restore config.json from a copy")
        config = _config_from_dict(settings.get(CONFIG_KEY), meta)
    state = load_safetensors(path)
    return Weights({_normalize_key(k): v for k, v in state.items()}, str(path), config)


_FIELDS: dict[str, type] = {
    "state_dict": dict,
    "current_model_state": dict,
    "optimizer_states": list,
    "lr_schedulers": list,
    "loops": dict,
    "callbacks": dict,
    "hyper_parameters": dict,
    "rng_states": dict,
    CONFIG_KEY: dict,
    "global_step": int,
    "epoch": int,
}
"""Type of each entry Lightning or tokenizer-posttrain writes in a training checkpoint."""
_ITEMS: dict[str, type] = {"optimizer_states": dict, "lr_schedulers": dict, "loops": dict, "callbacks": dict}
"""Type of each item of the entries that are collections of states."""
_SECTIONS = ("model", "data", "optim", "loss")
"""The config dicts under ``hyper_parameters`` (``model.lora`` too)."""


def _check_fields(ckpt: dict[str, Any], path: Path) -> None:
    def check(key: str, value: Any, expected: type) -> None:
        if value is not None and not isinstance(value, expected):
            raise CheckpointError(
                f"{path}: entry {key} is of type {type(value).__name__}, expected {expected.__name__}; the file was "
                "altered or not written by tokenizer-posttrain"
            )

    for key, expected in _FIELDS.items():
        check(key, ckpt.get(key), expected)
    for key, expected in _ITEMS.items():
        value = ckpt.get(key) or ()
        for name, item in value.items() if isinstance(value, dict) else enumerate(value):
            check(f"{key}[{shown(name)}]", item, expected)
    for key in ("state_dict", "current_model_state"):
        for name, tensor in (ckpt.get(key) or {}).items():
            check(f"{key} key {shown(name)}", name, str)
            check(f"{key}[{shown(name)}]", tensor, Tensor)
    hp = ckpt.get("hyper_parameters") or {}
    for section in _SECTIONS:
        check(f"hyper_parameters.{section}", hp.get(section), dict)
    check("hyper_parameters.model.lora", (hp.get("model") or {}).get("lora"), dict)


_COUNTERS = frozenset(("ready", "started", "processed", "completed"))
"""The counters of a Lightning loop's progress tracker. Its ``load_state_dict`` sets every key it is given as an
attribute, so any other key, or a counter that is not a count, would break the loop later."""
_ADAMW_NUMBERS = ("lr", "eps", "weight_decay")
"""The hyperparameters AdamW reads from each parameter group (``betas`` too): it adds its missing switches itself,
but not these."""
_ADAMW_SWITCHES = ("amsgrad", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay")
_SCHEDULER_FIELDS: dict[str, str] = {
    "base_lrs": "numbers",
    "_last_lr": "numbers",
    "last_epoch": "int",
    "_step_count": "count",
    "_get_lr_called_within_step": "switch",
    "_is_initial": "switch",
    "verbose": "switch",  # written by torch releases before 2.7
    "lr_lambdas": "nones",
}
"""What each key of a LambdaLR state holds. Its ``load_state_dict`` sets every key as an attribute of the scheduler
(another key could replace its optimizer or a method), and merges each ``lr_lambdas`` item that is not None into
a function's attributes; our schedules are plain functions, stored as None."""
MIN_LIGHTNING = "2.0.0"
"""Lightning rewrites the loops of a checkpoint written before this release on resume, expecting structures that
tokenizer-posttrain (which needs Lightning 2) never wrote."""
_RESUME_NEEDS = ("pytorch-lightning_version", "optimizer_states", "lr_schedulers")
"""The entries Lightning's resume reads without checking they are there."""


def _entry(key: str, name: object) -> str:
    """The path of item ``name`` of the entry ``key``, as messages name it (``loops.fit_loop['epoch_loop.x']``)."""
    return f"{key}.{name}" if isinstance(name, str) and name.isidentifier() else f"{key}[{shown(name)}]"


def _is_number(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and bool(torch.isfinite(value).all())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "dict": (lambda v: isinstance(v, dict), "dict"),
    "list": (lambda v: isinstance(v, (list, tuple)), "list"),
    "str": (lambda v: isinstance(v, str), "str"),
    "switch": (lambda v: isinstance(v, bool), "bool"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "int"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "int >= 0"),
    "number": (_is_number, "finite number"),
    "tensor": (lambda v: isinstance(v, Tensor), "Tensor"),
    "none": (lambda v: v is None, "None"),
}
"""Each kind of value the resumed states hold: the test, and its name in messages."""


class _Structure:
    """The checks of the nested states Lightning's resume loads (loops, optimizers, LR schedulers), whose
    ``load_state_dict`` methods fail with a traceback, or later in training, on values of the wrong type; the
    first problem is a one-line :class:`CheckpointError` naming the entry's path in the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def refuse(self, key: str, problem: str) -> NoReturn:
        raise CheckpointError(
            f"{self.path}: entry {key} {problem}; the file was altered or not written by tokenizer-posttrain"
        )

    def kind(self, key: str, value: Any, kind: str) -> None:
        accepts, name = _KINDS[kind]
        if not accepts(value):
            what = shown(value) if isinstance(value, (bool, int, float)) else f"of type {type(value).__name__}"
            self.refuse(key, f"is {what}, expected {name}")

    def item(self, key: str, state: dict, name: str, kind: str) -> Any:
        """``state[name]`` (``state`` is the entry ``key``), which must be there and of ``kind``."""
        if name not in state:
            self.refuse(key, f"has no {name!r}")
        self.kind(_entry(key, name), state[name], kind)
        return state[name]

    def version(self, value: Any) -> None:
        from packaging.version import InvalidVersion, Version

        key = "'pytorch-lightning_version'"
        self.kind(key, value, "str")
        try:
            older = Version(value) < Version(MIN_LIGHTNING)
        except InvalidVersion:
            self.refuse(key, f"is {value[:40]!r}, not a version number")
        if older:
            self.refuse(key, f"is {value[:40]}: written by a Lightning older than {MIN_LIGHTNING}")

    def loops(self, loops: dict) -> None:
        if "fit_loop" not in loops:
            self.refuse("loops", "has no 'fit_loop'")
        for name, loop in loops.items():
            key = _entry("loops", name)
            self.kind(key, loop, "dict")
            # Lightning looks up only its loops' progress attributes and state dicts: other keys are never read.
            for entry, value in loop.items():
                if not isinstance(entry, str):
                    continue
                where = _entry(key, entry)
                if entry.endswith("state_dict"):
                    self.loop_state(where, value)
                elif entry.endswith("optim_progress"):
                    self.kind(where, value, "dict")
                    optimizer = self.item(where, value, "optimizer", "dict")
                    for part in ("step", "zero_grad"):
                        self.progress(
                            _entry(f"{where}.optimizer", part), self.item(f"{where}.optimizer", optimizer, part, "dict")
                        )
                elif entry.endswith("progress"):
                    # A resume loads the fit loop only; the prediction loop's batch progress has no is_last_batch.
                    self.progress(where, value, batch=entry.endswith("batch_progress") and name == "fit_loop")

    def loop_state(self, key: str, state: Any) -> None:
        self.kind(key, state, "dict")
        if "_batches_that_stepped" in state:
            self.kind(_entry(key, "_batches_that_stepped"), state["_batches_that_stepped"], "count")
        if "combined_loader" in state:
            loaders = self.item(key, state, "combined_loader", "list")
            if loaders:
                # Lightning hands these to loaders that keep a state of their own; ours keep theirs elsewhere.
                self.refuse(f"{key}.combined_loader", f"holds {len(loaders)} data loader state(s), expected none")

    def progress(self, key: str, progress: Any, batch: bool = False) -> None:
        self.kind(key, progress, "dict")
        for part in ("total", "current"):
            tracker = self.item(key, progress, part, "dict")
            for counter, value in tracker.items():
                # A counter a later Lightning adds is a count too; one named like the tracker's methods replaces them.
                if counter not in _COUNTERS and (not isinstance(counter, str) or hasattr(_ProcessedTracker, counter)):
                    self.refuse(_entry(key, part), f"has a key {shown(counter)} that would replace a part of the loop")
                self.kind(_entry(_entry(key, part), counter), value, "count")
        if batch or "is_last_batch" in progress:
            self.item(key, progress, "is_last_batch", "switch")

    def optimizer(self, key: str, state: Any) -> int:
        """Check an AdamW state; the number of its parameter groups."""
        self.kind(key, state, "dict")
        groups = self.item(key, state, "param_groups", "list")
        listed = set()
        for i, group in enumerate(groups):
            where = f"{key}.param_groups[{i}]"
            self.kind(where, group, "dict")
            for j, param in enumerate(self.item(where, group, "params", "list")):
                self.kind(f"{where}.params[{j}]", param, "count")
                listed.add(param)
            for name in _ADAMW_NUMBERS:
                self.item(where, group, name, "number")
            betas = self.item(where, group, "betas", "list")
            if len(betas) != 2:
                self.refuse(f"{where}.betas", f"holds {len(betas)} values, expected 2")
            for j, beta in enumerate(betas):
                self.kind(f"{where}.betas[{j}]", beta, "number")
            for name in _ADAMW_SWITCHES:
                if name in group:
                    self.kind(_entry(where, name), group[name], "switch")
            if group.get("foreach") is not None:
                self.kind(f"{where}.foreach", group["foreach"], "switch")
            if "initial_lr" in group:
                self.kind(f"{where}.initial_lr", group["initial_lr"], "number")
        for param, moments in self.item(key, state, "state", "dict").items():
            if param not in listed:
                problem = f"holds the state of parameter {shown(param)}, which no parameter group lists"
                self.refuse(f"{key}.state", problem)
            where = f"{key}.state[{shown(param)}]"
            self.kind(where, moments, "dict")
            for name, value in moments.items():
                self.kind(_entry(where, name), value, "tensor")
        return len(groups)

    def scheduler(self, key: str, state: Any, optimizer: str | None, groups: int | None) -> None:
        """Check a LambdaLR state; ``groups``: the parameter groups of its optimizer (the entry ``optimizer``)."""
        self.kind(key, state, "dict")
        self.item(key, state, "lr_lambdas", "list")
        for name, value in state.items():
            if name not in _SCHEDULER_FIELDS:
                # A field a later torch adds is a plain value; one named like the scheduler's own attributes
                # (optimizer, step, ...) would replace them.
                if not isinstance(name, str) or hasattr(LambdaLR, name) or name == "optimizer":
                    self.refuse(key, f"has a key {shown(name)} that would replace a part of the scheduler")
                if not isinstance(value, (bool, int, float, str, type(None))):
                    self.refuse(_entry(key, name), f"is of type {type(value).__name__}, expected a plain value")
                continue
            kind, where = _SCHEDULER_FIELDS[name], _entry(key, name)
            if kind in ("numbers", "nones"):
                self.kind(where, value, "list")
                for i, item in enumerate(value):
                    self.kind(f"{where}[{i}]", item, "number" if kind == "numbers" else "none")
            else:
                self.kind(where, value, kind)
        # One learning rate per parameter group: LambdaLR zips these lists with the groups and with each other.
        sizes = {f"{key}.{name}": len(state[name]) for name in ("base_lrs", "_last_lr", "lr_lambdas") if name in state}
        if optimizer is not None and groups is not None:
            sizes[f"{optimizer}.param_groups"] = groups
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
            self.refuse(key, f"does not fit its optimizer: as many values are needed in each of {listed}")


def _check_structure(ckpt: dict[str, Any], path: Path) -> None:
    """The nested states a resume loads, checked as Lightning 2 and torch's AdamW and LambdaLR expect them."""
    structure = _Structure(path)
    if "pytorch-lightning_version" in ckpt:
        structure.version(ckpt["pytorch-lightning_version"])
    if ckpt.get("loops") is not None:
        structure.loops(ckpt["loops"])
    optimizers = ckpt.get("optimizer_states") or []
    groups = [structure.optimizer(f"optimizer_states[{i}]", state) for i, state in enumerate(optimizers)]
    for i, state in enumerate(ckpt.get("lr_schedulers") or []):
        # Lightning pairs the schedulers with the optimizers in order: ours have one each.
        optimizer = f"optimizer_states[{i}]" if i < len(groups) else None
        structure.scheduler(f"lr_schedulers[{i}]", state, optimizer, groups[i] if optimizer else None)


def read_checkpoint(
    path: str | Path, mmap: bool = False, resume: bool = False, training_states: bool = False
) -> dict[str, Any]:
    """The entries of a Lightning training checkpoint, loaded weights-only (nothing in it is unpickled, see
    :func:`~tokenizer_posttrain.core.untrusted.load_torch_file`), with the type of each entry Lightning and
    tokenizer-posttrain write checked, and the loop, optimizer and LR scheduler states a resume loads checked as
    Lightning and torch expect them, so a damaged or crafted file is refused in one line naming the entry. A FIFO,
    folder or device is refused without being opened. ``mmap`` maps the file instead of reading it;
    ``training_states`` checks the states a resume loads (reading weights needs none of them); ``resume`` checks
    them and requires the entries Lightning's resume reads."""
    path = Path(path)
    special = special_file(path)
    if special is not None:
        raise CheckpointError(f"{path} is {special}, not a checkpoint file; give the path of a .ckpt file")
    ckpt = load_torch_file(path, mmap=mmap)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} is not a Lightning checkpoint (it holds a {type(ckpt).__name__}, not a dict)")
    _check_fields(ckpt, path)
    if resume or training_states:  # reading weights (export, reconstruct) needs none of them
        _check_structure(ckpt, path)
    missing = [key for key in _RESUME_NEEDS if ckpt.get(key) is None] if resume else []
    if missing:
        raise CheckpointError(
            f"{path} cannot be resumed: it has no {' and no '.join(missing)} entry (Lightning writes them in every "
            "training checkpoint); resume a checkpoint that train_tokenizer.py wrote, or start a new run with "
            "another log.name"
        )
    return ckpt


def _read_lightning(path: Path, ema: bool = False) -> Weights:
    ckpt = read_checkpoint(path)
    if "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    # Lightning's EMA callback stores the average as state_dict and the live weights beside it.
    if "current_model_state" in ckpt:
        source = ckpt["state_dict"] if ema else ckpt["current_model_state"]
    elif ema:
        raise CheckpointError(f"{path} holds no EMA weights: the run was trained without model.ema_decay")
    else:
        source = ckpt["state_dict"]
    state = {k[len(LIGHTNING_PREFIX) :]: v for k, v in source.items() if k.startswith(LIGHTNING_PREFIX)}
    if not state:
        raise CheckpointError(
            f"{path} holds no tokenizer weights (no keys starting with "
            f"{LIGHTNING_PREFIX!r}); was it written by tokenizer-posttrain?"
        )
    lora = ((ckpt.get("hyper_parameters") or {}).get("model") or {}).get("lora") or {}
    if any(".lora_" in k for k in state):
        alpha, rank = lora.get("alpha"), lora.get("rank")
        if not (_is_number(alpha) and isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
            raise CheckpointError(
                f"{path} holds LoRA adapters but no usable hyper_parameters.model.lora alpha and rank "
                f"({shown(alpha)}, {shown(rank)}); the file was altered or not written by tokenizer-posttrain"
            )
        _fold_lora(state, float(alpha) / rank, path)
    return Weights(state, str(path), _config_from_dict(ckpt.get(CONFIG_KEY), path))


def _fold_lora(state: dict[str, Tensor], scale: float, path: Path) -> None:
    """Fold LoRA adapters of a training checkpoint into their conv weights (up is 1x1x1)."""
    for key in [k for k in state if k.endswith(".lora_down.weight")]:
        base = key[: -len(".lora_down.weight")]
        if f"{base}.lora_up.weight" not in state or f"{base}.weight" not in state:
            raise CheckpointError(f"{path}: the LoRA adapter {shown(base)} lacks its up or base weight")
        down, up = state.pop(key).float(), state.pop(f"{base}.lora_up.weight").float()
        weight = state[f"{base}.weight"]
        delta = torch.einsum("or,r...->o...", up.flatten(1), down)
        state[f"{base}.weight"] = (weight.float() + scale * delta).to(weight.dtype)


def _config_from_dict(data: Any, where: Path) -> NetworkConfig | None:
    if data is None:
        return None
    try:
        if isinstance(data, dict) and data.get(FAMILY_KEY) is not None:
            # A family after the first records its name; the layout is built from the fields before the weights
            # are compared, so each is bounded first (a crafted size would build a network without end).
            _bounded_sizes(data, where)
            config = config_from_dict(data)
            if config.name not in FAMILIES[str(data[FAMILY_KEY])].configs:
                raise CheckpointError(f"{where}: {CONFIG_KEY}.name={shown(config.name)} is not a model of its family")
            return config
        # Each field checked for type and range first: the layout is built from them before the weights are
        # compared.
        return config_from_dict(tokenizer_settings(data, CONFIG_KEY, where))
    except CheckpointError:
        raise
    except (TypeError, ValueError) as err:  # fields each in range that do not fit together
        raise CheckpointError(f"{where}: invalid {CONFIG_KEY}: {err}") from err


def _bounded_sizes(data: dict[str, Any], where: Path) -> None:
    """Every size in a family's recorded config within the bounds config.json's fields have: integers (not
    booleans) from 0 to MAX_WIDTH, at most MAX_BLOCKS residual blocks, at most MAX_LEVELS levels."""
    for key, value in data.items():
        values = value if isinstance(value, list | tuple) else [value]
        if isinstance(value, list | tuple) and len(value) > MAX_LEVELS:
            raise CheckpointError(f"{where}: {CONFIG_KEY}.{key} has {len(value)} entries, more than {MAX_LEVELS}")
        high = MAX_BLOCKS if "blocks" in key else MAX_WIDTH
        for item in values:
            if isinstance(item, int) and not isinstance(item, bool) and not 0 <= item <= high:
                raise CheckpointError(
                    f"{where}: {CONFIG_KEY}.{key}={shown(item)} is not from 0 to {high}; the file was altered: use "
                    "the checkpoint or export again"
                )


def _family_format(path: Path, ema: bool) -> Weights | None:
    """The weights of ``path`` when a family's own reader recognises it (a format of that family alone, such as
    a ``.pth`` state dict), else None."""
    for family in FAMILIES.values():
        state = family.reader(path) if family.reader is not None else None
        if state is not None:
            if ema:
                raise CheckpointError(f"{path}: EMA weights exist only in training checkpoints (.ckpt)")
            return Weights(state, str(path))
    return None


def _plain_state(path: Path) -> Weights | None:
    """A ``.pth`` that holds a plain dict of tensors (read weights-only), else None (a TorchScript archive under
    that name is read as one, below)."""
    try:
        content = load_torch_file(path)
    except CheckpointError:
        return None
    if (
        isinstance(content, dict)
        and content
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in content.items())
    ):
        return Weights(content, str(path))
    return None


def read_weights(path: str | Path, ema: bool = False) -> Weights:
    """Read tokenizer weights, normalised to autoencoder-layout keys, from a file or folder (a diffusers
    ``AutoencoderKLCosmos`` folder too, with the config its ``config.json`` describes).

    ``ema`` picks the EMA average of a Lightning checkpoint (an error for other sources)."""
    path = Path(path).expanduser()
    if path.is_dir():
        own = _family_format(path, ema)
        if own is not None:
            return own
        if is_wan_diffusers(path):
            return read_wan_diffusers(path)
        if diffusers_class(path):  # our own exports' config.json has no _class_name
            return read_diffusers(path)
        for name in (JIT_AUTOENCODER, JIT_ENCODER, JIT_DECODER, SAFETENSORS):
            special = special_file(path / name)
            if special is not None:  # skipped, it would let the folder's other files load without a word
                raise CheckpointError(f"{path / name} is {special}, not a weights file; replace it with the file")
        found = {n for n in (JIT_AUTOENCODER, JIT_ENCODER, JIT_DECODER, SAFETENSORS) if (path / n).is_file()}
        if JIT_AUTOENCODER in found:
            return Weights(_read_jit(path / JIT_AUTOENCODER), str(path / JIT_AUTOENCODER))
        if {JIT_ENCODER, JIT_DECODER} <= found:
            enc, dec = _read_jit(path / JIT_ENCODER), _read_jit(path / JIT_DECODER)
            return Weights({**dec, **enc}, f"{path / JIT_ENCODER} + {path / JIT_DECODER}")
        if SAFETENSORS in found:
            return _read_safetensors(path / SAFETENSORS)
        if found:
            (have,) = found
            need = JIT_DECODER if have == JIT_ENCODER else JIT_ENCODER
            raise CheckpointError(
                f"{path} has {have} but no {need}: both halves are needed to train the whole "
                f"tokenizer (or an {JIT_AUTOENCODER}). Copy the missing file into {path}."
            )
        raise CheckpointError(
            f"{path} holds no tokenizer checkpoint: expected {JIT_AUTOENCODER}, or {JIT_ENCODER} + "
            f"{JIT_DECODER}, or {SAFETENSORS} (as in the Hugging Face model folders)."
        )
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    special = special_file(path)
    if special is not None:  # a FIFO would block the read until someone writes to it
        raise CheckpointError(f"{path} is {special}, not a weights file; pass the weights file itself")
    own = _family_format(path, ema)
    if own is not None:
        return own
    suffix = path.suffix.lower()
    if suffix == ".pth" and not ema:
        plain = _plain_state(path)
        if plain is not None:  # a state dict no family claims: the closest layout and its differences get named
            return plain
    if suffix == ".safetensors":
        return _read_safetensors(path)
    if suffix == ".ckpt":
        return _read_lightning(path, ema)
    if ema:
        raise CheckpointError(f"{path}: EMA weights exist only in training checkpoints (.ckpt)")
    state = _read_jit(path)
    has_enc = any(k.startswith("encoder.") for k in state)
    has_dec = any(k.startswith("decoder.") for k in state)
    if has_enc != has_dec:
        half, other = ("encoder", JIT_DECODER) if has_enc else ("decoder", JIT_ENCODER)
        raise CheckpointError(f"{path} holds only the {half}; pass the folder that also has {other}")
    return Weights(state, str(path))


# -- identifying which model a state_dict belongs to ---------------------------------------


def identify(state: dict[str, Tensor]) -> list[tuple[NetworkConfig, LayoutDiff]]:
    """Every registered model of every family (at the sizes found in ``state``: its width...), closest layout
    first."""
    results = []
    for family in FAMILIES.values():
        for base in family.configs.values():
            # Every size the shapes give, also those equal to the release's: one of them may pin another (Wan2.2's
            # decoder width, which a change of width alone would scale).
            sizes = dict(family.sizes_of(state, base))
            try:
                cfg = base.replace(**sizes) if any(getattr(base, k) != v for k, v in sizes.items()) else base
            except ValueError:
                continue
            results.append((cfg, diff_layout(state, expected_shapes(cfg))))
    return sorted(results, key=lambda item: item[1].size)


@dataclass(frozen=True)
class ModelSettingNames:
    """How the user of a caller of :func:`load_tokenizer` names the model and its width, so that a checkpoint
    that does not fit the model asked for comes with the setting that fixes it."""

    model: str
    """The model setting with a ``{}`` for the name, e.g. ``model.model={}`` or ``--model {}``."""
    channels: str | None
    """The width setting with a ``{}``, e.g. ``model.channels={}``; None where there is none (the width is then
    read from the checkpoint when the model setting is left out)."""

    def fix(self, found: NetworkConfig, asked: NetworkConfig) -> str:
        """What to set so that a request for ``asked`` loads the checkpoint of ``found``."""
        if self.channels is not None:
            changes = [self.model.format(found.full_name)] if found.name != asked.name else []
            if found.channels != asked.channels:
                changes.append(self.channels.format(found.channels))
            return "set " + " ".join(changes)
        leave_out = "leave out " + self.model.format("").strip()
        if found.channels != asked.channels:
            return f"{leave_out}: the checkpoint's model and width are then read from it"
        return f"pass {self.model.format(found.name)}, or {leave_out} to read the model from the checkpoint"


TRAIN_OVERRIDES = ModelSettingNames("model.model={}", "model.channels={}")
"""train_tokenizer.py's overrides (and the ``model`` group of NeMo-Run recipes)."""
MODEL_FLAG = ModelSettingNames("--model {}", None)
"""The ``--model`` flag of reconstruct, encode, decode and posttrain (no width flag: they infer it)."""


def _fix(found: NetworkConfig, asked: NetworkConfig, names: ModelSettingNames | None) -> str:
    if names is not None:
        return names.fix(found, asked)
    # A caller that did not say how its user sets the model: both spellings.
    return (
        f"{TRAIN_OVERRIDES.fix(found, asked)} (train_tokenizer.py), or leave out --model "
        "(the other commands then read the model from the checkpoint)"
    )


def resolve_config(
    weights: Weights,
    name: str | None,
    overrides: dict[str, Any],
    setting_names: ModelSettingNames | None = None,
) -> NetworkConfig:
    """The config to build for ``weights``: asked for by name, stored with them, or inferred.

    ``setting_names``: how the caller's user sets the model, named in the fix when the weights do not fit."""
    ranked = identify(weights.state)
    best_cfg, best_diff = ranked[0]
    looks_like = describe_config(best_cfg) if best_diff.size == 0 else None
    if name is None:
        if weights.config is not None:
            config = weights.config.replace(**overrides) if overrides else weights.config
        elif looks_like is None:
            raise CheckpointError(
                f"{weights.source} does not match the layout of any known tokenizer. Closest is "
                f"{describe_config(best_cfg)}: {best_diff.describe()}"
            )
        else:
            config = best_cfg.replace(**overrides) if overrides else best_cfg
    else:
        config = get_config(name, **overrides)
    diff = diff_layout(weights.state, expected_shapes(config))
    if diff.size:
        hint = ""
        if looks_like:
            fix = _fix(best_cfg, config, setting_names)
            hint = f"this is a {looks_like} checkpoint, you asked for {describe_config(config)}: {fix}. "
        raise CheckpointError(
            f"{weights.source}: {hint}The weights do not fit {describe_config(config)}: {diff.describe()}"
        )
    return config


def load_tokenizer(
    path: str | Path,
    name: str | None = None,
    ema: bool = False,
    setting_names: ModelSettingNames | None = None,
    **config_overrides: Any,
) -> VideoTokenizer:
    """Build a tokenizer and load its weights strictly from ``path``.

    ``path`` is a Hugging Face style folder (``autoencoder.jit``, or ``encoder.jit`` +
    ``decoder.jit``, or our ``model.safetensors`` + ``config.json``), a diffusers ``AutoencoderKLCosmos``
    folder (``config.json`` + ``diffusion_pytorch_model.safetensors``), or a ``.jit``,
    ``.safetensors`` or Lightning ``.ckpt`` file. With ``name=None`` the model is inferred
    from the checkpoint. Weights are fp32 whatever the file's dtype (fp32 master weights).
    ``ema=True`` loads the EMA average kept by a run trained with ``model.ema_decay``.
    ``setting_names`` says how the caller's user sets the model (:data:`TRAIN_OVERRIDES`, :data:`MODEL_FLAG`),
    so that a checkpoint of another model or width is refused with the setting that fixes it.
    """
    weights = read_weights(path, ema)
    config = resolve_config(weights, name, config_overrides, setting_names)
    network = build_network(config)
    network.load_state_dict(weights.state, strict=True)
    return network
