# pattern: Hugging Face-style training loop: batches as dicts moved with {k: v.to(device)}, model(**batch) returning a loss, gradient accumulation, linear warmup LambdaLR, clip_grad_norm_, torch.cuda.empty_cache() before eval
# launch: hal run
# twin: --device cpu
# compare: exact
# expect: ok
"""A transformers-Trainer-like loop around a tiny classifier with an attention mask.

    python hf_style_trainer.py                  # cuda
    python hf_style_trainer.py --device cpu     # the twin
"""
import argparse
import json

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR


class TinyForSequenceClassification(nn.Module):
    def __init__(self, vocab_size=100, hidden=24, num_labels=3):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.encoder = nn.GRU(hidden, hidden, batch_first=True)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden, _ = self.encoder(self.embeddings(input_ids))
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.classifier(pooled)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))
    return LambdaLR(optimizer, lr_lambda)


def make_batches(n_batches, bsz=6, seq=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        lengths = torch.randint(3, seq + 1, (bsz,), generator=g)
        attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        input_ids = torch.randint(1, 100, (bsz, seq), generator=g) * attention_mask
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask,
                        "labels": torch.randint(0, 3, (bsz,), generator=g)})
    return batches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(42)
    model = TinyForSequenceClassification().to(device)
    no_decay = ["bias"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=5e-3)
    train_batches = make_batches(8)
    num_update_steps = len(train_batches) // args.gradient_accumulation_steps
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, 1, num_update_steps)

    model.train()
    losses = []
    for step, batch in enumerate(train_batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs["loss"] / args.gradient_accumulation_steps
        loss.backward()
        if (step + 1) % args.gradient_accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item() * args.gradient_accumulation_steps)

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in make_batches(2, seed=1):
            batch = {k: v.to(device) for k, v in batch.items()}
            preds = model(**batch)["logits"].argmax(-1)
            correct += (preds == batch["labels"]).sum().item()
    print("RESULT " + json.dumps({"losses": losses, "eval_correct": correct,
                                  "last_lr": lr_scheduler.get_last_lr()[0]}), flush=True)


if __name__ == "__main__":
    main()
