"""Tiny-BERT training with Hugging Face Trainer, accelerate and Ray Train, on a chosen backend.

No download: the model is built from a config, the data is generated. Each function returns (or
saves) the trained state dict so the tests compare ranks and backends."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(cfg)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 12):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(1, 64, (n, seq), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def _state(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# What holds a DDP Reducer (the Trainer, the prepared model) is kept until the process exits
# with os._exit. Freeing it frees the Reducer's process group under the GIL, and torch's
# ~ProcessGroupGloo joins its worker threads, one of which may still be dropping the last
# Trainer all_gather's tensors and needs the GIL for that: a deadlock (pytorch/pytorch#56297),
# seen here as the gloo reference rank of the Trainer test living on for 180 s after train()
# (gdb: main thread in ~ProcessGroupGloo -> thread::join, pt_gloo_runloop in
# ~AsyncAllgatherWork -> gil_scoped_acquire). smddp's group has no such thread.
_KEEP: list = []


def trainer(backend: str, out_dir: str):
    """The recipe: init_process_group(backend) before TrainingArguments, use_cpu=True."""
    from transformers import Trainer, TrainingArguments

    dist.init_process_group(backend)
    model = tiny_bert()
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    t = Trainer(model=model, args=args, train_dataset=Data())
    t.train()
    out = {"state": _state(model), "world": args.world_size, "backend": dist.get_backend(),
           "parallel_mode": str(args.parallel_mode)}
    dist.destroy_process_group()
    _KEEP.append(t)  # rank_entry ends with os._exit: see _KEEP
    return out


def accelerate_main(backend: str, out_path: str) -> None:
    """The accelerate recipe, run under `accelerate launch --multi_gpu --num_processes 2`."""
    from accelerate import Accelerator

    dist.init_process_group(backend)
    acc = Accelerator(cpu=True)
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Data(), batch_size=4, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    model.train()
    for batch in loader:
        opt.zero_grad()
        acc.backward(model(**batch).loss)
        opt.step()
    torch.save({"state": _state(acc.unwrap_model(model)), "backend": dist.get_backend(),
                "world": acc.num_processes}, f"{out_path}.{dist.get_rank()}")
    dist.destroy_process_group()
    _KEEP.extend((acc, model))  # the caller ends with os._exit: see _KEEP


def ray_train_loop(config):
    """Ray Train's per-worker loop: Ray has already called init_process_group(TorchConfig.backend)."""
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(tiny_bert())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = ray.train.torch.prepare_data_loader(torch.utils.data.DataLoader(Data(), batch_size=4))
    for batch in loader:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    inner = model.module if hasattr(model, "module") else model
    torch.save({"state": _state(inner), "backend": dist.get_backend()},
               os.path.join(config["out"], f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":  # accelerate launch integration_workers.py BACKEND OUT
    import sys

    accelerate_main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not through the interpreter's teardown, which would free _KEEP
