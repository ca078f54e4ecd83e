# pattern: legacy tensor types: dtype = torch.cuda.FloatTensor, torch.cuda.FloatTensor(n, m), torch.cuda.LongTensor([...]), x.type('torch.cuda.FloatTensor'), x.type(torch.cuda.HalfTensor), isinstance(x, torch.cuda.FloatTensor)
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
"""The old "Learning PyTorch with Examples" two-layer net, written with PyTorch 0.3-era tensor types.

Code of that age picks its tensor type once (``dtype = torch.cuda.FloatTensor``), builds tensors
with the type's constructor and converts with ``.type(...)``; --cpu is the same script with the
host types (torch.FloatTensor, torch.LongTensor, torch.HalfTensor).
"""
import argparse
import json

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

if args.cpu:
    dtype, long_dtype, half_dtype, type_name = torch.FloatTensor, torch.LongTensor, torch.HalfTensor, "torch.FloatTensor"
else:
    dtype, long_dtype, half_dtype, type_name = torch.cuda.FloatTensor, torch.cuda.LongTensor, torch.cuda.HalfTensor, "torch.cuda.FloatTensor"

torch.manual_seed(0)
N, D_in, H, D_out = 16, 10, 20, 3

x = torch.randn(N, D_in).type(dtype)
labels = long_dtype([i % D_out for i in range(N)])
y = torch.zeros(N, D_out).type(type_name)
y[torch.arange(N).type(long_dtype), labels] = 1.0

w1 = dtype(D_in, H).normal_(0, 0.1)
w2 = dtype(H, D_out).normal_(0, 0.1)
assert isinstance(w1, dtype), type(w1)

learning_rate = 1e-2
losses = []
for t in range(5):
    h = x.mm(w1)
    h_relu = h.clamp(min=0)
    y_pred = h_relu.mm(w2)
    loss = (y_pred - y).pow(2).sum()
    losses.append(loss.item())

    grad_y_pred = 2.0 * (y_pred - y)
    grad_w2 = h_relu.t().mm(grad_y_pred)
    grad_h = grad_y_pred.mm(w2.t())
    grad_h[h < 0] = 0
    grad_w1 = x.t().mm(grad_h)
    w1 -= learning_rate * grad_w1
    w2 -= learning_rate * grad_w2

# fp16 inference copy, the old way
w1_half, x_half = w1.type(half_dtype), x.type(half_dtype)
half_out = x_half.mm(w1_half).clamp(min=0).float()
predictions = (x.mm(w1).clamp(min=0).mm(w2)).max(1)[1]
assert isinstance(predictions, long_dtype), type(predictions)

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": w1.double().sum().item() + w2.double().sum().item(),
    "half_checksum": half_out.double().sum().item(),
    "correct": int((predictions == labels).sum().item()),
    "tensor_type": w1.type().replace("cuda.", ""),
}), flush=True)
