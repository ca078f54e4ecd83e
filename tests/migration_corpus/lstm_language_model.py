# pattern: word-level LSTM language model (examples/word_language_model style): --cuda flag, batchify, truncated BPTT with repackage_hidden, clip_grad_norm_, manual SGD update
# launch: hal run
# args: --cuda
# twin:
# compare: exact
# expect: ok
"""A 2-layer LSTM LM on a synthetic token stream, trained the way the PyTorch word_language_model
example does it. Run with --cuda on a GPU; the host twin is the same file without the flag.
"""
import argparse
import json
import math

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="PyTorch LSTM language model (tiny)")
parser.add_argument("--cuda", action="store_true", help="use CUDA")
parser.add_argument("--emsize", type=int, default=16)
parser.add_argument("--nhid", type=int, default=24)
parser.add_argument("--bptt", type=int, default=8)
parser.add_argument("--lr", type=float, default=5.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--seed", type=int, default=1111)
args = parser.parse_args()

torch.manual_seed(args.seed)
if torch.cuda.is_available() and not args.cuda:
    print("WARNING: You have a CUDA device, so you should probably run with --cuda")
device = torch.device("cuda" if args.cuda else "cpu")


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output))
        return nn.functional.log_softmax(decoded.view(-1, decoded.size(-1)), dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous().to(device)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


ntokens = 40
corpus = torch.randint(0, ntokens, (400,), generator=torch.Generator().manual_seed(0))
train_data = batchify(corpus, 4)
model = RNNModel(ntokens, args.emsize, args.nhid, 2).to(device)
criterion = nn.NLLLoss()

model.train()
hidden = model.init_hidden(4)
losses = []
for batch, i in enumerate(range(0, 4 * args.bptt, args.bptt)):
    data, targets = get_batch(train_data, i)
    model.zero_grad()
    hidden = repackage_hidden(hidden)
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-args.lr)
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "ppl": math.exp(losses[-1]),
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
}), flush=True)
