"""The distribution's name and version, as pyproject.toml declares them and as installed
(make test-wheel builds, checks and installs the wheel itself)."""

from importlib import metadata
from pathlib import Path

import pytest

import onepass

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_pyproject_names_the_distribution_onepass_reads():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["name"] == onepass.DISTRIBUTION != "onepass"  # PyPI refuses "onepass" (the project "one-pass")
    assert "version" in project["dynamic"]  # onepass.__version__, read by setuptools: one place to raise it


def test_the_installed_metadata_is_found_by_the_distribution_name():
    try:
        installed = metadata.distribution(onepass.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{onepass.DISTRIBUTION} is not installed here (onepass runs from a source tree)")
    assert installed.version == onepass.__version__
    assert [e.value for e in installed.entry_points if e.name == "onepass"] == ["onepass.cli:main"]
    assert any(r.startswith("transformers") and 'extra == "hf"' in r for r in installed.requires)
