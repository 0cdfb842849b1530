"""Runs that survive preemption and kills: exact resume after SIGKILL, checkpoints on SIGTERM/SIGUSR1.

The killed and signalled runs are fresh processes; the runs around them (the uninterrupted reference, the
resume) go through the same command line in this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, read_metrics, run_cli_here

ARGS = [
    "--factory",
    "tiny",
    "data.frames=9",
    "data.height=32",
    "data.width=32",
    "data.global_batch_size=2",  # 2 micro-batches a step, not the recipe's 8: the same checks, a quarter of the work
    "trainer.checkpoint_every_n_steps=1",
    "trainer.val_check_interval=1000",
    "log.export_on_end=false",
    "optim.lr=1e-3",
]


def start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train_tokenizer.py"), *ARGS, f"log.log_dir={tmp_path}", *extra],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def losses(run_dir: Path, name: str = "train/loss") -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in read_metrics(run_dir) if r.get(name)}


GAN = [
    "loss.gan.weight=0.1",
    "loss.gan.channels=8",
    "loss.gan.layers=2",
    "loss.gan.disc_start=2",  # before the kill at step 4: the discriminator's weights, optimizer and LeCam
    "loss.gan.gen_start=3",  # averages must all come back from the checkpoint
    "loss.gan.lecam_weight=0.01",
]


# With the GAN stage on only: these losses match only if the tokenizer's whole state (weights, optimizer, data
# position, random states) comes back exactly, as in a run without the stage, which differs by the stage's own
# checkpoint entry alone; so one run checks both.
@pytest.mark.parametrize("extra", [GAN], ids=["gan"])
def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(tmp_path: Path, extra: list[str]) -> None:
    whole = run_cli_here(*ARGS, *extra, "trainer.max_steps=10", f"log.log_dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()
    proc = start(killed_dir, *extra, "trainer.max_steps=10")
    wait_for(killed_dir / "tiny_cv8x8x8" / "checkpoints" / "step=4.ckpt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpts = sorted((killed_dir / "tiny_cv8x8x8" / "checkpoints").glob("*.ckpt"))
    # every checkpoint left is complete: each was written under a temporary name, then renamed
    done = max(torch.load(p, weights_only=True)["global_step"] for p in ckpts)
    assert 4 <= done < 10
    resumed = run_cli_here(*ARGS, *extra, "trainer.max_steps=10", f"log.log_dir={killed_dir}", cwd=killed_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    # With the GAN on, the discriminator's and generator's terms after the resume are the reference's too.
    for name in ["train/loss"] + (["train/gan_d", "train/gan_g"] if extra else []):
        a, b = losses(tmp_path / "whole" / "tiny_cv8x8x8", name), losses(killed_dir / "tiny_cv8x8x8", name)
        assert set(range(done, 10)) <= set(a) and set(range(done, 10)) <= set(b), (name, sorted(a), sorted(b))
        for step in range(done, 10):
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (name, step, a[step], b[step])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_writes_a_checkpoint_and_exits_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    proc = start(tmp_path, "trainer.max_steps=100000", "trainer.checkpoint_every_n_steps=1000")
    wait_for(tmp_path / "tiny_cv8x8x8" / "csv" / "version_0" / "metrics.csv", proc)
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Preempted at step" in out
    ckpt = torch.load(tmp_path / "tiny_cv8x8x8" / "checkpoints" / "last.ckpt", weights_only=True)
    assert 0 < ckpt["global_step"] < 1000  # written by the signal, not by the every-1000-steps schedule
    assert not list((tmp_path / "tiny_cv8x8x8" / "checkpoints").glob(".*.tmp"))


def test_rng_states_travel_with_checkpoints() -> None:
    import random

    import numpy as np

    from tokenizer_posttrain.training.checkpointing import RngState

    callback, checkpoint = RngState(), {}
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    callback.on_save_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    callback.on_load_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_rng_states_are_plain_data_that_load_with_weights_only(tmp_path: Path) -> None:
    import random

    import numpy as np

    from tokenizer_posttrain.training.checkpointing import RngState

    random.seed(5)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    np.random.seed(5)
    np.random.randn()  # and in NumPy's
    checkpoint: dict = {}
    RngState().on_save_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    torch.save(checkpoint, tmp_path / "states.ckpt")
    expected = (random.gauss(0, 1), random.random(), np.random.randn(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    loaded = torch.load(tmp_path / "states.ckpt", weights_only=True)  # refuses anything that needs unpickling
    RngState().on_load_checkpoint(None, None, loaded)  # type: ignore[arg-type]
    assert (random.gauss(0, 1), random.random(), np.random.randn(), np.random.rand()) == expected


class _Planted:
    """Unpickling this writes a marker file: what a crafted checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "code ran"))


def test_pickled_rng_states_are_never_unpickled(tmp_path: Path) -> None:
    import pickle
    import random

    from tokenizer_posttrain.core.errors import CheckpointError
    from tokenizer_posttrain.training.checkpointing import RngState

    marker = tmp_path / "marker"
    planted = {"rng_states": {"python": pickle.dumps(_Planted(marker)), "numpy": b"", "torch": None, "cuda": []}}
    with pytest.raises(CheckpointError, match="never done.*resume.skip_pickled_states=true"):
        RngState().on_load_checkpoint(None, None, planted)  # type: ignore[arg-type]
    # Asked to go on without them: a warning, the random state left as it is, and still nothing run.
    random.seed(3)
    expected = random.random()
    random.seed(3)
    with pytest.warns(UserWarning, match=r"random states \(rng_states\) .* not restored"):
        RngState(skip_pickled=True).on_load_checkpoint(None, None, planted)  # type: ignore[arg-type]
    assert random.random() == expected
    assert not marker.exists()


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import lightning.fabric.plugins.io.torch_io as torch_io

    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.core.errors import CheckpointError
    from tokenizer_posttrain.training.resume import checkpoint_step
    from tokenizer_posttrain.training.train import train

    real_save = torch_io._atomic_save
    saves: list[str] = []

    def fill_the_disk(checkpoint: dict, path: str) -> None:  # the disk fills up at the third save
        saves.append(str(path))
        if len(saves) < 3:
            return real_save(checkpoint, path)
        Path(path).write_bytes(b"\0" * 4096)  # what was written before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch_io, "_atomic_save", fill_the_disk)
    with pytest.raises(CheckpointError) as err:
        train(**tiny_run(tmp_path, steps=5, trainer={"checkpoint_every_n_steps": 1, "checkpoint_keep": 1}))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"no space left to write {tmp_path / 'run' / 'checkpoints'}")
    assert "bytes, " in message and "are free; the previous checkpoint is kept" in message
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step=1.ckpt"]  # no partial file left
    assert checkpoint_step(ckpts / "last.ckpt") == 1
    assert not (tmp_path / "run" / ".run.lock").exists()
