# pattern: torch.cuda.get_device_properties(0) / torch.cuda.get_device_capability() decide flash attention (sdpa_kernel FLASH_ATTENTION) and bf16; props.name / total_memory / multi_processor_count logged
# launch: hal run
# twin: none
# expect: warn:torch.cuda.get_device_capability
# may-warn: torch.cuda.get_device_properties
"""Capability-driven setup, as LLM training repos do it: sm80+ gets bf16 autocast and the flash
SDPA kernel, older GPUs fp16 + the math kernel; the device's name and memory are logged.

A host has no compute capability. Whatever the shim answers decides real code paths, so the
answer must be warned about once at the capability line (the properties' name/memory/cores have
host meanings: a note there is tolerated). The chosen path must then run to completion; no twin,
since the host's answer decides the path.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

props = torch.cuda.get_device_properties(0)
major, minor = torch.cuda.get_device_capability()
print(f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, sm{major}{minor}",
      flush=True)
use_flash = (major, minor) >= (8, 0)
amp_dtype = torch.bfloat16 if use_flash else torch.float16
sdpa_backends = [SDPBackend.FLASH_ATTENTION] if use_flash else [SDPBackend.MATH]


class Attention(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        with sdpa_kernel(sdpa_backends):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


torch.manual_seed(0)
model = Attention().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.cuda.amp.GradScaler(enabled=amp_dtype == torch.float16)
x = torch.randn(2, 16, 32, device="cuda")
losses = []
for _ in range(2):
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=amp_dtype):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "info": {"capability": [major, minor], "flash": use_flash, "amp_dtype": str(amp_dtype), "name": props.name,
             "total_memory": props.total_memory, "sms": props.multi_processor_count},
}), flush=True)
