import torch

from profiler.memtrack import PeakMemory


def test_live_tensor_bytes_count_resident_state_activations_and_frees():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 512, bias=False)  # weight 512*256*4 = 512 KiB
    x = torch.randn(64, 256)
    w_bytes = 512 * 256 * 4
    with PeakMemory(torch.device("cpu"), [lin.weight]) as pm:
        y = lin(x)  # (64, 512) fp32 = 128 KiB
        (y * y).sum().backward()  # y*y (128 KiB) and grad weight (512 KiB) while y lives
        del y
    # resident weight + y + y*y + its grad-of-square temporaries + weight grad: at least the
    # weight, y and the gradient, at most that plus a few activation-sized temporaries
    floor = w_bytes + 64 * 512 * 4 + w_bytes
    assert floor <= pm.peak_bytes <= floor + 4 * 64 * 512 * 4
    # a bigger activation raises the measured peak by about its size
    with PeakMemory(torch.device("cpu"), [lin.weight]) as pm2:
        big = torch.zeros(1024, 1024)  # 4 MiB
        del big
    assert pm2.peak_bytes == w_bytes + 4 * 2**20


def test_views_and_inplace_ops_are_not_counted_twice():
    base = torch.zeros(1000)
    with PeakMemory(torch.device("cpu"), [base, base[10:20]]) as pm:
        base.add_(1.0)
        v = base.view(10, 100)
        v.mul_(2.0)
    assert pm.peak_bytes == 4000
