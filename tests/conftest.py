"""Shared fixtures: the reference vectors shipped in tests/data, tiny networks, CLI runs."""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import os
import socket
import subprocess
import sys
import tempfile
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import dataloader as torch_dataloader

from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.network.cosmos import CausalVideoTokenizer

ROOT = Path(__file__).resolve().parents[1]

# Data loader iterators with worker processes, to stop the workers of those a test leaves open (a finished run's
# loaders, a loader a failed test left behind). Left to the garbage collector, torch stops them from __del__ during
# a later collection, where each worker ignores the stop and is killed after a 5 s timeout: 10 s for two workers,
# paid by whichever later test triggers the collection. A fresh process pays nothing: its exit kills them.
_LOADER_ITERATORS: weakref.WeakSet = weakref.WeakSet()
_iterator_init = torch_dataloader._MultiProcessingDataLoaderIter.__init__


def _tracked_iterator_init(self: object, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
    _iterator_init(self, *args, **kwargs)
    _LOADER_ITERATORS.add(self)


torch_dataloader._MultiProcessingDataLoaderIter.__init__ = _tracked_iterator_init


def open_loader_iterators() -> set[int]:
    """The ids of the data loader iterators whose workers are running now."""
    return {id(it) for it in list(_LOADER_ITERATORS) if not it._shutdown}


def stop_loader_workers(keep: set[int]) -> None:
    """Stop the workers of every open data loader iterator but those in ``keep`` (what torch's ``__del__`` does,
    here at once)."""
    for it in list(_LOADER_ITERATORS):
        if id(it) not in keep and not it._shutdown:
            it._shutdown_workers()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After each test body, stop the loader workers it left running (see _LOADER_ITERATORS)."""
    keep = open_loader_iterators()
    try:
        return (yield)
    finally:
        stop_loader_workers(keep)


REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
TINY = {"CV8x8x8": 16, "DV8x16x16": 16}


def reference_weights(name: str) -> Path:
    return REFERENCE / f"{name}_tiny_weights.safetensors"


def reference_io(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(REFERENCE / f"{name}_tiny_io.safetensors"))


@pytest.fixture(params=["CV8x8x8", "DV8x16x16"])
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def loaded_tiny_networks() -> dict[str, CausalVideoTokenizer]:
    """Each reference tiny model as load_tokenizer gave it, once a session (never handed out itself)."""
    return {}


@pytest.fixture
def tiny_network(model_name: str, loaded_tiny_networks: dict[str, CausalVideoTokenizer]) -> CausalVideoTokenizer:
    """The reference tiny model (width 16) with the reference weights, in eval mode: each test gets its own copy
    of the network loaded once a session (loading matches the file against every model's layout, twice the
    time of the copy)."""
    if model_name not in loaded_tiny_networks:
        loaded = load_tokenizer(reference_weights(model_name), channels=TINY[model_name]).eval()
        loaded_tiny_networks[model_name] = loaded
    return copy.deepcopy(loaded_tiny_networks[model_name])


def run_cli(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``train_tokenizer.py`` in a fresh process, as a user would."""
    return run_script(str(ROOT / "train_tokenizer.py"), *args, cwd=cwd, timeout=timeout, env=env)


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """What file descriptors 1 and 2 receive inside the block (this process's ``print`` and its child
    processes', e.g. data loader workers), as ``[stdout, stderr]`` once the block ends; usable where pytest's
    ``capfd`` is not (module-scoped fixtures)."""
    files = [tempfile.TemporaryFile() for _ in range(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    streams = [io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True) for fd in (1, 2)]
    result: list[str] = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            for fd, file, name, stream in zip((1, 2), files, ("stdout", "stderr"), streams, strict=True):
                os.dup2(file.fileno(), fd)
                patch.setattr(sys, name, stream)
            try:
                yield result
            finally:
                for stream in streams:
                    stream.flush()
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        for file in files:
            file.seek(0)
            result.append(file.read().decode("utf-8", errors="replace"))
            file.close()


def _print_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:  # noqa: ANN401
    """Python's own way of showing a warning (to ``sys.stderr``), where pytest would record it instead."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_cli_here(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``train_tokenizer.py ARGS`` in this process: the same command line (NeMo-Run's parser through
    ``commands.train_cli.run_cli``, the default recipe, ``train``) without the 5-8 s of imports a fresh
    process pays, for runs whose point is not a fresh process. Runs in ``cwd`` with ``env`` added, and puts
    back the environment (``train`` sets seed variables) and the working directory afterwards. stdout and
    stderr are what the file descriptors received (loader workers' output too); warnings, which pytest
    would otherwise collect, go to stderr as they happen, as Python prints them."""
    import recipes
    from tokenizer_posttrain.commands.train_cli import run_cli as cli
    from tokenizer_posttrain.training.train import check_launch, train

    environ = dict(os.environ)
    keep = open_loader_iterators()
    try:
        with (
            pytest.MonkeyPatch.context() as patch,
            warnings.catch_warnings(),
            captured_output() as output,
        ):
            warnings.simplefilter("default")
            warnings.showwarning = _print_warning
            patch.chdir(cwd)
            patch.setattr(sys, "argv", [str(ROOT / "train_tokenizer.py")])  # run_cli rewrites it
            for key, value in (env or {}).items():
                patch.setenv(key, value)
            code = cli(train, recipes.cv8x8x8.cv8x8x8, list(args), dry_run=check_launch)
    finally:
        stop_loader_workers(keep)  # the run is over: its loaders' workers stop as they would at the process's exit
        os.environ.clear()
        os.environ.update(environ)
    out, err = output
    return subprocess.CompletedProcess(["train_tokenizer.py", *args], code, out, err)


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """All rows of every CSV log version of a run, oldest first."""
    rows: list[dict[str, str]] = []
    for version in sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        with open(version / "metrics.csv") as f:
            rows.extend(csv.DictReader(f))
    return rows


@pytest.fixture(scope="session")
def exported_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny reference model exported once, in bf16 like the official release files."""
    from tokenizer_posttrain.io.export import export_tokenizer

    out = {}
    for name, width in TINY.items():
        net = load_tokenizer(reference_weights(name), channels=width)
        out[name] = export_tokenizer(net, tmp_path_factory.mktemp(f"export_{name}"), dtype=torch.bfloat16)
    return out


def fit(
    module: pl.LightningModule,
    tmp_path: Path,
    steps: int = 3,
    callbacks: list | None = None,
    datamodule: pl.LightningDataModule | None = None,
    **trainer_kw: Any,
) -> pl.Trainer:
    """A few bf16-mixed CPU training steps of ``module`` on small synthetic clips (no logs, no
    checkpoints, unless ``trainer_kw`` asks: any ``pl.Trainer`` argument, and ``ckpt_path_for_fit``
    to resume from a checkpoint)."""
    options: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=steps,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        callbacks=callbacks or [],
        use_distributed_sampler=False,
    )
    ckpt_path = trainer_kw.pop("ckpt_path_for_fit", None)
    trainer = pl.Trainer(**{**options, **trainer_kw})
    trainer.fit(
        module,
        datamodule=datamodule
        or SyntheticVideoDataModule(frames=9, height=32, width=32, num_workers=0, num_train_samples=8),
        ckpt_path=ckpt_path,
    )
    return trainer


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Torch runs on one thread in the test process and in the processes it starts (OMP_NUM_THREADS=1, as torchrun
    sets for its ranks anyway). With two, OpenMP's second thread spins at every barrier while another process holds
    the other core (a loader worker, a fresh process of a test, anything else on the machine): the same 4-step fit
    of a tiny CV8x8x8 took 1.1 s, 7.5 s or 44 s from one run to the next, and 1.1 s every time on one thread. Every
    process of a test on the same thread count also computes the same sums in the same order (a fresh process's
    outputs are compared with this one's)."""
    threads, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if variable is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = variable


@pytest.fixture(scope="module", autouse=True)
def fresh_compile_caches() -> Iterator[None]:
    """torch.compile's caches emptied after each test module, as a fresh process has them. The graphs, guards and
    code a module's compiled steps leave behind (some 100k objects after one compiled GAN step) would otherwise live
    for the rest of the session, and every full garbage collection walks them: energon runs two for each loader it
    makes (test_evaluate and a posttrain run after test_adversarial and test_acceleration: 36 s in the collector,
    25 s with this)."""
    yield
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def run_script(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python ARGS...`` in a fresh process with the repository importable (torchrun, -m modules)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def free_port() -> int:
    """A TCP port free at this moment: torchrun's default one would clash between tests run side by side."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_command(processes: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` for ``processes`` processes on this machine, on a port of its own."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-port",
        str(free_port()),
    ]


def run_torchrun(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 train_tokenizer.py --yes ARGS...`` on the CPU, in fresh processes."""
    return run_script(
        *torchrun_command()[1:],
        str(ROOT / "train_tokenizer.py"),
        "--yes",
        *args,
        cwd=cwd,
        timeout=timeout,
    )
