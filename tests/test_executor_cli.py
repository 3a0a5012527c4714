import json
import os
import shlex
import subprocess
import sys

from planner.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.plan import Assignment, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def executor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executor", *args], capture_output=True, text=True, cwd=ROOT)


def test_bad_plan_file_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"assignments": [}')
    for plan in (str(bad), str(tmp_path / "missing.json")):
        r = executor("launch", "--plan", plan, "--steps", "2", "--run-dir", str(tmp_path / "r"))
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "plan" in r.stderr and "Traceback" not in r.stderr
    r = executor("metrics", "--run-dir", str(tmp_path / "nothing-here"))
    assert r.returncode == 2 and "no run metrics" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bad_steps_exit_2(tmp_path):
    cluster = ClusterSpec("c", (NodeSpec("localhost", "local", (DeviceSpec("cpu"),)),))
    Plan(cluster, "tiny", 2, 16, "fp32", "none", (Assignment(0, "localhost", "cpu", 2, 1, 2, 1.0, 0, 0.0),),
         0.0, 0.0).save(str(tmp_path / "p.json"))
    r = executor("launch", "--plan", str(tmp_path / "p.json"), "--steps", "0", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and "steps must be >= 1" in r.stderr


def test_multinode_plan_prints_one_c10d_torchrun_command_per_node(tmp_path):
    cluster = ClusterSpec("two", (NodeSpec("gpu-a", "dc", (DeviceSpec("A100-80GB"),) * 2),
                                  NodeSpec("gpu-b", "dc", (DeviceSpec("T4"),))))
    asg = (Assignment(0, "gpu-a", "A100-80GB", 4, 1, 4, 0.4, 0, 0.1),
           Assignment(1, "gpu-a", "A100-80GB", 4, 1, 4, 0.4, 0, 0.1),
           Assignment(2, "gpu-b", "T4", 1, 2, 2, 0.2, 0, 0.1))
    Plan(cluster, "tiny", 10, 64, "bf16", "none", asg, 0.1, 100.0).save(str(tmp_path / "p.json"))
    r = executor("launch", "--plan", str(tmp_path / "p.json"), "--steps", "10", "--run-dir", str(tmp_path / "r"),
                 "--json")
    assert r.returncode == 0, r.stderr
    lines = json.loads(r.stdout)["multinode_commands"]
    assert len(lines) == 2
    for i, (line, node, k) in enumerate(zip(lines, ("gpu-a", "gpu-b"), (2, 1))):
        argv = shlex.split(line)
        assert argv[0] == f"GPUMIX_NODE={node}" and argv[2:4] == ["-m", "torch.distributed.run"]
        for flag in ("--nnodes=2", f"--nproc-per-node={k}", f"--node-rank={i}", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=gpu-a:29500"):
            assert flag in argv, (flag, argv)
        assert argv[argv.index("-m", 3) + 1] == "executor.worker" and "--plan" in argv
    assert not os.path.exists(tmp_path / "r" / "metrics.sqlite")  # nothing ran here


def test_a_gpu_plan_on_a_machine_without_that_gpu_fails_with_a_clear_reason(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: nothing to refuse")
    cluster = ClusterSpec("g", (NodeSpec("localhost", "local", (DeviceSpec("A100-80GB"),)),))
    Plan(cluster, "tiny", 2, 16, "bf16", "none", (Assignment(0, "localhost", "A100-80GB", 2, 1, 2, 1.0, 0, 0.0),),
         0.0, 0.0).save(str(tmp_path / "p.json"))
    r = executor("launch", "--plan", str(tmp_path / "p.json"), "--steps", "2", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 1
    assert "failed" in r.stdout and "needs CUDA device 0" in r.stdout, r.stdout
