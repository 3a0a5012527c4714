"""scripts/install.sh on a machine whose system Python refuses `pip install` (PEP 668).

The "system" interpreter here is a copy of this interpreter's binary whose standard library
(linked entry by entry from the real one) carries an EXTERNALLY-MANAGED marker, with pip in
its own site-packages: exactly what a stock Debian/Ubuntu python3 is. The test first shows
that its pip refuses to install, then runs install.sh with that interpreter first on PATH
and a one-wheel requirements file (the real torch install takes minutes; its commands are
checked with --check), and checks the package landed in the project-local virtual
environment and nothing in the system interpreter.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(180)

INSTALL = os.path.join(ROOT, "scripts", "install.sh")
PROBE = "gpumix_probe"


def externally_managed_python(base: str) -> str:
    """A python3 at base/bin whose prefix is base, marked externally managed; returns it."""
    stdlib = os.path.dirname(os.__file__)
    lib = os.path.join(base, "lib", os.path.basename(stdlib))
    os.makedirs(os.path.join(lib, "site-packages"))
    for name in os.listdir(stdlib):
        if name != "site-packages":
            os.symlink(os.path.join(stdlib, name), os.path.join(lib, name))
    with open(os.path.join(lib, "EXTERNALLY-MANAGED"), "w") as f:
        f.write("[externally-managed]\nError=this system's Python is managed by the distribution\n")
    import pip  # the system's pip, as Debian's python3-pip provides it

    os.symlink(os.path.dirname(pip.__file__), os.path.join(lib, "site-packages", "pip"))
    os.makedirs(os.path.join(base, "bin"))
    exe = os.path.join(base, "bin", "python3")
    shutil.copy2(os.path.realpath(sys.executable), exe)  # a copy: a link would find the real prefix
    return exe


def tiny_wheel(folder: str) -> str:
    """A one-module wheel built by hand (no build backend, no index needed)."""
    path = os.path.join(folder, f"{PROBE}-0.1-py3-none-any.whl")
    dist = f"{PROBE}-0.1.dist-info"
    files = {f"{PROBE}.py": "VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def run_install(env_extra: dict, *args: str, path_first: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    if path_first:
        env["PATH"] = path_first + os.pathsep + env["PATH"]
    env.update(env_extra)
    return subprocess.run(["bash", INSTALL, *args], capture_output=True, text=True, env=env, timeout=150)


def test_install_makes_and_uses_a_venv_where_system_pip_refuses(tmp_path):
    system_py = externally_managed_python(str(tmp_path / "system"))
    wheel = tiny_wheel(str(tmp_path))
    refused = subprocess.run([system_py, "-m", "pip", "install", "--no-index", wheel],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, refused.stderr

    reqs = tmp_path / "requirements.txt"
    reqs.write_text(f"--no-index\n{wheel}\n")
    venv = tmp_path / "venv"
    r = run_install({"GPUMIX_VENV": str(venv), "GPUMIX_REQUIREMENTS": str(reqs),
                     "GPUMIX_SKIP_TEST_PACKAGES": "1"}, path_first=os.path.dirname(system_py))
    assert r.returncode == 0, r.stdout + r.stderr
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            f"import sys, {PROBE}; print({PROBE}.VALUE, sys.prefix != sys.base_prefix, sys.base_prefix)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["42", "True", str(tmp_path / "system")], probe.stdout + probe.stderr
    system_site = tmp_path / "system" / "lib" / os.path.basename(os.path.dirname(os.__file__)) / "site-packages"
    assert sorted(os.listdir(system_site)) == ["pip"]  # nothing installed into the system interpreter

    again = run_install({"GPUMIX_VENV": str(venv), "GPUMIX_REQUIREMENTS": str(reqs),
                         "GPUMIX_SKIP_TEST_PACKAGES": "1", }, "--check", path_first=os.path.dirname(system_py))
    assert again.returncode == 0, again.stderr
    assert "-m venv" not in again.stdout  # an existing venv is reused, not rebuilt


def test_check_shows_the_real_install_through_the_venv_pip_only(tmp_path):
    venv = tmp_path / "fresh"
    r = run_install({"GPUMIX_VENV": str(venv)}, "--check")
    assert r.returncode == 0, r.stderr
    commands = [line[2:] for line in r.stdout.splitlines() if line.startswith("+ ")]
    venv_py = f"{venv}/bin/python"
    assert f"python3 -m venv --clear {venv}" in commands
    assert f"{venv_py} -m pip install --quiet --disable-pip-version-check -r requirements.txt" in commands
    # torch is resolved (dry run) before anything is installed, so a CUDA build is refused
    assert any(c.startswith(f"{venv_py} -m pip install --dry-run") and c.endswith("torch==2.13.0") for c in commands)
    pips = [c for c in commands if " pip " in f" {c} " or "-m pip" in c]
    assert pips and all(c.startswith(venv_py) for c in pips), pips  # never the system pip
    assert not os.path.exists(venv)  # --check ran nothing


def test_bad_argument_is_one_line_and_exit_2():
    r = subprocess.run(["bash", INSTALL, "--bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--bogus" in r.stderr
