import json
import os

import pytest

from executor.checkpoint import CKPT_DIR, LATEST, check_resumable, checkpoint_meta
from tests.test_executor_store import small_plan


def test_resume_needs_a_checkpoint_of_the_same_plan(tmp_path):
    run = str(tmp_path)
    plan = small_plan()
    with pytest.raises(ValueError, match="no checkpoint"):
        check_resumable(run, plan)
    os.makedirs(os.path.join(run, CKPT_DIR))
    with open(os.path.join(run, CKPT_DIR, LATEST), "w") as fh:
        json.dump(checkpoint_meta(plan, 7, "/x/step_000007"), fh)
    assert check_resumable(run, plan)["step"] == 7
    other = small_plan(slowdowns=(1.0, 1.0, 1.0))  # three ranks: other shard fractions and batch
    with pytest.raises(ValueError, match="differs from the plan"):
        check_resumable(run, other)
