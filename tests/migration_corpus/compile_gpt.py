# pattern: torch.compile of a nanoGPT-style model on "cuda"; graph breaks counted (torch._dynamo.utils.counters, torch._dynamo.explain) and reported
# launch: hal run
# args: --compile-backend aot_eager
# twin: --device cpu --compile-backend aot_eager
# compare: exact
# expect: ok
"""A one-block GPT compiled with torch.compile, trained for a few steps, graph breaks reported.

The forward builds its position ids with ``torch.arange(..., device=idx.device)`` and its causal
mask with ``torch.ones(..., device=...)``, as nanoGPT and minGPT do: the shim's device mapping must
not add graph breaks to a model that compiles to one graph on a real GPU (and on the host twin).

--compile-backend (as in HF's --torch_compile_backend) defaults to inductor; the corpus runs
aot_eager: Dynamo's capture and AOT autograd - what the shim can disturb - are the same, and the
host's C++ compile of inductor kernels (~30 s cold on two cores) is left out of the test budget.
"""
import argparse
import json
import math

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def attn(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=16, n_embd=32, n_head=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.block = Block(n_embd, n_head)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        logits = self.lm_head(self.ln_f(self.block(x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args()

    torch.manual_seed(1337)
    model = GPT().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 64, (8, 17))
    x = data[:, :-1].contiguous().to(args.device)
    y = data[:, 1:].contiguous().to(args.device)

    explanation = torch._dynamo.explain(model)(x, y)
    torch._dynamo.reset()
    counters.clear()

    compiled = torch.compile(model, backend=args.compile_backend)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    print("RESULT " + json.dumps({
        "graph_breaks": sum(counters["graph_break"].values()),
        "explain_graph_breaks": explanation.graph_break_count,
        "explain_graphs": explanation.graph_count,
        "losses": losses,
        "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
        "info": {"break_reasons": sorted({reason.splitlines()[0] for reason in counters["graph_break"]})[:5]},
    }), flush=True)


if __name__ == "__main__":
    main()
