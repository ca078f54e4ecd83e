import cProfile, pstats, torch, io
from hal import ops
dev = "cuda"
q = torch.randn(1, 16, 2048, 128, device=dev, dtype=torch.bfloat16)
cos = torch.randn(2048, 128, device=dev, dtype=torch.bfloat16); sin = torch.randn(2048, 128, device=dev, dtype=torch.bfloat16)
x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16); w = torch.ones(2048, device=dev, dtype=torch.bfloat16)
with torch.no_grad():
    for _ in range(20): ops.rotary_embedding(q, cos, sin); ops.rms_norm(x, w, 1e-6)
    torch.cuda.synchronize()
    for name, fn in (("rotary", lambda: ops.rotary_embedding(q, cos, sin)), ("rms_norm", lambda: ops.rms_norm(x, w, 1e-6))):
        pr = cProfile.Profile(); pr.enable()
        for _ in range(300): fn()
        pr.disable(); torch.cuda.synchronize()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(name); print(s.getvalue()[-6000:])
