"""Feature shards of the target's aux states: round trip, resume, other layers refused."""

import os

import pytest
import torch

from sglang_ext.training.features import read_shards, write_shards

from train_support import tiny_pair  # noqa: F401 -- a fixture
from train_support import _records


def test_feature_shards_round_trip_and_resume(tiny_pair, tmp_path):
    ext, convs = _records(tiny_pair)
    d = str(tmp_path / "f")
    write_shards(ext, convs[:4], d, shard_size=2)
    m = write_shards(ext, convs, d, shard_size=2)  # resumes: shards 0, 1 kept, shard 2 added
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                "shard-00002.safetensors"]
    recs = read_shards(d)
    again = [ext(c) for c in convs]  # one at a time; the shards were captured in padded batches
    assert len(recs) == 6 and len({len(r.input_ids) for r in recs}) > 1
    for a, b in zip(recs, again):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.allclose(a.aux, b.aux, atol=1e-5) and torch.allclose(a.last_hidden, b.last_hidden, atol=1e-5)
        assert a.aux.shape[1] == 3 * 64 and a.loss_mask.sum() > 0
    batched = ext.many(convs, batch_tokens=10 ** 6)  # all six in one padded forward
    assert all(torch.allclose(a.aux, b.aux, atol=1e-5) for a, b in zip(batched, again))
    # a resume in another order (another seed, another version's order) is refused, the shards left as they were
    with pytest.raises(ValueError, match="holds other conversations than chunk 0"):
        write_shards(ext, convs[::-1], d, shard_size=2)
    assert [len(r.input_ids) for r in read_shards(d)] == [len(r.input_ids) for r in recs]


def test_features_of_other_layers_are_refused_not_reused(tiny_pair, tmp_path):
    ext, convs = _records(tiny_pair)
    write_shards(ext, convs, str(tmp_path), shard_size=4, meta={"target": "t", "aux_output_ids": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"aux_output_ids=\[0, 1, 2\], this run asks for aux_output_ids=\[1, 2, 0\]"):
        write_shards(ext, convs, str(tmp_path), shard_size=4, meta={"target": "t", "aux_output_ids": [1, 2, 0]})
    os.remove(tmp_path / "shard-00001.safetensors")
    with pytest.raises(FileNotFoundError, match="shard-00001.safetensors, named in"):
        read_shards(str(tmp_path))

