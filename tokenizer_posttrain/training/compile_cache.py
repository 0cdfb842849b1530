"""The run's compile cache: the compiled training step, kept in the run folder for every later launch of the run.

A resumed or requeued run (another node, a fresh ``/tmp``) would otherwise compile its step again before its first
step. PyTorch's portable cache artifacts (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``:
Inductor's compiled graphs, AOTAutograd's, the Triton kernels) go into ``<run>/compile_cache/``, written by rank 0
after the first step and after the first validation, loaded by every rank before the fit.

Those artifacts are compiled code and pickled graphs: loading them runs what they hold. So a cache file is loaded
only with this user's signature on it, an HMAC-SHA256 under a key that lives in the user's home and only the user
can read (:func:`signing_key`), checked before a byte of the file reaches torch. A run folder on shared storage
that someone else can write to can then cost a compile, never run their code.

A file's name is the hash of everything a compiled graph depends on (:func:`cache_environment`): a different torch,
CUDA, Triton, Python, GPU model, code version, model, loss, precision, clip shape or batch size finds no file and
compiles afresh. Deleting the folder changes nothing but time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import secrets
import stat
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

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
    A key file that others can read or write is refused (``PermissionError``): with it they could sign caches."""
    path = path or Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".cache" / "tokenizer-posttrain" / "signing.key")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another rank made it first
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
        raise PermissionError(
            f"compile cache signing key {path} must belong to you and be readable by you alone (chmod 600 {path}); "
            f"or set model.compile_cache=none"
        )
    key = path.read_bytes()
    if len(key) < 16:
        raise PermissionError(f"compile cache signing key {path} is shorter than 16 bytes: delete it to make a new one")
    return key


def _signature(key: bytes, blob: bytes) -> str:
    return hmac.new(key, blob, hashlib.sha256).hexdigest()


class CompileCache:
    """One run's cache file (``<folder>/<name>.bin``) and its record (``<name>.json``: signature, environment,
    the first step's compile time)."""

    def __init__(self, folder: Path, environment: dict[str, Any], key: bytes) -> None:
        self.folder = folder
        self.environment = environment
        self._key = key
        name = cache_name(environment)
        self.blob_path = folder / f"{name}.bin"
        self.record_path = folder / f"{name}.json"
        self._saved: set[str] = set()

    def record(self) -> dict[str, Any]:
        """The cache's record (plain JSON, safe to read), or {} when there is none or it does not parse."""
        try:
            record = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def load(self) -> bool:
        """Load the cache into this process's compile caches if present and signed with this user's key; a
        file without a valid signature is left unread (a warning says so). Whether anything was loaded."""
        if not self.blob_path.exists():
            return False
        signature = self.record().get("signature")
        blob = self.blob_path.read_bytes()
        if not isinstance(signature, str) or not hmac.compare_digest(signature, _signature(self._key, blob)):
            warnings.warn(
                f"not loading the compile cache {self.blob_path}: it does not carry your signature (written by "
                "someone else, or altered), and loading it would run the code it holds; compiling afresh "
                f"(delete {self.folder} to silence this)",
                stacklevel=2,
            )
            return False
        torch.compiler.load_cache_artifacts(blob)
        self._saved = set(self.record().get("artifacts", []))
        return True

    def save(self, compile_seconds: float | None = None) -> bool:
        """Write what this process compiled so far, signed, if it holds artifacts not saved yet (rank 0 only);
        ``compile_seconds`` (the first step's time) joins the record. Whether a file was written."""
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        blob, info = artifacts
        names = sorted({name for entries in info.artifacts.values() for name in entries})
        if set(names) <= self._saved:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        record = self.record()
        record.update(
            signature=_signature(self._key, blob),
            artifacts=names,
            environment=self.environment,
            written=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
        if compile_seconds is not None:
            record["compile_seconds"] = round(compile_seconds, 1)
        # Blob first, then the record that signs it, each by an atomic rename: a reader sees a matching pair, or
        # a signature that does not match (ignored, as above).
        for path, data in ((self.blob_path, blob), (self.record_path, json.dumps(record, indent=1).encode())):
            partial = path.with_name(path.name + ".partial")
            partial.write_bytes(data)
            os.replace(partial, path)
        self._saved = set(names)
        return True


def _shape_text(shapes: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"{t}x{h}x{w}" for t, h, w in shapes)


class CompileCacheCallback(pl.Callback):
    """Loads the run's compile cache before the fit (every rank), says before the first step what compiling
    will cost, times the first step, and saves the cache after it and after the first validation (rank 0)."""

    def __init__(self, cache: CompileCache, shapes: list[tuple[int, int, int]]) -> None:
        self.cache = cache
        self.shapes = shapes
        self.loaded = False
        self.first_step_seconds: float | None = None
        self._started: float | None = None
        self._validated = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loaded = self.cache.load()
        if not trainer.is_global_zero:
            return
        last = self.cache.record().get("compile_seconds")
        before = f" ({last:.0f} s when it last compiled)" if isinstance(last, (int, float)) else ""
        if self.loaded:
            print(f"compile cache: loaded {self.cache.blob_path}: the first step should start in seconds{before}")
        else:
            print(
                f"compiling the training step for {_shape_text(self.shapes)}: minutes the first time{before}; later "
                f"launches of this run load it from {self.cache.folder}",
                flush=True,
            )

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first_step_seconds is None and self._started is not None:
            self.first_step_seconds = time.perf_counter() - self._started
            self._save(trainer, None if self.loaded else self.first_step_seconds)

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
        except OSError as err:  # an optimisation: training goes on without it
            warnings.warn(
                f"model.compile_cache: could not write {self.cache.blob_path} ({err}); training on", stacklevel=2
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
