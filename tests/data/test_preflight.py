"""The launch checks on real small shards: a cut-short train shard is named, warned about or refused."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from tests.videos import cut_inside_sample, encode_video, write_energon_dataset
from tokenizer_posttrain.core.errors import DataError
from tokenizer_posttrain.data.batch import PREFETCH
from tokenizer_posttrain.data.preflight import loader_prefetch, preflight
from tokenizer_posttrain.data.shard_check import MemberScan, index_change, index_offsets, indexed_damage


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    videos = {f"v{i:02d}": encode_video(12, 48, 64, seed=i) for i in range(20)}
    return write_energon_dataset(tmp_path / "data", videos, train_shards=2)


def _preflight(path: Path, max_skip_fraction: float, samples: int = 16) -> list[str]:
    return preflight(path, 9, 32, 32, None, samples, max_skip_fraction)


def rewrite_shard(shard: Path, videos: dict[str, bytes]) -> None:
    """Write ``shard`` anew with these ``<key>.mp4`` samples, leaving its energon index as it was."""
    import webdataset as wds

    with wds.TarWriter(str(shard)) as writer:
        for key, data in videos.items():
            writer.write({"__key__": key, "mp4": data})


def other_videos(count: int, first_seed: int) -> dict[str, bytes]:
    """``count`` videos not in :func:`two_shards`, keyed ``n<seed>``."""
    return {f"n{seed}": encode_video(12, 48, 64, seed=seed) for seed in range(first_seed, first_seed + count)}


def shard_videos(shard: Path) -> dict[str, bytes]:
    """The ``<key>.mp4`` samples of a tar shard, in order."""
    with tarfile.open(shard) as tar:
        return {m.name.removesuffix(".mp4"): tar.extractfile(m).read() for m in tar if m.isfile()}


def test_a_cut_shard_is_named_with_its_readable_samples(two_shards: Path) -> None:
    # Before: tarfile.ReadError ("unexpected end of data") out of the preflight, with no shard named.
    size = cut_inside_sample(two_shards / "train1.tar", 7)
    assert _preflight(two_shards, 0.2, samples=0) != []  # the shard check costs a stat: it always runs
    problems = _preflight(two_shards, max_skip_fraction=0.2)
    (line,) = [p for p in problems if "train1.tar" in p]
    assert line.startswith(f"train1.tar: damaged tar shard: the file ends at byte {size}, but its index (.tar.idx)")
    assert "7 of 10 samples readable" in line and "python -m data_tools make-shards" in line
    assert "training skips the 3 lost samples" in line
    damage = indexed_damage(two_shards / "train1.tar")
    assert (damage.readable, damage.total, damage.lost) == (7, 10, 3)
    assert indexed_damage(two_shards / "train0.tar") is None


def test_more_loss_than_the_skip_budget_is_refused_in_one_line(two_shards: Path) -> None:
    cut_inside_sample(two_shards / "train1.tar", 2)
    with pytest.raises(DataError) as err:
        _preflight(two_shards, max_skip_fraction=0.2)
    message = str(err.value)
    assert "\n" not in message
    assert "8 of 20 training samples are lost in damaged tar shards, more than data.max_skip_fraction=0.2" in message
    assert "train1.tar: damaged tar shard" in message and "2 of 10 samples readable" in message
    assert "make-shards" in message


def test_an_emptied_shard_is_named_not_raised(two_shards: Path) -> None:
    (two_shards / "train1.tar").write_bytes(b"")
    problems = _preflight(two_shards, max_skip_fraction=0.6, samples=20)
    assert any(p.startswith("train1.tar: damaged tar shard: the file ends at byte 0") for p in problems)
    assert any(p.startswith("train1.tar: damaged tar shard (ReadError: empty file)") for p in problems)


def test_a_replaced_shard_is_refused_in_one_line(two_shards: Path) -> None:
    # Before: no word, or a "cut short" warning when the new shard was smaller; energon then read the bytes where
    # the old index put its samples.
    rewrite_shard(two_shards / "train1.tar", other_videos(10, first_seed=100))
    with pytest.raises(DataError) as err:
        _preflight(two_shards, max_skip_fraction=1.0, samples=0)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"data.path={two_shards}: train1.tar: tar shard changed since it was prepared: sample")
    assert message.endswith(f"Run python -m data_tools prepare {two_shards} again")
    assert index_change(two_shards / "train0.tar") is None


def test_shards_rewritten_with_more_samples_are_refused(two_shards: Path) -> None:
    # Before: accepted without a word, and training read the first 10 samples of each 30.
    for n, shard in enumerate(("train0.tar", "train1.tar")):
        rewrite_shard(two_shards / shard, shard_videos(two_shards / shard) | other_videos(20, first_seed=100 + 20 * n))
    with pytest.raises(DataError) as err:
        _preflight(two_shards, max_skip_fraction=0.2, samples=0)
    message = str(err.value)
    assert "\n" not in message and "train0.tar: tar shard changed since it was prepared: it holds n100.mp4" in message
    assert "after the 10 samples its index lists" in message and "(1 more shards changed: train1.tar)" in message
    # A cut shard is not a changed one: its whole samples are where its index says.
    cut_inside_sample(two_shards / "train0.tar", 4)
    change = index_change(two_shards / "train0.tar", every_sample=True)
    assert change is None and indexed_damage(two_shards / "train0.tar").readable == 4


def test_member_scan_stops_at_the_cut_and_says_where(two_shards: Path) -> None:
    shard = two_shards / "train1.tar"
    whole = [member.name for member, _ in MemberScan(shard)]
    assert len(whole) == 10
    cut_inside_sample(shard, 6)
    scan = MemberScan(shard, total=10)
    assert [member.name for member, _ in scan] == whole[:6]
    assert scan.damage is not None and scan.damage.readable == 6
    assert scan.damage.detail.startswith("the file ends at byte") and whole[6] in scan.damage.detail
    assert "6 of 10 samples readable" in scan.damage.message()
    # cut exactly between two samples: tarfile ends quietly; the missing end marker tells
    with open(shard, "r+b") as f:
        f.truncate(index_offsets(shard)[5])
    scan = MemberScan(shard)
    assert [member.name for member, _ in scan] == whole[:5]
    assert scan.damage is not None and "without tar's end marker" in scan.damage.detail
    assert "how many are lost is unknown" in scan.damage.message()
    # a whole shard ends with the marker: no damage
    scan = MemberScan(two_shards / "train0.tar")
    assert len(list(scan)) == 10 and scan.damage is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the decoder may well work")
@pytest.mark.parametrize("workers", [0, 2])
def test_gpu_decoding_without_a_gpu_is_refused_in_one_line(two_shards: Path, workers: int) -> None:
    from tokenizer_posttrain.data.preflight import check_gpu_decoding

    # Without a video decoder it fails in the training process already, whether or not workers would decode.
    pattern = r"^data\.decode=gpu: \S+ could not be decoded on the GPU \(.+\); .*data\.decode=cpu$"
    with pytest.raises(DataError, match=pattern):
        check_gpu_decoding(two_shards, workers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the decoder may well work")
def test_the_forked_gpu_check_reports_the_workers_error(two_shards: Path) -> None:
    # The worker-side half of the check: the forked process decodes and sends back why it could not.
    from tokenizer_posttrain.data.preflight import _first_frame_problem, _forked_first_frame_problem

    with tarfile.open(two_shards / "train0.tar") as tar:
        member = next(m for m in tar if m.name.endswith(".mp4"))
        video = tar.extractfile(member).read()
    forked = _forked_first_frame_problem(video)
    assert forked and forked == _first_frame_problem(video)


def test_a_prefetch_that_overflows_shared_memory_is_refused_with_what_fits(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    # 2 processes x 3 workers x 4 batches, plus the one each process reads: 26 batches of free / 20 bytes.
    with pytest.raises(DataError) as err:
        loader_prefetch(free // 20, num_workers=3, prefetch=4, processes=2, folder=tmp_path)
    message = str(err.value)
    assert "data.prefetch=4 x data.num_workers=3 x 2 process(es)" in message and "26 batches" in message
    assert str(tmp_path) in message and "--shm-size" in message and "data.prefetch=3 fits" in message  # 20 of 20
    with pytest.raises(DataError, match="lower data.num_workers or data.micro_batch_size"):
        loader_prefetch(free // 2, num_workers=2, prefetch=None, folder=tmp_path)  # 3 batches even at 1


def test_a_huge_prefetch_is_refused_at_once(tmp_path: Path) -> None:
    # Before: data.prefetch=1000000000 hung the launch, trying every smaller value in turn to find what fits.
    import threading

    free = shutil.disk_usage(tmp_path).free
    raised: list[DataError] = []

    def refuse() -> None:
        with pytest.raises(DataError) as err:
            loader_prefetch(free // 20, num_workers=3, prefetch=10**9, processes=2, folder=tmp_path)
        raised.append(err.value)

    worker = threading.Thread(target=refuse, daemon=True)  # a hang must fail the test, not stall the suite
    worker.start()
    worker.join(timeout=10)  # the old scan took minutes; 10 s leaves room for a loaded machine
    assert not worker.is_alive() and len(raised) == 1
    message = str(raised[0])
    assert "\n" not in message and "data.prefetch=1000000000 x data.num_workers=3" in message
    assert "data.prefetch=3 fits" in message  # 2 x 3 x 3 + 2 = 20 of the 20 batches that fit


def test_the_default_prefetch_gives_way_to_short_shared_memory_with_a_warning(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    assert loader_prefetch(free // 40, num_workers=2, prefetch=None, folder=tmp_path) == PREFETCH == 6  # 13 of 40
    with pytest.warns(UserWarning, match=r"data\.prefetch lowered to 3, which may starve the GPU"):
        assert loader_prefetch(free // 8, num_workers=2, prefetch=None, folder=tmp_path) == 3  # 7 of 8
    assert loader_prefetch(free // 40, num_workers=2, prefetch=2, folder=tmp_path) == 2  # asked for, fits
    assert loader_prefetch(free, num_workers=0, prefetch=None, folder=tmp_path) == PREFETCH  # nothing in flight
    assert loader_prefetch(free * 10, num_workers=2, prefetch=4, folder=tmp_path / "absent") == 4  # no such folder
