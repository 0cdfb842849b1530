"""A stop signal under DDP: every rank stops at the same step and the checkpoint is written."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, torchrun_command
from tests.training.test_checkpointing import ARGS, wait_for


def worker_pid(agent: int, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker process of ``rank`` (a child of the agent process ``agent``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if parent == agent and f"RANK={rank}".encode() in environ:
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} worker under torchrun pid {agent}")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc (Linux)")
def test_sigterm_to_one_rank_stops_every_rank_at_one_step_and_checkpoints(tmp_path: Path) -> None:
    # Lightning's own agreement reads only rank 0's flag, and the signalled rank stops alone after
    # its batch: here rank 1 alone is signalled, and both must stop, checkpoint and exit 0.
    torchrun = torchrun_command()
    proc = subprocess.Popen(
        [*torchrun, str(ROOT / "train_tokenizer.py"), "--yes", *ARGS, f"log.log_dir={tmp_path}"]
        + [
            "trainer.max_steps=100000",
            "trainer.checkpoint_every_n_steps=1000",
            "data.global_batch_size=4",
            "data.micro_batch_size=1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_for(tmp_path / "tiny_cv8x8x8" / "csv" / "version_0" / "metrics.csv", proc)
        time.sleep(1.0)
        os.kill(worker_pid(proc.pid, rank=1), signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Preempted at step" in out
    ckpt = torch.load(tmp_path / "tiny_cv8x8x8" / "checkpoints" / "last.ckpt", weights_only=True)
    assert 0 < ckpt["global_step"] < 1000  # written by the signal, not by the every-1000-steps schedule
    assert f"Preempted at step {ckpt['global_step']}:" in out
    # 4 clips per step on 2 ranks at 1 clip each: 2 micro-batches a step, and the stop fell between steps
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 2 * ckpt["global_step"]
