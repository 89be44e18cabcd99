"""One rank of the data-parallel trainer checks, run under torchrun: trains the head saved in DIR on the
feature shards in DIR, and rank 0 writes the trained weights and its metrics. test_training.py runs it on
the CPU (gloo); tests/gpu/check_ddp.py on GPUs (NCCL, DDP_DEVICE=cuda: rank r on cuda:r), and trains the
same directory in one process through `train_dir` for comparison."""

import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file

# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from sglang_ext.config import Eagle3DraftConfig  # noqa: E402
from sglang_ext.core.heads import Eagle3Head  # noqa: E402
from sglang_ext.training.features import read_shards  # noqa: E402
from sglang_ext.training.trainer import TrainConfig, train  # noqa: E402


def train_dir(d: str, device: torch.device, cfg: dict, perturb: bool = False) -> tuple[Eagle3Head, dict]:
    """The head of DIR trained on DIR's shards with `cfg` (a TrainConfig's fields); metrics gain `seconds`.
    `perturb`: start from other weights (a rank that the trainer must bring to rank 0's)."""
    head = Eagle3Head(Eagle3DraftConfig.from_dict(json.load(open(os.path.join(d, "head.json")))))
    head.load_state_dict(load_file(os.path.join(d, "head.safetensors")))
    head.embed_tokens.weight.requires_grad_(False)  # as the trainer's init leaves it
    head.to(device)
    if perturb:
        with torch.no_grad():
            head.fc.weight.add_(1.0)
    t = time.time()
    metrics = train(head, read_shards(os.path.join(d, "features")), load_file(os.path.join(d, "lm.safetensors"))["w"],
                    TrainConfig(**cfg), log=lambda *_: None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    metrics["seconds"] = time.time() - t
    return head, metrics


if __name__ == "__main__":
    import torch.distributed as dist

    d = sys.argv[1]
    device = torch.device("cpu")
    if os.environ.get("DDP_DEVICE") == "cuda":
        device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
        torch.cuda.set_device(device)
    rank = int(os.environ["RANK"])
    head, metrics = train_dir(d, device, json.load(open(os.path.join(d, "train.json"))), perturb=rank == 1)
    tokens = torch.tensor([float(metrics.get("tokens_trained", 0))], device=device)
    dist.all_reduce(tokens)  # every rank's share: the tokens of the global batch
    metrics["tokens_trained"] = int(tokens.item())
    if "steady" in metrics:  # the same for the steps after the warm-up (all ranks run the same steps)
        steady = torch.tensor([float(metrics["steady"]["tokens"])], device=device)
        dist.all_reduce(steady)
        metrics["steady"]["tokens"] = int(steady.item())
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
                  os.path.join(d, "trained.safetensors"))
        json.dump(metrics, open(os.path.join(d, "ddp_metrics.json"), "w"))
