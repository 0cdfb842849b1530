"""Training on real video shards made by data_tools, through the real command lines: ``train_tokenizer.py``'s
and ``python -m data_tools``'s, run in this process (run_cli_here, data_tools' main); the two-rank run is torchrun's
fresh processes."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from data_tools.__main__ import main as data_tools_main
from tests.conftest import read_metrics, run_cli_here, run_torchrun
from tests.videos import bigbuckbunny, cut_inside_sample, encode_video, write_energon_dataset, write_video

TINY = [
    "--factory",
    "tiny",
    "data.num_workers=2",
    "data.global_batch_size=2",
    "data.micro_batch_size=1",
    "trainer.val_check_interval=4",
    "log.export_on_end=false",
]


def make_shards(src: Path, out: Path, *args: str) -> None:
    """``python -m data_tools make-shards SRC OUT ARGS``, in this process."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        status = data_tools_main(["make-shards", str(src), str(out), *args])
    assert status == 0, log.getvalue()[-4000:]


@pytest.fixture(scope="module")
def video_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("videos")
    for i in range(10):
        write_video(src / f"cam{i % 2}" / f"clip{i}.mp4", 24 + 2 * i, 64, 96, fps=(10, 24, 30)[i % 3], seed=i)
    out = tmp_path_factory.mktemp("shards")
    make_shards(src, out, "--shard-size", "20000", "--val-fraction", "0.2")
    return out


def trace(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / "rank0.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in read_metrics(run_dir) if r.get("train/loss")}


def test_resumed_run_continues_the_data_stream(video_dataset: Path, tmp_path: Path) -> None:
    data = f"data.path={video_dataset}"
    # The uninterrupted run exports, and measures the export's latent statistics on a few clips of the videos.
    stats = ("log.export_on_end=true", "log.latent_stats_clips=4")
    whole = run_cli_here(*TINY, data, *stats, "trainer.max_steps=8", f"log.log_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli_here(*TINY, data, "trainer.max_steps=4", f"log.log_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli_here(*TINY, data, "trainer.max_steps=8", f"log.log_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout

    a, b = trace(tmp_path / "a" / "tiny_cv8x8x8"), trace(tmp_path / "b" / "tiny_cv8x8x8")
    assert len(a) == len(b) == 16  # 8 steps x 2 micro-batches: nothing repeated, nothing skipped
    assert a == b  # the same clips in the same order at the same steps
    assert len({k for rec in a for k in rec["keys"]}) >= 5  # it really reads many videos
    la, lb = losses(tmp_path / "a" / "tiny_cv8x8x8"), losses(tmp_path / "b" / "tiny_cv8x8x8")
    for step in range(4, 8):  # and the resumed run trains exactly like the uninterrupted one
        assert lb[step] == pytest.approx(la[step], rel=1e-4), (step, la, lb)
    assert any(r.get("val/psnr") for r in read_metrics(tmp_path / "a" / "tiny_cv8x8x8"))
    # The export's latent statistics come from the run's own videos (the encoder trained: none to copy).
    assert f"measured on 4 clips of {video_dataset}" in whole.stdout
    assert "[latent statistics] 0/4 clips | elapsed 0:00" in whole.stdout  # progress lines in a log
    mean, std = torch.load(tmp_path / "a" / "tiny_cv8x8x8" / "export" / "mean_std.pt", weights_only=True)
    assert mean.shape == std.shape == (16, 16) and torch.isfinite(mean).all() and (std > 0).all()


def test_preflight_refuses_clips_the_videos_cannot_give(video_dataset: Path, tmp_path: Path) -> None:
    result = run_cli_here(
        *TINY,
        f"data.path={video_dataset}",
        "data.frames=49",
        "trainer.max_steps=2",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "cannot give a 49x64x64 clip" in result.stderr and "fewer" in result.stderr
    assert ".tar:" in result.stderr  # names the files
    assert "Fix:" in result.stderr
    assert not (tmp_path / "tiny_cv8x8x8" / "checkpoints").exists()


def test_not_a_dataset_is_explained(tmp_path: Path) -> None:
    result = run_cli_here(
        *TINY, f"data.path={tmp_path}", "trainer.max_steps=2", f"log.log_dir={tmp_path}", cwd=tmp_path
    )
    assert result.returncode != 0
    assert "is not a prepared energon dataset" in result.stderr and "make-shards" in result.stderr


def test_too_many_bad_videos_stop_the_run_with_their_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(4):
        write_video(src / f"good{i}.mp4", 20, 64, 64, seed=i)
        write_video(src / f"short{i}.mp4", 4, 64, 64, seed=i)  # packs fine, but cannot give a 17-frame clip
    make_shards(src, tmp_path / "data", "--val-fraction", "0")
    result = run_cli_here(
        *TINY,
        f"data.path={tmp_path / 'data'}",
        "data.preflight_samples=0",
        "data.num_workers=0",
        "data.max_skip_fraction=0.2",
        "trainer.max_steps=40",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "were unusable, more than data.max_skip_fraction=0.2" in result.stderr
    assert "short" in result.stderr and "fewer than the 17 a clip needs" in result.stderr
    assert "skipped video" in result.stdout  # each skip is logged as it happens


def test_a_cut_shard_is_skipped_named_and_counted_and_training_goes_on(tmp_path: Path) -> None:
    # Before: tarfile.ReadError at launch (preflight) and, past it, in the loader: a traceback, no shard named.
    videos = {f"v{i:02d}": encode_video(20, 64, 64, seed=i) for i in range(20)}
    data = write_energon_dataset(tmp_path / "data", videos, train_shards=2)
    cut_inside_sample(data / "train1.tar", 2)  # samples 3 to 10 of train1.tar are gone
    result = run_cli_here(
        *TINY,
        f"data.path={data}",
        "data.num_workers=1",
        "data.max_skip_fraction=0.6",
        "trainer.max_steps=10",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # named at launch, with what is lost
    assert "train1.tar: damaged tar shard: the file ends at byte" in result.stderr
    assert "2 of 10 samples readable" in result.stderr and "training skips the 8 lost samples" in result.stderr
    # named once when the loader meets it, then counted
    assert result.stdout.count("warning: train1.tar: damaged tar shard (ReadError") == 1
    assert "sample 3 of 10 cannot be read, so samples 3 to 10 of it are skipped" in result.stdout
    assert "in 1 damaged tar shard(s): train1.tar: " in result.stdout
    rows = read_metrics(tmp_path / "tiny_cv8x8x8")
    assert max(float(r["data/skipped_samples"]) for r in rows if r.get("data/skipped_samples")) > 0
    keys = {k for rec in trace(tmp_path / "tiny_cv8x8x8") for k in rec["keys"]}
    assert keys <= {f"v{i:02d}" for i in range(12)}  # train0's ten and train1's first two


def test_bigbuckbunny_trains(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(bigbuckbunny(), src / "bigbuckbunny.mp4")
    make_shards(src, tmp_path / "data", "--val-fraction", "0")
    result = run_cli_here(
        "--factory",
        "tiny",
        f"data.path={tmp_path / 'data'}",
        "data.num_workers=0",
        "data.resize_short_side=128",
        "data.frames=17",
        "trainer.max_steps=3",
        "log.export_on_end=false",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    keys = {k for rec in trace(tmp_path / "tiny_cv8x8x8") for k in rec["keys"]}
    assert len(keys) == 1 and "bigbuckbunny" in keys.pop()
    assert "no val split: validation is off" in result.stderr


def test_two_ranks_read_disjoint_shares_and_save_both_states(video_dataset: Path, tmp_path: Path) -> None:
    import torch

    from tokenizer_posttrain.data.energon_state import from_plain

    result = run_torchrun(
        *TINY,
        f"data.path={video_dataset}",
        "data.num_workers=1",
        "data.global_batch_size=2",
        "trainer.max_steps=3",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "tiny_cv8x8x8"
    keys = [
        {
            k
            for line in (run_dir / "samples" / f"rank{r}.jsonl").read_text().splitlines()
            for k in json.loads(line)["keys"]
        }
        for r in (0, 1)
    ]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # energon splits the data over the ranks
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    (datamodule_state,) = [v for k, v in ckpt.items() if "DataModule" in k]
    states = from_plain(datamodule_state["energon_loader_state"], "energon_loader_state")
    assert len(states) == 2  # both ranks' loader positions
