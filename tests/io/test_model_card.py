"""The model card written beside exported files."""

from __future__ import annotations

from pathlib import Path

from tokenizer_posttrain.io.model_card import model_card


def test_the_verdict_heads_the_card() -> None:
    results = {"metrics": {"psnr": 5.92}, "baseline_metrics": {"psnr": 6.34}}
    line = "WORSE than the base: PSNR 6.34 -> 5.92 dB (-0.420 dB) on 4 held-out clips"
    card = model_card(Path("last.ckpt"), {"model": "CV8x8x8"}, results, ema=False, verdict=line)
    assert card.splitlines()[:3] == ["# CV8x8x8 (post-trained)", "", f"**Verdict: {line}.**"]
    assert "| psnr | 6.34 | 5.92 |" in card
    assert "Verdict" not in model_card(Path("last.ckpt"), {"model": "CV8x8x8"}, results, ema=False)
