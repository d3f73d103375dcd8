"""Position-offset augmentation of the collection (TrainConfig.max_position_offset), on the tiny model.

Running a sequence at positions offset .. offset + L - 1 rotates the captured post-RoPE queries and
keys but leaves their dot products -- the training labels -- unchanged (RoPE is relative), so
adapters can learn signatures for positions beyond the training sequence length.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open

from train.__main__ import main
from train.collect import sequence_position_offset, shard_path
from train.config import TrainConfig
from train_helpers import tiny_run_flags, write_tiny_llama


def config_with(**fields):
    base = dict(model="smollm2", sequence_tokens=192, queries_per_sequence=16, top_k=8, sink_tokens=4,
                local_tokens=4, work_dir="/tmp/unused")
    base.update(fields)
    return TrainConfig(**base)


def test_offsets_are_deterministic_in_range_and_off_by_default():
    assert all(sequence_position_offset(config_with(), "train", i) == 0 for i in range(5))
    config = config_with(max_position_offset=1000)
    offsets = [sequence_position_offset(config, split, i) for split in ("train", "validation") for i in range(40)]
    assert all(0 <= o <= 1000 for o in offsets)
    assert len(set(offsets)) > 20, "offsets should vary across sequences"
    assert offsets == [sequence_position_offset(config, split, i) for split in ("train", "validation")
                       for i in range(40)]


def test_negative_offset_is_rejected():
    with pytest.raises(ValueError, match="max_position_offset"):
        config_with(max_position_offset=-1)


def _load(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def two_collections(tmp_path_factory):
    root = tmp_path_factory.mktemp("position_offset")
    model_dir = write_tiny_llama(str(root / "model"))
    plain, shifted = str(root / "plain"), str(root / "shifted")
    assert main(["collect", *tiny_run_flags(model_dir, plain, threads=1)]) == 0
    assert main(["collect", *tiny_run_flags(model_dir, shifted, threads=1, **{"max-position-offset": 300})]) == 0
    return plain, shifted


def test_offset_rotates_queries_and_keys_but_keeps_their_scores(two_collections):
    plain, shifted = two_collections
    config = config_with(max_position_offset=300, work_dir=shifted)
    checked = 0
    for index in range(3):
        offset = sequence_position_offset(config, "train", index)
        a, _ = _load(shard_path(config_with(work_dir=plain), "train", index))
        b, metadata = _load(shard_path(config, "train", index))
        assert metadata["position_offset"] == str(offset)
        assert torch.equal(a["query_positions"], b["query_positions"])
        for layer in (0, 1):
            qa, ka = a[f"layer.{layer}.queries"].double(), a[f"layer.{layer}.keys"].double()
            qb, kb = b[f"layer.{layer}.queries"].double(), b[f"layer.{layer}.keys"].double()
            group = qa.shape[0] // ka.shape[0]
            scores_a = qa @ ka.repeat_interleave(group, 0).transpose(1, 2)
            scores_b = qb @ kb.repeat_interleave(group, 0).transpose(1, 2)
            torch.testing.assert_close(scores_b, scores_a, rtol=1e-4, atol=1e-4)
            if offset:
                assert not torch.allclose(kb, ka, atol=1e-3), "an offset must rotate the keys"
        checked += offset > 0
    assert checked, "at least one sequence should have a non-zero offset"


def test_manifest_records_the_offset_and_old_manifests_still_match(two_collections, tmp_path):
    plain, shifted = two_collections
    with open(os.path.join(shifted, "shards", "manifest.json")) as f:
        assert json.load(f)["max_position_offset"] == 300
    # A manifest written before the field existed means offset 0: collecting again into it is accepted.
    manifest = os.path.join(plain, "shards", "manifest.json")
    with open(manifest) as f:
        old = json.load(f)
    old.pop("max_position_offset")
    with open(manifest, "w") as f:
        json.dump(old, f)
    from train.collect import check_manifest

    check_manifest(config_with(work_dir=plain, **old))  # raises ValueError on a mismatch
