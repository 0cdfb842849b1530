"""clips: one pass over an energon dataset's clips through the trainer's loaders, for evaluation and statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.videos import encode_video, write_energon_dataset
from tokenizer_posttrain.core.errors import EvaluationError
from tokenizer_posttrain.evaluation.clips import held_out_clips, open_clips, video_fps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def train_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three train videos of 12 frames (no val split) and one of 5 frames, too short for a 9-frame clip."""
    train = {f"t{i}": encode_video(12, 32, 48, seed=i) for i in range(3)}
    train["short"] = encode_video(5, 32, 48, seed=7)
    return write_energon_dataset(tmp_path_factory.mktemp("shards"), train)


def test_a_missing_split_falls_back_to_the_other_and_says_so(train_only: Path) -> None:
    skipped: list[str] = []
    source, clips = open_clips(str(train_only), 9, 32, 32, None, skipped)
    got = list(clips)
    assert source == "energon train split (the dataset has no val split)"
    assert sorted(key for key, _ in got) == ["t0", "t1", "t2"]
    assert all(clip.shape == (3, 9, 32, 32) and clip.dtype == torch.float32 for _, clip in got)
    assert all(clip.min() >= -1 and clip.max() <= 1 for _, clip in got)
    assert len(skipped) == 1 and "short" in skipped[0]


def test_the_ordered_pass_repeats_and_a_seed_draws_other_crops(train_only: Path) -> None:
    def first(seed: int | None) -> torch.Tensor:
        _, clips = open_clips(str(train_only), 9, 24, 24, None, [], prefer="train", seed=seed, float32=False)
        return dict(clips)["t0"]

    ordered = first(None)
    assert ordered.dtype == torch.bfloat16 and torch.equal(ordered, first(None))
    assert torch.equal(first(3), first(3))
    assert any(not torch.equal(first(seed), ordered) for seed in (1, 2, 3))


def test_a_folder_that_is_not_a_dataset_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match=r"not an energon dataset .*make-shards"):
        open_clips(str(tmp_path), 9, 32, 32, None, [])


def test_a_fifo_index_is_refused_not_waited_on(train_only: Path, tmp_path: Path) -> None:
    # Before: evaluate opened a FIFO planted as a shard's index and waited for a writer.
    import os
    import shutil
    import threading

    from tokenizer_posttrain.core.errors import UserError

    data = tmp_path / "data"
    shutil.copytree(train_only, data)
    (data / "train.tar.idx").unlink()
    os.mkfifo(data / "train.tar.idx")
    raised: list[BaseException] = []
    reader = threading.Thread(target=lambda: raised.append(_error(data)), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive() and isinstance(raised[0], UserError)
    assert f"{data / 'train.tar.idx'} is a FIFO, not a regular file" in str(raised[0])


def _error(data: Path) -> BaseException | None:
    try:
        open_clips(str(data), 9, 32, 32, None, [])
    except Exception as err:  # noqa: BLE001 - the test looks at whatever was raised
        return err
    return None


def test_several_clips_per_video_the_same_in_every_evaluation(train_only: Path) -> None:
    # Before: one clip per held-out video, so two videos (one held out) gave a verdict on one clip.
    def clips() -> list[tuple[str, str, torch.Tensor]]:
        _, stream = held_out_clips(str(train_only), 9, 24, 24, None, [], clips_per_video=3)
        return list(stream)

    first = clips()
    # The ordered pass first (the keys as they were), then passes of random starts and crops, video by video.
    assert [key for key, _, _ in first[:3]] == ["t0", "t1", "t2"]
    assert sorted(key for key, _, _ in first[3:]) == ["t0#2", "t0#3", "t1#2", "t1#3", "t2#2", "t2#3"]
    assert all(key.split("#")[0] == video for key, video, _ in first)
    again = clips()  # the baseline before training and the evaluation after it see the same pixels
    assert [k for k, _, _ in again] == [k for k, _, _ in first]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(first, again, strict=True))
    crops = {key: clip for key, _, clip in first}
    assert not torch.equal(crops["t0"], crops["t0#2"])


def test_the_frame_rate_of_a_video_comes_from_the_manifest_or_its_shard(tmp_path: Path) -> None:
    data = write_energon_dataset(
        tmp_path / "data", {"a": encode_video(9, 32, 32, fps=25), "b": encode_video(9, 32, 32)}
    )
    assert video_fps(str(data), ["a", "b", "missing"]) == {"a": 25.0, "b": 10.0}  # read from the shard
    (data / "manifest.jsonl").write_text('{"key": "a", "fps": 29.97}\nnot json\n{"key": "b", "fps": "fast"}\n')
    assert video_fps(str(data), ["a", "b"]) == {"a": 29.97, "b": 10.0}  # the manifest first, a bad entry ignored


def test_a_video_file_given_as_data_says_to_make_a_dataset_of_its_folder(tmp_path: Path) -> None:
    # Before: the fix said `make-shards clip.mp4 OUT`, which fails: make-shards takes a folder.
    video = tmp_path / "clip.mp4"
    video.write_bytes(encode_video(9, 32, 32))
    with pytest.raises(EvaluationError, match=r"make-shards VIDEOS \(a folder with your videos\) OUT"):
        open_clips(str(video), 9, 32, 32, None, [])
