"""No code runs from a file: nothing in the project unpickles, evaluates or fully loads what it reads.

Every ``.py`` of the package, ``data_tools``, ``recipes``, ``benchmarks`` and ``train_tokenizer.py`` is parsed, and
each call or import that can run code named by a file's content is reported as ``file:line``, with no exception
(:data:`ALLOWED` is empty: even the states of earlier checkpoints are skipped, never unpickled).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCANNED = ("tokenizer_posttrain", "data_tools", "recipes", "benchmarks", "train_tokenizer.py")

ALLOWED: set[tuple[str, str]] = set()
"""(file, what) pairs the scan lets through: none (even ``.jit`` archives are read without an unpickler)."""

UNPICKLING_MODULES = frozenset(
    ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle")
)
"""Modules whose loaders rebuild arbitrary objects (and so run code the data names)."""

HARMLESS_IMPORTS = {"pickle": {"UnpicklingError", "PickleError", "PicklingError"}}
"""Names that may be imported from those modules: exception classes, to catch refusals."""

SAFE_YAML_LOADERS = frozenset(("yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader", "yaml.CBaseLoader"))


class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.found: list[tuple[int, str]] = []  # (line, what)

    def report(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.aliases[(alias.asname or alias.name).split(".")[0]] = (
                alias.name if alias.asname else alias.name.split(".")[0]
            )
            if alias.name.split(".")[0] in UNPICKLING_MODULES:
                self.report(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
        if module.split(".")[0] in UNPICKLING_MODULES:
            names = {alias.name for alias in node.names}
            if not names <= HARMLESS_IMPORTS.get(module, set()):
                self.report(node, f"from {module} import {', '.join(sorted(names))}")

    def dotted(self, node: ast.expr) -> str:
        """The full name a call target refers to (``t.load`` after ``import torch as t``: torch.load)."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, f"builtins.{node.id}")
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else ""
        return ""  # a call on an expression: ``x().eval()``, ``self.net.eval()``

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if name in ("builtins.eval", "builtins.exec", "builtins.__import__"):
            self.report(node, f"{name.removeprefix('builtins.')}()")
        elif name.split(".")[0] in UNPICKLING_MODULES and name.rsplit(".", 1)[-1] not in {"dumps", "dump"}:
            self.report(node, f"{name}()")
        elif name in ("torch.jit.load", "torch.jit._serialization.load"):
            self.report(node, f"{name}() runs the archive's TorchScript")
        elif name in ("torch.load", "torch.serialization.load"):
            flag = keywords.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                self.report(node, f"{name}() without weights_only=True")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = keywords.get("Loader", node.args[1] if len(node.args) > 1 else None)
            if loader is None or self.dotted(loader) not in SAFE_YAML_LOADERS:
                self.report(node, f"{name}() without a safe Loader")
        elif name in ("yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all"):
            self.report(node, f"{name}()")
        elif name == "numpy.load":
            flag = keywords.get("allow_pickle")
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                self.report(node, "numpy.load() with allow_pickle")
        elif name in ("pandas.read_pickle", "joblib.load", "torch.package.PackageImporter"):
            self.report(node, f"{name}()")
        self.generic_visit(node)


def unsafe_calls(source: str, filename: str) -> list[str]:
    """``file:line: what`` for each import or call in ``source`` that can run code named by data it reads,
    but those :data:`ALLOWED` names."""
    scanner = _Scanner()
    scanner.visit(ast.parse(source, filename))
    return [f"{filename}:{line}: {what}" for line, what in scanner.found if (filename, what) not in ALLOWED]


def project_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    return files


def test_nothing_in_the_project_runs_code_from_what_it_reads() -> None:
    files = project_files()
    assert len(files) > 50 and ROOT / "tokenizer_posttrain" / "data" / "energon.py" in files
    problems = []
    for path in files:
        problems += unsafe_calls(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not problems, "\n".join(problems)


OLD_ENERGON = """
import pickle

class EnergonVideoDataModule:
    def state_dict(self):
        return {_STATE_KEY: pickle.dumps(state)}

    def load_state_dict(self, state_dict):
        if _STATE_KEY in state_dict:
            self._restore_state = pickle.loads(state_dict[_STATE_KEY])
"""


@pytest.mark.parametrize(
    ("source", "found"),
    [
        (OLD_ENERGON, ["x.py:2: import pickle", "x.py:10: pickle.loads()"]),  # the datamodule before the fix
        ("import pickle as p\ndef f(b):\n    return p.load(b)", ["x.py:1: import pickle", "x.py:3: pickle.load()"]),
        ("from pickle import loads", ["x.py:1: from pickle import loads"]),
        ("import dill", ["x.py:1: import dill"]),
        ("import marshal\nmarshal.loads(b)", ["x.py:1: import marshal", "x.py:2: marshal.loads()"]),
        ("import torch\ntorch.load(p)", ["x.py:2: torch.load() without weights_only=True"]),
        ("import torch\ntorch.jit.load(p)", ["x.py:2: torch.jit.load() runs the archive's TorchScript"]),
        ("from torch import jit\njit.load(p)", ["x.py:2: torch.jit.load() runs the archive's TorchScript"]),
        ("import torch\ntorch.load(p, weights_only=False)", ["x.py:2: torch.load() without weights_only=True"]),
        (
            "import torch\ntorch.load(\n    p,\n    map_location='cpu',\n)",
            ["x.py:2: torch.load() without weights_only=True"],
        ),
        ("from torch import load\nload(p)", ["x.py:2: torch.load() without weights_only=True"]),
        ("eval(text)", ["x.py:1: eval()"]),
        ("exec(text)", ["x.py:1: exec()"]),
        ("import yaml\nyaml.load(f)", ["x.py:2: yaml.load() without a safe Loader"]),
        ("import yaml\nyaml.load(f, Loader=yaml.Loader)", ["x.py:2: yaml.load() without a safe Loader"]),
        ("import yaml\nyaml.unsafe_load(f)", ["x.py:2: yaml.unsafe_load()"]),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", ["x.py:2: numpy.load() with allow_pickle"]),
        # What the project does, and must keep doing without a report:
        ("import torch\ntorch.load(\n    p,\n    weights_only=True,\n)", []),
        ("net.eval()\nmodel.to('cpu').eval()\nself.network.eval()", []),
        ("import yaml\nyaml.safe_load(f)\nyaml.load(f, Loader=yaml.SafeLoader)", []),
        ("from pickle import UnpicklingError", []),
        ("import numpy as np\nnp.load(f)", []),
        ("import re\nre.compile('x')", []),
    ],
)
def test_the_scan_sees_each_way_of_running_code_and_only_those(source: str, found: list[str]) -> None:
    assert unsafe_calls(source, "x.py") == found


def test_nothing_is_exempt_from_the_scan() -> None:
    source = "import pickle\ndef f(data):\n    return pickle.loads(data)\n"
    assert unsafe_calls(source, "tokenizer_posttrain/io/jit_archive.py") == [
        "tokenizer_posttrain/io/jit_archive.py:1: import pickle",
        "tokenizer_posttrain/io/jit_archive.py:3: pickle.loads()",
    ]
