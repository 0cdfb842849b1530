"""transcode keeps what decides how a video is shown: here, the display matrix of a phone video."""

from __future__ import annotations

from pathlib import Path

from data_tools.transcode import transcode
from tests.videos import encode_video
from tokenizer_posttrain.data.orientation import Orientation
from tokenizer_posttrain.data.probe import probe_video


def test_the_display_matrix_survives_a_transcode(tmp_path: Path) -> None:
    # Before: the re-encoded mp4 had no matrix, so a portrait phone clip trained sideways.
    source = tmp_path / "phone.mkv"
    source.write_bytes(encode_video(12, 32, 48, container="matroska", rotation=-90))
    assert transcode(source, tmp_path / "out.mp4") == 12
    info = probe_video(tmp_path / "out.mp4")
    assert info.orientation == Orientation(quarter_turns=3) and info.display_size() == (32, 48)
    plain = tmp_path / "plain.mkv"
    plain.write_bytes(encode_video(12, 32, 48, container="matroska"))
    transcode(plain, tmp_path / "plain.mp4")
    assert probe_video(tmp_path / "plain.mp4").display_matrix is None
