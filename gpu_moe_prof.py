"""One GPU: where an MoE model step spends its time (path, device vs host)."""
import os, sys, time, tempfile, torch
sys.path.insert(0, os.getcwd())
from benchmarks.moe import MODEL_1B
from hal.collectives import init_distributed, shutdown, current_world
from hal.parallel.engine import PipelineEngine
from hal.parallel.model_config import ModelConfig
from hal.parallel.plan import ParallelPlan, StagePlan
from hal.parallel.topology import Topology, build_groups

store = tempfile.mktemp()
w = init_distributed("cuda", init_method=f"file://{store}", rank=0, world_size=1)
model = ModelConfig(**MODEL_1B)
plan = ParallelPlan((StagePlan("cuda", 1, model.num_layers),), "1f1b", 4, 1)
topo = Topology.from_plan(plan)
groups = build_groups(topo, current_world(), validate=False)
eng = PipelineEngine(model, plan, topo, groups, backend=w.backend, seed=0, device=w.device, dtype=torch.bfloat16, seq_len=2048)
tokens = torch.randint(0, model.vocab_size, (4, 1, 2049)).to(w.device)
def step():
    eng.module.zero_grad(set_to_none=True); eng.step_lazy(tokens)
for _ in range(2): step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(3): step()
torch.cuda.synchronize()
print("step s", (time.perf_counter() - t) / 3)
print("paths", {getattr(getattr(b, "moe", b), "path", "?") for b in eng.module.moe_blocks().values()})
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
ka = prof.key_averages()
print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=50))
print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
shutdown()
