"""Layer 2, tokenizer files in and out: strict loading of official ``.jit`` folders, our exports and training
checkpoints (:mod:`.checkpoint`), on the file names and key layout they share (:mod:`.layout`); ``.jit`` weights
read as data, never run (:mod:`.jit_archive`), and ``config.json`` values bounded before a network is built from
them (:mod:`.config_json`); the export to the official file set (:mod:`.export`), diffusers'
``AutoencoderKLCosmos`` folders both ways (:mod:`.diffusers_format`) and the model card written beside them
(:mod:`.model_card`). The formats a user picks are entries of one table (:mod:`.formats`): a new one is an
``ExportFormat`` there (or a :func:`~.formats.register_format` call), and its test in ``tests/io``."""
