"""Model specs through a fresh interpreter: the CLI refuses unimplemented configs with exit 2, and
importing the planner pulls in no torch. The specs themselves: tests/unit/test_specs.py."""
import json
import subprocess
import sys

import pytest

from tests.unit.test_specs import GEMMA_7B, MIXTRAL_8X7B


def test_importing_planner_pulls_in_no_torch():
    code = ("import sys, planner, contracts.specs, contracts.cluster, contracts.plan, contracts.catalog, contracts.cli\n"
            "import pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(planner.__path__, 'planner.'):\n"
            "    if m.name != 'planner.__main__': importlib.import_module(m.name)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'streamlit', 'profiler', 'executor', 'models')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cfg,key", [(MIXTRAL_8X7B, "num_local_experts"), (GEMMA_7B, "model_type")])
def test_cli_refuses_mixtral_and_gemma_with_exit_2(tmp_path, cfg, key):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for cmd in (["memory", "--model", str(tmp_path), "--seq", "512", "--json"],):
        r = subprocess.run([sys.executable, "-m", "planner", *cmd], capture_output=True, text=True)
        assert r.returncode == 2 and key in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == ""
