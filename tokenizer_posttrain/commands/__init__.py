"""Layer 6, the command lines: ``python -m tokenizer_posttrain COMMAND`` (export, evaluate, reconstruct,
encode, decode, posttrain) and the NeMo-Run entry behind ``train_tokenizer.py`` (:mod:`.train_cli`). Every
command maps its failures to exit codes the same way (:mod:`.guard`)."""
