"""Tensor-parallel plan files (contracts/plan.py, DESIGN.md "Plans at scale"): `stage`, `tp`, `tp_group`
and `tensor_parallel` round-trip, each TP group counts once in the sums, a bad group is refused in one
line naming the device and the rule, and a plan file without the keys reads as before."""
from __future__ import annotations

import copy

import pytest

from contracts.plan import Plan
from executor.checks import check_tensor_parallel


def _cluster(per_node=(4,), nodes=("n0",)) -> dict:
    return {"name": "c", "nodes": [{"name": n, "datacenter": n, "gpus": {"cpu": k}} for n, k in zip(nodes, per_node)]}


def _asg(i, node, mb, m, f, *, tp=1, group=None, stage=None) -> dict:
    return {"device_index": i, "node": node, "type": "cpu", "micro_batch": mb, "accum_steps": m, "batch": mb * m,
            "shard_fraction": f, "predicted_memory_bytes": 0, "predicted_step_s": 0.0, "emulated": False,
            "slowdown": 1.0, "memory_gb": None, "stage": stage, "tp": tp, "tp_group": group}


def _base(assignments, cluster, global_batch, pipeline=None, tp=True) -> dict:
    d = {"version": 1, "cluster": cluster, "model": "tiny", "global_batch": global_batch, "seq": 32, "dtype": "fp32",
         "recompute": "none", "zero": 1, "assignments": assignments, "predicted_iteration_s": 1.0,
         "predicted_samples_per_s": 1.0, "tensor_parallel": tp}
    if pipeline is not None:
        d["pipeline"] = pipeline
    return d


def dp_tp_file() -> dict:
    """tp 2 × uneven DP 2: groups {0, 1} (rows 2, 60 % of the state) and {2, 3} (rows 1, 40 %)."""
    return _base([_asg(0, "n0", 2, 1, 0.6, tp=2, group=0), _asg(1, "n0", 2, 1, 0.6, tp=2, group=0),
                  _asg(2, "n0", 1, 1, 0.4, tp=2, group=2), _asg(3, "n0", 1, 1, 0.4, tp=2, group=2)],
                 _cluster(), 3)


def pipe_tp_file() -> dict:
    """2 stages × tp 2 × DP 2 on two nodes, as planner/geo/scale/plan_file.py writes it: a stage lists
    every device of its groups, each with the group's rows."""
    M = 2
    a = [_asg(i, "n0", r, M, f, tp=2, group=g, stage=0) for i, r, f, g in ((0, 2, .6, 0), (1, 2, .6, 0),
                                                                           (2, 1, .4, 2), (3, 1, .4, 2))]
    a += [_asg(4 + i, "n1", r, M, f, tp=2, group=4 + g, stage=1) for i, r, f, g in ((0, 1, .5, 0), (1, 1, .5, 0),
                                                                                   (2, 2, .5, 2), (3, 2, .5, 2))]
    a.append(_asg(8, "n1", 0, 0, 0.0))  # left out
    pipe = {"schedule": "1f1b", "micro_batch": 3, "num_microbatches": M, "simulated_ops": [], "stages": [
        {"first_layer": 0, "num_layers": 1, "devices": [0, 1, 2, 3], "rows": [2, 2, 1, 1], "datacenter": "n0"},
        {"first_layer": 1, "num_layers": 1, "devices": [4, 5, 6, 7], "rows": [1, 1, 2, 2], "datacenter": "n1"}]}
    return _base(a, _cluster((4, 5), ("n0", "n1")), 6, pipe)


def test_a_tp_plan_round_trips_and_counts_each_group_once():
    d = dp_tp_file()
    p = Plan.from_dict(d)
    assert p.tensor_parallel and p.tp_degree == 2
    assert [a.tp_group for a in p.assignments] == [0, 0, 2, 2] and all(a.tp == 2 for a in p.assignments)
    assert [[a.device_index for a in g] for g in p.tp_groups()] == [[0, 1], [2, 3]]
    out = p.to_dict()
    assert out["tensor_parallel"] is True
    assert [{k: a[k] for k in ("stage", "tp", "tp_group")} for a in out["assignments"]] == \
        [{"stage": None, "tp": 2, "tp_group": g} for g in (0, 0, 2, 2)]
    assert Plan.from_dict(out) == p


def test_a_tp_pipeline_file_reads_one_entry_per_group_and_writes_every_device_back():
    d = pipe_tp_file()
    p = Plan.from_dict(d)
    assert [st.devices for st in p.pipeline.stages] == [(0, 2), (4, 6)]
    assert [st.rows for st in p.pipeline.stages] == [(2, 1), (1, 2)]
    assert [a.stage for a in p.assignments] == [0] * 4 + [1] * 4 + [None]
    out = p.to_dict()
    assert out["pipeline"]["stages"] == d["pipeline"]["stages"]
    assert Plan.from_dict(out) == p


def test_a_tp1_planner_file_keeps_its_keys():
    d = _base([_asg(i, "n0", 1, 2, 0.25, group=i, stage=0) for i in range(4)], _cluster(), 8, tp=False,
              pipeline={"schedule": "1f1b", "micro_batch": 4, "num_microbatches": 2, "stages": [
                  {"first_layer": 0, "num_layers": 2, "devices": [0, 1, 2, 3], "rows": [1, 1, 1, 1]}]})
    p = Plan.from_dict(d)
    assert not p.tensor_parallel and p.tp_degree == 1 and p.pipeline.stages[0].devices == (0, 1, 2, 3)
    out = p.to_dict()
    assert out["tensor_parallel"] is False and [a["tp_group"] for a in out["assignments"]] == [0, 1, 2, 3]
    assert Plan.from_dict(out) == p


def test_an_old_plan_file_reads_and_writes_as_before():
    d = dp_tp_file()
    for a, f in zip(d["assignments"], (0.3, 0.3, 0.2, 0.2)):
        for k in ("stage", "tp", "tp_group"):
            del a[k]
        a["shard_fraction"] = f
    del d["tensor_parallel"]
    d["global_batch"] = 6
    p = Plan.from_dict(d)
    assert not p.tensor_parallel and all((a.stage, a.tp, a.tp_group) == (None, 1, None) for a in p.assignments)
    out = p.to_dict()
    assert "tensor_parallel" not in out and not any({"stage", "tp", "tp_group"} & set(a) for a in out["assignments"])
    assert Plan.from_dict(out) == p
    with pytest.raises(ValueError, match="batches sum to 6, not the global batch 3"):  # the old rule, unchanged
        Plan.from_dict({**d, "global_batch": 3})


def _broken(change, base=dp_tp_file) -> dict:
    d = copy.deepcopy(base())
    change(d)
    return d


def _set(i, **kw):
    return lambda d: d["assignments"][i].update(**kw)


BAD = [
    (_set(1, tp=3), r"device 1: tp must be one of 1, 2, 4, 8, got 3"),
    (_set(1, tp_group=None), r"device 1: tp 2 needs tp_group"),
    (_set(1, tp=1, tp_group=0), r"device 1: tp 1 is a group of one, so tp_group must be the device itself"),
    (_set(3, tp_group=0), r"device 0 \(tp_group 0\): a TP group of tp 2 needs exactly 2 devices with that tp, got 3"),
    (_set(1, micro_batch=1, batch=1),
     r"device 1 \(tp_group 0\): the devices of a TP group carry the same micro_batch, accum_steps and shard_fraction"),
    (_set(3, shard_fraction=0.3), r"device 3 \(tp_group 2\): the devices of a TP group carry the same"),
    (lambda d: [d["assignments"][i].update(tp_group=1) for i in (0, 1)],
     r"device 0 \(tp_group 1\): tp_group must be the group's first \(lowest\) device index"),
    (lambda d: d.update(tensor_parallel=False), r"tensor_parallel is false but device 0 has tp 2"),
    (lambda d: d.update(global_batch=6), r"batches sum to 3, not the global batch 6"),
    (_set(0, stage=1), r"device 1 \(tp_group 0\): the devices of a TP group are in one stage: stage None here"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_a_bad_tp_group_is_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message) as e:
        Plan.from_dict(_broken(change))
    assert "\n" not in str(e.value)


def test_a_tp_group_across_nodes_is_refused():
    d = dp_tp_file()
    d["cluster"] = _cluster((2, 2), ("n0", "n1"))
    for a, node in zip(d["assignments"], ("n0", "n0", "n1", "n1")):
        a["node"] = node
    for i, g in ((1, 1), (2, 1)):  # groups {0} ... {1, 2}: devices 1 (n0) and 2 (n1)
        d["assignments"][i]["tp_group"] = g
    d["assignments"][0].update(tp=1, tp_group=None, micro_batch=0, accum_steps=0, batch=0, shard_fraction=0.0)
    d["assignments"][3].update(tp=1, tp_group=None)
    d["assignments"][1].update(micro_batch=1, batch=1, shard_fraction=0.4)
    d["assignments"][2].update(micro_batch=1, batch=1, shard_fraction=0.4)
    d["assignments"][3].update(micro_batch=2, batch=2, shard_fraction=0.6)
    with pytest.raises(ValueError, match=r"device 2 \(tp_group 1\): a TP group lives on one node: it is on 'n1'"):
        Plan.from_dict(d)


def test_a_pipeline_stage_giving_a_group_two_row_counts_is_refused():
    d = pipe_tp_file()
    d["pipeline"]["stages"][0]["rows"] = [2, 1, 1, 1]
    with pytest.raises(ValueError, match=r"stage 0 gives device 1 rows 1, its TP group \(device 0\) rows 2"):
        Plan.from_dict(d)
    d = pipe_tp_file()
    d["assignments"][5]["stage"] = d["assignments"][4]["stage"] = 0
    with pytest.raises(ValueError, match=r"device 4 has stage 0, but the pipeline lists its TP group"):
        Plan.from_dict(d)


def test_the_door_refuses_what_the_tp_runtime_does_not_run_in_one_line():
    p = Plan.from_dict(dp_tp_file())
    check_tensor_parallel(p)  # zero 1, no checkpoints, random weights: runs
    cases = [
        (dict(init_from="/hf"), "--init-from: a tensor-parallel plan (tp 2) cannot start from Hugging Face weights"),
        (dict(resume=True), "--resume: a tensor-parallel plan (tp 2) writes no checkpoints yet"),
        (dict(checkpoint_every=5), "--checkpoint-every: a tensor-parallel plan (tp 2) writes no checkpoints yet"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
            check_tensor_parallel(p, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"runs at zero 1 only, this one says zero 2"):
        check_tensor_parallel(Plan.from_dict({**dp_tp_file(), "zero": 2}))
    # tp 2 on node n0 (one group), tp 4 on node n1 (one group): two degrees
    mixed = _base([_asg(i, "n0", 2, 1, 0.5, tp=2, group=0) for i in range(2)]
                  + [_asg(2 + i, "n1", 2, 1, 0.5, tp=4, group=2) for i in range(4)], _cluster((2, 4), ("n0", "n1")), 4)
    with pytest.raises(ValueError, match=r"TP groups have degrees 2, 4: the runtime runs one TP degree"):
        check_tensor_parallel(Plan.from_dict(mixed))
    old = Plan.from_dict({**dp_tp_file(), "zero": 3, "param_dtype": "bf16"} | {"tensor_parallel": True})
    with pytest.raises(ValueError, match="zero 3"):
        check_tensor_parallel(old)
