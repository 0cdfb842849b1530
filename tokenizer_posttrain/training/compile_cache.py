"""The run's compile cache: the compiled training step, kept in the run folder for every later launch of the run.

A resumed or requeued run (another node, a fresh ``/tmp``) would otherwise compile its step again before its first
step. PyTorch's portable cache artifacts (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``:
Inductor's compiled graphs, AOTAutograd's, the Triton kernels) go into ``<run>/compile_cache/``, written by rank 0
after the first step, after the first step of each later clip shape, after the first validation and at the end,
and loaded by every rank before the fit. Each save that holds something new becomes a part of its own
(``<name>-<i>.bin``): torch records only what the current process compiled or used, so rewriting one file would
drop what an earlier launch compiled and this one did not meet.

Those artifacts are compiled code and pickled graphs: loading them runs what they hold. So a part is loaded only
with this user's signature on it, an HMAC-SHA256 of its name and bytes under a key that lives in the user's home
and only the user can read (:func:`signing_key`), checked before a byte of it reaches torch; parts are read only
as regular files (no links, FIFOs or devices), and written through fresh temporary files renamed into place, so
that links planted in the folder are replaced, never written through. A run folder on shared storage that someone
else can write to can then cost a compile, never run their code or overwrite the user's files.

A cache's name is the hash of everything a compiled graph depends on (:func:`cache_environment`): a different
torch, CUDA, Triton, Python, GPU model, code version, model, loss, precision, clip shape or batch size finds no
cache and compiles afresh. Deleting the folder changes nothing but time; so does anything failing in it (a
warning says what).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import re
import secrets
import stat
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ..core.files import write_bytes_atomically
from ..core.untrusted import read_regular_file
from ..data.batch import VIDEO
from .config import DataConfig, LossConfig, ModelConfig

FOLDER = "compile_cache"
KEY_FILE_ENV = "TOKENIZER_POSTTRAIN_SIGNING_KEY"
"""Environment variable naming the signing key file (default ``~/.cache/tokenizer-posttrain/signing.key``)."""
_PACKAGE = Path(__file__).resolve().parents[1]


def cache_folder(model: ModelConfig, run_dir: Path) -> Path | None:
    """Where ``model.compile_cache`` puts the cache of the run in ``run_dir``; None when it is off (``none``, or
    the step is not compiled)."""
    if not model.compile or model.compile_cache == "none":
        return None
    return run_dir / FOLDER if model.compile_cache == "run" else Path(model.compile_cache)


def code_version() -> str:
    """Hash of the package's source files: code that changed may trace to other graphs."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _device_name() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{props.name} sm_{props.major}{props.minor}"
    return f"cpu {platform.machine()}"


def cache_environment(
    model: ModelConfig, data: DataConfig, loss: LossConfig, precision: str, shapes: list[tuple[int, int, int]]
) -> dict[str, Any]:
    """Everything the compiled graphs depend on; ``shapes`` are the run's (frames, height, width) clip shapes."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # File paths name where weights come from, which the graphs never see.
    model_settings = {k: v for k, v in asdict(model).items() if k not in ("jit_ckpt_pth", "compile_cache")}
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "device": _device_name(),
        "code": code_version(),
        "model": model_settings,
        "loss": _without_paths(asdict(loss)),
        "precision": str(precision),
        "micro_batch_size": data.micro_batch_size,
        "shapes": [list(shape) for shape in shapes],
    }


def _without_paths(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k != "weights_path"}
    return value


def cache_name(environment: dict[str, Any]) -> str:
    """The cache file's stem: a hash of ``environment``."""
    return hashlib.sha256(json.dumps(environment, sort_keys=True, default=str).encode()).hexdigest()[:24]


def signing_key(path: Path | None = None) -> bytes:
    """This user's key for signing compile caches: ``path``, else the file :data:`KEY_FILE_ENV` names, else
    ``~/.cache/tokenizer-posttrain/signing.key``; made (32 random bytes, readable by the user alone) if absent.
    A key that is not the user's own, that others can read or write, or whose folder others can write to is
    refused (``PermissionError``): with it they could sign caches."""
    path = path or Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".cache" / "tokenizer-posttrain" / "signing.key")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Written whole under a temporary name (mkstemp: mode 0600), then linked into place: ranks starting
        # together either make the key or find it complete, never half written.
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".signing-", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(partial, path)
            except FileExistsError:  # another rank made it first
                pass
            except OSError:  # a file system without hard links
                if not path.exists():
                    os.replace(partial, path)
        finally:
            if os.path.lexists(partial):
                os.unlink(partial)
    folder = path.parent.stat()
    if folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"compile cache signing key {path}: its folder {path.parent} can be written by others, who could replace "
            f"the key; use a private folder ({KEY_FILE_ENV}=...), or set model.compile_cache=none"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise PermissionError(f"compile cache signing key {path} cannot be read ({err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
            raise PermissionError(
                f"compile cache signing key {path} must be a file of yours that only you can read and write "
                f"(chmod 600 {path}); or set model.compile_cache=none"
            )
        key = f.read()
    if len(key) < 16:
        raise PermissionError(f"compile cache signing key {path} is shorter than 16 bytes: delete it to make a new one")
    return key


MAX_PART_BYTES = 16 * 2**30
"""Larger cache files are not read (a planted file must not exhaust memory before its signature is checked)."""


def _signature(key: bytes, file_name: str, blob: bytes) -> str:
    # The file's name (which hashes its environment) is signed too: a blob signed for another environment or
    # another part cannot be passed off as this one.
    return hmac.new(key, file_name.encode() + b"\0" + blob, hashlib.sha256).hexdigest()


def _artifact_names(info: Any) -> set[str]:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(name) for entries in artifacts.values() for name in entries}


class CompileCache:
    """One run's cache: parts ``<folder>/<name>-<i>.bin``, each what a launch compiled that earlier parts lacked,
    and the record ``<name>.json`` (each part's signature, the environment, the first step's compile time)."""

    def __init__(self, folder: Path, environment: dict[str, Any], key: bytes) -> None:
        self.folder = folder
        self.environment = environment
        self._key = key
        self.name = cache_name(environment)
        self.record_path = folder / f"{self.name}.json"
        self._part_name = re.compile(rf"{self.name}-(\d+)\.bin")
        # Artifacts that files already hold: those torch loaded from them, and those saved by this process.
        self._known: set[str] = set()

    def record(self) -> dict[str, Any]:
        """The record (plain JSON, safe to read), reduced to well-formed entries: ``parts`` (each a dict with a
        part ``file`` name of this cache and a ``signature``) and ``compile_seconds`` (a number or None)."""
        try:
            raw = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            raw = {}
        raw = raw if isinstance(raw, dict) else {}
        parts = [
            {"file": part["file"], "signature": part["signature"]}
            for part in raw.get("parts", [])
            if isinstance(part, dict)
            and isinstance(part.get("file"), str)
            and self._part_name.fullmatch(part["file"])
            and isinstance(part.get("signature"), str)
        ]
        seconds = raw.get("compile_seconds")
        number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        return {"parts": parts, "compile_seconds": float(seconds) if number else None}

    def load(self, report: bool = True) -> bool:
        """Load every part signed with this user's key into this process's compile caches; a part without a
        valid signature is not handed to torch, and one that cannot be read or loaded is skipped (``report``:
        with a warning). Whether anything was loaded."""
        loaded = False
        for part in self.record()["parts"]:
            path = self.folder / part["file"]
            try:
                blob = read_regular_file(path, MAX_PART_BYTES)
                if not hmac.compare_digest(part["signature"], _signature(self._key, part["file"], blob)):
                    self._warn(
                        report,
                        f"not loading the compile cache {path}: it does not carry your signature (written by someone "
                        "else, or altered), and loading it would run the code it holds",
                    )
                    continue
                info = torch.compiler.load_cache_artifacts(blob)
            except Exception as err:  # noqa: BLE001 - an optimisation: whatever fails, the step compiles
                self._warn(report, f"could not load the compile cache {path} ({err})")
                continue
            if info is None:
                self._warn(report, f"torch {torch.__version__} could not load the compile cache {path}")
                continue
            self._known |= _artifact_names(info)
            loaded = True
        return loaded

    def _warn(self, report: bool, message: str) -> None:
        if report:
            warnings.warn(f"{message}; compiling afresh (delete {self.folder} to silence this)", stacklevel=3)

    def save(self, compile_seconds: float | None = None) -> bool:
        """Write what this process compiled that no part holds yet, as a new signed part (rank 0 only);
        ``compile_seconds`` (the first step's time) joins the record. Whether a part was written."""
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        blob, info = artifacts
        names = _artifact_names(info)
        if names <= self._known:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        record = self.record()
        parts = record["parts"]
        taken = {int(match.group(1)) for part in parts if (match := self._part_name.fullmatch(part["file"]))}
        file_name = f"{self.name}-{max(taken, default=-1) + 1}.bin"
        # The part first, then the record that signs it: a reader meets a signed part or none.
        write_bytes_atomically(self.folder / file_name, blob)
        parts.append({"file": file_name, "signature": _signature(self._key, file_name, blob)})
        seconds = compile_seconds if compile_seconds is not None else record["compile_seconds"]
        new_record = {
            "parts": parts,
            "compile_seconds": None if seconds is None else round(seconds, 1),
            "environment": self.environment,
            "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        write_bytes_atomically(self.record_path, json.dumps(new_record, indent=1).encode())
        self._known |= names
        return True


def _shape_text(shapes: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"{t}x{h}x{w}" for t, h, w in shapes)


def _clip_shape(batch: Any) -> tuple[int, int, int] | None:
    """(frames, height, width) of a training batch's videos ``[B, C, T, H, W]``; None for other batches."""
    video = batch.get(VIDEO) if isinstance(batch, dict) else None
    if isinstance(video, torch.Tensor) and video.dim() == 5:
        t, h, w = video.shape[2:]
        return int(t), int(h), int(w)
    return None


class CompileCacheCallback(pl.Callback):
    """Loads the run's compile cache before the fit (every rank), says before the first step what compiling
    will cost (and before the first clip of each later shape), times the first step, and saves the cache after
    it, after each new shape's first step, after the first validation and at the end (rank 0)."""

    def __init__(self, cache: CompileCache, shapes: list[tuple[int, int, int]]) -> None:
        self.cache = cache
        self.shapes = shapes
        self.loaded = False
        self.first_step_seconds: float | None = None
        self._started: float | None = None
        self._validated = False
        self._seen: set[tuple[int, int, int]] = set()
        self._new_shape = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loaded = self.cache.load(report=trainer.is_global_zero)
        if not trainer.is_global_zero:
            return
        last = self.cache.record()["compile_seconds"]
        before = f" ({last:.0f} s when it last compiled)" if last is not None else ""
        if self.loaded:
            print(f"compile cache: loaded {self.cache.folder}: the first step should start in seconds{before}")
        else:
            print(
                f"compiling the training step for {_shape_text(self.shapes)}: minutes the first time{before}; later "
                f"launches of this run load it from {self.cache.folder}",
                flush=True,
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        shape = _clip_shape(batch)
        self._new_shape = shape is not None and shape not in self._seen
        if shape is not None and self._new_shape:
            self._seen.add(shape)
            if self._started is not None and trainer.is_global_zero:  # met after the first step: an aspect bucket
                print(
                    f"first {_shape_text([shape])} clip: compiling the training step for it (seconds if the compile "
                    "cache holds it)",
                    flush=True,
                )
        if self._started is None:
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first_step_seconds is None and self._started is not None:
            self.first_step_seconds = time.perf_counter() - self._started
            self._save(trainer, None if self.loaded else self.first_step_seconds)
        elif self._new_shape:  # saved now, not at the end: a run stopped early keeps it too
            self._save(trainer)
        self._new_shape = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._validated and not trainer.sanity_checking:
            self._validated = True
            self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Shapes met after the first step (aspect buckets) compiled since; saves nothing when none did.
        self._save(trainer)

    def _save(self, trainer: pl.Trainer, compile_seconds: float | None = None) -> None:
        if not trainer.is_global_zero:
            return
        try:
            self.cache.save(compile_seconds)
        except Exception as err:  # noqa: BLE001 - an optimisation: whatever fails, training goes on without it
            warnings.warn(
                f"model.compile_cache: could not write to {self.cache.folder} ({err}); training on", stacklevel=2
            )

    def summary(self) -> str | None:
        """The end-of-run line on compiling."""
        if self.first_step_seconds is None:
            return None
        how = "with the compile cache loaded" if self.loaded else "compiling"
        return f"first step: {self.first_step_seconds:.1f} s ({how}; cache: {self.cache.folder})"


def compile_cache_callback(
    model: ModelConfig,
    data: DataConfig,
    loss: LossConfig,
    precision: str,
    run_dir: Path,
    shapes: list[tuple[int, int, int]],
) -> CompileCacheCallback | None:
    """The callback for the run in ``run_dir`` (None when ``model.compile_cache`` is off or nothing compiles);
    reads (or makes) the signing key now, so that a bad key file stops the launch with one line."""
    folder = cache_folder(model, run_dir)
    if folder is None:
        return None
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        warnings.warn(
            f"model.compile_cache: torch {torch.__version__} has no portable compile cache (torch 2.7+): every launch "
            "compiles afresh",
            stacklevel=2,
        )
        return None
    environment = cache_environment(model, data, loss, precision, shapes)
    return CompileCacheCallback(CompileCache(folder, environment, signing_key()), shapes)
