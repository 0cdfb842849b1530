"""One launch per run folder: a live holder refuses a second launch, a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tokenizer_posttrain.training.run_lock import LOCK_NAME, RunFolderBusy, RunLock


def plant_lock(run_dir: Path, **holder: object) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "started": "earlier", "slurm_job": None, **holder}))
    return path


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_live_holder_refuses_a_second_launch_naming_it(tmp_path: Path) -> None:
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunFolderBusy, match=rf"in use by another run: PID {os.getpid()} on .*log\.name="):
            RunLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released on exit
    with RunLock(tmp_path / "run"):  # and free again
        pass


def test_a_lock_of_a_process_that_is_gone_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    pid = dead_pid()
    plant_lock(tmp_path / "run", pid=pid)
    with pytest.warns(UserWarning, match=f"stale lock .*process {pid} on .* is gone"):
        lock = RunLock(tmp_path / "run")
        lock.acquire()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_held_on_another_host_is_not_guessed_stale(tmp_path: Path) -> None:
    plant_lock(tmp_path / "run", pid=dead_pid(), host="some-other-node")
    with pytest.raises(RunFolderBusy, match="on some-other-node"):
        RunLock(tmp_path / "run").acquire()


def test_an_earlier_attempt_of_the_same_slurm_job_is_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A requeued job may restart on another node, with its old lock still in the folder.
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    plant_lock(tmp_path / "run", pid=1, host="some-other-node", slurm_job="4242")
    with pytest.warns(UserWarning, match="earlier attempt of SLURM job 4242"), RunLock(tmp_path / "run"):
        pass


def test_an_unreadable_lock_file_is_stale(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text("{half")
    with pytest.warns(UserWarning, match="unreadable"), RunLock(tmp_path / "run"):
        pass


def test_release_leaves_a_lock_taken_over_by_another_launch(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    plant_lock(tmp_path / "run", pid=os.getpid() + 1, host="another")
    lock.release()
    assert (tmp_path / "run" / LOCK_NAME).exists()
