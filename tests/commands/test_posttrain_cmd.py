"""The posttrain command: its options are the workflow function's parameters, with the same defaults as the recipe."""

from __future__ import annotations

import argparse
import inspect


def test_posttrain_command_recipe_and_function_share_their_defaults() -> None:
    import fiddle as fdl

    from recipes.workflows import posttrain_recipe
    from tokenizer_posttrain.commands.posttrain_cmd import register
    from tokenizer_posttrain.workflow.posttrain import posttrain

    root = argparse.ArgumentParser()
    register(root.add_subparsers(dest="command"))
    parsed = vars(root.parse_args(["posttrain", "--base", "b", "--videos", "v", "--out", "o"]))
    recipe = fdl.build(posttrain_recipe("b", "v", "o")).keywords
    for name, param in inspect.signature(posttrain).parameters.items():
        if param.default is not inspect.Parameter.empty:
            assert parsed[name] == param.default == recipe[name], name
