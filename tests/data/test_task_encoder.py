"""The energon TaskEncoder on real small mp4 shards: shapes, range, random crops, skips."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tarfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import webdataset
from megatron.energon.av import AVDecoder, AVWebdatasetDecoder
from megatron.energon.tools.prepare import command

from tests.videos import cut_inside_sample, encode_video, write_energon_dataset
from tokenizer_posttrain.data.batch import ASPECT_RATIO, KEYS, LOSS_MASK, SKIPPED, VIDEO
from tokenizer_posttrain.data.clip_decode import Box, ClipReader
from tokenizer_posttrain.data.energon import EnergonVideoDataModule
from tokenizer_posttrain.data.task_encoder import ClipSpec, VideoOnlyDecoder, nearest_bucket


def position_video(frames: int, height: int, width: int, gop: int | None = None) -> bytes:
    """Frame t is grey level 4t in channel R; G ramps with x, B with y: a crop's origin is readable.
    ``gop``: a keyframe exactly every ``gop`` frames (none at scene cuts)."""
    buf = io.BytesIO()
    options = {"crf": "0"}
    if gop:
        options.update({"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"})
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(10), options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        y, x = np.mgrid[0:height, 0:width]
        for t in range(frames):
            img = np.stack([np.full_like(x, 4 * t), 2 * x, 2 * y], axis=-1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def batches(path: Path, spec: ClipSpec, n: int, micro_batch_size: int = 1, seed: int = 0, workers: int = 0) -> list:
    dm = EnergonVideoDataModule(
        str(path),
        spec,
        micro_batch_size=micro_batch_size,
        num_workers=workers,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        seed=seed,
    )
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def position_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    video = position_video(25, 48, 64)
    # several samples: energon gives every loader worker a share and needs one for each
    return write_energon_dataset(
        tmp_path_factory.mktemp("pos"), {f"pos{i}": video for i in range(4)}, {"posval": video}
    )


def test_clip_shape_dtype_range_and_keys(position_dataset: Path) -> None:
    (batch,) = batches(position_dataset, ClipSpec(frames=9, height=32, width=32), 1, micro_batch_size=2)
    assert batch[VIDEO].shape == (2, 3, 9, 32, 32) and batch[VIDEO].dtype == torch.bfloat16
    assert batch[VIDEO].min() >= -1 and batch[VIDEO].max() <= 1
    assert batch[LOSS_MASK].shape == (2, 1, 9, 32, 32) and bool((batch[LOSS_MASK] == 1).all())
    assert (
        batch[ASPECT_RATIO].tolist() == [1.0, 1.0]
        and all(k.startswith("pos") for k in batch[KEYS])
        and batch[SKIPPED] == []
    )


def _origin(clip: torch.Tensor) -> tuple[int, int, int]:
    """(start frame, top, left) of a crop of :func:`position_video`."""
    u8 = ((clip.float() + 1) * 127.5).round()
    return round(float(u8[0, 0].mean()) / 4), round(float(u8[2, 0, 0, 0]) / 2), round(float(u8[1, 0, 0, 0]) / 2)


def test_crops_are_uniformly_random_and_cover_the_clip(position_dataset: Path) -> None:
    spec = ClipSpec(frames=9, height=32, width=32)
    origins = [_origin(b[VIDEO][0]) for b in batches(position_dataset, spec, 120)]
    starts, tops, lefts = zip(*origins, strict=False)
    # every start 0..16, every top 0..16 and left 0..32 is allowed; both ends are reached
    assert min(starts) == 0 and max(starts) == 25 - 9
    assert min(tops) == 0 and max(tops) == 48 - 32
    assert min(lefts) == 0 and max(lefts) == 64 - 32
    assert len(set(origins)) > 100  # not a handful of fixed crops
    # the decoded frames are the consecutive frames from the start
    clip = batches(position_dataset, spec, 1)[0][VIDEO][0]
    grey = ((clip[0, :, 0, 0].float() + 1) * 127.5 / 4).round().tolist()
    assert grey == [grey[0] + i for i in range(9)]


def test_crops_of_one_decode_share_its_frames_and_draw_their_own_places(position_dataset: Path) -> None:
    spec = ClipSpec(frames=9, height=16, width=16, crops_per_decode=3, hflip=True)
    drawn = batches(position_dataset, spec, 8, micro_batch_size=3)
    origins, flipped = [], []
    for batch in drawn:  # one decode per micro-batch of 3: one video, one start, the places their own
        assert batch[VIDEO].shape == (3, 3, 9, 16, 16) and batch[LOSS_MASK].shape == (3, 1, 9, 16, 16)
        assert len(set(batch[KEYS])) == 1 and batch[ASPECT_RATIO].tolist() == [1.0] * 3
        clips = [clip.flip(-1) if _flipped(clip) else clip for clip in batch[VIDEO]]
        assert len({_origin(clip)[0] for clip in clips}) == 1
        origins += [_origin(clip) for clip in clips]
        flipped += [_flipped(clip) for clip in batch[VIDEO]]
    assert len({origin[1:] for origin in origins}) > 8
    assert len({origin[0] for origin in origins}) > 2
    assert 0 < sum(flipped) < len(flipped)  # a flip of its own too
    # Validation still takes one centre crop per video, a full micro-batch of videos.
    (val,) = list(EnergonVideoDataModule(str(position_dataset), spec, 3, 0).val_dataloader())
    assert val[VIDEO].shape[0] == 1
    with pytest.raises(ValueError, match="micro_batch_size=2 must be a multiple of crops_per_decode=3"):
        EnergonVideoDataModule(str(position_dataset), spec, 2, 0)


def _flipped(clip: torch.Tensor) -> bool:
    """Whether a crop of :func:`position_video` is mirrored (G, which ramps with x, falls)."""
    return bool(clip[1, 0, 0, 0] > clip[1, 0, 0, -1])


def test_one_crop_per_decode_is_the_stream_there_was_before(position_dataset: Path) -> None:
    spec = ClipSpec(frames=9, height=16, width=16, hflip=True)
    explicit = ClipSpec(frames=9, height=16, width=16, hflip=True, crops_per_decode=1)
    for a, b in zip(batches(position_dataset, spec, 6), batches(position_dataset, explicit, 6), strict=True):
        assert torch.equal(a[VIDEO], b[VIDEO])
    with pytest.raises(ValueError, match="crops_per_decode=0 must be an integer >= 1"):
        ClipSpec(crops_per_decode=0)


def test_keyframe_starts_begin_at_or_just_after_a_keyframe(tmp_path: Path) -> None:
    # Keyframes at 0, 8, 16, 24 of 25 frames; clips of 9 start at most at 16, so 24 is too late for one.
    video = position_video(25, 48, 64, gop=8)
    dataset = write_energon_dataset(tmp_path, {f"kf{i}": video for i in range(4)}, {"kfval": video})
    spec = ClipSpec(frames=9, height=32, width=32, start="keyframe", keyframe_window=2)
    clips = [b[VIDEO][0] for b in batches(dataset, spec, 60)]
    starts = {_origin(clip)[0] for clip in clips}
    assert starts <= {0, 1, 2, 8, 9, 10, 16} and {0, 8, 16} <= starts
    grey = ((clips[0][0, :, 0, 0].float() + 1) * 127.5 / 4).round().tolist()
    assert grey == [grey[0] + i for i in range(9)]  # still the consecutive frames from the start


def test_same_seed_same_stream_other_seed_other_crops(position_dataset: Path) -> None:
    spec = ClipSpec(frames=9, height=32, width=32, hflip=True)
    a = [b[VIDEO] for b in batches(position_dataset, spec, 6, seed=1)]
    b = [b[VIDEO] for b in batches(position_dataset, spec, 6, seed=1)]
    c = [b[VIDEO] for b in batches(position_dataset, spec, 6, seed=2)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=False))


def test_validation_is_the_deterministic_centre(position_dataset: Path) -> None:
    dm = EnergonVideoDataModule(
        str(position_dataset), ClipSpec(frames=9, height=32, width=32), micro_batch_size=1, num_workers=0
    )
    assert dm.has_validation
    clip = next(iter(dm.val_dataloader()))[VIDEO][0]
    assert _origin(clip) == ((25 - 9) // 2, (48 - 32) // 2, (64 - 32) // 2)


def test_resize_short_side_happens_while_decoding(position_dataset: Path) -> None:
    (batch,) = batches(position_dataset, ClipSpec(frames=9, height=24, width=24, resize_short_side=24), 1)
    assert batch[VIDEO].shape == (1, 3, 9, 24, 24)
    u8 = (batch[VIDEO][0].float() + 1) * 127.5
    # a 48x64 frame scaled to 24x32 doubles the ramps' slopes: neighbours differ by ~4 levels
    assert float((u8[1, 0, 0, 1:] - u8[1, 0, 0, :-1]).mean()) == pytest.approx(4, abs=0.6)


def test_aspect_buckets(tmp_path: Path) -> None:
    spec = ClipSpec(frames=9, height=64, width=64, aspect_buckets=True)
    assert spec.bucket_size("1:1") == (64, 64)
    h, w = spec.bucket_size("16:9")
    assert (h % 16, w % 16) == (0, 0) and abs(h * w - 64 * 64) <= 0.15 * 64 * 64 and w > h
    assert nearest_bucket(1280, 720) == "16:9" and nearest_bucket(720, 1280) == "9:16"
    assert nearest_bucket(640, 480) == "4:3" and nearest_bucket(100, 100) == "1:1"
    wide, tall = encode_video(12, 72, 128, seed=1), encode_video(12, 128, 72, seed=2)
    data = write_energon_dataset(tmp_path / "b", {f"w{i}": wide for i in range(3)} | {f"t{i}": tall for i in range(3)})
    for batch in batches(data, spec, 6, micro_batch_size=2):
        ratios = batch[ASPECT_RATIO].tolist()
        assert len(set(ratios)) == 1  # one bucket per batch
        assert batch[VIDEO].shape[-1] / batch[VIDEO].shape[-2] == pytest.approx(ratios[0])
        assert ratios[0] > 1.5 if batch[KEYS][0].startswith("w") else ratios[0] < 0.67


def test_unusable_videos_are_skipped_and_named(tmp_path: Path) -> None:
    good = encode_video(20, 48, 64, seed=0)
    data = write_energon_dataset(
        tmp_path / "bad",
        {
            "good": good,
            "corrupt": good[: len(good) // 3],
            "short": encode_video(5, 48, 64),
            "small": encode_video(20, 16, 16),
            "noise": b"not a video" * 50,
        },
    )
    skipped: list[str] = []
    for batch in batches(data, ClipSpec(frames=9, height=32, width=32), 3):
        assert batch[KEYS] == ["good"]
        skipped += batch[SKIPPED]
    for key, reason in (
        ("corrupt", "unreadable"),
        ("short", "5 frames, fewer than the 9"),
        ("small", "16x16 are smaller than the 32x32 crop"),
        ("noise", "unreadable"),
    ):
        assert any(s.startswith(f"train.tar:{key}: ") and reason in s for s in skipped), (key, skipped)


def _rss_mb() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_host_memory_stays_flat_while_decoding(position_dataset: Path) -> None:
    # PyAV containers left open leak native memory clip after clip; ours are always closed.
    dm = EnergonVideoDataModule(
        str(position_dataset), ClipSpec(frames=9, height=32, width=32), micro_batch_size=1, num_workers=0
    )
    it = iter(dm.train_dataloader())
    for _ in range(40):
        next(it)
    before = _rss_mb()
    for _ in range(200):
        next(it)
    assert _rss_mb() - before < 20


@pytest.fixture
def cut_dataset(tmp_path: Path) -> Path:
    videos = {f"v{i}": encode_video(12, 48, 64, seed=i) for i in range(10)}
    data = write_energon_dataset(tmp_path / "cut", videos)
    cut_inside_sample(data / "train.tar", 4)
    return data


def test_a_cut_shard_is_skipped_from_the_cut_on_and_named(cut_dataset: Path) -> None:
    # Before: tarfile.ReadError out of energon's reader, and the stream ended.
    found = batches(cut_dataset, ClipSpec(frames=9, height=32, width=32), 12)
    assert {k for b in found for k in b[KEYS]} == {"v0", "v1", "v2", "v3"}
    skipped = [s for b in found for s in b[SKIPPED]]
    first = skipped[0]
    assert first.startswith("train.tar: damaged tar shard (ReadError: ")
    assert "sample 5 of 10 cannot be read, so samples 5 to 10 of it are skipped" in first
    assert "python -m data_tools make-shards" in first
    # the rest of the shard is skipped without reading it again, each sample counted, every pass
    later = "in the damaged part of its tar shard (from sample 5 on)"
    assert skipped[1:6] == [f"train.tar#{n}: {later}" for n in range(6, 11)]
    assert skipped[6:] == [f"train.tar#{n}: {later}" for n in range(5, 11)]


def test_a_worker_left_with_nothing_but_damage_fails_in_one_line(cut_dataset: Path) -> None:
    from tokenizer_posttrain.core.errors import DataError

    # Two workers: the second one's share (samples 6 to 10) lies wholly after the cut.
    with pytest.raises(DataError) as err:
        batches(cut_dataset, ClipSpec(frames=9, height=32, width=32), 6, workers=2)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    assert "damaged part of tar shards (train.tar)" in message and "make-shards" in message


def test_turned_videos_are_bucketed_as_displayed(tmp_path: Path) -> None:
    # Stored landscape, displayed portrait (a phone held upright): the 9:16 bucket, not 16:9.
    spec = ClipSpec(frames=9, height=64, width=64, aspect_buckets=True)
    portrait = encode_video(12, 72, 128, rotation=-90)
    data = write_energon_dataset(tmp_path / "turned", {f"p{i}": portrait for i in range(2)})
    for batch in batches(data, spec, 2):
        assert batch[ASPECT_RATIO].tolist()[0] < 0.67
        assert batch[VIDEO].shape[-2] > batch[VIDEO].shape[-1]


def test_a_clip_spec_refuses_an_unknown_start() -> None:
    with pytest.raises(ValueError, match="ClipSpec.start='keyframes' must be one of uniform, keyframe"):
        ClipSpec(start="keyframes")
    with pytest.raises(ValueError, match="keyframe_window=-1"):
        ClipSpec(start="keyframe", keyframe_window=-1)
    with pytest.raises(ValueError, match="ClipSpec.decode='nvdec' must be one of cpu, gpu"):
        ClipSpec(decode="nvdec")


class Planted:
    """Unpickled, it makes the folder ``marker``: the code a pickle in a shard can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.makedirs, (str(self.marker), 0o777, True))  # exist_ok: every read makes it again


def write_planted_dataset(root: Path, marker: Path, samples: int = 2) -> Path:
    """A prepared energon dataset of one train shard whose samples hold ``x<i>.mp4`` plus ``x<i>.pkl`` (a
    pickle) and ``x<i>.pth`` (``torch.save``), either of which makes ``marker`` when it is unpickled."""
    saved = io.BytesIO()
    torch.save(Planted(marker), saved)
    root.mkdir(parents=True)
    with tarfile.open(root / "000000.tar", "w") as tar:
        for i in range(samples):
            members = {
                f"x{i}.mp4": encode_video(12, 48, 64, seed=i),
                f"x{i}.pkl": pickle.dumps(Planted(marker)),
                f"x{i}.pth": saved.getvalue(),
            }
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    # energon's own command in this process, as write_energon_dataset does (a fresh process costs seconds)
    args = ["--non-interactive", "--no-progress", "--sample-type", "CrudeWebdataset", "--split-parts"]
    with contextlib.redirect_stdout(io.StringIO()):
        command.main([*args, "train:000000.tar", str(root)], prog_name="energon prepare", standalone_mode=False)
    return root


def test_pickles_in_a_shard_are_never_unpickled(tmp_path: Path) -> None:
    # Before: energon's default decoder unpickled x.pkl and torch.load-ed x.pth at every read, making the marker.
    marker = tmp_path / "marker"
    data = write_planted_dataset(tmp_path / "planted", marker)
    pickle.loads(pickle.dumps(Planted(marker)))  # the payload works: unpickled, it does make the marker
    assert marker.is_dir()
    marker.rmdir()
    found = batches(data, ClipSpec(frames=9, height=32, width=32), 4)
    assert not marker.exists()
    assert {k for b in found for k in b[KEYS]} == {"x0", "x1"} and all(b[SKIPPED] == [] for b in found)
    assert all(b[VIDEO].shape == (1, 3, 9, 32, 32) for b in found)


def _handlers(value: object, seen: set[int]) -> list[object]:
    """Every handler of a webdataset Decoder reachable from ``value``'s attributes, lists and dicts."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, webdataset.autodecode.Decoder):
        return list(value.handlers)
    if isinstance(value, dict):
        return [h for inner in value.values() for h in _handlers(inner, seen)]
    if isinstance(value, list | tuple | set):
        return [h for inner in value for h in _handlers(inner, seen)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return _handlers(vars(value), seen)
    return []


def test_the_decoder_holds_no_handler_that_unpickles(tmp_path: Path) -> None:
    # Before: SampleDecoder.__init__ built energon's default decoder into _decoder, with webdataset's gzip and basic
    # handlers (pickle.loads for .pkl/.pickle/.pyd, torch.load for .pth): unused, but its decode() reached them.
    decoder = VideoOnlyDecoder()
    handlers = _handlers(decoder, set())
    assert handlers and all(isinstance(h, AVWebdatasetDecoder) for h in handlers), handlers
    marker = tmp_path / "marker"
    raw = {"__key__": "x", "mp4": encode_video(12, 48, 64), "pkl": pickle.dumps(Planted(marker))}
    decoded = decoder(raw)
    assert isinstance(decoded["mp4"], AVDecoder) and decoded["pkl"] == raw["pkl"] and not marker.exists()
    with ClipReader(decoded["mp4"], gpu=False) as reader:  # and the video decodes as training reads it
        assert reader.read(0, 12, Box(0, 0, 48, 64)).shape == (3, 12, 48, 64)
    assert decoder.decode("x.pkl", raw["pkl"]) == raw["pkl"] and not marker.exists()
    assert decoder.config() == {
        "image_decode": "torchrgb",
        "av_decode": "AVDecoder",
        "video_decode_audio": False,
        "guess_content": False,
        "decoded_members": ["mp4"],
    }
