"""The one activation meter (``cluster.memory.SavedTensorMeter``) against counts made by hand (plan's use of it:
tests/plan/test_plan_costs.py)."""
from __future__ import annotations

import torch
from torch import nn

from edgetrain.cluster.memory import SavedTensorMeter


def tiny_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_saved_bytes_of_a_tiny_net_match_a_hand_count():
    # batch 5, float32: the first Linear saves its input (5x4), ReLU its output (5x3), which the second
    # Linear saves again as its input (one storage, counted once); the weights are excluded
    net, x = tiny_net(), torch.randn(5, 4)
    with SavedTensorMeter(list(net.parameters())) as meter:
        out = net(x)
    assert meter.bytes == 5 * 4 * 4 + 5 * 3 * 4 == 140
    with SavedTensorMeter([*net.parameters(), x]) as without_input:
        out = net(x)
    assert without_input.bytes == 5 * 3 * 4
    out.sum().backward()  # the meter only looked: the graph still runs backward


def test_views_share_their_storage_and_nothing_outside_the_block_is_counted():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8)
    with SavedTensorMeter([weight]) as meter:
        y = x[:4] @ weight  # saves the view x[:4]: x's whole storage, 8x8 floats
        z = x[4:] @ weight  # another view of the same storage
    (y.sum() + z.sum() + (x @ weight).sum()).backward()
    assert meter.bytes == 8 * 8 * 4



def test_a_spawned_process_peak_is_its_own_not_its_launchers():
    import subprocess
    import sys

    held = b"\x01" * (1 << 30)  # the launcher holds 1 GiB (touched) when it starts the device
    code = "from edgetrain.cluster.throttle import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                 check=True).stdout)
    assert len(held) and 0 < child < 900, child  # torch and edgetrain imported: a few hundred MiB, not 1 GiB more
