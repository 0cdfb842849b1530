"""Unit tests of the pure parts of data_tools: sizes, keys, splits, shard patterns, discovery."""

from __future__ import annotations

import re
from pathlib import Path

import braceexpand
import pytest

from data_tools.prepare import split_pattern
from data_tools.shards import tar_file_size, tar_member_size
from data_tools.sources import assign_keys, assign_splits, base_key, find_videos, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("500MB", 500 * 10**6), ("1GB", 10**9), ("2GiB", 2 * 2**30), ("123456", 123456), ("1.5 gb", 1_500_000_000)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "1XB", "-5MB", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_base_key_has_no_dot_or_slash() -> None:
    assert base_key("a.mp4") == "a"
    assert base_key("Sub Dir/take.01.MP4") == "Sub_Dir__take_01"
    assert base_key("x/y/z.mkv") == "x__y__z"
    assert base_key("noext") == "noext"
    for rel in ["..hidden.mp4", "a/.b/c.d.e.mp4", "ünïcode name.mp4", "(1).mp4"]:
        key = base_key(rel)
        assert key and re.fullmatch(r"[A-Za-z0-9_-]+", key), (rel, key)


def test_assign_keys_unique_and_stable() -> None:
    rels = ["a b.mp4", "a_b.mp4", "clip.mp4", "clip.mkv", "d/e.mp4"]
    keys = assign_keys(rels, set())
    assert len(set(keys.values())) == len(rels)
    assert keys["a b.mp4"] == "a_b" and keys["clip.mp4"] == "clip" and keys["d/e.mp4"] == "d__e"
    assert keys["a_b.mp4"].startswith("a_b-") and keys["clip.mkv"].startswith("clip-")
    # a later run never reuses a taken key, and the clash suffix depends on the path only
    later = assign_keys(["clip.avi"], set(keys.values()))
    assert later["clip.avi"] not in keys.values()
    assert assign_keys(["a_b.mp4"], {"a_b"}) == {"a_b.mp4": keys["a_b.mp4"]}


def test_assign_splits() -> None:
    keys = [f"video{i}" for i in range(200)]
    splits = assign_splits(keys, {}, 0.1, seed=0)
    assert splits == assign_splits(keys, {}, 0.1, seed=0)  # deterministic
    assert 5 <= sum(s == "val" for s in splits.values()) <= 40
    assert splits != assign_splits(keys, {}, 0.1, seed=1)
    assert set(assign_splits(keys, {}, 0.0, seed=0).values()) == {"train"}


def test_assign_splits_minimums() -> None:
    # a tiny fraction still gives one val video once there are two videos, and never all val
    assert sorted(assign_splits(["a", "b"], {}, 0.001, 0).values()) == ["train", "val"]
    assert assign_splits(["only"], {}, 0.5, 0) == {"only": "train"}
    assert sorted(assign_splits(["a", "b", "c"], {}, 0.999, 0).values()).count("train") >= 1
    # old videos keep their split; a new one becomes val only when no val exists yet
    assert assign_splits(["b"], {"a": "train"}, 0.001, 0) == {"b": "val"}
    assert assign_splits(["c"], {"a": "train", "b": "val"}, 0.001, 0) == {"c": "train"}


def _matches(pattern: str, name: str) -> bool:
    # what energon does with a --split-parts pattern: brace-expand, then regex-match each
    return any(re.match(p, name) for p in braceexpand.braceexpand(pattern))


@pytest.mark.parametrize(
    "chosen",
    [
        ["000000.tar"],
        ["000000.tar", "000001.tar", "000002.tar", "000005.tar", "000007.tar", "000008.tar"],
        ["a.tar", "sub dir/b+c.tar", "w{1},x.tar", "x(1).tar"],
    ],
)
def test_split_pattern_matches_exactly(chosen: list[str]) -> None:
    universe = chosen + ["000003.tar", "000010.tar", "0000001.tar", "aXtar.tar", "a_tar.tar", "b+c.tar", "y.tar"]
    pattern = split_pattern(chosen)
    assert {n for n in universe if _matches(pattern, n)} == set(chosen)


def test_split_pattern_is_short_for_many_shards() -> None:
    names = [f"{i:06d}.tar" for i in range(10000) if i % 1000 != 7]
    assert len(split_pattern(names)) < 400


def test_tar_sizes() -> None:
    assert tar_member_size(1, "a.mp4") == 1024
    assert tar_member_size(512, "a.mp4") == 1024
    assert tar_member_size(513, "a.mp4") == 1536
    assert tar_file_size(0) == 10240
    assert tar_file_size(10240) == 20480


def test_find_videos(tmp_path: Path) -> None:
    for rel in ["b.MP4", "a/c.mkv", "a/d.Webm", "e.avi", "f.mov", "g.m4v", "notes.txt", ".hidden/h.mp4", "out/i.mp4"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    found = [p.relative_to(tmp_path).as_posix() for p in find_videos(tmp_path, exclude=tmp_path / "out")]
    assert found == ["a/c.mkv", "a/d.Webm", "b.MP4", "e.avi", "f.mov", "g.m4v"]
