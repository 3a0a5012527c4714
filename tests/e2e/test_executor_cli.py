import json
import os
import shlex
import subprocess
import sys

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    # checked before any rank starts: one line, exit 2, no run recorded
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "needs CUDA device 0" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "r" / "metrics.sqlite")


def test_a_plan_for_another_node_is_refused_before_any_rank_starts(tmp_path):
    cluster = ClusterSpec("c", (NodeSpec("gpu-far-away", "dc", (DeviceSpec("cpu"),)),))
    Plan(cluster, "tiny", 2, 16, "fp32", "none", (Assignment(0, "gpu-far-away", "cpu", 2, 1, 2, 1.0, 0, 0.0),),
         0.0, 0.0).save(str(tmp_path / "p.json"))
    r = executor("launch", "--plan", str(tmp_path / "p.json"), "--steps", "2", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "gpu-far-away" in r.stderr and not os.path.exists(tmp_path / "r" / "metrics.sqlite")


def _two_node_plan(tmp_path) -> str:
    cluster = ClusterSpec("two", (NodeSpec("gpu-a", "dc", (DeviceSpec("A100-80GB"),)),
                                  NodeSpec("gpu-b", "dc", (DeviceSpec("T4"),))))
    asg = (Assignment(0, "gpu-a", "A100-80GB", 4, 1, 4, 0.5, 0, 0.1), Assignment(1, "gpu-b", "T4", 2, 1, 2, 0.5, 0, 0.1))
    Plan(cluster, "tiny", 6, 64, "bf16", "none", asg, 0.1, 60.0).save(str(tmp_path / "p.json"))
    return str(tmp_path / "p.json")


def test_a_multinode_launch_validates_its_numbers_too(tmp_path):
    plan = _two_node_plan(tmp_path)
    for flags, word in ((["--steps", "-5"], "steps"), (["--steps", "0"], "steps"),
                        (["--steps", "3", "--checkpoint-every", "-1"], "checkpoint_every"),
                        (["--steps", "3", "--seed", "-2"], "seed"), (["--steps", "3", "--lr", "nan"], "lr"),
                        (["--steps", "3", "--warmup-steps", "-1"], "warmup_steps")):
        r = executor("launch", "--plan", plan, *flags, "--run-dir", str(tmp_path / "r"), "--json")
        assert r.returncode == 2, (flags, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr and r.stdout == "", (flags, r.stderr)
    assert not os.path.exists(tmp_path / "r" / "plan.json")


def test_other_executor_clis_refuse_bad_numbers(tmp_path):
    for args, word in ((["stop", "--run-dir", str(tmp_path), "--timeout", "-1"], "--timeout"),
                       (["stop", "--run-dir", str(tmp_path), "--timeout", "nan"], "--timeout"),
                       (["metrics", "--run-dir", str(tmp_path), "--last", "0"], "--last"),
                       (["orchestrate", "--once", "--poll-s", "nan"], "--poll-s"),
                       (["submit", "--model", "tiny", "--global-batch", "8", "--steps", "1", "--seq", "0"], "seq"),
                       (["submit", "--model", "tiny", "--global-batch", "-8", "--steps", "1"], "global batch"),
                       (["submit", "--model", "tiny", "--global-batch", "8", "--steps", "0"], "steps")):
        r = executor(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and word in r.stderr, (args, r.stderr)


def test_submit_refuses_what_no_device_set_of_the_pool_can_run(tmp_path):
    from executor.queue import JobQueue

    # tiny at 1e8 samples: the step's 1e8 × 128 token ids alone (the worker holds a step's batch) outgrow this machine
    for args, word in ((["--model", "llama2-13b", "--global-batch", "16", "--steps", "10"], "fits in memory on no"),
                       (["--model", "tiny", "--global-batch", "100000000", "--steps", "10"], "fits in memory on no"),
                       (["--model", "gpt2", "--global-batch", "100000", "--steps", "10"], "one step takes")):
        r = executor("submit", *args)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr and "nothing queued" in r.stderr, r.stderr
    assert JobQueue().list() == []
    r = executor("submit", "--model", "tiny", "--global-batch", "8", "--steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "queued" and len(JobQueue().list()) == 1
