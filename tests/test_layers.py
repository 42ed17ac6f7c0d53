"""The import-layer contract: one direction through the pipeline, private torch in one file.

Layers, lowest first (a module may import its own layer and the layers below it, never one
above, not even lazily inside a function):

    _compat  <  plan, cluster, options (pure data), kernels (custom ops)  <  capture
    <  passes.strategies  <  cost_models  <  search
    <  passes.lower / passes.fusion / passes.stages  <  runtime  <  api  <  views, testing, cli

`plan` is data the search fills in, so it sits below the search that builds it; the
kernels define custom ops (Triton, with autograd) that strategies, fusion and the runtime
all name, and import nothing of autopar's. Private
torch APIs (`torch._*`, `torch.utils._*`, `torch.distributed._*`, DTensor's private
modules, `x._local_tensor`, ...) are reached only through `autopar/_compat.py`, so a torch
upgrade breaks one file. No module imports the repository's top-level `samples` package.

The check reads the sources with `ast` (no import side effects), so it also sees imports
made inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "autopar"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("autopar._compat",),
    (
        "autopar.plan",
        "autopar.cluster",
        "autopar.hardware",
        "autopar.devices",
        "autopar.options",
        "autopar.forked",
        "autopar.kernels",
    ),
    ("autopar.capture",),
    ("autopar.passes.strategies",),
    ("autopar.cost_models",),
    ("autopar.search",),
    (
        "autopar.passes.lower",
        "autopar.passes.comm",
        "autopar.passes.comm_buckets",
        "autopar.passes.shape_reads",
        "autopar.passes.loss_weight",
        "autopar.passes.in_place",
        "autopar.passes.fusion",
        "autopar.passes.stages",
        "autopar.passes.recompute",
        "autopar.passes.precision",
    ),
    ("autopar.runtime",),
    (
        "autopar.api",
        "autopar.planning",
        "autopar.rank_plans",
        "autopar.calibration",
        "autopar.calibration_fit",
        "autopar.calibration_timing",
    ),
    ("autopar.views", "autopar.plan_views", "autopar.testing", "autopar.cli", "autopar.__main__"),
)

# The package facade re-exports the public names of every layer.
FACADES = {"autopar", "autopar.passes"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix wins
    for index, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[0]:
                    best = (len(name), index)
    return None if best is None else best[1]


def _sources() -> list[tuple[str, Path, ast.Module]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        out.append((_module_name(path), path, ast.parse(path.read_text(), str(path))))
    return out


def _imports(module: str, path: Path, tree: ast.Module) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, node.lineno))
            # `from autopar import api` imports the submodule autopar.api
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    return found


def _is_private_torch(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "torch" or (len(parts) > 1 and parts[1] == "ops"):
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _attribute_chain(node: ast.Attribute) -> str | None:
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if not isinstance(value, ast.Name):
        return None
    return ".".join([value.id, *reversed(parts)])


SOURCES = _sources()


def test_every_module_has_a_layer():
    missing = [m for m, _, _ in SOURCES if m not in FACADES and _layer(m) is None]
    assert not missing, f"modules outside the layer table: {missing}"


@pytest.mark.parametrize("module,path,tree", SOURCES, ids=[m for m, _, _ in SOURCES])
def test_imports_go_down(module: str, path: Path, tree: ast.Module):
    if module in FACADES:
        return
    own = _layer(module)
    upward = []
    for name, line in _imports(module, path, tree):
        if not name.startswith("autopar"):
            continue
        target = _layer(name)
        if target is not None and own is not None and target > own:
            upward.append(f"{path.name}:{line} imports {name} (layer {target} > {own})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module,path,tree", SOURCES, ids=[m for m, _, _ in SOURCES])
def test_no_samples_import(module: str, path: Path, tree: ast.Module):
    bad = [
        f"{path.name}:{line} imports {name}"
        for name, line in _imports(module, path, tree)
        if name == "samples" or name.startswith("samples.")
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,path,tree", SOURCES, ids=[m for m, _, _ in SOURCES])
def test_private_torch_only_in_compat(module: str, path: Path, tree: ast.Module):
    if module == "autopar._compat":
        return
    bad = [
        f"{path.name}:{line} imports {name}"
        for name, line in _imports(module, path, tree)
        if _is_private_torch(name)
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain is not None and _is_private_torch(chain):
                bad.append(f"{path.name}:{node.lineno} uses {chain}")
            if node.attr == "_local_tensor":
                bad.append(f"{path.name}:{node.lineno} reads ._local_tensor")
    assert not bad, "\n".join(sorted(set(bad)))


def test_contract_detects_violations():
    """The checks above can fail: a synthetic upward and private import is caught."""
    tree = ast.parse("from autopar.runtime import x\nimport torch._ops\ny = torch._C.foo\n")
    names = [n for n, _ in _imports("autopar.search.fake", ROOT / "search" / "fake.py", tree)]
    assert "autopar.runtime" in names
    assert _layer("autopar.runtime.x") > _layer("autopar.search.fake")
    assert _is_private_torch("torch._ops")
    chains = [_attribute_chain(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    assert any(c is not None and _is_private_torch(c) for c in chains)
    assert not _is_private_torch("torch.ops._c10d_functional.all_reduce")
    assert not _is_private_torch("torch.distributed.tensor")


def test_files_stay_small():
    """House style: no module in autopar/ over ~500 lines."""
    big = [
        f"{p.relative_to(ROOT.parent)}: {n} lines"
        for _, p, _ in SOURCES
        if (n := len(p.read_text().splitlines())) > 520
    ]
    assert not big, "\n".join(big)
