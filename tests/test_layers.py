"""The package's layers: no module imports from a layer above its own (or beside it), and the public API
imports from the package itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tokenizer_posttrain"
LAYERS = {
    "core": 0,
    "network": 1,
    "io": 2,
    "losses": 2,
    "data": 2,
    "evaluation": 3,
    "training": 4,
    "workflow": 5,
    "commands": 6,
}
"""Folder -> layer; the package's own ``__init__`` and ``__main__`` stand above them all."""
TOP = max(LAYERS.values()) + 1


def layer_of(module: str) -> tuple[str, int]:
    """(folder, layer) of a ``tokenizer_posttrain[.folder[...]]`` name; the package root, its ``__main__``
    and anything not in a layer folder (a name the root hands on, a folder missing from LAYERS) rank on top."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in LAYERS:
        return "", TOP
    return parts[1], LAYERS[parts[1]]


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import of ``tokenizer_posttrain`` in ``source``, at any depth."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import name`` may name a submodule: count it as an import of that submodule.
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "tokenizer_posttrain"]


def upward_edges(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports of ``source`` (module ``module``) that reach a layer above its own or beside it."""
    folder, rank = layer_of(module)
    problems = []
    for line, target in imported_modules(source, module, is_package):
        target_folder, target_rank = layer_of(target)
        if target_folder == folder and rank != TOP:
            continue
        if target_rank >= rank:
            problems.append(f"{module}:{line} imports {target} (layer {target_rank} >= {rank})")
    return problems


def package_modules() -> list[tuple[str, Path]]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        modules.append((".".join(relative.parts), path))
    return modules


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    problems = []
    for module, path in package_modules():
        folder = module.split(".")[1]
        assert folder in LAYERS or folder in ("__init__", "__main__"), f"{path}: give {folder} a layer in LAYERS"
        name = module.removesuffix(".__init__")
        problems += upward_edges(path.read_text(), name, is_package=path.name == "__init__.py")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "flagged"),
    [
        ("tokenizer_posttrain.network.cosmos.tokenizer", "from ...training.module import TokenizerModel", True),
        ("tokenizer_posttrain.io.export", "def f():\n    from ..losses import build_loss", True),  # beside
        ("tokenizer_posttrain.data.fake", "import tokenizer_posttrain.commands.guard", True),
        ("tokenizer_posttrain.core.files", "from tokenizer_posttrain import load_tokenizer", True),
        ("tokenizer_posttrain.training.module", "from ..losses import build_loss\nfrom . import config", False),
        ("tokenizer_posttrain.commands.guard", "from ..core.errors import UserError", False),
    ],
)
def test_the_check_sees_upward_and_sideways_imports(module: str, source: str, flagged: bool) -> None:
    assert bool(upward_edges(source, module)) == flagged


def test_every_folder_says_its_role() -> None:
    for folder in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        assert doc.startswith(f"Layer {LAYERS[folder]},"), f"{folder}/__init__.py should open with its layer"


def test_the_public_api_comes_from_the_package() -> None:
    import tokenizer_posttrain as api
    from tokenizer_posttrain.io.checkpoint import load_tokenizer
    from tokenizer_posttrain.io.export import export_tokenizer
    from tokenizer_posttrain.network import build_tokenizer

    assert (api.load_tokenizer, api.export_tokenizer, api.build_tokenizer) == (
        load_tokenizer,
        export_tokenizer,
        build_tokenizer,
    )
    assert set(api.__all__) >= {"build_tokenizer", "load_tokenizer", "export_tokenizer", "Encoding"}


FAMILY_FOLDERS = (
    "tokenizer_posttrain.network.cosmos",
    "tokenizer_posttrain.network.wan21",
    "tokenizer_posttrain.network.wan22",
)
"""Each tokenizer family's folder: only its own modules name its classes and submodules."""
FAMILY_FORMATS = {
    "tokenizer_posttrain": "the public API hands on CausalVideoTokenizer, TokenizerConfig and REGISTRY",
    "tokenizer_posttrain.network": "imports the family folder to register it",
    "tokenizer_posttrain.io.config_json": "checks the fields of Cosmos' config.json (the cosmos export format)",
    "tokenizer_posttrain.io.diffusers_format": "maps Cosmos' keys to diffusers' AutoencoderKLCosmos (the diffusers "
    "format, a Cosmos-only entry of io/formats.py)",
    "tokenizer_posttrain.io.wan_diffusers": "diffusers' AutoencoderKLWan folders take Wan2.1's latent constants",
}
"""Modules outside a family folder that may import it, and why: a family's own file formats and the API."""
COSMOS_PARTS = ("quant_conv", "post_quant_conv", "conv_out", "quantizer", "tail", "unpatcher3d", "patcher3d")
"""Submodules of Cosmos' network that the layers above must reach through the family seam instead."""


def family_leaks(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports of a family folder, and attribute reads of Cosmos' submodules, in a module outside the folder."""
    if module.startswith(FAMILY_FOLDERS):
        return []
    found = []
    if module not in FAMILY_FORMATS:
        found += [
            f"{module}:{line} imports {target}"
            for line, target in imported_modules(source, module, is_package)
            if target.startswith(FAMILY_FOLDERS)
        ]
    found += [
        f"{module}:{node.lineno} reads .{node.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in COSMOS_PARTS
    ]
    return found


def test_only_a_family_s_folder_names_its_classes_and_submodules() -> None:
    problems = []
    for module, path in package_modules():
        name = module.removesuffix(".__init__")
        problems += family_leaks(path.read_text(), name, is_package=path.name == "__init__.py")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "flagged"),
    [
        ("tokenizer_posttrain.training.module", "from ..network.cosmos import CausalVideoTokenizer", True),
        ("tokenizer_posttrain.evaluation.inference", "z = network.quant_conv(network.encoder(x))", True),
        ("tokenizer_posttrain.training.module", "y = self.network.decoder.tail(h)", True),
        ("tokenizer_posttrain.network.cosmos.tokenizer", "z = self.quant_conv(self.encoder(x))", False),
        ("tokenizer_posttrain.training.module", "y = self.network.apply_head(h)", False),
    ],
)
def test_the_family_check_sees_imports_and_submodules(module: str, source: str, flagged: bool) -> None:
    assert bool(family_leaks(source, module)) == flagged
