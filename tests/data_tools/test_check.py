"""check end to end: every planted problem is found, in a video folder and in tar shards; exit codes; report."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_dataset_files import finishes, make_prepared, plant
from tests.data.test_preflight import other_videos, rewrite_shard, shard_videos
from tests.data.test_task_encoder import write_planted_dataset
from tests.videos import bigbuckbunny, cut_inside_sample, encode_video, faststart, write_energon_dataset

from .test_make_shards import plant_videos, run_main, run_tool


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("planted")
    plant_videos(src)
    return src


def read_report(path: Path) -> dict[tuple[str, str], dict]:
    """(sample, code) -> report line."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(set(line) == {"sample", "severity", "code", "message"} for line in lines)
    return {(line["sample"], line["code"]): line for line in lines}


def test_check_finds_every_planted_problem(planted: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.jsonl"
    result = run_tool("check", planted, "--frames", "33", "--crop", "64", "--report", report)
    assert result.returncode == 1, result.stdout + result.stderr
    found = read_report(report)
    expected = {
        ("corrupt.mp4", "unreadable"): "error",
        ("audio.mp4", "no_video_stream"): "error",
        ("short.mp4", "too_few_frames"): "error",
        ("tiny.mp4", "too_small"): "error",
        ("vfr.mp4", "variable_fps"): "warning",
        ("dup.mp4", "duplicate"): "warning",
        ("short.mp4", "odd_fps"): "warning",
        ("good_24.mp4", "low_resolution"): "warning",
    }
    for (sample, code), severity in expected.items():
        assert found[(sample, code)]["severity"] == severity, (sample, code)
    assert "clip30.mov" in found[("dup.mp4", "duplicate")]["message"]
    assert "10 frames" in found[("short.mp4", "too_few_frames")]["message"]
    errors = {sample for (sample, _), line in found.items() if line["severity"] == "error"}
    assert errors == {"corrupt.mp4", "audio.mp4", "short.mp4", "tiny.mp4"}
    # the good ones, of every container, have only low-resolution warnings
    for sample in ("clip30.mov", "Sub Dir/take.01.MP4", "vp9.webm", "mpeg4.avi", "nested/h264.mkv"):
        assert {code for s, code in found if s == sample} == {"low_resolution"}, sample
    assert "notes.txt" not in {s for s, _ in found}
    for code in ("unreadable", "no_video_stream", "too_few_frames", "too_small", "duplicate", "variable_fps"):
        assert code in result.stdout
    assert "12 total, 8 usable, 4 with errors" in result.stdout


def test_check_allow_skips_and_resize(planted: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report = tmp_path / "r.jsonl"
    status, out, _ = run_main(capsys, "check", planted, "--crop", "64", "--allow-skips", "--report", report)
    assert status == 0 and "warning" in out
    # resizing the short side to 128 first makes the 64x48 video big enough for a 96 crop
    args = ["--frames", "8", "--crop", "96", "--resize-short-side", "128", "--report", report]
    status, _, _ = run_main(capsys, "check", planted, *args)
    assert status == 1
    assert not {s for s, code in read_report(report) if code == "too_small"}
    assert {s for s, code in read_report(report) if code == "too_few_frames"} == set()


def _shard(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_check_reads_every_tar_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    good = encode_video(40, 64, 96, fps=24)
    shards = tmp_path / "shards"
    shards.mkdir()
    _shard(shards / "000000.tar", {"a.mp4": good, "a.json": b"{}", "b.mp4": encode_video(5, 64, 96, seed=1)})
    _shard(shards / "000001.tar", {"c.mp4": good, "d.mkv": encode_video(40, 64, 96, container="matroska")})
    monkeypatch.chdir(tmp_path)  # the default report goes to the working folder
    status, out, _ = run_main(capsys, "check", shards, "--frames", "33", "--crop", "64")
    assert status == 1
    found = read_report(tmp_path / "check_report.jsonl")
    assert {s for s, _ in found} == {"000000.tar:a.mp4", "000000.tar:b.mp4", "000001.tar:c.mp4", "000001.tar:d.mkv"}
    assert found[("000000.tar:b.mp4", "too_few_frames")]["severity"] == "error"
    assert "000000.tar:a.mp4" in found[("000001.tar:c.mp4", "duplicate")]["message"]
    assert "4 total, 3 usable" in out


def test_check_missing_or_empty(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status, _, err = run_main(capsys, "check", tmp_path / "missing")
    assert status == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no videos here")
    status, _, err = run_main(capsys, "check", tmp_path / "empty")
    assert status == 2 and "no .tar shards and no video files" in err
    _shard(tmp_path / "no_videos.tar", {"x.json": b"{}"})
    status, _, err = run_main(capsys, "check", tmp_path / "no_videos.tar")
    assert status == 2 and "no video samples" in err


def test_check_holds_the_clip_shape_to_the_model_s_rule(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Before any file is read: the clip shape alone does not fit the model named.
    status, _, err = run_main(capsys, "check", tmp_path, "--frames", "33", "--crop", "60", "--model", "Wan2.1-VAE")
    assert status == 2 and err.strip() == "error: the clips do not fit Wan2.1-VAE: --crop=60 is not a multiple of 8"
    status, _, err = run_main(capsys, "check", tmp_path, "--frames", "16", "--model", "Wan2.1_VAE")
    assert status == 2 and "--frames=16 is not 1+4k frames (use 13 or 17)" in err
    status, _, err = run_main(capsys, "check", tmp_path, "--frames", "21", "--model", "CV8x8x8")
    assert status == 2 and "Cosmos-1.0-Tokenizer-CV8x8x8: --frames=21 is not 1+8k frames (use 17 or 25)" in err
    status, _, err = run_main(capsys, "check", tmp_path, "--model", "Wan3-VAE")
    assert status == 2 and "--model: unknown tokenizer model 'Wan3-VAE'" in err
    # A shape that fits goes on to the data (here: none).
    status, _, err = run_main(capsys, "check", tmp_path / "missing", "--frames", "17", "--model", "Wan2.1-VAE")
    assert status == 2 and "does not exist" in err


def test_real_footage_packs_and_checks_clean(tmp_path: Path) -> None:
    # As shipped, the sample's one keyframe in 132 frames draws the long-GOP warning; transcoded, nothing.
    src = tmp_path / "footage"
    src.mkdir()
    shutil.copy(bigbuckbunny(), src / "bigbuckbunny.mp4")
    for name, extra in (("shipped", []), ("transcoded", ["--transcode"])):
        made = run_tool("make-shards", src, tmp_path / name, *extra)
        assert made.returncode == 0, made.stdout + made.stderr
        report = tmp_path / f"{name}.jsonl"
        checked = run_tool("check", tmp_path / name, "--frames", "33", "--crop", "256", "--report", report)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "1 total, 1 usable, 0 with errors" in checked.stdout
        lines = [json.loads(line) for line in report.read_text().splitlines()]
        if name == "shipped":
            assert [(line["code"], line["severity"]) for line in lines] == [("long_gop", "warning")]
            assert "a keyframe every 132 frames" in lines[0]["message"] and "2.0x" in lines[0]["message"]
        else:
            assert lines == []


@pytest.fixture
def cut_shards(tmp_path: Path) -> Path:
    videos = {f"v{i:02d}": encode_video(12, 48, 64, seed=i) for i in range(20)}
    data = write_energon_dataset(tmp_path / "data", videos, train_shards=2)
    cut_inside_sample(data / "train1.tar", 6)
    return data


def test_check_names_a_cut_shard_and_its_readable_samples(cut_shards: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: tarfile.ReadError ("unexpected end of data") and a traceback, no shard named.
    report = cut_shards.parent / "report.jsonl"
    status, out, err = run_main(capsys, "check", cut_shards, "--frames", "9", "--crop", "32", "--report", report)
    assert status == 1 and "Traceback" not in err
    found = read_report(report)
    line = found[("train1.tar", "damaged_shard")]
    assert line["severity"] == "error"
    assert line["message"].startswith("damaged tar shard: the file ends at byte")
    assert "inside v16.mp4" in line["message"] and "6 of 10 samples readable" in line["message"]
    assert "python -m data_tools make-shards" in line["message"]
    assert "16 total, 16 usable, 0 with errors" in out
    assert "damaged tar shards: 1 (train1.tar), 4 more samples in them cannot be read" in out
    assert "and 1 tar shards are damaged" in out
    args = ["--frames", "9", "--crop", "32", "--allow-skips", "--report", report]
    status, out, _ = run_main(capsys, "check", cut_shards, *args)
    assert status == 0 and "--allow-skips given" in out


def test_check_names_a_cut_shard_without_an_index(cut_shards: Path, capsys: pytest.CaptureFixture) -> None:
    plain = cut_shards.parent / "plain"
    plain.mkdir()
    shutil.copy(cut_shards / "train1.tar", plain / "000001.tar")
    report = plain.parent / "plain.jsonl"
    status, _, _ = run_main(capsys, "check", plain, "--frames", "9", "--crop", "32", "--report", report)
    assert status == 1
    message = read_report(report)[("000001.tar", "damaged_shard")]["message"]
    assert "6 samples readable before it, how many are lost is unknown (no energon index)" in message


def test_check_finds_partial_and_deeply_damaged_videos(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: both passed check (the cut file's index still promises 72 frames), and training then failed on them.
    src = tmp_path / "videos"
    src.mkdir()
    whole = faststart(encode_video(72, 64, 96, fps=24), tmp_path / "whole.mp4")
    (src / "whole.mp4").write_bytes(whole)
    (src / "cut.mp4").write_bytes(whole[: int(len(whole) * 0.4)])
    damaged = bytearray(encode_video(72, 96, 160, fps=24, gop=8, seed=1))
    at = len(damaged) // 3
    damaged[at : at + 2000] = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    (src / "middle.mp4").write_bytes(bytes(damaged))
    report = tmp_path / "report.jsonl"
    status, out, _ = run_main(capsys, "check", src, "--frames", "17", "--crop", "64", "--report", report)
    assert status == 1
    found = read_report(report)
    partial = found[("cut.mp4", "partial_video")]
    assert partial["severity"] == "error"
    assert re.search(r"^\d+ of 72 frames readable: the file ends", partial["message"])
    assert ("cut.mp4", "too_few_frames") not in found  # its readable part is long enough: the damage is the error
    assert {s for s, code in found if code == "partial_video"} == {"cut.mp4"}  # the fast path cannot see middle.mp4
    assert "partial_video" in out
    status, _, _ = run_main(capsys, "check", src, "--frames", "17", "--crop", "64", "--deep", "--report", report)
    found = read_report(report)
    assert {s for s, code in found if code == "partial_video"} == {"cut.mp4", "middle.mp4"}
    assert "does not decode" in found[("middle.mp4", "partial_video")]["message"]


def test_check_reports_pickled_members_without_unpickling_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: "2 usable" and exit 0 for samples holding a .pkl and a .pth that other webdataset readers unpickle.
    marker = tmp_path / "marker"
    data = write_planted_dataset(tmp_path / "planted", marker)
    report = tmp_path / "report.jsonl"
    for extra in ([], ["--allow-skips"]):  # training never skips them: --allow-skips does not accept them
        status, out, _ = run_main(capsys, "check", data, "--frames", "9", "--crop", "32", "--report", report, *extra)
        assert status == 1 and "error: 4 tar members are pickles" in out and "2 total, 2 usable" in out
    assert not marker.exists()
    pickled = {sample: line for (sample, code), line in read_report(report).items() if code == "pickled_member"}
    assert set(pickled) == {f"000000.tar:x{i}.{ext}" for i in (0, 1) for ext in ("pkl", "pth")}
    message = pickled["000000.tar:x1.pth"]["message"]
    assert pickled["000000.tar:x1.pth"]["severity"] == "error"
    assert message.startswith("sample x1 of 000000.tar holds x1.pth, a pickle: training never reads it")
    assert "other webdataset readers unpickle it" in message and "remove it" in message


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    videos = {f"v{i:02d}": encode_video(12, 48, 64, seed=i) for i in range(20)}
    return write_energon_dataset(tmp_path / "data", videos, train_shards=2)


def _changed(report: Path) -> dict[str, str]:
    """shard -> changed_shard message."""
    return {sample: line["message"] for (sample, code), line in read_report(report).items() if code == "changed_shard"}


def test_check_refuses_a_replaced_shard(two_shards: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: "all usable", exit 0, for a shard whose samples are not the ones its energon index lists.
    rewrite_shard(two_shards / "train1.tar", other_videos(10, first_seed=100))
    report = two_shards.parent / "report.jsonl"
    args = ["--frames", "9", "--crop", "32", "--allow-skips", "--report", report]
    status, out, _ = run_main(capsys, "check", two_shards, *args)
    assert status == 1 and "20 total, 20 usable" in out  # --allow-skips does not cover it: training refuses it
    said = " ".join(out.split())  # rich wraps long lines
    assert "1 tar shards changed since they were prepared (train1.tar)" in said
    assert f"run python -m data_tools prepare {two_shards} again" in said
    (message,) = _changed(report).values()
    assert message.startswith("train1.tar: tar shard changed since it was prepared: sample 1 of 10 (at byte 0)")
    assert message.endswith(f"Run python -m data_tools prepare {two_shards} again")


def test_check_refuses_shards_rewritten_with_more_samples(two_shards: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: "all usable", exit 0, and training read a third of the videos.
    for n, shard in enumerate(("train0.tar", "train1.tar")):
        rewrite_shard(two_shards / shard, shard_videos(two_shards / shard) | other_videos(20, first_seed=100 + 20 * n))
    report = two_shards.parent / "report.jsonl"
    status, out, _ = run_main(capsys, "check", two_shards, "--frames", "9", "--crop", "32", "--report", report)
    assert status == 1 and "60 total, 60 usable" in out
    changed = _changed(report)
    assert set(changed) == {"train0.tar", "train1.tar"}
    assert "it holds n120.mp4 and more after the 10 samples its index lists" in changed["train1.tar"]


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return make_prepared(tmp_path)


@pytest.mark.parametrize("case", ["nested_os_system", "sample_loader"])
def test_check_refuses_a_dataset_yaml_that_names_code(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    # Before: "all usable", exit 0, for a folder whose dataset.yaml makes energon run code at the launch.
    marker = tmp_path / "marker"
    said = plant(prepared, case, marker)
    report = tmp_path / "report.jsonl"
    status, out, err = run_main(capsys, "check", prepared, "--frames", "9", "--crop", "32", "--report", report)
    assert status == 1 and out == "" and not marker.exists()
    assert err.startswith(f"error: refusing {prepared / '.nv-meta' / 'dataset.yaml'}: {said}")
    assert err.count("\n") == 1 and f"run python -m data_tools prepare {prepared} again" in err


@pytest.mark.parametrize("name", ["train0.tar.idx", ".nv-meta/.info.json", ".nv-meta/split.yaml"])
def test_check_refuses_a_fifo_instead_of_waiting_on_it(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture, name: str
) -> None:
    # Before: check blocked for ever reading train0.tar.idx (read_bytes) or .info.json (read_text).
    fifo = prepared / name
    fifo.unlink()
    os.mkfifo(fifo)
    report = tmp_path / "report.jsonl"
    found: list[tuple[int, str, str]] = []
    finishes(
        lambda: found.append(run_main(capsys, "check", prepared, "--frames", "9", "--crop", "32", "--report", report)),
        fifo,
    )
    status, _, err = found[0]
    assert status == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {fifo} is a FIFO, not a regular file: ")
