"""One rank of the data-parallel trainer check in test_training.py, run under torchrun (gloo, CPU):
trains the head saved in DIR on the feature shards in DIR, and rank 0 writes the trained weights."""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sglang_ext.core.heads import Eagle3Head, HeadConfig  # noqa: E402
from training.features import read_shards  # noqa: E402
from training.trainer import TrainConfig, train  # noqa: E402

d = sys.argv[1]
head = Eagle3Head(HeadConfig.from_dict(json.load(open(os.path.join(d, "head.json")))))
head.load_state_dict(load_file(os.path.join(d, "head.safetensors")))
if int(os.environ["RANK"]) == 1:  # a rank that starts elsewhere is brought to rank 0's weights
    with torch.no_grad():
        head.fc.weight.add_(1.0)
cfg = TrainConfig(**json.load(open(os.path.join(d, "train.json"))))
train(head, read_shards(os.path.join(d, "features")), load_file(os.path.join(d, "lm.safetensors"))["w"], cfg,
      log=lambda *_: None)
if int(os.environ["RANK"]) == 0:
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, os.path.join(d, "trained.safetensors"))
