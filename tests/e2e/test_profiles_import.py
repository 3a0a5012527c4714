"""planner.core.profiles imports no torch (checked in a fresh interpreter). The profile store itself:
tests/unit/test_profiles.py."""
import subprocess
import sys

from testkit import ROOT


def test_planner_profiles_module_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, planner.core.profiles; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
