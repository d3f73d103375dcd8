"""Adapters: save/load round trip (safetensors + JSON, no pickle) and the authors' checkpoint converter."""

import hashlib
import json
import os

import pytest
import torch
from torch import nn

from hashattention import reference
from hashattention.adapters import (
    CHECKSUM_KEY,
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterConfig,
    HashAdapters,
    convert_authors_checkpoint,
    pretrained_path,
    weights_checksum,
)


def small_config(**overrides):
    values = dict(num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=64, hidden_features=(16, 8))
    values.update(overrides)
    return AdapterConfig(**values)


@pytest.mark.parametrize("key_heads", ["query", "kv"])
def test_save_load_round_trip(tmp_path, key_heads):
    torch.manual_seed(0)
    config = small_config(
        key_heads=key_heads, bits=64, model="tiny", training={"lr": 1e-3}, validation={"recall@16x": 0.5}
    )
    adapters = HashAdapters(config)
    adapters.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [CONFIG_NAME, WEIGHTS_NAME]  # no temporary files left
    with open(tmp_path / CONFIG_NAME) as f:
        metadata = json.load(f)
    assert metadata["model"] == "tiny" and metadata["validation"] == {"recall@16x": 0.5}
    with open(tmp_path / WEIGHTS_NAME, "rb") as f:
        assert not f.read(64).startswith(b"PK"), "weights must be safetensors, not a pickled zip"

    loaded = HashAdapters.from_pretrained(str(tmp_path))
    assert loaded.config == adapters.config
    for (name, a), (other, b) in zip(adapters.state_dict().items(), loaded.state_dict().items()):
        assert name == other and torch.equal(a, b)
    x = torch.randn(1, 4, 5, 64)
    keys = torch.randn(1, 2, 5, 64)
    assert torch.equal(adapters[1].query_signatures(x), loaded[1].query_signatures(x))
    assert torch.equal(adapters[1].key_signatures(keys), loaded[1].key_signatures(keys))


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        HashAdapters.from_pretrained(str(tmp_path))
    HashAdapters(small_config()).save_pretrained(str(tmp_path))
    path = tmp_path / CONFIG_NAME
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format_version"):
        HashAdapters.from_pretrained(str(tmp_path))
    data["format_version"] = 1
    data["num_layers"] = 3  # the weights hold 2 layers
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not match"):
        HashAdapters.from_pretrained(str(tmp_path))


class AuthorsLayer(nn.Module):
    """The authors' per-layer module layout: per head an nn.Sequential(Linear, SiLU, Linear, SiLU, Linear)."""

    def __init__(self, heads, sizes):
        super().__init__()

        def mlp():
            return nn.Sequential(
                nn.Linear(sizes[0], sizes[1]), nn.SiLU(), nn.Linear(sizes[1], sizes[2]), nn.SiLU(),
                nn.Linear(sizes[2], sizes[3]),
            )

        self.learning_to_hash_transformation_q = nn.ModuleList(mlp() for _ in range(heads))
        self.learning_to_hash_transformation_k = nn.ModuleList(mlp() for _ in range(heads))


def test_convert_authors_checkpoint(tmp_path):
    torch.manual_seed(0)
    layers, heads, kv_heads, sizes = 2, 4, 2, (64, 24, 16, 32)
    authors = nn.ModuleList(AuthorsLayer(heads, sizes) for _ in range(layers)).to(torch.bfloat16)
    state = authors.state_dict()
    assert "1.learning_to_hash_transformation_k.3.4.weight" in state  # the released key layout
    path = tmp_path / "usa_patch.pt"
    torch.save(state, path)

    adapters = convert_authors_checkpoint(str(path), num_kv_heads=kv_heads, model="tiny")
    config = adapters.config
    assert (config.num_layers, config.num_query_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 64)
    assert (config.hidden_features, config.bits, config.key_heads) == ((24, 16), 32, "query")

    x = torch.randn(1, heads, 7, 64)
    keys = torch.randn(1, kv_heads, 7, 64)
    for layer in range(layers):
        for side, inputs, mlp in (
            ("q", x, adapters[layer].query),
            ("k", adapters[layer].expand_keys(keys), adapters[layer].key),
        ):
            modules = getattr(authors[layer], f"learning_to_hash_transformation_{side}")
            expected = torch.stack(
                [modules[h].float()(inputs[0, h]) for h in range(heads)]
            )[None]  # their MLP, in float32, per head
            torch.testing.assert_close(mlp(inputs), expected, atol=1e-5, rtol=1e-5)
        # Packed signatures agree with the float64 reference of the converted weights.
        q = adapters[layer].query
        want = reference.encode_signatures(x, list(q.weights), list(q.biases), q.activation)
        assert torch.equal(adapters[layer].query_signatures(x), want)

    # A converted checkpoint saves and loads like any other.
    adapters.save_pretrained(str(tmp_path / "converted"))
    reloaded = HashAdapters.from_pretrained(str(tmp_path / "converted"))
    assert torch.equal(reloaded[1].query_signatures(x), adapters[1].query_signatures(x))


def test_convert_authors_checkpoint_errors():
    with pytest.raises(ValueError, match="unexpected key"):
        convert_authors_checkpoint({"0.something_else.weight": torch.zeros(1)}, num_kv_heads=1)
    with pytest.raises(ValueError, match="no learning_to_hash_transformation"):
        convert_authors_checkpoint({}, num_kv_heads=1)
    state = AuthorsLayer(2, (64, 8, 8, 32)).state_dict()
    gapped = {f"1.{name}": tensor for name, tensor in state.items()}  # layer 0 missing
    with pytest.raises(ValueError, match="gaps"):
        convert_authors_checkpoint(gapped, num_kv_heads=1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(key_heads="token"), "key_heads"),
        (dict(bits=40), "bits"),
        (dict(activation="softplus"), "activation"),
        (dict(num_layers=True), "num_layers must be an int"),
        (dict(head_dim=64.0), "head_dim must be an int"),
        (dict(bits=2**40), "bits must be an int in"),
        (dict(hidden_features=(16.5,)), "hidden_features entries must be an int"),
        (dict(hidden_features=(0,)), "hidden_features entries must be an int in \\[1"),
        (dict(hidden_features=16), "hidden_features must be a sequence"),
        (dict(activation=["silu"]), "activation"),
    ],
)
def test_adapter_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_shipped_adapters_load_by_name():
    from hashattention.adapters import pretrained_names, pretrained_path

    assert "smollm2-135m-instruct" in pretrained_names()
    by_name = HashAdapters.from_pretrained("smollm2-135m-instruct")
    by_path = HashAdapters.from_pretrained(pretrained_path("smollm2-135m-instruct"))
    assert by_name.config == by_path.config and by_name.config.num_layers == 30
    for name, tensor in by_path.state_dict().items():
        assert torch.equal(by_name.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="shipped: \\['smollm2-135m-instruct'"):
        pretrained_path("no-such-adapters")
    with pytest.raises(FileNotFoundError, match="nor the name of shipped adapters"):
        HashAdapters.from_pretrained("no-such-adapters")


def saved_adapters(tmp_path):
    torch.manual_seed(0)
    adapters = HashAdapters(small_config())
    adapters.save_pretrained(str(tmp_path))
    return adapters


def test_save_records_the_weights_checksum(tmp_path):
    saved_adapters(tmp_path)
    record = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert record[CHECKSUM_KEY] == hashlib.sha256((tmp_path / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert record[CHECKSUM_KEY] == weights_checksum(str(tmp_path))


@pytest.mark.parametrize("where", ["payload", "last byte"])
def test_corrupted_weights_fail_the_checksum(tmp_path, where):
    """Zeroed payload bytes keep a valid safetensors file (zeros load fine): only the checksum sees them."""
    saved_adapters(tmp_path)
    path = tmp_path / WEIGHTS_NAME
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    if where == "payload":
        data[header:header + 256] = bytes(256)
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{WEIGHTS_NAME} is corrupted or was replaced: its SHA-256 is [0-9a-f]{{64}}"):
        HashAdapters.from_pretrained(str(tmp_path))


def test_files_without_a_checksum_still_load(tmp_path):
    adapters = saved_adapters(tmp_path)
    path = tmp_path / CONFIG_NAME
    record = json.loads(path.read_text())
    del record[CHECKSUM_KEY]
    path.write_text(json.dumps(record))
    loaded = HashAdapters.from_pretrained(str(tmp_path))
    for name, tensor in adapters.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_unreadable_files_are_named_in_the_error(tmp_path):
    saved_adapters(tmp_path)
    weights, config = tmp_path / WEIGHTS_NAME, tmp_path / CONFIG_NAME
    record = json.loads(config.read_text())
    del record[CHECKSUM_KEY]  # an older file: the safetensors reader meets the damage itself
    config.write_text(json.dumps(record))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        HashAdapters.from_pretrained(str(tmp_path))
    config.write_text("{not json")
    with pytest.raises(ValueError, match=f"{config} is not valid JSON"):
        HashAdapters.from_pretrained(str(tmp_path))
    config.write_text(json.dumps({"format_version": 1, "num_layers": 2}))
    with pytest.raises(ValueError, match=f"{config}: .*num_query_heads"):
        HashAdapters.from_pretrained(str(tmp_path))


def test_weights_of_other_shapes_are_named_in_the_error(tmp_path):
    saved_adapters(tmp_path)
    config = tmp_path / CONFIG_NAME
    record = json.loads(config.read_text())
    record["hidden_features"] = [16, 4]  # the weights hold (16, 8)
    config.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=f"(?s){tmp_path / WEIGHTS_NAME} does not match {config}: .*size mismatch"):
        HashAdapters.from_pretrained(str(tmp_path))


def test_corrupted_authors_checkpoint_is_named_in_the_error(tmp_path):
    path = tmp_path / "usa_patch.pt"
    torch.save(AuthorsLayer(2, (64, 8, 8, 32)).state_dict(), path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"{path}: not a readable torch checkpoint"):
        convert_authors_checkpoint(str(path), num_kv_heads=1)


def test_shipped_adapters_carry_a_matching_checksum():
    directory = pretrained_path("smollm2-135m-instruct")
    with open(os.path.join(directory, CONFIG_NAME)) as f:
        recorded = json.load(f)[CHECKSUM_KEY]
    assert recorded == weights_checksum(directory)


def test_float64_adapters_encode_like_float32(tmp_path):
    """The ops take float32/float16/bfloat16 weights; float64 adapters are encoded through float32, so
    they give the signatures of the same adapters in float32 (and load from disk in float64)."""
    adapters = saved_adapters(tmp_path)
    doubled = HashAdapters.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert doubled[0].query.weights[0].dtype == torch.float64
    x = torch.randn(1, 4, 5, 64)
    keys = torch.randn(1, 2, 5, 64)
    assert torch.equal(doubled[1].query_signatures(x), adapters[1].query_signatures(x))
    assert torch.equal(doubled[1].key_signatures(keys), adapters[1].key_signatures(keys))
    for got, want in zip(doubled[0].decode_signatures(x, keys), adapters[0].decode_signatures(x, keys)):
        assert torch.equal(got, want)
