"""The one collective wait (``cluster.peers.wait``): a timeout is one line naming what and the fix, within
its deadline; anything else is left as it is. Device functions live at module level so spawned processes
import them."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from edgetrain.cluster.peers import wait
from edgetrain.errors import EdgetrainError

from edgetrain_testing import on_devices

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms for recv operation to complete"
PEER_GONE = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"


class FailingWork(dist.Work):
    """A collective whose wait fails with ``message`` (PyTorch lets Python subclass ``Work``)."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def wait(self, timeout=None) -> bool:
        raise RuntimeError(self.message)


def receive_from_a_silent_peer(rank: int, world: int, timeout_s: float) -> dict | None:
    """Device 0 waits for a message device 1 never sends; device 1 stays up past device 0's deadline."""
    if rank == 1:
        time.sleep(timeout_s + 2)
        return None
    started = time.monotonic()
    try:
        wait(dist.irecv(torch.zeros(4), src=1), timeout_s, "the test's receive")
    except EdgetrainError as e:
        return {"error": str(e), "seconds": time.monotonic() - started}
    return {"error": None}


def assert_one_line_timeout(message: str, what: str, timeout_s: float) -> None:
    assert "\n" not in message
    assert message.startswith(f"{what} timed out after {timeout_s:g} s: a device stopped responding")
    assert "raise --timeout" in message


def test_a_peer_that_never_answers_is_one_line_within_the_deadline():
    device0, _ = on_devices(receive_from_a_silent_peer, 2, 1.0)
    assert device0["error"] is not None, "the receive completed although nobody sent"
    assert_one_line_timeout(device0["error"], "the test's receive", 1.0)
    assert 0.9 <= device0["seconds"] < 3.0


def test_a_future_that_never_completes_is_one_line_within_the_deadline():
    started = time.monotonic()
    with pytest.raises(EdgetrainError) as e:
        wait(torch.futures.Future(), 0.2, "PowerSGD all-reduce")
    assert 0.2 <= time.monotonic() - started < 1.0
    assert_one_line_timeout(str(e.value), "PowerSGD all-reduce", 0.2)


def test_a_done_future_gives_its_value():
    done = torch.futures.Future()
    done.set_result(torch.ones(2))
    assert torch.equal(wait(done, 1.0, "x"), torch.ones(2))


def test_gloos_timeout_becomes_the_one_line():
    with pytest.raises(EdgetrainError) as e:
        wait(FailingWork(GLOO_TIMEOUT), 5.0, "topk all-gather")
    assert_one_line_timeout(str(e.value), "topk all-gather", 5.0)


@pytest.mark.parametrize("pending", [FailingWork(PEER_GONE), torch.futures.Future()], ids=["work", "future"])
def test_a_peer_that_died_is_not_called_a_timeout(pending):
    """Not a timeout: the echo of another device's failure, which the launcher blames (cluster/launch.py)."""
    if isinstance(pending, torch.futures.Future):
        pending.set_exception(RuntimeError(PEER_GONE))
    with pytest.raises(RuntimeError, match="Connection closed by peer") as e:
        wait(pending, 5.0, "tiled training: halo exchange")
    assert not isinstance(e.value, EdgetrainError)
