"""Atomic writes: the target holds the old file or the new one, never half of one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenizer_posttrain.core.files import atomic_path, temporary_path


def test_the_content_appears_under_the_name_only_when_complete(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "last.ckpt"
    with atomic_path(target) as tmp:
        assert tmp == tmp_path / "sub" / ".last.ckpt.tmp" and tmp.parent.is_dir()
        tmp.write_text("new")
        assert not target.exists()
    assert target.read_text() == "new" and not tmp.exists()


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    target.write_text("old")
    with pytest.raises(OSError, match="disk full"), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert target.read_text() == "old" and not list(tmp_path.glob(".*"))


def test_the_suffix_can_stay_last_for_writers_that_read_it() -> None:
    assert temporary_path(Path("out/clip.mp4"), keep_suffix=True) == Path("out/.clip.tmp.mp4")
    assert temporary_path(Path("out/clip.mp4")) == Path("out/.clip.mp4.tmp")
