"""A crafted checkpoint runs no code: a payload planted in each state field of a real checkpoint, as an object in
the pickle stream or as pickled bytes, is refused in one line or ignored by resume, export, evaluate and
reconstruct, and the payload's marker file never appears.

One tiny run on an energon dataset writes the checkpoint (it holds every state: model, optimizer, loops,
callbacks, RNG and energon loader states, hyperparameters); each case plants one payload in a copy of it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.conftest import no_vgg, tiny
from tests.videos import encode_video, write_energon_dataset, write_video
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.commands.guard import run_guarded
from tokenizer_posttrain.training.config import DataConfig, LogConfig, OptimConfig, ResumeConfig, TrainerConfig
from tokenizer_posttrain.training.train import train

DATAMODULE = "EnergonVideoDataModule"
STEPS = 2


class Payload:
    """Unpickling this writes the marker file: what a crafted checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "code ran"))


def _first_callback(ckpt: dict, value: Any) -> None:  # noqa: ANN401
    next(iter(ckpt["callbacks"].values()))["planted"] = value


def _every_callback(ckpt: dict, value: Any) -> None:  # noqa: ANN401
    ckpt["callbacks"] = dict.fromkeys(ckpt["callbacks"], value)


PLACES: dict[str, Callable[[dict, Any], None]] = {
    "rng_states.python": lambda c, v: c["rng_states"].update(python=v),
    "rng_states.numpy": lambda c, v: c["rng_states"].update(numpy=v),
    "energon_loader_state": lambda c, v: c[DATAMODULE].update(energon_loader_state=v),
    "hyper_parameters": lambda c, v: c.update(hyper_parameters=v),
    "hyper_parameters.model": lambda c, v: c["hyper_parameters"].update(model=v),
    "callbacks": _every_callback,
    "callbacks.<first>.planted": _first_callback,
    "loops": lambda c, v: c.update(loops=v),
    "optimizer_states": lambda c, v: c["optimizer_states"].__setitem__(0, v),
    "top-level": lambda c, v: c.update(planted=v),
}
"""Where a payload is planted in a copy of the run's checkpoint."""

OPT_IN = "as pickled bytes (written before tokenizer-posttrain stored such states as plain data)"
ENTRY = "{path}: entry {entry} is of type bytes, expected"
OBJECT = "refusing to load {path}: it holds a pickled Python object ("
OK = None

BYTES_OUTCOMES: dict[str, tuple[str | None, str | None]] = {
    # place: (resume, export/evaluate/reconstruct): the start of the one-line error, or OK
    "rng_states.python": ("the checkpoint holds the random states (rng_states) " + OPT_IN, OK),
    "rng_states.numpy": ("the checkpoint holds the random states (rng_states) " + OPT_IN, OK),
    "energon_loader_state": ("the checkpoint holds the energon loader state (energon_loader_state) " + OPT_IN, OK),
    "hyper_parameters": (ENTRY.format(path="{path}", entry="hyper_parameters"),) * 2,
    "hyper_parameters.model": (ENTRY.format(path="{path}", entry="hyper_parameters.model"),) * 2,
    "callbacks": ("{path}: entry callbacks[",) * 2,
    "callbacks.<first>.planted": (OK, OK),
    "loops": (ENTRY.format(path="{path}", entry="loops"),) * 2,
    "optimizer_states": (ENTRY.format(path="{path}", entry="optimizer_states[0]"),) * 2,
    "top-level": (OK, OK),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("planted")
    videos = {f"v{i}": encode_video(20, 48, 64, seed=i) for i in range(4)}
    write_energon_dataset(root / "data", videos, {"val0": encode_video(20, 48, 64, seed=9)})
    write_video(root / "clip.mp4", 9, 32, 32)
    return root


def run_train(workdir: Path, name: str, max_steps: int, resume_from: Path | None = None) -> int:
    """A tiny run on the energon data in this process, failing as the train command does (one line, exit 1)."""

    def run() -> None:
        train(
            model=tiny("CV8x8x8"),
            data=DataConfig(
                path=str(workdir / "data"),
                frames=9,
                height=32,
                width=32,
                global_batch_size=1,
                micro_batch_size=1,
                num_workers=0,
                preflight_samples=0,
            ),
            trainer=TrainerConfig(
                accelerator="cpu",
                devices="1",
                max_steps=max_steps,
                val_check_interval=1000,
                checkpoint_every_n_steps=STEPS,
            ),
            optim=OptimConfig(lr=1e-4),
            resume=ResumeConfig(resume_from_path=str(resume_from) if resume_from else None),
            log=LogConfig(log_dir=str(workdir / "runs"), name=name, export_on_end=False),
            loss=no_vgg(),
        )

    return run_guarded(run)


@pytest.fixture(scope="module")
def checkpoint(workdir: Path) -> Path:
    assert run_train(workdir, "base", STEPS) == 0
    path = workdir / "runs" / "base" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    missing = {"state_dict", "optimizer_states", "loops", "callbacks", "hyper_parameters", "rng_states", DATAMODULE}
    assert missing <= ckpt.keys() and ckpt["global_step"] == STEPS
    return path


COMMANDS: dict[str, Callable[[Path, Path, Path], list[str]]] = {
    # (checkpoint, workdir, output folder) -> the command line
    "export": lambda ckpt, work, out: ["export", "--checkpoint", str(ckpt), "--out", str(out)],
    "evaluate": lambda ckpt, work, out: [
        "evaluate",
        "--checkpoint",
        str(ckpt),
        "--data",
        str(work / "data"),
        "--out",
        str(out),
        "--frames",
        "9",
        "--size",
        "32",
        "--max-clips",
        "1",
        "--videos-per-side",
        "0",
    ],
    "reconstruct": lambda ckpt, work, out: [
        "reconstruct",
        "--checkpoint",
        str(ckpt),
        "--input",
        str(work / "clip.mp4"),
        "--output",
        str(out / "clip.mp4"),
        "--device",
        "cpu",
        "--window",
        "9",
    ],
}

IGNORED_BY_COMMANDS = tuple(place for place, (_, others) in BYTES_OUTCOMES.items() if others is OK)


def _cases() -> list:
    """Every place for each kind and command; the byte payloads the commands ignore all in one checkpoint (an
    export or evaluation that succeeds costs seconds, a refusal a blink)."""
    cases = []
    for kind in ("bytes", "object"):
        for command in ("resume", *COMMANDS):
            together = kind == "bytes" and command != "resume"
            groups = [(p,) for p in PLACES if not (together and p in IGNORED_BY_COMMANDS)]
            groups += [IGNORED_BY_COMMANDS] if together else []
            cases += [pytest.param(kind, g, command, id=f"{kind}-{'+'.join(g)}-{command}") for g in groups]
    return cases


@pytest.mark.parametrize(("kind", "places", "command"), _cases())
def test_a_planted_payload_runs_no_code(
    checkpoint: Path,
    workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    kind: str,
    places: tuple[str, ...],
    command: str,
) -> None:
    marker = tmp_path / "marker"
    ckpt = torch.load(checkpoint, weights_only=True)
    for place in places:
        PLACES[place](ckpt, pickle.dumps(Payload(marker)) if kind == "bytes" else Payload(marker))
    planted = workdir / f"{kind}-{len(places)}-{places[0]}-{command}.ckpt".replace("<", "").replace(">", "")
    torch.save(ckpt, planted)
    capsys.readouterr()

    if command == "resume":
        code = run_train(workdir, planted.stem, STEPS + 1, resume_from=planted)
    else:
        code = main(COMMANDS[command](planted, workdir, tmp_path / "out"))
    err = capsys.readouterr().err
    planted.unlink()

    assert not marker.exists(), "the planted code ran"
    if kind == "object":
        expected = OBJECT
    else:
        (expected,) = {BYTES_OUTCOMES[place][command != "resume"] for place in places}
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    if expected is None:
        assert code == 0 and not errors, err
        if command == "resume":
            resumed = torch.load(workdir / "runs" / planted.stem / "checkpoints" / "last.ckpt", weights_only=True)
            assert resumed["global_step"] == STEPS + 1  # the planted field was ignored, training went on
    else:
        assert code == 1, err
        assert len(errors) == 1, err
        assert errors[0].startswith("error: " + expected.format(path=planted)), errors[0]
