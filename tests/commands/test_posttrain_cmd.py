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


def test_help_names_allow_worse_and_the_exit_codes() -> None:
    from tokenizer_posttrain.commands.posttrain_cmd import register

    root = argparse.ArgumentParser()
    register(root.add_subparsers(dest="command"))
    parser = root._subparsers._group_actions[0].choices["posttrain"]  # noqa: SLF001 - argparse keeps them there
    text = " ".join(parser.format_help().split())
    assert "--allow-worse, --no-allow-worse" in text
    assert "3 done, but the post-trained tokenizer is worse than the base on the held-out clips" in text
    assert vars(root.parse_args(["posttrain", "--base", "b", "--videos", "v", "--out", "o", "--allow-worse"]))[
        "allow_worse"
    ]


def test_help_says_how_the_statistics_clips_and_the_verdict_follow_the_run() -> None:
    from tokenizer_posttrain.commands.posttrain_cmd import register

    root = argparse.ArgumentParser()
    register(root.add_subparsers(dest="command"))
    parser = root._subparsers._group_actions[0].choices["posttrain"]  # noqa: SLF001 - argparse keeps them there
    text = " ".join(parser.format_help().split())
    assert "a quarter of the clips training sees (steps x batch size), at least 16 and at most 400" in text
    assert "up to 8 per held-out video" in text and "a verdict needs at least 8" in text
    assert "outputs/tiny_cv8x8x8/export on a CPU" in text


def test_max_drift_its_earlier_name_and_allow_drift() -> None:
    from tokenizer_posttrain.commands.posttrain_cmd import register

    root = argparse.ArgumentParser()
    register(root.add_subparsers(dest="command"))
    command = ["posttrain", "--base", "b", "--videos", "v", "--out", "o"]
    assert vars(root.parse_args(command))["max_drift"] == 0.05 and not vars(root.parse_args(command))["allow_drift"]
    # --max-latent-drift (its earlier name) sets the same parameter; the last one given wins.
    assert vars(root.parse_args([*command, "--max-latent-drift", "0.2"]))["max_drift"] == 0.2
    assert vars(root.parse_args([*command, "--max-drift", "0.3"]))["max_drift"] == 0.3
    assert vars(root.parse_args([*command, "--max-drift", "0.3", "--max-latent-drift", "0.1"]))["max_drift"] == 0.1
    assert "max_latent_drift" not in vars(root.parse_args(command))
    assert vars(root.parse_args([*command, "--allow-drift"]))["allow_drift"]
    parser = root._subparsers._group_actions[0].choices["posttrain"]  # noqa: SLF001 - argparse keeps them there
    text = " ".join(parser.format_help().split())
    assert "4 done, but its latents drifted from the base's past --max-drift (--allow-drift makes it 0)" in text
    assert "--max-latent-drift MAX_DRIFT the earlier name of --max-drift" in text
