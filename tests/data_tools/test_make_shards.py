"""make-shards and prepare end to end: real small videos in, tar shards + manifest + energon metadata out."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest
import yaml

from data_tools.__main__ import main
from data_tools.shards import Packed, ShardWriter
from tests.conftest import ROOT, captured_output, run_script
from tests.data.test_probe import audio_only_mp4
from tests.videos import encode_video, write_energon_dataset, write_video
from tokenizer_posttrain.data.probe import probe_video


def run_tool(*args: object, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m data_tools ARGS`` as a user runs it, in this process (its ``main``; a fresh process would
    only add seconds of imports): exit status and what file descriptors 1 and 2 received."""
    argv = [str(a) for a in args]
    with pytest.MonkeyPatch.context() as patch, captured_output() as output:
        patch.chdir(cwd)
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse: --help and bad arguments
            status = exit_.code
    return subprocess.CompletedProcess(["python", "-m", "data_tools", *argv], status, *output)


def plant_videos(src: Path) -> None:
    """A folder with one video per case make-shards and check must handle."""
    write_video(src / "good_24.mp4", 40, 144, 256, fps=24)  # taller than --max-height 100
    write_video(src / "clip30.mov", 40, 64, 96, fps=30)
    upper = write_video(src / "Sub Dir" / "take.01.mp4", 40, 64, 96, fps=24, seed=3)
    upper.rename(upper.with_suffix(".MP4"))  # suffixes match in any case
    write_video(src / "vp9.webm", 40, 64, 96, fps=24, codec="libvpx-vp9", seed=4)
    write_video(src / "mpeg4.avi", 40, 64, 96, fps=30, codec="mpeg4", seed=5)
    write_video(src / "nested" / "h264.mkv", 40, 144, 256, fps=30, seed=6)
    write_video(src / "short.mp4", 10, 64, 96, seed=7)
    write_video(src / "tiny.mp4", 40, 48, 64, seed=8)  # under a 64x64 crop
    write_video(src / "vfr.mp4", 40, 64, 96, fps=30, seed=9, pts_steps=[33, 33, 100, 17])
    (src / "dup.mp4").write_bytes((src / "clip30.mov").read_bytes())
    (src / "corrupt.mp4").write_bytes(encode_video(40, 64, 96, seed=10)[:1500])
    (src / "audio.mp4").write_bytes(audio_only_mp4())
    (src / "notes.txt").write_text("not a video")


UNREADABLE = {"corrupt.mp4", "audio.mp4"}


def tar_members(out: Path) -> dict[str, tuple[str, bytes]]:
    """member name -> (shard, bytes) over every shard of ``out``."""
    members = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                members[m.name] = (shard.name, tar.extractfile(m).read())
    return members


def manifest(out: Path) -> dict[str, dict]:
    return {e["key"]: e for e in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    src = tmp_path_factory.mktemp("videos")
    plant_videos(src)
    out = tmp_path_factory.mktemp("shards") / "dataset"
    result = run_tool("make-shards", src, out, "--shard-size", "60KB", "--val-fraction", "0.25", "--max-height", "100")
    return src, out, result


def test_unreadable_files_are_listed_and_fail_the_run(packed: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    src, out, result = packed
    assert result.returncode == 1, result.stdout + result.stderr
    for name in UNREADABLE:
        assert name in result.stdout
    assert "--allow-skips" in result.stdout
    skipped = {Path(s["source"]).name: s["reason"] for s in map(json.loads, (out / "skipped.jsonl").open())}
    assert set(skipped) == UNREADABLE
    assert skipped["audio.mp4"] == "no video stream"
    assert skipped["corrupt.mp4"].startswith("unreadable (")


def test_members_keys_and_manifest(packed: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    src, out, _ = packed
    members, entries = tar_members(out), manifest(out)
    expected = {"good_24", "clip30", "Sub_Dir__take_01", "vp9", "mpeg4", "nested__h264", "short", "tiny", "vfr", "dup"}
    assert set(entries) == expected
    assert set(members) == {f"{k}.mp4" for k in expected}
    for key, e in entries.items():
        shard, data = members[f"{key}.mp4"]
        assert "." not in key and "/" not in key
        assert e["shard"] == shard and e["bytes"] == len(data)
        assert e["sha1"] == hashlib.sha1(data).hexdigest()
        assert Path(e["source"]).is_file() and (src / e["relpath"]).resolve() == Path(e["source"])
        info = probe_video(data)
        assert (e["frames"], e["width"], e["height"], e["codec"]) == (info.frames, info.width, info.height, info.codec)
        assert (e["fps"], e["duration"]) == (pytest.approx(info.fps), pytest.approx(info.duration))
        assert e["split"] in ("train", "val")


def test_copies_and_transcodes(packed: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    src, out, _ = packed
    members, entries = tar_members(out), manifest(out)
    for key, rel in [("clip30", "clip30.mov"), ("Sub_Dir__take_01", "Sub Dir/take.01.MP4"), ("vfr", "vfr.mp4")]:
        assert not entries[key]["transcoded"]
        assert members[f"{key}.mp4"][1] == (src / rel).read_bytes()  # byte for byte
    for key in ("vp9", "mpeg4", "nested__h264"):  # webm, avi, mkv -> h264 mp4, same frames and rate
        data = members[f"{key}.mp4"][1]
        assert entries[key]["transcoded"] and data[4:8] == b"ftyp"
        info = probe_video(data)
        assert (info.codec, info.frames) == ("h264", 40)
        assert info.fps == pytest.approx(probe_video(src / entries[key]["relpath"]).fps)
        # x264 writes its settings into the stream: fast to decode (no CABAC, no deblocking), GOP 16
        settings = data[data.index(b"x264 - core") :][:2000]
        assert b"cabac=0" in settings and b"deblock=0" in settings and b"keyint=16 " in settings
    # --max-height 100: 256x144 becomes 178x100 (even width, same aspect)
    for key in ("good_24", "nested__h264"):
        assert (entries[key]["width"], entries[key]["height"], entries[key]["transcoded"]) == (178, 100, True)


def test_split_and_shard_size(packed: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    _, out, _ = packed
    entries = manifest(out)
    split_of_shard: dict[str, set[str]] = {}
    for e in entries.values():
        split_of_shard.setdefault(e["shard"], set()).add(e["split"])
    assert all(len(s) == 1 for s in split_of_shard.values())  # whole shards are train or val
    assert sum(e["split"] == "val" for e in entries.values()) >= 1
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            assert shard.stat().st_size <= 60_000 or len(tar.getmembers()) == 1
    assert len(split_of_shard) >= 3
    meta = out / ".nv-meta"
    assert yaml.safe_load((meta / "dataset.yaml").read_text())["__class__"] == "CrudeWebdataset"
    counts = json.loads((meta / ".info.json").read_text())["shard_counts"]
    assert set(counts) == set(split_of_shard)
    assert sum(counts.values()) == len(entries)
    assert all((out / f"{s}.idx").is_file() for s in split_of_shard)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")  # energon's loader on a CPU-only host
def test_energon_opens_train_and_val(packed: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        basic_sample_keys,
        edataclass,
        get_loader,
        get_train_dataset,
        get_val_dataset,
        stateless,
    )
    from megatron.energon.av import AVDecoder

    @edataclass
    class RawVideo(Sample):
        video: AVDecoder

    @stateless
    def cook(raw: dict) -> RawVideo:
        return RawVideo(**basic_sample_keys(raw), video=raw["mp4"])

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    _, out, _ = packed
    entries = manifest(out)
    worker = WorkerConfig(rank=0, world_size=1, num_workers=0)
    train = get_train_dataset(
        out, worker_config=worker, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
        repeat=False, task_encoder=Encoder(),
    )  # fmt: skip
    seen = {}
    for sample in get_loader(train):
        seen[sample.__key__] = sample.video.get_video_duration(get_frame_count=True)[1]
    assert seen == {k: e["frames"] for k, e in entries.items() if e["split"] == "train"}
    val = get_val_dataset(out, worker_config=worker, batch_size=None, task_encoder=Encoder())
    assert {s.__key__ for s in get_loader(val)} == {k for k, e in entries.items() if e["split"] == "val"}


def test_changed_options_are_refused(packed: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    src, out, _ = packed
    # In a fresh process, as a user runs it: the exit status of the real entry point (the other runs call main).
    args = ["make-shards", str(src), str(out), "--shard-size", "60KB", "--val-fraction", "0.25"]
    result = run_script("-m", "data_tools", *args, cwd=ROOT, timeout=300)
    assert result.returncode == 2
    assert "max_height=100 (now None)" in result.stderr


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).digest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_rerun_is_a_noop_and_new_videos_get_new_shards(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    write_video(src / "a.mp4", 12, 64, 96)
    write_video(src / "b.mp4", 12, 64, 96, seed=1)
    first = run_tool("make-shards", src, out, "--transcode", "--val-fraction", "0")
    assert first.returncode == 0, first.stdout + first.stderr
    entries = manifest(out)
    assert all(e["transcoded"] and e["split"] == "train" for e in entries.values())
    assert entries["a"]["sha1"] != hashlib.sha1((src / "a.mp4").read_bytes()).hexdigest()
    assert "val" not in yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]

    before = _snapshot(out)
    (out / "000009.tar.tmp").write_bytes(b"half a shard from a killed run")
    again = run_tool("make-shards", src, out, "--transcode", "--val-fraction", "0")
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr
    assert _snapshot(out) == before  # nothing rewritten, the stale temp file is gone

    write_video(src / "later" / "c.mp4", 12, 64, 96, seed=2)
    third = run_tool("make-shards", src, out, "--transcode", "--val-fraction", "0")
    assert third.returncode == 0, third.stdout + third.stderr
    after = _snapshot(out)
    assert after["000000.tar"] == before["000000.tar"]
    assert set(tar_members(out)) == {"a.mp4", "b.mp4", "later__c.mp4"}
    with tarfile.open(out / "000001.tar") as tar:
        assert tar.getnames() == ["later__c.mp4"]
    counts = json.loads((out / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    assert counts == {"000000.tar": 2, "000001.tar": 1}

    # killed after committing the manifest but before renaming the shard: the next run packs it again
    (out / "000001.tar").rename(out / "000001.tar.tmp")
    fourth = run_tool("make-shards", src, out, "--transcode", "--val-fraction", "0")
    assert fourth.returncode == 0 and "packed again" in fourth.stdout, fourth.stdout + fourth.stderr
    assert set(tar_members(out)) == {"a.mp4", "b.mp4", "later__c.mp4"}
    assert len(manifest(out)) == 3 and not list(out.glob("*.tmp"))


def _write_shard(path: Path, keys: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, key in enumerate(keys):
            data = encode_video(8, 32, 32, seed=i + len(key))
            info = tarfile.TarInfo(f"{key}.mp4")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_prepare_an_existing_tar_folder(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    _write_shard(shards / "part-a.tar", ["k0", "k1"])
    _write_shard(shards / "part-b.tar", ["k2"])
    _write_shard(shards / "more" / "part-c.tar", ["k3", "k4"])

    result = run_tool("make-shards", shards)  # no OUT: prepare in place
    assert result.returncode == 0, result.stdout + result.stderr
    splits = yaml.safe_load((shards / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert len(splits["train"]) >= 1 and len(splits["val"]) == 1  # 3 shards, 1 % -> still one val shard
    assert yaml.safe_load((shards / ".nv-meta" / "dataset.yaml").read_text())["__class__"] == "CrudeWebdataset"

    again = run_tool("prepare", shards, "--val-fraction", "0")  # re-prepare a prepared folder
    assert again.returncode == 0, again.stdout + again.stderr
    splits = yaml.safe_load((shards / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert list(splits) == ["train"]
    assert sum(json.loads((shards / ".nv-meta" / ".info.json").read_text())["shard_counts"].values()) == 5

    elsewhere = run_tool("make-shards", shards, tmp_path / "other")
    assert elsewhere.returncode == 2 and "python -m data_tools prepare" in elsewhere.stderr


def test_prepare_with_other_threads_alive_runs_in_a_fresh_process(tmp_path: Path) -> None:
    # energon forks its workers; a fork beside other threads can copy a held lock and hang (it did, in a test
    # process), so with a thread alive the preparation runs in a new interpreter, with the same result.
    import threading

    from data_tools.prepare import PrepareError, energon_prepare, is_prepared

    shards = tmp_path / "shards"
    _write_shard(shards / "000000.tar", ["k0", "k1"])
    _write_shard(shards / "000001.tar", ["k2"])
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        energon_prepare(shards, {"train": ["000000.tar", "000001.tar"], "val": []})
        assert is_prepared(shards, ["000000.tar", "000001.tar"])
        (shards / "000001.tar").write_bytes(b"not a tar file")
        with pytest.raises(PrepareError, match=r"^energon prepare failed on .*shards") as failed:
            energon_prepare(shards, {"train": ["000000.tar", "000001.tar"], "val": []})
        assert "\n" not in str(failed.value)
    finally:
        stop.set()


def run_main(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    """``python -m data_tools ARGS`` in this process (for the quick error paths): status, stdout, stderr."""
    try:
        status = main([str(a) for a in args])
    except SystemExit as exit_:  # argparse: --help and bad arguments
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status, out, _ = run_main(capsys, "--help")
    assert status == 0 and all(c in out for c in ("make-shards", "prepare", "check"))
    status, _, err = run_main(capsys, "make-shards", tmp_path / "nope", tmp_path / "out")
    assert status == 2 and "nope" in err
    write_video(tmp_path / "v" / "a.mp4", 8, 32, 32)
    status, _, err = run_main(capsys, "make-shards", tmp_path / "v")
    assert status == 2 and "OUT is required" in err
    status, _, err = run_main(capsys, "make-shards", tmp_path / "v", tmp_path / "out", "--shard-size", "lots")
    assert status == 2 and "not a size" in err
    status, _, err = run_main(capsys, "make-shards", tmp_path / "v", tmp_path / "out", "--val-fraction", "1")
    assert status == 2 and "[0, 1)" in err
    (tmp_path / "e").mkdir()
    status, _, err = run_main(capsys, "make-shards", tmp_path / "e", tmp_path / "out2")
    assert status == 2 and "no videos" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_make_shards_as_a_function_checks_what_the_command_line_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # The posttrain workflow calls it in its own process, with no parser in front to check the fraction.
    from data_tools.__main__ import make_shards_command
    from data_tools.make_shards import Options

    write_video(tmp_path / "v" / "a.mp4", 8, 32, 32)
    assert make_shards_command(tmp_path / "v", tmp_path / "out", Options(val_fraction=1.0)) == 2
    assert capsys.readouterr().err == "error: argument --val-fraction: must be in [0, 1), got 1.0\n"
    (tmp_path / "e").mkdir()
    assert make_shards_command(tmp_path / "e", tmp_path / "out", Options()) == 2
    assert "error: no videos in" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_broken_manifest_line_is_named_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: json.decoder.JSONDecodeError (or KeyError) and a traceback, from make-shards and from prepare.
    src, out = tmp_path / "src", tmp_path / "out"
    out.mkdir()
    writer = ShardWriter(out, max_bytes=10**6, index=0, entries=[])  # make-shards' own writer: shard + manifest
    for key, seed in (("a", 0), ("b", 1)):
        video = write_video(src / f"{key}.mp4", 8, 32, 32, seed=seed)
        writer.add(Packed(video.name, video, video, key, "train", {}, transcoded=False))
    writer.close()
    path = out / "manifest.jsonl"
    lines = path.read_text().splitlines()
    for broken, problem in (
        (lines[1][:40], "is not valid JSON (Unterminated string starting at: column "),
        ('["a list"]', 'is not a make-shards entry (no "key", "relpath", "shard", "split", "source_bytes", '),
    ):
        path.write_text("\n".join([lines[0], broken]) + "\n")
        status, said, err = run_main(capsys, "make-shards", src, out, "--val-fraction", "0")
        assert status == 1 and said == "" and "Traceback" not in err and err.count("\n") == 1
        assert err.startswith(f"error: {path} line 2 {problem}")
        assert err.endswith(
            "fix or delete that line, or delete the file (make-shards writes one JSON object per video)\n"
        )
    status, _, err = run_main(capsys, "prepare", out)
    assert status == 1 and err.startswith(f'error: {path} line 2 is not a make-shards entry (no "shard", "split" ')
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"fps": ', "is not valid JSON (Expecting value: line 1 column 9)"),
        (b'["a", "list"]', "holds a JSON list, not the object of options make-shards writes"),
        (b'{"src": "\xff"}', "is not UTF-8 text"),
        (None, "is a FIFO, not a regular file"),  # before: make-shards waited for a writer
    ],
)
def test_a_broken_settings_file_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: bytes | None, problem: str
) -> None:
    # Before: a JSONDecodeError (or AttributeError on a list) traceback from make-shards; a FIFO blocked it.
    src, out = tmp_path / "src", tmp_path / "out"
    write_video(src / "a.mp4", 8, 32, 32)
    out.mkdir()
    if content is None:
        os.mkfifo(out / "make_shards.json")
    else:
        (out / "make_shards.json").write_bytes(content)
    results: list[tuple[int, str, str]] = []
    runner = threading.Thread(
        target=lambda: results.append(run_main(capsys, "make-shards", src, out, "--val-fraction", "0")), daemon=True
    )
    runner.start()
    runner.join(timeout=30)
    if runner.is_alive():  # blocked on the FIFO: open its other end so the thread ends, then fail
        os.close(os.open(out / "make_shards.json", os.O_RDWR | os.O_NONBLOCK))
        pytest.fail("make-shards waited on a FIFO make_shards.json")
    status, said, err = results[0]
    assert status == 1 and said == "" and "Traceback" not in err and err.count("\n") == 1
    assert err == (
        f"error: {out / 'make_shards.json'} {problem}: delete it (make-shards writes it again with the options of "
        "this run) or choose a new OUT folder\n"
    )


def test_prepare_again_replaces_a_fifo_or_a_link_in_nv_meta(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Before: energon opened the FIFO for writing and waited for ever; through a link it would write elsewhere.
    data = write_energon_dataset(tmp_path / "data", {"a": encode_video(8, 32, 32)})
    meta, victim = data / ".nv-meta", tmp_path / "victim.txt"
    victim.write_text("keep me")
    (meta / "dataset.yaml").unlink()
    os.mkfifo(meta / "dataset.yaml")
    (meta / "split.yaml").unlink()
    (meta / "split.yaml").symlink_to(victim)
    results: list[tuple[int, str, str]] = []
    runner = threading.Thread(target=lambda: results.append(run_main(capsys, "prepare", data)), daemon=True)
    runner.start()
    runner.join(timeout=60)
    if runner.is_alive():  # blocked on the FIFO: open its other end so the thread ends, then fail
        os.close(os.open(meta / "dataset.yaml", os.O_RDWR | os.O_NONBLOCK))
        pytest.fail("prepare waited on a FIFO in .nv-meta")
    assert results[0][0] == 0, results[0]
    assert victim.read_text() == "keep me"
    assert (meta / "dataset.yaml").is_file() and not (meta / "split.yaml").is_symlink()
