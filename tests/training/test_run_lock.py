"""One launch per run folder: a live holder refuses a second launch, a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tokenizer_posttrain.training.run_lock import LOCK_NAME, RunFolderBusy, RunLock

ROOT = Path(__file__).resolve().parents[2]


def plant_lock(run_dir: Path, **holder: object) -> Path:
    """A lock file as a launch that ended without releasing it leaves it: its record, no flock held."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "started": "earlier", "slurm_job": None, **holder}))
    return path


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@contextmanager
def held_by_another_process(run_dir: Path) -> Iterator[subprocess.Popen]:
    """A second process that takes the run folder's lock and keeps it until killed."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tokenizer_posttrain.training.run_lock import RunLock\n"
        "RunLock(Path(sys.argv[1])).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_live_holder_refuses_a_second_launch_naming_it(tmp_path: Path) -> None:
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunFolderBusy, match=rf"in use by another run: PID {os.getpid()} on .*log\.name="):
            RunLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released on exit
    with RunLock(tmp_path / "run"):  # and free again
        pass


def test_a_holder_in_another_process_refuses_until_it_is_killed(tmp_path: Path) -> None:
    with held_by_another_process(tmp_path / "run") as child:
        with pytest.raises(RunFolderBusy, match=f"PID {child.pid} on "):
            RunLock(tmp_path / "run").acquire()
        child.send_signal(signal.SIGKILL)  # killed: no release, its record stays
        child.wait()
        assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == child.pid
        with pytest.warns(UserWarning, match=f"stale lock .*PID {child.pid} on .* ended without releasing it"):
            with RunLock(tmp_path / "run"):
                assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_lock_of_a_process_that_is_gone_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    pid = dead_pid()
    plant_lock(tmp_path / "run", pid=pid)
    with pytest.warns(UserWarning, match=f"stale lock .*PID {pid} on .* ended without releasing it"):
        lock = RunLock(tmp_path / "run")
        lock.acquire()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_pid_reused_by_a_restarted_container_is_not_taken_for_the_holder(tmp_path: Path) -> None:
    # A container restarted with the same host name starts PIDs from 1 again: the killed run's PID is now a
    # live process, here this very launch. Nobody holds the lock, so it is stale.
    plant_lock(tmp_path / "run", pid=os.getpid())
    with pytest.warns(UserWarning, match="stale lock"), RunLock(tmp_path / "run"):
        pass
    plant_lock(tmp_path / "run", pid=1)  # PID 1: always alive
    with pytest.warns(UserWarning, match="stale lock"), RunLock(tmp_path / "run"):
        pass


def test_a_lock_held_on_another_host_is_not_guessed_stale(tmp_path: Path) -> None:
    # Its flock may not reach this node (file systems whose locks stay local): the record decides.
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


def test_release_leaves_a_lock_file_that_replaced_its_own(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    (tmp_path / "run" / LOCK_NAME).unlink()
    plant_lock(tmp_path / "run", pid=os.getpid() + 1, host="another")
    lock.release()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["host"] == "another"


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).symlink_to(victim)
    with pytest.raises(RunFolderBusy, match=f"cannot open the run lock {tmp_path / 'run' / LOCK_NAME} .*remove"):
        RunLock(tmp_path / "run").acquire()
    assert victim.read_text() == "keep me"
