# pattern: side-stream prefetch and timing: torch.cuda.Stream, with torch.cuda.stream(s), current_stream().wait_stream(s), tensor.record_stream(...), torch.cuda.Event(enable_timing=True) + elapsed_time
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
"""An apex-style data prefetcher (copies the next batch on a side stream while the current one
trains) and per-step timing with CUDA events.

On the host, work on any stream runs in order, so the prefetcher is exact and the events time
wall-clock: the run must complete with the twin's numbers and positive step times.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()


class DataPrefetcher:
    def __init__(self, batches):
        self.batches = iter(batches)
        self.stream = torch.cuda.Stream()
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.batches)
        except StopIteration:
            self.next_input = self.next_target = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input, target = self.next_input, self.next_target
        if input is not None:
            input.record_stream(torch.cuda.current_stream())
            target.record_stream(torch.cuda.current_stream())
        self.preload()
        return input, target


torch.manual_seed(0)
g = torch.Generator().manual_seed(11)
batches = [(torch.randn(16, 20, generator=g).pin_memory() if not args.cpu else torch.randn(16, 20, generator=g),
            torch.randint(0, 5, (16,), generator=g)) for _ in range(4)]
device = "cpu" if args.cpu else "cuda"
model = nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 5)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

losses, times_ms = [], []
if args.cpu:
    loader = iter(batches)
    fetch = lambda: next(loader, (None, None))  # noqa: E731
else:
    prefetcher = DataPrefetcher(batches)
    fetch = prefetcher.next
input, target = fetch()
while input is not None:
    if not args.cpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    loss = F.cross_entropy(model(input), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if not args.cpu:
        end.record()
        torch.cuda.synchronize()
        times_ms.append(start.elapsed_time(end))
    losses.append(loss.item())
    input, target = fetch()

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "timed_steps_positive": all(t > 0 for t in times_ms) if not args.cpu else True,
    "info": {"step_ms": times_ms},
}), flush=True)
