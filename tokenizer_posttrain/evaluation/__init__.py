"""Layer 3, judging a tokenizer: whole videos through it in windows and tiles (:mod:`.inference`), the metrics
(:mod:`.metrics`), a dataset's clips in one pass (:mod:`.clips`), held-out evaluation against a baseline
(:mod:`.evaluate`) and its report (:mod:`.report`), the latents' statistics (:mod:`.latent_stats`,
:mod:`.latent_shift`), and video tensors made viewable (:mod:`.media`). Training's validation uses the same
metrics."""
