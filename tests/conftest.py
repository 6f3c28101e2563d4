"""Shared fixtures: plugin installation into throwaway path entries, device selection."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # CPU: Triton kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: more threads only contend
    torch.set_num_threads(1)

from flashloop_backend.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN = ROOT / "plugins" / "flashloop-kernels-example"
BROKEN_PLUGIN = ROOT / "tests" / "fixtures" / "broken_kernels_plugin"
VLLM_RLT_PLUGIN = ROOT / "plugins" / "flashloop-vllm-rlt"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pip_install_target(source: Path, target: Path) -> None:
    """Install a plugin distribution into its own folder (no network, no deps)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="session")
def installed_plugins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Install the example provider and the broken fixture, each into its own folder."""
    base = tmp_path_factory.mktemp("plugins")
    paths = {"example": base / "example", "broken": base / "broken", "vllm_rlt": base / "vllm_rlt"}
    pip_install_target(EXAMPLE_PLUGIN, paths["example"])
    pip_install_target(BROKEN_PLUGIN, paths["broken"])
    pip_install_target(VLLM_RLT_PLUGIN, paths["vllm_rlt"])
    return paths


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch):
    """Put folders on sys.path for one test and rediscover plugins from them."""

    def add(*folders: Path) -> Registry:
        for folder in folders:
            monkeypatch.syspath_prepend(str(folder))
        return Registry.discover(refresh=True)

    yield add
    Registry.discover(refresh=True)  # drop the test's entry points from the cache


def write_distribution(
    folder: Path,
    dist: str,
    entry_points: dict[str, dict[str, str]],
    modules: dict[str, str] | None = None,
) -> Path:
    """Hand-write an installed distribution (dist-info + modules) into ``folder``."""
    info = folder / f"{dist}-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    lines = []
    for group, names in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in names.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for filename, source in (modules or {}).items():
        (folder / filename).write_text(source)
    return folder


@pytest.fixture
def rng() -> Iterator[torch.Generator]:
    yield torch.Generator().manual_seed(1234)
