"""What a launch resumes from: the newest readable checkpoint, of the same run, and nothing when the run is done."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.training.conftest import tiny_run
from tokenizer_posttrain.commands.guard import run_guarded
from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.training.config import ResumeConfig
from tokenizer_posttrain.training.resume import (
    SettingsChanged,
    check_same_run,
    checkpoint_step,
    current_settings,
    find_resume_checkpoint,
    remove_partial_saves,
)
from tokenizer_posttrain.training.train import train


def save_ckpt(path: Path, step: int, **extra: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"w": torch.zeros(64, 64)}, "global_step": step, **extra}, path)
    return path


def truncate(path: Path, fraction: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def test_a_truncated_newest_checkpoint_falls_back_to_the_next_with_a_warning(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "step=4.ckpt", 4)
    save_ckpt(tmp_path / "step=6.ckpt", 6)
    truncate(save_ckpt(tmp_path / "last.ckpt", 7))
    with pytest.warns(UserWarning, match=r"unreadable checkpoint: cannot read .*last\.ckpt: .*truncated"):
        assert find_resume_checkpoint(tmp_path, ResumeConfig()) == str(tmp_path / "step=6.ckpt")


def test_last_ckpt_wins_at_equal_steps_and_a_newer_step_file_wins_over_it(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "step=6.ckpt", 6)
    save_ckpt(tmp_path / "last.ckpt", 6)
    assert find_resume_checkpoint(tmp_path, ResumeConfig()) == str(tmp_path / "last.ckpt")
    save_ckpt(tmp_path / "step=8.ckpt", 8)  # killed between the step file and last.ckpt
    assert find_resume_checkpoint(tmp_path, ResumeConfig()) == str(tmp_path / "step=8.ckpt")


def test_only_unreadable_checkpoints_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").write_bytes(b"not a zip")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no checkpoint in .* can be read"):
        find_resume_checkpoint(tmp_path, ResumeConfig())


def test_an_explicit_unreadable_checkpoint_is_named(tmp_path: Path) -> None:
    truncate(save_ckpt(tmp_path / "mine.ckpt", 3))
    with pytest.raises(CheckpointError, match=r"cannot read .*mine\.ckpt: .*truncated"):
        find_resume_checkpoint(tmp_path, ResumeConfig(resume_from_path=str(tmp_path / "mine.ckpt")))
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        checkpoint_step(tmp_path / "other.ckpt")


def test_partial_saves_are_removed(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "last.ckpt", 2)
    (tmp_path / ".last.ckpt.tmp").write_bytes(b"x" * 100)
    (tmp_path / ".step=4.ckpt.tmp").write_bytes(b"x")
    with pytest.warns(UserWarning, match="removed 2 partial"):
        removed = remove_partial_saves(tmp_path)
    assert sorted(p.name for p in removed) == [".last.ckpt.tmp", ".step=4.ckpt.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_settings_that_define_the_run_are_compared_and_others_not(tmp_path: Path) -> None:
    run = tiny_run(tmp_path)
    saved = {"model": run["model"], "data": run["data"], "loss": run["loss"]}
    from dataclasses import asdict

    path = save_ckpt(tmp_path / "last.ckpt", 2, hyper_parameters={k: asdict(v) for k, v in saved.items()})
    same = tiny_run(tmp_path, model={"model": "Cosmos-1.0-Tokenizer-CV8x8x8", "compile": True}, data={"num_workers": 3})
    check_same_run(str(path), current_settings(same["model"], same["data"], same["loss"]))
    # The adaptive weight's cadence is a speed setting too (its default changed from 8 to null).
    same["loss"].gan.adaptive_every = 8
    check_same_run(str(path), current_settings(same["model"], same["data"], same["loss"]))
    other = tiny_run(tmp_path, model={"trainable": "decoder", "lora": {"rank": 4}}, data={"frames": 17})
    other["model"].lora = type(other["model"].lora)(rank=4)
    with pytest.raises(SettingsChanged) as err:
        check_same_run(str(path), current_settings(other["model"], other["data"], other["loss"]))
    message = str(err.value)
    for change in ("model.trainable: 'all' -> 'decoder'", "model.lora.rank: 0 -> 4", "data.frames: 9 -> 17"):
        assert change in message
    assert "log.name=" in message and "resume.allow_changes=true" in message and "\n" not in message


def test_relaunches_end_to_end(tmp_path: Path) -> None:
    """A finished run is left alone; other settings stop the launch; last.ckpt is at the final step."""
    run_dir = train(**tiny_run(tmp_path, steps=3, log={"export_on_end": True}, trainer={"checkpoint_every_n_steps": 2}))
    ckpts = run_dir / "checkpoints"
    assert checkpoint_step(ckpts / "last.ckpt") == 3  # not 2, the last periodic save
    export = run_dir / "export" / "autoencoder.jit"
    before = export.stat().st_mtime_ns
    (ckpts / ".last.ckpt.tmp").write_bytes(b"partial")

    # Same command again: nothing to train, nothing re-exported.
    with pytest.warns(UserWarning, match="partial"):
        assert train(**tiny_run(tmp_path, steps=3, log={"export_on_end": True})) == run_dir
    assert export.stat().st_mtime_ns == before
    assert not (ckpts / ".last.ckpt.tmp").exists()

    # More steps with another clip and loss: refused before any work, listing both.
    changed = tiny_run(tmp_path, steps=5, data={"height": 16}, loss={"perceptual_weight": 0.0, "l1_weight": 2.0})
    with pytest.raises(SettingsChanged, match=r"data\.height: 32 -> 16; loss\.l1\.weight: 1\.0 -> 2\.0"):
        train(**changed)
    assert checkpoint_step(ckpts / "last.ckpt") == 3

    # Asked for explicitly, the changed run resumes, without Lightning's false "not resumable" warning.
    changed["resume"] = ResumeConfig(allow_changes=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(**changed)
    assert checkpoint_step(ckpts / "last.ckpt") == 5
    assert not [w for w in seen if "dataloader is not resumable" in str(w.message)]
    assert not (run_dir / ".run.lock").exists()


def test_a_finished_run_is_an_error_when_resume_past_end_is_off(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt", 3)
    with pytest.raises(ValueError, match="already reached step 3"):
        train(**tiny_run(tmp_path, steps=3, resume={"resume_past_end": False}))


def test_a_live_run_in_the_folder_stops_the_launch(tmp_path: Path) -> None:
    from tests.training.test_run_lock import held_by_another_process
    from tokenizer_posttrain.training.run_lock import RunFolderBusy

    with held_by_another_process(tmp_path / "run") as holder:
        with pytest.raises(RunFolderBusy, match=f"PID {holder.pid}"):
            train(**tiny_run(tmp_path))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_resumed_run_keeps_the_schedule_on_the_optimizer_step(tmp_path: Path) -> None:
    """A schedule switching at step 3 switches there in a run resumed at step 2, not 3 steps into the resume."""
    from tests.conftest import read_metrics
    from tokenizer_posttrain.losses.high_freq import HighFreqConfig

    loss = {"perceptual_weight": 0.0, "high_freq": HighFreqConfig(boundaries=[3], values=[0.0, 0.2])}
    with pytest.warns(UserWarning, match=r"loss\.high_freq\.boundaries=\[3\]: trainer\.max_steps=2 ends before step 3"):
        run_dir = train(**tiny_run(tmp_path, steps=2, loss=loss))
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 2
    # Same settings, more steps: resumes without resume.allow_changes (max_steps does not define the run).
    assert train(**tiny_run(tmp_path, steps=5, loss=loss)) == run_dir
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 5

    rows = {int(row["step"]): row for row in read_metrics(run_dir) if row.get("train/loss")}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert [step for step, row in rows.items() if row.get("train/high_freq")] == [3, 4]
    for step in (3, 4):
        l1, high_freq, total = (float(rows[step][f"train/{key}"]) for key in ("l1", "high_freq", "loss"))
        assert high_freq > 0 and total == pytest.approx(l1 + 0.2 * high_freq, rel=1e-5, abs=1e-7)
    for step in (0, 1, 2):  # L1 alone before the boundary
        assert float(rows[step]["train/loss"]) == pytest.approx(float(rows[step]["train/l1"]), rel=1e-6)


# -- Relaunches that stop in one line, naming what is wrong (issue 35) ------------------------------------------


def launch(capsys: pytest.CaptureFixture, **configs: object) -> tuple[int, str]:
    """``train(**configs)`` as the train command runs it: its exit code, and what it wrote to stderr."""
    capsys.readouterr()
    code = run_guarded(lambda: train(**configs))
    return code, capsys.readouterr().err


def one_error(err: str) -> str:
    """The only ``error:`` line of ``err``, which holds no traceback."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0].removeprefix("error: ")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last.ckpt of a tiny 2-step run: every state Lightning resumes (loops, optimizer, LR scheduler)."""
    root = tmp_path_factory.mktemp("finished")
    return train(**tiny_run(root, steps=2)) / "checkpoints" / "last.ckpt"


def _fit_loop(ckpt: dict) -> dict:
    return ckpt["loops"]["fit_loop"]


def _adamw(ckpt: dict) -> dict:
    return ckpt["optimizer_states"][0]


def _lambda_lr(ckpt: dict) -> dict:
    return ckpt["lr_schedulers"][0]


PLANTED: dict[str, tuple[Callable[[dict], object], str]] = {
    # what is planted in a copy of a real checkpoint: (how, the start of the one-line error after the path)
    "a loop state": (
        lambda c: _fit_loop(c).update(state_dict=b"\x80\x04."),
        ": entry loops.fit_loop.state_dict is of type bytes, expected dict;",
    ),
    "no fit loop": (lambda c: c["loops"].pop("fit_loop"), ": entry loops has no 'fit_loop';"),
    "a progress counter": (
        lambda c: _fit_loop(c)["epoch_loop.batch_progress"]["total"].update(ready="2"),
        ": entry loops.fit_loop['epoch_loop.batch_progress'].total.ready is of type str, expected int >= 0;",
    ),
    "a progress key": (
        lambda c: _fit_loop(c)["epoch_progress"]["current"].update(reset=0),
        ": entry loops.fit_loop.epoch_progress.current has a key 'reset' that would replace a part of the loop;",
    ),
    "loader states": (
        lambda c: _fit_loop(c)["state_dict"].update(combined_loader=[{}]),
        ": entry loops.fit_loop.state_dict.combined_loader holds 1 data loader state(s), expected none;",
    ),
    "the optimizer's state": (
        lambda c: _adamw(c).update(state=[1, 2]),
        ": entry optimizer_states[0].state is of type list, expected dict;",
    ),
    "its param groups": (
        lambda c: _adamw(c).update(param_groups=b"\x80\x04."),
        ": entry optimizer_states[0].param_groups is of type bytes, expected list;",
    ),
    "a learning rate": (
        lambda c: _adamw(c)["param_groups"][0].update(lr="1e-4"),
        ": entry optimizer_states[0].param_groups[0].lr is of type str, expected finite number;",
    ),
    "a moment": (
        lambda c: _adamw(c)["state"][0].update(exp_avg=b"\x80\x04."),
        ": entry optimizer_states[0].state[0].exp_avg is of type bytes, expected Tensor;",
    ),
    "a state of no parameter": (
        lambda c: _adamw(c)["state"].update({10**6: {}}),
        ": entry optimizer_states[0].state holds the state of parameter 1000000, which no parameter group lists;",
    ),
    "a scheduler's step": (
        lambda c: _lambda_lr(c).update(last_epoch="2"),
        ": entry lr_schedulers[0].last_epoch is of type str, expected int;",
    ),
    "a scheduler attribute": (
        lambda c: _lambda_lr(c).update(optimizer=0),
        ": entry lr_schedulers[0] has a key 'optimizer' that would replace a part of the scheduler;",
    ),
    "a schedule function's state": (
        lambda c: _lambda_lr(c).update(lr_lambdas=[{"planted": 1}]),
        ": entry lr_schedulers[0].lr_lambdas[0] is of type dict, expected None;",
    ),
    "a scheduler of other groups": (
        lambda c: _lambda_lr(c).update(base_lrs=[1e-4, 1e-4]),
        ": entry lr_schedulers[0] does not fit its optimizer: as many values are needed in each of "
        "lr_schedulers[0].base_lrs 2, lr_schedulers[0]._last_lr 1, lr_schedulers[0].lr_lambdas 1, "
        "optimizer_states[0].param_groups 1;",
    ),
    "an old Lightning": (
        lambda c: c.update({"pytorch-lightning_version": "1.5.0"}),
        ": entry 'pytorch-lightning_version' is 1.5.0: written by a Lightning older than 2.0.0;",
    ),
    # Found only when the optimizer holds its parameters (the file does not say which parameter a state is for).
    "a moment of another shape": (
        lambda c: _adamw(c)["state"][0].update(exp_avg=torch.zeros(3)),
        ": entry optimizer_states[0].state[0].exp_avg has shape (3,), its parameter (",
    ),
    # Found when Lightning loads the file, after the launch checks.
    "no scheduler states": (
        lambda c: c.pop("lr_schedulers"),
        " cannot be resumed: it has no lr_schedulers entry (Lightning writes them in every training checkpoint)",
    ),
}


@pytest.mark.parametrize("place", PLANTED)
def test_a_crafted_state_in_the_checkpoint_stops_the_relaunch_in_one_line(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, place: str
) -> None:
    plant, expected = PLANTED[place]
    ckpt = torch.load(finished_run, weights_only=True)
    plant(ckpt)
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(ckpt, path)

    # The same command again, with more steps: the run folder's checkpoint is explicitly the one to resume.
    code, err = launch(capsys, **tiny_run(tmp_path, steps=3, resume={"resume_from_path": str(path)}))
    assert code == 1, err
    assert one_error(err).startswith(f"{path}{expected}")
    if ";" in expected:
        assert one_error(err).endswith("the file was altered or not written by tokenizer-posttrain")
    assert torch.load(path, weights_only=True)["global_step"] == 2  # nothing trained, nothing written over it


def test_fields_a_later_release_adds_resume_and_training_states_do_not_stop_reading_weights(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tokenizer_posttrain.io.checkpoint import read_weights

    ckpt = torch.load(finished_run, weights_only=True)
    _lambda_lr(ckpt)["_added_by_a_later_torch"] = 1  # plain values under new names: not an attack
    _fit_loop(ckpt)["epoch_progress"]["current"]["skipped"] = 0
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(ckpt, path)
    resumed, err = launch(capsys, **tiny_run(tmp_path, steps=3, resume={"resume_from_path": str(path)}))
    assert resumed == tmp_path / "run", err  # the run folder: trained on to step 3
    assert torch.load(path, weights_only=True)["global_step"] == 3
    # Reading the weights (export, reconstruct) looks at no training state: a garbled one does not stop it.
    _adamw(ckpt)["param_groups"] = b"garbled"
    torch.save(ckpt, tmp_path / "garbled.ckpt")
    assert read_weights(tmp_path / "garbled.ckpt").state


@pytest.mark.parametrize(("make", "what"), [(os.mkfifo, "a FIFO"), (Path.mkdir, "a folder")])
def test_a_special_file_as_last_ckpt_stops_the_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture, make: Callable[[Path], None], what: str
) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    make(ckpts / "last.ckpt")
    code, err = launch(capsys, **tiny_run(tmp_path, steps=1))
    assert code == 1, err
    assert one_error(err) == (
        f"{ckpts / 'last.ckpt'} is {what}, not a checkpoint file; move it out of {ckpts} and run the same command again"
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]  # it did not train from step 0


def test_a_fifo_is_never_opened_as_a_checkpoint(tmp_path: Path) -> None:
    save_ckpt(tmp_path / "step=2.ckpt", 2)
    fifo = tmp_path / "step=3.ckpt"
    os.mkfifo(fifo)
    outcome: list[BaseException | str | None] = []

    def find() -> None:
        try:
            outcome.append(find_resume_checkpoint(tmp_path, ResumeConfig()))
        except CheckpointError as err:
            outcome.append(err)

    thread = threading.Thread(target=find, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():
        # Blocked opening the FIFO for reading: a writer that comes and goes gives it the end of the file.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail("the FIFO was opened: the launch blocked until something wrote into it")
    (refused,) = outcome
    assert isinstance(refused, CheckpointError)
    assert str(refused) == (
        f"{fifo} is a FIFO, not a checkpoint file; move it out of {tmp_path} and run the same command again"
    )
    with pytest.raises(CheckpointError, match=r"step=3\.ckpt is a FIFO, not a checkpoint file"):
        find_resume_checkpoint(tmp_path / "elsewhere", ResumeConfig(resume_from_path=str(fifo)))


class _System:
    """A checkpoint entry that unpickling would turn into a call of ``os.system`` (it never is)."""

    def __reduce__(self) -> tuple:
        return (os.system, ("true",))


def test_when_no_checkpoint_can_be_read_the_error_says_why_for_each(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    save_ckpt(ckpts / "step=1.ckpt", 1)
    (ckpts / "step=2.ckpt").write_bytes(b"not a checkpoint at all")
    truncate(ckpts / "step=1.ckpt")
    torch.save({"state_dict": {}, "global_step": 3, "planted": _System()}, ckpts / "last.ckpt")
    code, err = launch(capsys, **tiny_run(tmp_path, steps=4))
    assert code == 1, err
    assert one_error(err) == (
        f"no checkpoint in {ckpts} can be read (last.ckpt: holds a pickled Python object (posix.system); "
        "step=2.ckpt: not a torch checkpoint; step=1.ckpt: truncated or damaged); move them away to start over, "
        "or start a new run with another log.name"
    )


def energon_run(root: Path, steps: int, **data: object) -> dict[str, object]:
    """The configs of a tiny run on the energon dataset at ``root/data`` (``data`` overrides its data fields)."""
    fields = {"path": str(root / "data"), "num_workers": 0, "preflight_samples": 0, **data}
    return tiny_run(root, steps=steps, model={"model": "CV8x8x8", "jit_ckpt_pth": None, "channels": 16}, data=fields)


@pytest.fixture(scope="module")
def energon_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last.ckpt of a 1-step run on a small energon dataset: 0 workers, micro-batches of 1."""
    from tests.videos import encode_video, write_energon_dataset

    root = tmp_path_factory.mktemp("energon")
    write_energon_dataset(root / "data", {f"v{i}": encode_video(20, 48, 64, seed=i) for i in range(4)})
    return train(**energon_run(root, steps=1)) / "checkpoints" / "last.ckpt"


def test_a_resume_with_another_loader_layout_is_refused_or_restarts_the_stream(
    energon_checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    from tokenizer_posttrain.training.resume import check_same_stream

    root = energon_checkpoint.parents[2]
    fix = (
        "and energon can continue a stream only in the loader that saved it; resume with the old values, start a new "
        "run with another log.name=..., or resume with resume.allow_changes=true (the data stream then starts afresh)"
    )
    for data, change in (
        ({"micro_batch_size": 2, "global_batch_size": 2}, "data.micro_batch_size: 1 -> 2"),
        ({"num_workers": 1}, "data.num_workers: 0 -> 1"),
    ):
        code, err = launch(capsys, **energon_run(root, steps=2, **data))
        assert code == 1, err
        assert (
            one_error(err)
            == f"{energon_checkpoint} holds the position of its data stream for another loader ({change}), {fix}"
        )
    # The number of training processes counts too (one saved position each).
    with pytest.raises(
        SettingsChanged, match=r"\(training processes \(trainer\.devices x trainer\.num_nodes\): 1 -> 2\)"
    ):
        check_same_stream(str(energon_checkpoint), energon_run(root, steps=2)["data"], 2, allow_changes=False)
    assert checkpoint_step(energon_checkpoint) == 1

    # Asked for, the run goes on with a fresh data stream, and says so.
    changed = energon_run(root, steps=2, micro_batch_size=2, global_batch_size=2)
    changed["resume"] = ResumeConfig(allow_changes=True)
    with pytest.warns(UserWarning, match=r"data stream starts afresh: .*\(data\.micro_batch_size: 1 -> 2\)"):
        train(**changed)
    assert checkpoint_step(energon_checkpoint) == 2
