"""Installing GPUMix: scripts/install.sh (its venv, its torch build) and `pip install .` (the gpumix command).

install.sh on a machine whose system Python refuses `pip install` (PEP 668): the "system" interpreter here is a copy of this interpreter's binary whose standard library
(linked entry by entry from the real one) carries an EXTERNALLY-MANAGED marker, with pip in
its own site-packages: exactly what a stock Debian/Ubuntu python3 is. The test first shows
that its pip refuses to install, then runs install.sh with that interpreter first on PATH
and a one-wheel requirements file (the real torch install takes minutes; its commands are
checked with --check), and checks the package landed in the project-local virtual
environment and nothing in the system interpreter. The torch build it picks is checked with
--check and a fake `nvidia-smi` on PATH. `pip install .` goes into a fresh virtual environment
that sees this one's packages through a .pth file (offline, no torch download), and its
`gpumix` runs from a folder outside the checkout, so the installed copy is what runs.
"""
from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile

import psutil
import pytest

from testkit import ROOT
from testkit.processes import free_port, kill_processes_with_data_dir
from testkit.wait import wait_until

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


def tiny_wheel(folder: str, version: str = "0.1") -> str:
    """A one-module wheel built by hand (no build backend, no index needed)."""
    path = os.path.join(folder, f"{PROBE}-{version}-py3-none-any.whl")
    dist = f"{PROBE}-{version}.dist-info"
    files = {f"{PROBE}.py": "VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: {version}\n",
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


def fake_nvidia_smi(folder, gpu_line: str | None) -> str:
    """A folder holding an `nvidia-smi` that lists GPUs (gpu_line, then seven more), or fails as without a driver."""
    os.makedirs(folder, exist_ok=True)
    more = "".join(f"; echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'" for i in range(1, 8))
    body = f"echo '{gpu_line}'{more}" if gpu_line else "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9"
    path = os.path.join(folder, "nvidia-smi")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 2\n{body}\n")
    os.chmod(path, 0o755)
    return str(folder)


GPU = "GPU 0: NVIDIA H200 (UUID: GPU-00000000-1111-2222-3333-444444444444)"


@pytest.mark.parametrize("gpu_line, args, build, why", [
    (GPU, (), "cuda", f"nvidia-smi lists a GPU: {GPU}"),
    (None, (), "cpu", "nvidia-smi lists no GPU"),
    (GPU, ("--torch", "cpu"), "cpu", "asked with --torch cpu"),
    (None, ("--torch=cuda",), "cuda", "asked with --torch cuda"),
])
def test_check_names_the_torch_build_it_would_install(tmp_path, gpu_line, args, build, why):
    venv = tmp_path / "fresh"
    r = run_install({"GPUMIX_VENV": str(venv)}, *args, "--check",
                    path_first=fake_nvidia_smi(tmp_path / "bin", gpu_line))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"install.sh: torch build: {build} ({why})", r.stdout
    commands = [line[2:] for line in lines if line.startswith("+ ")]
    venv_py = f"{venv}/bin/python"
    cuda_torch = f"{venv_py} -m pip install --quiet --disable-pip-version-check torch===2.13.0"
    cpu_check = [c for c in commands if c.startswith(f"{venv_py} -m pip install --dry-run") and c.endswith(" torch==2.13.0")]
    if build == "cuda":  # the default index's release, before the rest; the CPU-only check is not run
        assert commands.index(cuda_torch) < commands.index(
            f"{venv_py} -m pip install --quiet --disable-pip-version-check -r requirements.txt"), commands
        assert not cpu_check, commands
    else:
        assert cpu_check and cuda_torch not in commands, commands
    assert not os.path.exists(venv)


def test_without_nvidia_smi_the_cpu_build_is_chosen(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an nvidia-smi (the fake one that fails is checked above)")
    r = run_install({"GPUMIX_VENV": str(tmp_path / "fresh")}, "--check")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "install.sh: torch build: cpu (no nvidia-smi on PATH)", r.stdout


def test_cuda_spec_never_takes_a_local_cpu_wheel(tmp_path):
    """Why install.sh asks for torch===X for the CUDA build: where a find-links folder holds X+cpu
    (this machine's pip config does), `==X` takes that wheel and `===X` only X itself."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("2.13.0+cpu", "2.13.0"):
        tiny_wheel(str(wheels), version)

    def chosen(spec: str) -> list[str]:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                            "--find-links", str(wheels), "--quiet", "--report", "-", spec],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return [item["metadata"]["version"] for item in json.loads(r.stdout)["install"]]

    assert chosen(f"{PROBE}==2.13.0") == ["2.13.0+cpu"]
    assert chosen(f"{PROBE}===2.13.0") == ["2.13.0"]


def test_bad_torch_choice_is_one_line_and_exit_2():
    r = subprocess.run(["bash", INSTALL, "--torch", "gpu"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "'gpu'" in r.stderr, r.stderr


# What `pip install .` must leave out, and the folders it must not copy to build from.
NOT_INSTALLED = ("tests", "bench", "testkit")
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "data", "artifacts", "build", "dist", "*.egg-info", "__pycache__")


def source_packages() -> list[str]:
    """Every package of the checkout that the wheel must hold (dotted names), tests and benches aside."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", *NOT_INSTALLED)]
        if rel != "." and "__init__.py" in files and not rel.startswith(".venv"):
            found.append(rel.replace(os.sep, "."))
    return sorted(found)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """`pip install .` of a copy of the checkout into a fresh venv that sees this venv's packages
    (a .pth file) instead of downloading them: --no-deps --no-build-isolation --no-index."""
    base = tmp_path_factory.mktemp("pip-install")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=NOT_COPIED)  # pip builds in the tree it is given: never in the shared checkout
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    with open(os.path.join(site, "gpumix_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")  # this venv's torch, streamlit, setuptools, pip
    env = clean_env(base)
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
                       capture_output=True, text=True, timeout=150, env=env, cwd=base)
    assert r.returncode == 0, r.stdout + r.stderr
    work = base / "work"
    work.mkdir()
    return {"venv": str(venv), "py": py, "site": site, "work": str(work), "base": str(base)}


def clean_env(base) -> dict[str, str]:
    """No checkout on the path, no data folder given: the installed package picks its own (XDG)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "GPUMIX_DATA_DIR")}
    env["XDG_DATA_HOME"] = os.path.join(base, "xdg")
    return env


def gpumix(installed: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(installed["venv"], "bin", "gpumix"), *args], capture_output=True, text=True,
                          timeout=120, cwd=installed["work"], env=clean_env(installed["base"]))


def test_pip_install_gives_the_packages_and_nothing_else(installed):
    site = installed["site"]
    for package in source_packages():
        assert os.path.isfile(os.path.join(site, *package.split("."), "__init__.py")), package
    assert os.path.isfile(os.path.join(site, "app.py"))
    assert os.path.isfile(os.path.join(site, "gpumix", "examples", "clusters", "lab.json"))
    assert os.path.isfile(os.path.join(site, "gpumix", "streamlit_config", "config.toml"))
    for name in NOT_INSTALLED:
        assert not os.path.exists(os.path.join(site, name)), name
    assert "contracts" in source_packages() and "planner.hetero" in source_packages()  # the walk finds packages


def test_gpumix_help_lists_every_sub_command(installed):
    from executor.__main__ import COMMANDS as EXECUTOR
    from planner.__main__ import COMMANDS as PLANNER
    from profiler.__main__ import COMMANDS as PROFILER

    r = gpumix(installed, "--help")
    assert r.returncode == 0, r.stderr
    listed = re.findall(r"^    (\S+)", r.stdout, flags=re.MULTILINE)
    assert sorted(listed) == sorted({*PLANNER, *PROFILER, *EXECUTOR, "dashboard", "planner", "profiler", "executor"}), r.stdout


def test_installed_gpumix_plans_from_outside_the_checkout(installed):
    cluster = os.path.join(ROOT, "examples", "clusters", "lab.json")
    r = gpumix(installed, "plan", "--cluster", cluster, "--model", "tiny", "--global-batch", "8", "--json", "--out", "plan.json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["cluster"]["name"] == "lab" and sum(a["batch"] for a in plan["assignments"]) == 8, plan
    assert os.path.isfile(os.path.join(installed["work"], "plan.json"))
    # the code that ran is the installed copy, and its data went to XDG_DATA_HOME, not site-packages
    where = subprocess.run([installed["py"], "-c", "import contracts.paths as p; print(p.__file__, p.data_dir(), p.EXAMPLES_DIR)"],
                           capture_output=True, text=True, timeout=60, cwd=installed["work"], env=clean_env(installed["base"]))
    module, data, examples = where.stdout.split()
    assert module.startswith(installed["site"]) and data == os.path.join(installed["base"], "xdg", "gpumix"), where.stdout
    assert os.path.isfile(os.path.join(examples, "clusters", "lab.json")) and examples.startswith(installed["site"]), examples
    assert not os.path.exists(os.path.join(installed["site"], "data"))


@pytest.mark.slow
def test_installed_launch_finds_its_modules_in_the_workers(installed):
    """The workers start from site-packages (PYTHONPATH and cwd: contracts.paths.PROJECT_ROOT)."""
    cluster = os.path.join(ROOT, "examples", "clusters", "local-2cpu-emulated.json")
    r = gpumix(installed, "plan", "--cluster", cluster, "--model", "tiny", "--global-batch", "4", "--out", "two.json")
    assert r.returncode == 0, r.stderr
    run_dir = os.path.join(installed["work"], "runs", "r1")
    r = gpumix(installed, "launch", "--plan", "two.json", "--steps", "2", "--run-dir", run_dir)
    assert r.returncode == 0 and "done" in r.stdout, r.stdout + r.stderr
    metrics = gpumix(installed, "metrics", "--run-dir", run_dir, "--json")
    assert metrics.returncode == 0, metrics.stderr
    summary = json.loads(metrics.stdout)
    assert summary["status"] == "done" and summary["world_size"] == 2, summary
    assert written_into_site_packages(installed["site"]) == []


def written_into_site_packages(site: str) -> list[str]:
    """Files in site-packages that no installed distribution's RECORD lists (bytecode and the test's .pth aside)."""
    recorded = set()
    for record in glob.glob(os.path.join(site, "*.dist-info", "RECORD")):
        with open(record) as f:
            recorded.update(os.path.normpath(line.rsplit(",", 2)[0]) for line in f if line.strip())
    return sorted(rel for folder, dirs, files in os.walk(site) if "__pycache__" not in folder
                  for rel in (os.path.relpath(os.path.join(folder, name), site) for name in files)
                  if rel not in recorded and rel != "gpumix_test_deps.pth")


def test_installed_tool_forms_agree(installed):
    """`gpumix planner memory`, `gpumix memory` and `python -m planner memory` are one command;
    `gpumix profiler memory` is the profiler's (a different set of flags: --fake)."""
    args = ("--model", "tiny", "--micro-batch", "1", "--seq", "64", "--json")
    outputs = [gpumix(installed, "memory", *args), gpumix(installed, "planner", "memory", *args),
               subprocess.run([installed["py"], "-m", "planner", "memory", *args], capture_output=True, text=True,
                              timeout=120, cwd=installed["work"], env=clean_env(installed["base"]))]
    assert all(o.returncode == 0 for o in outputs), [o.stderr for o in outputs]
    assert len({o.stdout for o in outputs}) == 1 and json.loads(outputs[0].stdout)
    profiler = gpumix(installed, "profiler", "memory", "--help")
    assert profiler.returncode == 0 and "--fake" in profiler.stdout and "--fake" not in gpumix(installed, "memory", "--help").stdout


def test_installed_dashboard_serves_on_localhost(installed):
    port = free_port()
    data = os.path.join(installed["base"], "dashboard-data")  # names the server's processes for the cleanup
    log = open(os.path.join(installed["base"], "dashboard.log"), "w")
    proc = subprocess.Popen([os.path.join(installed["venv"], "bin", "gpumix"), "dashboard", "--server.port", str(port)],
                            cwd=installed["work"], env={**clean_env(installed["base"]), "GPUMIX_DATA_DIR": data},
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        health = f"http://127.0.0.1:{port}/_stcore/health"
        body = wait_until(lambda: urllib.request.urlopen(health, timeout=5).read(), 90, "the installed dashboard",
                          ignore=(OSError,))
        assert body == b"ok"
        cmdline = psutil.Process(proc.pid).cmdline()  # gpumix became streamlit (exec): the installed app, localhost only
        assert os.path.join(installed["site"], "app.py") in cmdline and "--server.address=127.0.0.1" in cmdline, cmdline
    finally:
        kill_processes_with_data_dir(data)
        proc.wait(timeout=30)
        log.close()
