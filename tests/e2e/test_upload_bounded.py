"""An upload is parsed in a child process bounded in time and memory (ui/background.run_bounded):
past either bound the page gets one line (ChildFailed), the child is gone, and the server's own
memory has not grown; a bad file's own error comes back as it is."""
from __future__ import annotations

import time

import psutil
import pytest

from contracts.uploads import cluster_from_upload, model_from_upload
from ui.background import ChildFailed, run_bounded

MIB = 2**20


def test_a_call_past_its_memory_bound_fails_in_one_line_and_the_parent_stays_small():
    before = psutil.Process().memory_info().rss
    with pytest.raises(ChildFailed, match="needs more than 256 MiB"):
        run_bounded(bytearray, 2048 * MIB, timeout_s=30, memory_bytes=256 * MIB)
    assert psutil.Process().memory_info().rss - before < 64 * MIB


def test_a_call_past_its_time_bound_is_killed():
    t0 = time.monotonic()
    with pytest.raises(ChildFailed, match="took longer than 1 s"):
        run_bounded(time.sleep, 60, timeout_s=1, memory_bytes=256 * MIB)
    assert time.monotonic() - t0 < 15
    assert not [c for c in psutil.Process().children(recursive=True) if "ui.background" in " ".join(c.cmdline())]


def test_bad_files_keep_their_own_message_and_good_ones_parse():
    with pytest.raises(ValueError, match="huge.json: .*over the limit"):
        run_bounded(cluster_from_upload, b'{"nodes": [{"name": "n", "gpus": {"A100-80GB": 100000000}}]}',
                    "huge.json", timeout_s=30, memory_bytes=1024 * MIB)
    with pytest.raises(ValueError, match="deep.json: nested too deeply"):
        run_bounded(cluster_from_upload, b"[" * 100_000, "deep.json", timeout_s=30, memory_bytes=1024 * MIB)
    with pytest.raises(ValueError, match="bin.json: not a text file"):
        run_bounded(model_from_upload, b"\xff\xfe\x00", "bin.json", timeout_s=30, memory_bytes=1024 * MIB)
    cluster = run_bounded(cluster_from_upload, b'{"name": "lab", "nodes": [{"name": "n", "gpus": {"T4": 2}}]}',
                          "lab.json", timeout_s=30, memory_bytes=1024 * MIB)
    assert cluster.name == "lab" and cluster.num_devices == 2
