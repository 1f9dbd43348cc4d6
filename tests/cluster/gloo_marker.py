"""One device of tests/cluster/test_hosts.py's encryption check: its update, a marker tensor, all-reduced on a
gloo group over each given interface (rank 1 holds the marker, the others zeros), so that the marker's bytes
cross rank 1's link once per group: in the clear, or not.

Usage: python gloo_marker.py RANK WORLD ADDRESS:PORT:INTERFACE:PHRASE ...
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

rank, world = int(sys.argv[1]), int(sys.argv[2])
for group in sys.argv[3:]:
    address, port, interface, phrase = group.split(":", 3)
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(address, int(port), world, rank == 0, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    pg = dist.ProcessGroupGloo(store, rank, world, options)
    # ASCII bytes read as float32: normal numbers (every high byte < 0x7f), so adding zeros keeps them exact
    marker = torch.frombuffer(bytearray(phrase.encode() * 1024), dtype=torch.float32)
    update = marker.clone() if rank == 1 else torch.zeros_like(marker)
    pg.allreduce([update]).wait()
    assert torch.equal(update, marker), "the all-reduce changed the marker"
    print(f"rank {rank}: all-reduce over {interface} ok", flush=True)
# Every all-reduce has returned here; leaving without the groups' destructors: gloo's threads torn down at the
# interpreter's exit can end the process in std::terminate (exit code 134) after the check itself passed
os._exit(0)
