"""docs/overrides.md is the table the config dataclasses give, ``train_tokenizer.py --help`` lists the same keys,
and the README keeps what CI and readers rely on: the test command of .ci/run, links that resolve, one page."""

from __future__ import annotations

import re
from pathlib import Path

import recipes
from tokenizer_posttrain.commands.override_table import COMMAND, PAGE, cell, page
from tokenizer_posttrain.commands.train_cli import help_text
from tokenizer_posttrain.training.train import train

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TOPIC_PAGES = ("data", "loss", "training", "export", "multi-gpu", "overrides", "python-api")
"""The pages of docs/ that the README's material moved to (benchmarks and reliability keep their own links)."""


def table_keys(text: str) -> set[str]:
    """The keys of the settings table: the first cell of each row, e.g. ``model.lora.rank`` or ``model.lora.*``."""
    settings = text.split("\n## Settings\n", 1)[1]
    return set(re.findall(r"^\| `([^`]+)` \|", settings, flags=re.MULTILINE))


def help_keys(text: str) -> set[str]:
    """The keys of ``--help``: ``group.*`` lines and ``group.setting: type = default`` lines."""
    keys = set()
    for line in text.splitlines():
        found = re.match(r"^\s*([A-Za-z_]\w*(?:\.\w+)*)(\.\*(?:\s|$)|: )", line)
        if found and (found.group(2).startswith(".*") or "." in found.group(1)):
            keys.add(found.group(1) + (".*" if found.group(2).startswith(".*") else ""))
    return keys


def test_the_page_is_the_table_the_dataclasses_give() -> None:
    fresh = page(train, recipes.cv8x8x8.cv8x8x8)
    assert PAGE.read_text() == fresh, f"docs/overrides.md is out of date: run `.venv/bin/{COMMAND}`"


def test_the_table_and_help_list_the_same_keys() -> None:
    table = table_keys(PAGE.read_text())
    shown = help_keys(help_text(train, recipes.cv8x8x8.cv8x8x8, []))
    assert {"model.*", "model.lora.*", "model.lora.rank", "loss.gan.adaptive_every", "log.name"} <= table
    assert table - shown == set(), "in docs/overrides.md but not in --help"
    assert shown - table == set(), "in --help but not in docs/overrides.md"


def test_table_cells_keep_pipes_tags_and_stars_as_text() -> None:
    assert cell("all | decoder") == "all \\| decoder"
    assert cell("<run folder>/x") == "&lt;run folder>/x"
    assert cell("2 ** layers, ['*.attn_1.*']") == "2 \\*\\* layers, ['\\*.attn_1.\\*']"
    assert cell("prefetch_factor, _partial_") == "prefetch_factor, \\_partial\\_"


def test_the_readme_holds_the_ci_command_and_links_that_resolve() -> None:
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python3 -m venv .venv") and f"\n{ci}\n" in text, "README lost .ci/run's test command"
    main_job = (
        "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && "
        ".venv/bin/python train_tokenizer.py --factory tiny"
    )
    assert f"\n{main_job}\n" in text
    assert len(text.splitlines()) <= 300, "the README is a front page: move detail to a page of docs/"
    assert "(docs/overrides.md)" in text
    for doc in [README, *(ROOT / "docs" / f"{name}.md" for name in TOPIC_PAGES)]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            if "://" in target:
                continue
            linked = (doc.parent / target) if target else doc
            assert linked.is_file(), f"{doc.name} links to {target}, which does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{doc.name} links to {target}#{anchor}: no such heading"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page`` (outside code blocks)."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found
