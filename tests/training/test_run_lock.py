"""One launch per run folder: a live holder refuses a second launch, a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tokenizer_posttrain.training.run_lock import LOCK_NAME, RunFolderBusy, RunLock, boot_id, process_start

ON_LINUX = sys.platform.startswith("linux")


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


@pytest.mark.skipif(not ON_LINUX, reason="process start times come from Linux's /proc")
def test_a_pid_reused_by_a_restarted_container_is_stale(tmp_path: Path) -> None:
    # A container restarted with the same host name starts PIDs from 1 again: the killed run's PID is now a
    # live process, here this very launch. Its recorded start time tells the two apart.
    mine = process_start(os.getpid())
    assert mine is not None
    plant_lock(tmp_path / "run", pid=os.getpid(), process_start=mine - 1, boot_id=boot_id())
    with pytest.warns(UserWarning, match=f"PID {os.getpid()} on .* now belongs to another process"):
        with RunLock(tmp_path / "run"):
            held = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert held["pid"] == os.getpid() and held["process_start"] == mine and held["boot_id"] == boot_id()


@pytest.mark.skipif(not ON_LINUX, reason="boot ids come from Linux's /proc")
def test_a_lock_from_before_a_restart_of_the_host_is_stale(tmp_path: Path) -> None:
    plant_lock(tmp_path / "run", pid=os.getpid(), process_start=process_start(os.getpid()), boot_id="an-older-boot")
    with pytest.warns(UserWarning, match="has restarted since"), RunLock(tmp_path / "run"):
        pass


@pytest.mark.skipif(not ON_LINUX, reason="process start times come from Linux's /proc")
def test_the_live_holder_with_its_own_start_time_still_refuses(tmp_path: Path) -> None:
    with RunLock(tmp_path / "run"):
        held = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert held["process_start"] == process_start(os.getpid())
        with pytest.raises(RunFolderBusy, match="in use by another run"):
            RunLock(tmp_path / "run").acquire()


@pytest.mark.skipif(not ON_LINUX, reason="process start times come from Linux's /proc")
def test_process_start_orders_processes_and_knows_a_gone_one(tmp_path: Path) -> None:
    # A command name with spaces and parentheses (the executable's file name), which /proc/<pid>/stat shows
    # unquoted between parentheses.
    odd = tmp_path / "a) b (c"
    odd.symlink_to(sys.executable)
    script = "import sys, time; sys.stdout.write('up'); sys.stdout.flush(); time.sleep(5)"
    child = subprocess.Popen([str(odd), "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.read(2) == b"up"
        assert "a) b (c" in Path(f"/proc/{child.pid}/stat").read_text()
        theirs, mine = process_start(child.pid), process_start(os.getpid())
        assert theirs is not None and mine is not None and theirs >= mine
    finally:
        child.kill()
        child.wait()
    assert process_start(dead_pid()) is None
