# pattern: image classifier in the examples/mnist style: --no-cuda flag, use_cuda = torch.cuda.is_available(), cuda_kwargs (pin_memory), Dropout, StepLR, test loop with argmax accuracy
# launch: hal run
# twin: --no-cuda
# compare: exact
# expect: ok
"""A tiny CNN on random 12x12 "digits", structured like the PyTorch MNIST example.

    python image_classifier_cnn.py              # GPU
    python image_classifier_cnn.py --no-cuda    # the example's own CPU switch: the twin
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(model, device, train_loader, optimizer):
    model.train()
    losses = []
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1, keepdim=True).eq(target.view_as(output.argmax(dim=1, keepdim=True))).sum().item()
    return test_loss / len(test_loader.dataset), correct


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST-style Example (tiny)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--no-cuda", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if use_cuda else "cpu")
    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}
    test_kwargs = {"batch_size": 32}
    if use_cuda:
        cuda_kwargs = {"num_workers": 0, "pin_memory": True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)

    g = torch.Generator().manual_seed(0)
    images = torch.randn(48, 1, 12, 12, generator=g)
    labels = torch.randint(0, 10, (48,), generator=g)
    train_loader = DataLoader(TensorDataset(images[:32], labels[:32]), **train_kwargs)
    test_loader = DataLoader(TensorDataset(images[32:], labels[32:]), **test_kwargs)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    losses = []
    for epoch in range(1, args.epochs + 1):
        losses += train(model, device, train_loader, optimizer)
        test_loss, correct = test(model, device, test_loader)
        scheduler.step()
    print("RESULT " + json.dumps({
        "losses": losses,
        "test_loss": test_loss,
        "correct": correct,
    }), flush=True)


if __name__ == "__main__":
    main()
