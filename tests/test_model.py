"""load_model: demo specs, real folders, and one clear sentence for every failure."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvchat.engine.models import demo
from kvchat.engine.models.model import (
    DEFAULT_CONTEXT_LENGTH,
    WAY_OUT,
    ModelLoadError,
    context_length,
    fingerprint,
    load_model,
)


def load_error(spec: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(spec)
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith(WAY_OUT) or "use one of" in message
    return message


def test_demo_loads(demo_model):
    assert demo_model.model_id == "demo"
    assert demo_model.path == demo.demo_path("demo")
    assert demo_model.context_length == demo.SHAPES["demo"]["max_position_embeddings"]
    assert demo_model.model.model.embed_tokens.weight.dtype == mx.float32


def test_a_model_folder_loads_by_path(demo_model):
    loaded = load_model(str(demo_model.path))
    assert loaded.path == demo_model.path
    assert loaded.fingerprint != demo_model.fingerprint  # the id is part of it


def test_fingerprint_is_stable_and_follows_the_files(demo_model, tmp_path):
    assert fingerprint("demo", demo_model.path) == demo_model.fingerprint
    copy = shutil.copytree(demo_model.path, tmp_path / "copy")
    assert fingerprint("demo", copy) == demo_model.fingerprint
    config = json.loads((copy / "config.json").read_text())
    config.update(demo.SHAPES["qwen2.5-0.5b"])
    (copy / "config.json").write_text(json.dumps(config))
    assert fingerprint("demo", copy) != demo_model.fingerprint


def test_demo_shapes_differ_in_config():
    tokenizer = demo.train_tokenizer()
    # demo:random is the trained demo's shape with random weights, by design
    assert demo.SHAPES["random"] == demo.SHAPES["demo"]
    names = [name for name in demo.demo_names() if name != "random"]
    configs = [demo.model_config(name, tokenizer) for name in names]
    assert len({json.dumps(c, sort_keys=True) for c in configs}) == len(configs) == 6


def test_half_precision_stays_as_stored(demo_model, tmp_path):
    """No device casts a model's weights: the CPU computes with bfloat16 as stored too."""
    copy = shutil.copytree(demo_model.path, tmp_path / "half")
    weights = mx.load(str(copy / "model.safetensors"))
    mx.save_safetensors(
        str(copy / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    )
    loaded = load_model(str(copy))
    dtypes = {p.dtype for p in dict(tree_flatten(loaded.model.parameters())).values()}
    assert dtypes == {mx.bfloat16}
    if loaded.fast_path is not None:
        assert loaded.weights.startswith("bfloat16, kept as stored, ")


def test_missing_folder():
    message = load_error("./no/such/model")
    assert "no such folder" in message


def test_folder_without_config(tmp_path):
    assert "no config.json" in load_error(str(tmp_path))


def test_folder_with_garbage_config(tmp_path):
    (tmp_path / "config.json").write_text("not json {")
    assert "damaged" in load_error(str(tmp_path))


def test_folder_with_unsupported_model_type(demo_model, tmp_path):
    copy = shutil.copytree(demo_model.path, tmp_path / "odd")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    assert "not supported" in load_error(str(copy))


def test_a_file_is_not_a_model(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    assert "not a folder" in load_error(str(file))


def test_hugging_face_id_offline(monkeypatch, tmp_path):
    """With the hub unreachable (offline mode) and nothing cached, an id fails clearly."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    message = load_error("kvchat-tests/no-such-model")
    assert "could not be downloaded (no network?)" in message


def test_unknown_demo_shape():
    message = load_error("demo:gpt-5")
    assert "demo:qwen2.5-0.5b" in message


def test_context_length():
    assert context_length({"max_position_embeddings": 8192}) == 8192
    assert context_length({"text_config": {"max_position_embeddings": 1024}}) == 1024
    assert context_length({}) == DEFAULT_CONTEXT_LENGTH


def test_a_load_says_how_many_layers_it_has_read(demo_model):
    """The weights are read a layer at a time, each layer's count given as it is done (the
    loading screen's progress); the model is as an eager load makes it."""
    seen: list[tuple[int, int, str]] = []
    lm = load_model("demo", lambda done, total, what: seen.append((done, total, what)))
    layers = len(lm.model.layers)
    assert seen == [(n, layers, "layers read") for n in range(1, layers + 1)]
    ours = dict(tree_flatten(lm.model.parameters()))
    theirs = dict(tree_flatten(demo_model.model.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
