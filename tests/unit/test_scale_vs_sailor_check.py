"""The Sailor comparison's check: which sizes fail the ratio or solve-time target."""
import bench.vs_sailor as vs


def _row(n, ratio, solve_s):
    return {"num_gpus": n, "ratio": ratio, "solve_s": solve_s}


def test_check_passes_only_when_every_size_meets_both_targets():
    ok = {"sizes": [_row(32, 1.2, 10.0), _row(64, 1.1, 59.0)]}
    assert vs.check_failures(ok) == []
    low = {"sizes": [_row(32, 1.2, 10.0), _row(64, 0.92, 5.0)]}
    assert vs.check_failures(low) == ["64 GPUs: ratio 0.92 < 1.1"]
    slow = {"sizes": [_row(32, 1.5, 61.0)]}
    assert vs.check_failures(slow) == ["32 GPUs: solve 61.0 s > 60 s"]
    missing = {"sizes": [_row(16, None, 1.0)]}
    assert len(vs.check_failures(missing)) == 1


def test_check_is_judged_on_sailors_reading():
    assert vs.JUDGED_READING == "sailor"
    assert vs.JUDGED_READING in vs.NETWORK_READINGS
