"""Where the CLI (and the parity harness) get a model and its example batch from.

A model source is one of

- ``module:factory``       ``module`` is imported (the current directory is put on
                           ``sys.path`` first, as uvicorn and gunicorn do);
- ``path/to/file.py:factory``  the file is loaded by path;
- ``NAME``                 a sample of the source checkout: ``samples/NAME.py:build``, looked
                           up in ``./samples`` and then beside the autopar package (an
                           editable install). Nothing is imported under the name
                           ``samples``: the file is loaded by path like any other.

The protocol, the same for samples and for any user file:

- ``factory()`` returns the model, an ``nn.Module`` whose ``forward(*batch)`` returns the
  scalar loss; with ``--config NAME`` it is called as ``factory(NAME)``. Weights come from
  torch's global RNG, seeded before the call, so every rank builds the same model.
- the module that holds the factory defines ``example_batch(model, batch_size)``, which
  returns the global batch: a tuple of tensors (a single tensor counts as a 1-tuple). The
  global RNG is seeded before this call too.
- optional: ``CONFIGS``, the names ``factory`` accepts; a ``--config`` outside it is refused
  before anything is built.

To plan without memory (``autopar plan``, ``autopar bench``) the factory runs under
``torch.device("meta")`` and the batch is moved to the meta device; a factory that builds
its modules the ordinary way needs nothing more for that.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

SAMPLE_FACTORY = "build"
BATCH_FN = "example_batch"
FORMS = "a sample name, module:factory or path/to/file.py:factory"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved source: a module to import (`module`) or a file to load (`path`)."""

    text: str  # as the user wrote it
    factory: str
    module: str | None = None
    path: Path | None = None
    sample: str | None = None  # the sample's name when `text` named one

    @property
    def label(self) -> str:
        return f"sample {self.sample!r}" if self.sample else repr(self.text)

    @property
    def spec(self) -> str:
        """The same source, independent of the current directory (for other processes)."""
        return f"{self.path}:{self.factory}" if self.path is not None else self.text


def sample_dirs() -> list[Path]:
    """Where sample names are looked up: ./samples, then the checkout autopar lives in."""
    here = Path.cwd() / "samples"
    beside = Path(__file__).resolve().parents[2] / "samples"
    return list(dict.fromkeys(d.resolve() for d in (here, beside) if d.is_dir()))


def known_samples() -> list[str]:
    names = {p.stem for d in sample_dirs() for p in d.glob("*.py") if not p.stem.startswith("_")}
    return sorted(names)


def resolve_source(text: str) -> ModelSource:
    """Parse `text` into a source; ValueError (naming the forms) when it names nothing."""
    target, colon, factory = text.rpartition(":")
    if not colon:
        return _resolve_sample(text)
    if not target or not factory.isidentifier():
        raise ValueError(f"model {text!r} is not a model source: give {FORMS}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"model {text!r}: no such file {target}")
        return ModelSource(text, factory, path=path)
    return ModelSource(text, factory, module=target)


def _resolve_sample(name: str) -> ModelSource:
    for d in sample_dirs():
        path = d / f"{name}.py"
        if name.isidentifier() and path.is_file():
            return ModelSource(name, SAMPLE_FACTORY, path=path, sample=name)
    known = known_samples()
    where = (
        f"known samples: {', '.join(known)}"
        if known
        else "no samples/ directory here or beside the autopar package"
    )
    raise ValueError(
        f"unknown sample {name!r}; {where} (or give module:factory or file.py:factory)"
    )


def import_source(source: ModelSource) -> ModuleType:
    """The module holding the factory (a file is loaded once per process)."""
    if source.path is None:
        assert source.module is not None
        cwd = str(Path.cwd())
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            return importlib.import_module(source.module)
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"model {source.text!r}: cannot import {source.module}: {exc}"
            ) from None
    digest = hashlib.sha1(str(source.path).encode()).hexdigest()[:8]
    name = f"autopar_model_{source.path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    _importable_package(source.path)
    spec = importlib.util.spec_from_file_location(name, source.path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _importable_package(path: Path) -> None:
    """A file inside a package (``samples/moe.py`` importing ``samples.llama``) imports its
    siblings by the package's name: put the directory holding the package on the path."""
    if (path.parent / "__init__.py").is_file():
        root = str(path.parent.parent)
        if root not in sys.path:
            sys.path.append(root)


def check_source(source: ModelSource, config: str | None) -> ModuleType:
    """Import the source and check the protocol (factory, example_batch, config name)."""
    module = import_source(source)
    for attr in (source.factory, BATCH_FN):
        if not callable(getattr(module, attr, None)):
            where = source.path if source.path is not None else source.module
            raise ValueError(
                f"model {source.text!r}: {where} defines no function {attr}(); a model "
                f"module defines the factory and {BATCH_FN}(model, batch_size)"
            )
    configs = getattr(module, "CONFIGS", None)
    if config is not None and configs is not None and config not in configs:
        raise ValueError(
            f"unknown config {config!r} for {source.label}; known: {', '.join(configs)}"
        )
    return module


def load_model(
    source: ModelSource | str,
    config: str | None = None,
    batch_size: int = 8,
    *,
    seed: int = 0,
    meta: bool = False,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """`(model, global batch)` from `source`; on the meta device with `meta=True`."""
    if isinstance(source, str):
        source = resolve_source(source)
    module = check_source(source, config)
    args = () if config is None else (config,)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = getattr(module, source.factory)(*args)
    else:
        model = getattr(module, source.factory)(*args)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model {source.text!r}: {source.factory}() returned {type(model).__name__}, "
            "not an nn.Module"
        )
    torch.manual_seed(seed)
    batch = getattr(module, BATCH_FN)(model, batch_size)
    batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    if meta:
        batch = tuple(t.to("meta") for t in batch)
    return model, batch
