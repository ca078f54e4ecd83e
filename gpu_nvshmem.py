"""Scratch probe: torch symmetric-memory (NVSHMEM) all_to_all_vdev_2d / _2d_offset vs all_to_all_single, 4 GPUs."""
import os, sys, time, statistics, traceback
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def body(rank, world, T, H, ne, k, out_q):
    import torch.distributed._symmetric_memory as symm_mem
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    res = {"rank": rank}
    try:
        if hasattr(symm_mem, "set_backend"):
            symm_mem.set_backend("NVSHMEM")
        torch.empty(1, device=dev)
        group_name = dist.group.WORLD.group_name
        symm_mem.enable_symm_mem_for_group(group_name)
        E = ne * world
        gen = torch.Generator().manual_seed(100 + rank)
        experts = torch.topk(torch.softmax(torch.randn(T, E, generator=gen) * 2, -1), k, dim=-1).indices.reshape(-1)
        load = torch.bincount(experts, minlength=E)  # rank-major: expert e = r*ne + j
        order = torch.argsort(experts, stable=True)
        rows_n = T * k
        max_in = rows_n
        max_out = rows_n * world
        inp = symm_mem.empty((max_in, H), dtype=torch.bfloat16, device=dev)
        inp[:rows_n].copy_(torch.randn(rows_n, H, generator=gen).to(torch.bfloat16)[order // k])
        out = symm_mem.empty((max_out, H), dtype=torch.bfloat16, device=dev)
        back = symm_mem.empty((max_in, H), dtype=torch.bfloat16, device=dev)
        in_splits = symm_mem.empty(E, dtype=torch.int64, device=dev).copy_(load.to(dev))
        out_so = symm_mem.empty((2, E), dtype=torch.int64, device=dev)
        back_so = symm_mem.empty((2, E), dtype=torch.int64, device=dev)
        dist.barrier()

        def ours():
            torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, group_name, major_align=1)
            torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_so, back_so, group_name)

        ours(); torch.cuda.synchronize()
        res["roundtrip_equal"] = bool(torch.equal(back[:rows_n], inp[:rows_n]))
        res["out_splits"] = out_so[0].tolist()
        # raw baseline: same per-rank splits
        send = load.view(world, ne).sum(1).tolist()
        recv_t = torch.empty(world * 1, dtype=torch.int64, device=dev)
        dist.all_to_all_single(recv_t, torch.tensor(send, device=dev))
        recv = recv_t.tolist()
        there = torch.empty((sum(recv), H), dtype=torch.bfloat16, device=dev)
        back2 = torch.empty((rows_n, H), dtype=torch.bfloat16, device=dev)
        src = inp[:rows_n].clone()

        def raw():
            dist.all_to_all_single(there, src, recv, send)
            dist.all_to_all_single(back2, there, send, recv)

        def sync():
            torch.cuda.synchronize(); dist.barrier()

        def b2b(fn, n=20):
            sync(); t = time.perf_counter()
            for _ in range(n):
                fn()
            sync(); return (time.perf_counter() - t) / n

        for fn in (ours, raw):
            b2b(fn, 3)
        times = {"nvshmem": [], "raw": []}
        for _ in range(5):
            times["nvshmem"].append(b2b(ours)); times["raw"].append(b2b(raw))
        res.update({kk: statistics.median(v) for kk, v in times.items()})
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:800]
        res["tb"] = traceback.format_exc()[-1500:]
    out_q.put(res)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    world = 4
    for T in (4096, 16384):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=body, args=(r, world, T, 2048, 2, 2, q)) for r in range(world)]
        [p.start() for p in ps]
        got = [q.get(timeout=240) for _ in ps]
        [p.join(30) for p in ps]
        got.sort(key=lambda r: r["rank"])
        r0 = got[0]
        if "error" in r0:
            print("T", T, "error", r0["error"]); print(r0.get("tb")); break
        print(f"T={T}: roundtrip equal {[g['roundtrip_equal'] for g in got]}, nvshmem {max(g['nvshmem'] for g in got)*1e3:.3f} ms, "
              f"raw {max(g['raw'] for g in got)*1e3:.3f} ms, ratio raw/nvshmem {max(g['raw'] for g in got)/max(g['nvshmem'] for g in got):.3f}", flush=True)
