"""The model card written beside exported files."""

from __future__ import annotations

from pathlib import Path

from tokenizer_posttrain.io.model_card import card_title, model_card


def test_the_verdict_heads_the_card() -> None:
    results = {"metrics": {"psnr": 5.92}, "baseline_metrics": {"psnr": 6.34}}
    line = "WORSE than the base: PSNR 6.34 -> 5.92 dB (-0.420 dB) on 4 held-out clips"
    card = model_card(Path("last.ckpt"), {"model": "CV8x8x8"}, results, ema=False, verdict=line)
    assert card.splitlines()[:3] == ["# CV8x8x8 (post-trained)", "", f"**Verdict: {line}.**"]
    assert "| psnr | 6.34 | 5.92 |" in card
    assert "Verdict" not in model_card(Path("last.ckpt"), {"model": "CV8x8x8"}, results, ema=False)


def test_a_test_size_model_is_not_titled_as_the_released_one() -> None:
    # Before: "# Cosmos-1.0-Tokenizer-CV8x8x8 (post-trained)" for a width-16 model.
    assert card_title("Cosmos-1.0-Tokenizer-CV8x8x8", 16) == (
        "CV8x8x8 architecture at width 16 (post-trained; not the released Cosmos-1.0-Tokenizer-CV8x8x8, which has "
        "width 128)"
    )
    assert card_title("Cosmos-1.0-Tokenizer-CV8x8x8", 128) == "Cosmos-1.0-Tokenizer-CV8x8x8 (post-trained)"
    assert card_title("Cosmos-1.0-Tokenizer-DV8x16x16", None) == "Cosmos-1.0-Tokenizer-DV8x16x16 (post-trained)"


def test_metrics_are_rounded_and_the_run_is_described() -> None:
    hp = {
        "model": {"model": "Cosmos-1.0-Tokenizer-CV8x8x8", "channels": 16, "jit_ckpt_pth": "/ckpts/base"},
        "data": {"path": "/data/v", "frames": 17, "height": 64, "width": 64},
        "optim": {"lr": 0.001, "schedule": "cosine", "warmup_steps": 2},
    }
    info = {"model": "Cosmos-1.0-Tokenizer-CV8x8x8", "global_step": 40, "hyper_parameters": hp}
    results = {
        "metrics": {"psnr": 13.651138305664062, "ssim": 0.23331234, "lpips": None},
        "baseline_metrics": {"psnr": 12.146031379699707, "ssim": 0.16061},
        "comparison": {"latent_drift": 0.34312345},
        "drift_limit": 0.05,
        "n_clips": 8,
        "n_videos": 1,
    }
    drift = "latent drift 0.343 is above the limit 0.05: ..."
    card = model_card(Path("last.ckpt"), info, results, ema=False, drift=drift)
    assert card.startswith("# CV8x8x8 architecture at width 16 (post-trained; not the released")
    assert f"**Warning: {drift}.**" in card
    assert "| psnr | 12.15 | 13.65 |" in card and "| ssim | 0.1606 | 0.2333 |" in card
    assert "13.651138305664062" not in card
    assert "| steps | 40 |" in card and "| learning rate | 0.001 (cosine schedule, 2 warmup steps) |" in card
    assert "| latent drift (limit 0.05) | - | 0.3431 |" in card and "On 8 held-out clips of 1 video." in card


def test_the_latent_statistics_row_says_what_the_export_normalizes_with() -> None:
    kept = "the encoder did not train: the base's 16 per-channel latent constants ... stay exact (nothing measured)"
    card = model_card(Path("run/last.ckpt"), {"model": "Wan2.1-VAE"}, None, ema=False, latent_stats=kept)
    assert f"| latent statistics | {kept} |" in card
    assert "latent statistics" not in model_card(Path("run/last.ckpt"), {"model": "Wan2.1-VAE"}, None, ema=False)
