"""check end to end: every planted problem is found, in a video folder and in tar shards; exit codes; report."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.videos import bigbuckbunny, encode_video

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


def test_real_footage_packs_and_checks_clean(tmp_path: Path) -> None:
    src = tmp_path / "footage"
    src.mkdir()
    shutil.copy(bigbuckbunny(), src / "bigbuckbunny.mp4")
    made = run_tool("make-shards", src, tmp_path / "dataset")
    assert made.returncode == 0, made.stdout + made.stderr
    report = tmp_path / "report.jsonl"
    checked = run_tool("check", tmp_path / "dataset", "--frames", "33", "--crop", "256", "--report", report)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert report.read_text() == ""
    assert "1 total, 1 usable, 0 with errors" in checked.stdout
