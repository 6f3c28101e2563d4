"""Records name paths relative to the repository, never this machine's directories."""

import os
from pathlib import Path

import pytest

from flashloop_backend.tools import paths
from flashloop_backend.tools.paths import record_path

REPO = Path(__file__).resolve().parents[1]


def test_a_path_inside_the_repository_is_written_relative_to_its_root(monkeypatch):
    embedded = REPO / "flashloop_backend" / "models" / "ouro-tiny-bytes"
    assert record_path(embedded) == "flashloop_backend/models/ouro-tiny-bytes"
    assert record_path(str(REPO / "configs" / "all_on.json")) == "configs/all_on.json"
    assert record_path(REPO) == "."
    monkeypatch.chdir(REPO / "scripts")  # relative to the working directory, not the root
    assert record_path("../configs/all_on.json") == "configs/all_on.json"
    assert record_path("train_embedded.py") == "scripts/train_embedded.py"


def test_a_path_outside_stays_as_given_and_is_never_expanded(tmp_path, monkeypatch):
    outside = tmp_path / "model"
    assert record_path(outside) == str(outside)  # the user gave it absolute
    monkeypatch.chdir(tmp_path)
    assert record_path("model") == "model"
    assert record_path("./text.txt") == "./text.txt"
    assert record_path("~/models/ouro") == "~/models/ouro"


def test_a_symlinked_spelling_of_the_repository_is_still_inside(tmp_path):
    link = tmp_path / "checkout"
    try:
        link.symlink_to(REPO, target_is_directory=True)
    except OSError:
        pytest.skip("no symlinks here")
    assert record_path(link / "configs" / "all_on.json") == "configs/all_on.json"


def test_an_installed_package_writes_its_files_under_the_package_name(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    package = site / "flashloop_backend"
    (package / "models").mkdir(parents=True)
    monkeypatch.setattr(paths, "PACKAGE_ROOT", package)
    # site-packages holds no pyproject.toml: it is not a repository
    assert paths.repository_root() is None
    assert record_path(package / "models" / "ouro-tiny-bytes") == (
        "flashloop_backend/models/ouro-tiny-bytes"
    )
    other = site / "torch" / "lib"
    assert record_path(other) == str(other)
    assert os.path.isabs(record_path(other))


def test_the_heldout_text_names_the_standard_library_by_version_not_directory():
    import platform
    import sysconfig

    from flashloop_backend.tools.evaluation import heldout_text

    _, source = heldout_text(limit_bytes=1)
    assert f"Python {platform.python_version()} standard library" in source
    assert sysconfig.get_paths()["stdlib"] not in source


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in (*value.keys(), *value.values()):
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_committed_records_name_no_machine_directory():
    import json

    machine = ("/root/", "/work/", "/home/", "/tmp/", str(REPO))
    found = {
        (path.name, text)
        for path in sorted((REPO / "results").glob("*.json"))
        for text in _strings(json.loads(path.read_text()))
        if any(m in text for m in machine)
    }
    assert not found
