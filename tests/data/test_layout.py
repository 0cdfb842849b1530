"""Reading a dataset's split layout from .nv-meta/split.yaml without energon."""

from __future__ import annotations

from pathlib import Path

from tokenizer_posttrain.data.layout import dataset_splits, split_parts


def test_unprepared_folders_have_no_splits(tmp_path: Path) -> None:
    assert split_parts(tmp_path) is None and dataset_splits(tmp_path) == set()


def test_splits_with_shards_are_listed(tmp_path: Path) -> None:
    (tmp_path / ".nv-meta").mkdir()
    # The rest of what prepare writes: split_parts checks a prepared folder whole.
    (tmp_path / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    (tmp_path / ".nv-meta" / ".info.json").write_text('{"shard_counts": {"000000.tar": 1}}')
    (tmp_path / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train: ['{000000..000002}.tar']\n  val: ['000003.tar']\n  test: []\n"
    )
    assert split_parts(tmp_path)["train"] == ["{000000..000002}.tar"]
    assert dataset_splits(tmp_path) == {"train", "val"}


def test_a_changed_shard_is_told_in_one_line_whatever_its_member_names() -> None:
    from tokenizer_posttrain.data.shard_check import ShardChange

    message = ShardChange("train0.tar", "it holds " + "x\n" * 500 + " and more").message("/data")
    assert "\n" not in message and len(message) < 500 and message.startswith("train0.tar: tar shard changed")
