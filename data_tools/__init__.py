"""Turn a folder of videos into a megatron-energon dataset, and check a dataset before training.

Run ``python -m data_tools --help`` from the repository root for the commands.
"""
