"""Eager host cost per call of hal's Triton ops vs the reference ops (small shapes: launch-bound)."""
import time, torch
from hal import ops
from hal.ops import registry
from kernels.triton import library as lib

dev = "cuda"
x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
q = torch.randn(1, 16, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
cos = torch.randn(2048, 128, device=dev, dtype=torch.bfloat16); sin = torch.randn(2048, 128, device=dev, dtype=torch.bfloat16)
g = torch.randn(2048, 2 * 2816, device=dev, dtype=torch.bfloat16, requires_grad=True)
print("traceable", lib.TRACEABLE, "impls", {n: [i.name for i in registry.implementations(n)] for n in ("rms_norm", "swiglu", "rotary_embedding")})

def timeit(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize(); total = (time.perf_counter() - t) / n
    return host * 1e6, total * 1e6

cases = {
 "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
 "rotary": lambda: ops.rotary_embedding(q, cos, sin),
 "swiglu": lambda: ops.swiglu(g),
}
from hal.op_registry import REFERENCE
for name, fn in cases.items():
    with torch.no_grad():
        a = timeit(fn)
    def fb(fn=fn):
        y = fn(); y.sum().backward()
    b = timeit(fb, 100)
    print(f"{name:10s} dispatched: fwd host {a[0]:7.1f} us (with device {a[1]:7.1f}); fwd+bwd host {b[0]:7.1f} us ({b[1]:7.1f})")
# reference only
for op in registry.names():
    for impl in registry.implementations(op):
        if impl.name != REFERENCE:
            registry.unregister(op, impl.name)
for name, fn in cases.items():
    with torch.no_grad():
        a = timeit(fn)
    def fb(fn=fn):
        y = fn(); y.sum().backward()
    b = timeit(fb, 100)
    print(f"{name:10s} reference : fwd host {a[0]:7.1f} us (with device {a[1]:7.1f}); fwd+bwd host {b[0]:7.1f} us ({b[1]:7.1f})")
# raw triton launch
from kernels.triton import norm
with torch.no_grad():
    a = timeit(lambda: norm.rms_norm_forward(x, w, 1e-6))
print(f"raw norm.rms_norm_forward host {a[0]:.1f} us ({a[1]:.1f})")
with torch.no_grad():
    a = timeit(lambda: lib._rms_norm(x, w, 1e-6))
print(f"lib op hal_triton::rms_norm host {a[0]:.1f} us ({a[1]:.1f})")
