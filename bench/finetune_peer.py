"""The peer of ``python -m tacl_jax.finetune`` for a generic classification config: the same
checkpoint fine-tuned with ``transformers`` in PyTorch (``BertForSequenceClassification``) on the
same rows in the same order with the same numbers, then the validation accuracy/F1.

    python bench/finetune_peer.py --config=configs/finetune_demo.py --seed=42 [--data_dir=DIR] [--out=peer.json]

Same as tacl_jax: the tokenizer folder's fast tokenizer (max length, longest-first truncation,
padding to max_len), labels by ``data.label_list``, the batch order
``tacl_jax.finetune.data.train_batch_indices`` (epochs of full batches), AdamW (torch's, β, ε,
weight decay off biases/LayerNorm as Trainer), gradient clipping at ``optim.clip_norm``, a linear
decay to 0 after ``warmup_steps`` (``get_linear_schedule_with_warmup``), dropout on in training.
What differs: the classifier's random init (torch's generator) and the dropout masks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from tacl_jax.config import load_config_file  # noqa: E402
from tacl_jax.finetune import data as data_lib, metrics  # noqa: E402


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/finetune_demo.py")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--data_dir", default="", help="train.jsonl and validation.jsonl from here instead")
    a = p.parse_args()
    over = {"seed": a.seed}
    if a.data_dir:
        over.update({"data.train_file": os.path.join(a.data_dir, "train.jsonl"),
                     "data.validation_file": os.path.join(a.data_dir, "validation.jsonl")})
    c = load_config_file(a.config, over)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(c.seed)
    folder = c.init.path
    tok = transformers.AutoTokenizer.from_pretrained(c.init.tokenizer_path or folder)
    labels = [str(x) for x in c.data.label_list]

    def encode(path):
        rows = data_lib.read_rows(path)
        enc = tok([r[c.data.text_column or "sentence"] for r in rows], max_length=c.max_len, truncation=True,
                  padding="max_length", return_tensors="pt")
        y = torch.tensor([labels.index(str(r[c.data.label_column or "label"])) for r in rows])
        return enc, y

    (train, y_train), (val, y_val) = encode(c.data.train_file), encode(c.data.validation_file)
    model = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=len(labels))
    n, b = len(y_train), c.global_batch_size
    per_epoch = n // b
    steps = c.num_train_steps if c.num_train_steps > 0 else max(1, math.ceil(c.num_train_epochs * per_epoch))
    no_decay = [p_ for name, p_ in model.named_parameters() if name.endswith("bias") or "LayerNorm" in name]
    decay = [p_ for name, p_ in model.named_parameters() if not (name.endswith("bias") or "LayerNorm" in name)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.optim.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=c.optim.learning_rate, betas=(c.optim.b1, c.optim.b2), eps=c.optim.eps)
    warmup = c.optim.warmup_steps if c.optim.warmup_steps >= 0 else round(c.optim.warmup_fraction * steps)
    sched = transformers.get_linear_schedule_with_warmup(opt, warmup, steps)
    t0 = time.time()
    model.train()
    for step in range(steps):
        idx = torch.from_numpy(data_lib.train_batch_indices(n, b, c.seed, step))
        out = model(input_ids=train["input_ids"][idx], attention_mask=train["attention_mask"][idx],
                    token_type_ids=train["token_type_ids"][idx], labels=y_train[idx])
        out.loss.backward()
        if c.optim.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.optim.clip_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        if (step + 1) % c.log_every == 0:
            print(f"step {step + 1}/{steps} loss={out.loss.item():.4f}", flush=True)
    model.eval()
    preds = []
    with torch.no_grad():
        for s in range(0, len(y_val), c.eval_batch_size):
            sl = slice(s, s + c.eval_batch_size)
            preds.append(model(input_ids=val["input_ids"][sl], attention_mask=val["attention_mask"][sl],
                               token_type_ids=val["token_type_ids"][sl]).logits.argmax(-1).numpy())
    preds = np.concatenate(preds)
    res = {f"eval_{k}": v for k, v in metrics.compute(c.data.metrics or ("accuracy",), preds, y_val.numpy()).items()}
    res.update(seed=c.seed, train_steps=steps, train_runtime=round(time.time() - t0, 1), impl="transformers")
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
