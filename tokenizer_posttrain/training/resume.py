"""What a launch resumes from: the newest readable checkpoint of the run folder, checked to belong to the run
that is being launched."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError, UserError
from ..core.untrusted import special_file
from ..io.checkpoint import read_checkpoint
from ..network import resolve_name
from .config import DataConfig, LossConfig, ModelConfig, ResumeConfig

LAST_CKPT = "last.ckpt"


class SettingsChanged(UserError):
    """The checkpoint to resume was written by a run with other defining settings."""


def read_checkpoint_header(path: str | Path) -> dict[str, Any]:
    """A training checkpoint's entries, its tensors memory-mapped (not read); :class:`CheckpointError` naming the
    file when it is truncated, not a training checkpoint, holds anything but plain data, or garbles a state
    the resume loads (checked here, before any work)."""
    ckpt = read_checkpoint(path, mmap=True, training_states=True)
    if "state_dict" not in ckpt:
        raise CheckpointError(f"{path}: not a training checkpoint of this app (no state_dict)")
    return ckpt


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a checkpoint was written at (read without loading its tensors)."""
    return int(read_checkpoint_header(path).get("global_step", 0))


def remove_partial_saves(ckpt_dir: Path) -> list[Path]:
    """Delete the temporary files of saves that were interrupted (``.NAME.<random>.tmp``, and the older
    ``.NAME.tmp``); only while this launch holds
    the run folder's lock, since a live run's save in progress looks the same."""
    removed = []
    if ckpt_dir.is_dir():
        for tmp in ckpt_dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    if removed:
        warnings.warn(f"removed {len(removed)} partial file(s) of interrupted saves in {ckpt_dir}", stacklevel=2)
    return removed


def _candidates(ckpt_dir: Path) -> list[Path]:
    """``last.ckpt`` and ``step=N.ckpt``, newest first by file name (``last.ckpt`` first), whatever they are (a
    FIFO too: :func:`_refuse_special_files`); their real steps are read when they are opened."""
    steps = sorted(
        (p for p in ckpt_dir.glob("step=*.ckpt") if p.stem.split("=", 1)[1].isdigit()),
        key=lambda p: int(p.stem.split("=", 1)[1]),
        reverse=True,
    )
    last = ckpt_dir / LAST_CKPT
    return ([last] if last.is_symlink() or last.exists() else []) + steps


def _refuse_special_files(candidates: list[Path]) -> None:
    """A FIFO, folder, device or broken link under a checkpoint's name stops the launch: skipped, the run would
    start again from step 0 without a word, and a FIFO opened would block the launch for ever."""
    for path in candidates:
        special = special_file(path)
        if special is not None:
            raise CheckpointError(
                f"{path} is {special}, not a checkpoint file; move it out of {path.parent} and run the same "
                "command again"
            )


def _why_unreadable(path: Path, err: CheckpointError) -> str:
    """The reason ``err`` gives why ``path`` cannot be resumed, in a few words: "holds a pickled Python object
    (posix.system)", "truncated or damaged", "not a torch checkpoint", "entry loops is of type bytes, ..."."""
    text = str(err)
    named = re.search(r"a pickled Python object \([\w.]{1,120}(?:\.\.\.)?\)", text)
    if named:
        return f"holds {named.group(0)}"
    if text.startswith(f"cannot read {path}"):
        try:
            with open(path, "rb") as f:  # a regular file: special files are never opened
                start = f.read(4)
        except OSError:
            return "cannot be read"
        if not start:
            return "empty"
        # torch.save writes a zip archive: one that cannot be read was cut short or damaged.
        return "truncated or damaged" if start == b"PK\x03\x04" else "not a torch checkpoint"
    return text.removeprefix(f"{path}: ").replace(str(path), path.name).split(";")[0]


def _scan(candidates: list[Path]) -> tuple[list[tuple[int, str]], list[str]]:
    """``(step, path)`` of each of ``candidates`` that can be read, newest first (``last.ckpt`` before a
    ``step=N.ckpt`` of the same step), and ``NAME: why`` for each that cannot, also named in a warning; a special
    file is never opened."""
    found, unreadable = [], []
    for path in candidates:
        special = special_file(path)
        if special is not None:
            warnings.warn(f"skipping {path}: it is {special}, not a checkpoint file", stacklevel=3)
            unreadable.append(f"{path.name}: is {special}")
            continue
        try:
            found.append((checkpoint_step(path), int(path.name == LAST_CKPT), str(path)))
        except CheckpointError as err:
            warnings.warn(f"skipping an unreadable checkpoint: {err}", stacklevel=3)
            unreadable.append(f"{path.name}: {_why_unreadable(path, err)}")
    return [(step, path) for step, _, path in sorted(found, reverse=True)], unreadable


def readable_checkpoints(ckpt_dir: Path) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint of ``ckpt_dir`` that can be read, newest first (``last.ckpt`` before a
    ``step=N.ckpt`` of the same step); one that cannot (truncated, not a checkpoint) is named in a warning."""
    return _scan(_candidates(ckpt_dir) if ckpt_dir.is_dir() else [])[0]


def find_resume_checkpoint(ckpt_dir: Path, resume: ResumeConfig) -> str | None:
    """The explicit ``resume.resume_from_path``, else the newest readable of ``last.ckpt`` and ``step=N.ckpt``
    (a kill between writing ``step=N.ckpt`` and ``last.ckpt`` must not lose that step). A checkpoint that cannot
    be read (truncated, not a checkpoint) is named in a warning and the next newest is taken; when none can, the
    error says why for each. A FIFO, folder or device under one of those names stops the launch unopened."""
    if resume.resume_from_path:
        path = Path(resume.resume_from_path)
        if special_file(path) is None and not path.is_file():
            raise FileNotFoundError(f"resume.resume_from_path={path} does not exist")
        read_checkpoint_header(path)
        return str(path)
    if not resume.resume_if_exists or not ckpt_dir.is_dir():
        return None
    candidates = _candidates(ckpt_dir)
    _refuse_special_files(candidates)
    found, unreadable = _scan(candidates)
    if not found and unreadable:
        raise CheckpointError(
            f"no checkpoint in {ckpt_dir} can be read ({'; '.join(unreadable)}); move them away to start over, "
            "or start a new run with another log.name"
        )
    return found[0][1] if found else None


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, out)
    else:
        out[prefix] = value


# What defines a run: changing one of these on resume trains something else than the checkpoint's run.
# Speed switches (compile, CUDA graphs, ...), batch layout, logging and max_steps may change.
_MODEL_KEYS = ("model", "jit_ckpt_pth", "channels", "trainable", "lora", "ema_decay", "latent_noise")
# crops_per_decode too: the loader's saved position counts decodes (micro_batch_size / crops_per_decode a batch).
_DATA_KEYS = ("path", "frames", "height", "width", "resize_short_side", "aspect_buckets", "hflip", "crops_per_decode")
# Of the loss: where files are, memory chunking, old names, and how often loss.gan recomputes its adaptive weight.
_LOSS_IGNORED = {"weights_path", "frame_chunk", "l1_weight", "perceptual_weight", "adaptive_every"}


def defining_settings(hparams: dict[str, Any]) -> dict[str, Any]:
    """The run-defining settings of a module's hyperparameters (``model``, ``data``, ``loss`` as saved), by
    dotted override key."""
    out: dict[str, Any] = {}
    model, data, loss = (hparams.get(group) or {} for group in ("model", "data", "loss"))
    for key in _MODEL_KEYS:
        if key in model:
            _flatten(f"model.{key}", model[key], out)
    for key in _DATA_KEYS:
        if key in data:
            out[f"data.{key}"] = data[key]
    flat_loss: dict[str, Any] = {}
    _flatten("loss", loss, flat_loss)
    out.update({k: v for k, v in flat_loss.items() if k.rsplit(".", 1)[-1] not in _LOSS_IGNORED})
    if isinstance(out.get("model.model"), str):
        try:
            out["model.model"] = resolve_name(out["model.model"])
        except ValueError:
            pass
    for key in ("model.jit_ckpt_pth", "data.path"):
        if isinstance(out.get(key), str):
            out[key] = os.path.normpath(out[key])
    return out


def current_settings(model: ModelConfig, data: DataConfig, loss: LossConfig) -> dict[str, Any]:
    """:func:`defining_settings` of the run being launched."""
    return defining_settings({"model": asdict(model), "data": asdict(data), "loss": asdict(loss)})


def settings_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key: saved -> now`` for every defining setting both record with different values (settings that an
    older checkpoint did not record are not compared)."""
    return [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in now if key in saved and saved[key] != now[key]]


def check_same_stream(ckpt_path: str, data: DataConfig, world_size: int, allow_changes: bool) -> str | None:
    """Refuse to resume ``ckpt_path`` when its energon loader position was saved with another
    ``data.micro_batch_size``, ``data.num_workers`` or number of training processes (``world_size`` now): energon
    continues a stream only in the loader layout that saved it. With ``allow_changes`` (``resume.allow_changes``)
    the launch goes on: the reason the data module must start the stream afresh, or None when it can continue it.
    Synthetic clips (no ``data.path``) keep no position."""
    if data.path is None:
        return None
    from ..data.energon import EnergonVideoDataModule, saved_loader_layout

    header = read_checkpoint_header(ckpt_path)
    layout = saved_loader_layout(header.get(EnergonVideoDataModule.__qualname__), ckpt_path)
    if layout is None:
        return None
    (processes, workers), changes = layout, []
    if processes != world_size:
        changes.append(f"training processes (trainer.devices x trainer.num_nodes): {processes} -> {world_size}")
    if workers != data.num_workers:
        changes.append(f"data.num_workers: {workers} -> {data.num_workers}")
    # Energon does not record the micro-batch of batches grouped by size (aspect buckets): the run's settings do.
    batch = ((header.get("hyper_parameters") or {}).get("data") or {}).get("micro_batch_size")
    if batch is not None and batch != data.micro_batch_size:
        changes.append(f"data.micro_batch_size: {batch} -> {data.micro_batch_size}")
    if not changes:
        return None
    if allow_changes:
        return f"its position in {ckpt_path} belongs to another loader ({'; '.join(changes)})"
    raise SettingsChanged(
        f"{ckpt_path} holds the position of its data stream for another loader ({'; '.join(changes)}), and energon "
        "can continue a stream only in the loader that saved it; resume with the old values, start a new run with "
        "another log.name=..., or resume with resume.allow_changes=true (the data stream then starts afresh)"
    )


def check_same_run(ckpt_path: str, now: dict[str, Any]) -> None:
    """Refuse to resume ``ckpt_path`` when it was written with other defining settings."""
    header = read_checkpoint_header(ckpt_path)
    changes = settings_changes(defining_settings(header.get("hyper_parameters") or {}), now)
    if changes:
        raise SettingsChanged(
            f"{ckpt_path} was written by a run with other settings ({'; '.join(changes)}); start a new run "
            "with another log.name=..., or resume with these changes anyway with resume.allow_changes=true"
        )
