"""Which gloo collectives take CUDA tensors on this machine: two processes on one GPU, each op tried alone.

Run: python benchmarks/gloo_cuda_probe.py  (prints one line per op: ok, or the error's first line)."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def probe(rank: int, world: int, init: str, op: str, queue) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.cuda.set_device(0)
    t = torch.full((8,), float(rank + 1), device="cuda")
    try:
        if op == "all_reduce":
            dist.all_reduce(t)
        elif op == "broadcast":
            dist.broadcast(t, src=0)
        elif op == "all_gather_into_tensor":
            dist.all_gather_into_tensor(torch.empty(8 * world, device="cuda"), t)
        elif op == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(torch.empty(8 // world, device="cuda"), t)
        elif op == "send_recv":
            dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        elif op == "all_to_all_single":
            dist.all_to_all_single(torch.empty_like(t), t)
        torch.cuda.synchronize()
        queue.put((rank, "ok"))
    except Exception as err:  # noqa: BLE001 - the probe reports whatever gloo says
        queue.put((rank, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for op in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "send_recv",
               "all_to_all_single"):
        init = f"file://{tempfile.mkdtemp()}/store"
        queue = ctx.Queue()
        procs = [ctx.Process(target=probe, args=(r, 2, init, op, queue)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        results = {}
        while not queue.empty():
            r, said = queue.get()
            results[r] = said
        codes = [p.exitcode for p in procs]
        print(f"{op:24s} {results.get(0, 'no answer')} | exit codes {codes}", flush=True)
    sys.exit(0)
