import torch
from torch.utils.data import DataLoader

from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule, SyntheticVideoDataset


def test_clips_are_deterministic_moving_and_in_range() -> None:
    ds = SyntheticVideoDataset(8, frames=9, height=32, width=48, seed=3)
    a, b = ds[5], SyntheticVideoDataset(8, frames=9, height=32, width=48, seed=3)[5]
    assert torch.equal(a[VIDEO], b[VIDEO])
    assert not torch.equal(a[VIDEO], ds[6][VIDEO])
    assert not torch.equal(a[VIDEO], SyntheticVideoDataset(8, 9, 32, 48, seed=4)[5][VIDEO])
    video = a[VIDEO]
    assert video.shape == (3, 9, 32, 48) and video.dtype == torch.bfloat16
    assert video.min() >= -1 and video.max() <= 1 and video.float().std() > 0.1
    assert (video[:, -1].float() - video[:, 0].float()).abs().mean() > 0.01  # things move
    assert a[LOSS_MASK].shape == (1, 9, 32, 48) and bool((a[LOSS_MASK] == 1).all())


def test_loaders_batch_plain_dicts_on_cpu_workers() -> None:
    dm = SyntheticVideoDataModule(frames=9, height=32, width=32, micro_batch_size=2, num_workers=2, num_train_samples=8)
    loader: DataLoader = dm.train_dataloader()
    batch = next(iter(loader))
    assert set(batch) == {VIDEO, LOSS_MASK}
    assert batch[VIDEO].shape == (2, 3, 9, 32, 32) and batch[VIDEO].device.type == "cpu"
    assert next(iter(dm.val_dataloader()))[VIDEO].shape == (2, 3, 9, 32, 32)


def test_cached_clips_are_the_same_clips_made_once() -> None:
    plain = SyntheticVideoDataset(3, frames=5, height=16, width=16, seed=4)
    cached = SyntheticVideoDataset(3, frames=5, height=16, width=16, seed=4, cache=True)
    first = cached[1][VIDEO]
    assert cached[1][VIDEO] is first  # served from memory the second time
    assert torch.equal(first, plain[1][VIDEO]) and first.dtype == torch.bfloat16
    assert not torch.equal(cached[2][VIDEO], first)
