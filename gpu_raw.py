"""Scratch (not committed): raw gloo throughput, N groups, sends posted from the main thread or N threads."""
import os, sys, time, threading, torch, torch.distributed as dist, torch.multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor

def body(rank, n_groups, mib, threaded, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(n_groups)]
    n = mib * 2**20 // 4
    t = torch.ones(n) if rank == 0 else torch.empty(n)
    parts = t.chunk(n_groups)
    pool = ThreadPoolExecutor(n_groups) if threaded else None
    best = 0
    for it in range(4):
        dist.barrier()
        s = time.perf_counter()
        fn = dist.isend if rank == 0 else dist.irecv
        if pool:
            works = list(pool.map(lambda pg: fn(pg[0], 1 - rank, group=pg[1]), zip(parts, groups)))
        else:
            works = [fn(p, 1 - rank, group=g) for p, g in zip(parts, groups)]
        for w in works: w.wait()
        dist.barrier()
        e = time.perf_counter() - s
        if it: best = max(best, mib * 2**20 / e / 1e9)
    if rank == 1: print(f"{n_groups} groups threaded={threaded} {mib} MiB {best:.2f} GB/s", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    for g in (1, 2, 4, 8):
        for threaded in (False, True):
            store = f"/tmp/glstore_{g}_{threaded}_{time.time()}"
            mp.spawn(body, args=(g, mib, threaded, store), nprocs=2)
