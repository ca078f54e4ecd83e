# pattern: whole-step CUDA graph capture: torch.cuda.CUDAGraph + side-stream warm-up + torch.cuda.graph(g) + g.replay() (the CUDA Graphs docs' recipe)
# launch: hal run
# twin: none
# expect: error:CUDAGraph
"""Capture forward+backward+optimizer step once, then replay the graph with new data copied into
static inputs (the "whole network capture" example of the CUDA semantics notes).

A graph replays recorded device work; the host has no such thing, and running the captured
region eagerly once would silently train on the capture batch only. The expected outcome is
ONE error line naming this script's line that builds the graph, and a non-zero exit - not a
traceback, and not a result.
"""
import json

import torch
import torch.nn as nn

N, D_in, H, D_out = 32, 16, 32, 4
model = nn.Sequential(nn.Linear(D_in, H), nn.Dropout(p=0.2), nn.Linear(H, D_out)).cuda()
loss_fn = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

static_input = torch.randn(N, D_in, device="cuda")
static_target = torch.randn(N, D_out, device="cuda")

s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for i in range(3):
        optimizer.zero_grad(set_to_none=True)
        y_pred = model(static_input)
        loss = loss_fn(y_pred, static_target)
        loss.backward()
        optimizer.step()
torch.cuda.current_stream().wait_stream(s)

g = torch.cuda.CUDAGraph()
optimizer.zero_grad(set_to_none=True)
with torch.cuda.graph(g):
    static_y_pred = model(static_input)
    static_loss = loss_fn(static_y_pred, static_target)
    static_loss.backward()
    optimizer.step()

losses = []
for _ in range(3):
    static_input.copy_(torch.randn(N, D_in, device="cuda"))
    static_target.copy_(torch.randn(N, D_out, device="cuda"))
    g.replay()
    losses.append(static_loss.item())

print("RESULT " + json.dumps({"losses": losses}), flush=True)
