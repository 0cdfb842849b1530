"""Layer 3, judging a tokenizer: whole videos through it in windows and tiles (:mod:`.inference`), the metrics
(:mod:`.metrics`), held-out evaluation against a baseline (:mod:`.evaluate`) and its report (:mod:`.report`),
and video tensors made viewable (:mod:`.media`). Training's validation uses the same metrics."""
