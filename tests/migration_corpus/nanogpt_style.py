# pattern: nanoGPT train.py conventions: device string + device_type = 'cuda' if 'cuda' in device, dtype from torch.cuda.is_bf16_supported(), ctx = torch.amp.autocast(device_type=..., dtype=ptdtype), torch.cuda.amp.GradScaler(enabled=dtype == 'float16'), pin_memory().to(device, non_blocking=True), TF32 flags, estimate of tokens/s
# launch: hal run
# twin: --device=cpu
# compare: rtol=2e-2
# expect: warn:torch.backends.cuda.matmul.allow_tf32
# expect: warn:torch.backends.cudnn.allow_tf32
"""A nanoGPT-shaped training script (configurator-style --key=value overrides, get_batch with
pinned memory, autocast context chosen from the device string), one tiny block, three iterations.

The twin is nanoGPT's own CPU path (--device=cpu), which runs fp32 under nullcontext, while the
GPU path runs bf16 autocast: losses are compared within rtol 2e-2 (bf16 vs fp32 after 3 steps).
"""
import json
import math
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
batch_size = 4
block_size = 16
n_embd = 32
n_head = 2
vocab_size = 65
learning_rate = 6e-4
max_iters = 3
device = "cuda"  # examples: 'cpu', 'cuda', 'cuda:0', 'cuda:1' etc.
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
for arg in sys.argv[1:]:  # poor man's configurator
    key, val = arg[2:].split("=")
    globals()[key] = type(globals()[key])(val)
# -----------------------------------------------------------------------------

torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True  # allow tf32 on matmul
torch.backends.cudnn.allow_tf32 = True  # allow tf32 on cudnn
device_type = "cuda" if "cuda" in device else "cpu"  # for later use in torch.autocast
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

data = torch.randint(0, vocab_size, (2000,), generator=torch.Generator().manual_seed(0))


def get_batch(step):
    g = torch.Generator().manual_seed(step)
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


model = GPT()
model.to(device)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)

X, Y = get_batch(0)
losses = []
t0 = time.time()
for iter_num in range(max_iters):
    with ctx:
        logits, loss = model(X, Y)
    X, Y = get_batch(iter_num + 1)  # async prefetch next batch while the GPU is busy
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
dt = time.time() - t0
print(f"iter {max_iters}: loss {losses[-1]:.4f}, {max_iters * batch_size * block_size / dt:.0f} tokens/s", flush=True)
print("RESULT " + json.dumps({
    "losses": losses,
    "initial_loss_near_uniform": abs(losses[0] - math.log(vocab_size)) < 0.5,
    "info": {"dtype": dtype, "device_type": device_type},
}), flush=True)
