import pytest
import torch

from models.decoder import build_model, num_parameters
from contracts.specs import PRESETS


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "gpt2", "qwen2-0.5b", "llama3-8b", "mistral-7b"])
def test_param_count_equals_spec(name):
    spec = PRESETS[name]
    with torch.device("meta"):  # shapes only, no memory
        model = build_model(spec)
    assert num_parameters(model) == spec.num_params


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_forward_shape_and_deterministic_init(name):
    spec = PRESETS[name]
    torch.manual_seed(3)
    a = build_model(spec)
    torch.manual_seed(3)
    b = build_model(spec)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    idx = torch.randint(0, spec.vocab_size, (2, 16))
    assert a(idx).shape == (2, 16, spec.vocab_size)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_recompute_gives_same_gradients(name):
    spec = PRESETS[name]
    idx = torch.randint(0, spec.vocab_size, (2, 32))
    grads = []
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        m = build_model(spec, recompute)
        m(idx).float().square().mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def test_causal():
    """A token's logits must not depend on later tokens."""
    spec = PRESETS["tiny-llama"]
    torch.manual_seed(0)
    m = build_model(spec)
    idx = torch.randint(0, spec.vocab_size, (1, 20))
    idx2 = idx.clone()
    idx2[0, 10:] = (idx2[0, 10:] + 1) % spec.vocab_size
    torch.testing.assert_close(m(idx)[0, :10], m(idx2)[0, :10])
    assert not torch.allclose(m(idx)[0, 10:], m(idx2)[0, 10:])


def test_bad_recompute():
    with pytest.raises(ValueError, match="recompute"):
        build_model(PRESETS["tiny"], "some")
