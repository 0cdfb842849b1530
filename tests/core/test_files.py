"""Atomic writes: the target holds the old file or the new one, never half of one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tokenizer_posttrain.core.files import atomic_path, new_file_mode, temporary_path


def test_the_content_appears_under_the_name_only_when_complete(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "last.ckpt"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path / "sub" and tmp.name.startswith(".last.ckpt.") and tmp.name.endswith(".tmp")
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


def test_the_suffix_can_stay_last_for_writers_that_read_it(tmp_path: Path) -> None:
    kept = temporary_path(tmp_path / "clip.mp4", keep_suffix=True)
    assert kept.name.startswith(".clip.") and kept.name.endswith(".tmp.mp4") and kept.is_file()
    plain = temporary_path(tmp_path / "clip.mp4")
    assert plain.name.startswith(".clip.mp4.") and plain.name.endswith(".tmp") and plain != kept


def test_a_link_planted_at_the_old_fixed_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    # Others can write to a shared run folder: a link at a predictable temporary name would have made the
    # checkpoint save overwrite whatever it points at.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / ".last.ckpt.tmp").symlink_to(victim)
    with atomic_path(ckpts / "last.ckpt") as tmp:
        assert not tmp.is_symlink()
        tmp.write_text("checkpoint")
    assert victim.read_text() == "keep me" and (ckpts / "last.ckpt").read_text() == "checkpoint"
    assert len({temporary_path(ckpts / "last.ckpt") for _ in range(5)}) == 5  # unpredictable, never reused


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_written_file_gets_the_mode_the_umask_gives_a_new_file(tmp_path: Path, umask: int, mode: int) -> None:
    # Before: every atomic write kept mkstemp's 0600, so on a shared cluster nobody else could load an export.
    previous = os.umask(umask)
    try:
        assert new_file_mode() == mode
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            tmp.write_text("weights")
            assert stat.S_IMODE(tmp.stat().st_mode) == 0o600  # private while partial
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == mode


def test_every_file_of_an_export_is_readable_by_the_team(tmp_path: Path) -> None:
    from tokenizer_posttrain.io.export import export_tokenizer
    from tokenizer_posttrain.network import build_tokenizer

    previous = os.umask(0o022)
    try:
        export_tokenizer(build_tokenizer("CV8x8x8", channels=8), tmp_path / "export")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "export").iterdir()}
    assert len(modes) == 5 and set(modes.values()) == {0o644}, modes
