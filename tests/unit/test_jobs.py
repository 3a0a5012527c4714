import pytest

from contracts.jobs import JobSpec


def test_round_trip_and_derived_fields():
    j = JobSpec("a", "gpt2", 64, 1024, 100, 5.5, priority=2, requested_type="T4", requested_gpus=4)
    assert JobSpec.from_dict(j.to_dict()) == j
    assert j.tokens == 100 * 64 * 1024
    assert j.spec.name == "gpt2"


@pytest.mark.parametrize("kwargs, words", [
    (dict(global_batch=0), "global_batch"),
    (dict(seq=-1), "seq"),
    (dict(steps=1.5), "steps"),
    (dict(submit_s=float("nan")), "submit_s"),
    (dict(submit_s=-1), "submit_s"),
    (dict(requested_type="T4"), "together"),
    (dict(requested_type="T4", requested_gpus=0), "requested_gpus"),
    (dict(job_id=""), "job_id"),
])
def test_validation_names_the_field(kwargs, words):
    base = dict(job_id="a", model="gpt2", global_batch=8, seq=128, steps=10, submit_s=0.0)
    with pytest.raises(ValueError, match=words):
        JobSpec(**{**base, **kwargs})


def test_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        JobSpec.from_dict({"job_id": "a", "model": "gpt2", "global_batch": 8, "seq": 8, "steps": 1,
                           "submit_s": 0, "gpus": 3})
    with pytest.raises(ValueError, match="missing keys"):
        JobSpec.from_dict({"job_id": "a"})


def test_unknown_model_is_reported_when_resolved():
    with pytest.raises(ValueError, match="unknown model"):
        JobSpec("a", "no-such-model", 8, 8, 1, 0.0).spec
