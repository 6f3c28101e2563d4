"""Paths as records store them: relative to the repository, so a record reads the same on
every machine and names no home or work directory."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def repository_root() -> Path | None:
    """The checkout holding this package, or None for an installed copy (site-packages is
    not a repository: paths beside the package there are not the project's)."""
    root = PACKAGE_ROOT.parent
    return root if (root / "pyproject.toml").is_file() else None


def _relative_to(path: Path, base: Path) -> str | None:
    try:
        return path.relative_to(base).as_posix() or "."
    except ValueError:
        return None


def record_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a record writes it. Inside the repository: relative to its root
    (``configs/all_on.json``); inside the installed package: under the package's name
    (``flashloop_backend/models/ouro-tiny-bytes``), as in the repository. Anywhere else the
    path is returned as given: a relative or ``~`` path is never expanded into this
    machine's absolute path."""
    given = os.fspath(path)
    if given.startswith("~"):
        return given
    # abspath keeps symlinked spellings, resolve follows them; either may be the inside one
    candidates = (Path(os.path.abspath(given)), Path(given).resolve())
    root = repository_root()
    package_name = PACKAGE_ROOT.name
    for candidate in candidates:
        if root is not None and (rel := _relative_to(candidate, root)) is not None:
            return rel
        if (rel := _relative_to(candidate, PACKAGE_ROOT)) is not None:
            return package_name if rel == "." else f"{package_name}/{rel}"
    return given
