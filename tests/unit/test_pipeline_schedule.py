"""Pipeline schedules by hand and row pieces split and merged, without ranks (the multi-rank runtime:
tests/e2e/test_pipeline_runtime.py)."""
import pytest

from models.pipeline import in_flight, row_pieces, schedule_ops


def test_schedules_by_hand():
    assert schedule_ops("1f1b", 2, 0, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                                             ("B", 3)]
    assert schedule_ops("1f1b", 2, 1, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                             ("B", 3)]
    assert schedule_ops("gpipe", 3, 1, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    # 1F1B: stage s of S holds min(S - s, M); GPipe all M
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 4, s, 3) for s in range(4)] == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="schedule"):
        schedule_ops("zb", 2, 0, 4)


def test_row_pieces_split_and_merge_rows():
    # rank with rows [2, 5) of a micro-batch of 6 against peers holding 2, 1, 3 rows
    assert row_pieces((2, 3), [2, 1, 3]) == [(1, 0, 1), (2, 1, 3)]
    assert row_pieces((0, 6), [6]) == [(0, 0, 6)]
    assert row_pieces((0, 2), [1, 2]) == [(0, 0, 1), (1, 1, 2)]
