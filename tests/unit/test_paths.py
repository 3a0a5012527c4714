"""contracts.paths: where the data folder is, in a checkout and in an installed package."""
from __future__ import annotations

import os

from contracts import paths


def test_checkout_keeps_data_beside_the_code(monkeypatch):
    monkeypatch.setattr(paths, "SOURCE_CHECKOUT", True)
    assert paths.default_data_dir() == os.path.join(paths.PROJECT_ROOT, "data")


def test_installed_package_keeps_data_under_xdg_data_home(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "SOURCE_CHECKOUT", False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert paths.default_data_dir() == str(tmp_path / "xdg" / "gpumix")
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.default_data_dir() == str(tmp_path / "home" / ".local" / "share" / "gpumix")


def test_the_environment_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "SOURCE_CHECKOUT", False)
    monkeypatch.setenv(paths.ENV_DATA_DIR, str(tmp_path / "d"))
    assert paths.data_dir() == str(tmp_path / "d") and os.path.isdir(tmp_path / "d")


def test_this_checkout_is_one():
    assert paths.SOURCE_CHECKOUT and os.path.isdir(os.path.join(paths.EXAMPLES_DIR, "clusters"))
