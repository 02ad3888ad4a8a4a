"""Bad checkpoint folders raise PosttrainError naming the file/key and the fix."""

import json
import os
import shutil

import pytest

from posttrain.errors import PosttrainError
from posttrain.models import from_pretrained, save_pretrained


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_folder(tmp_path):
    with pytest.raises(PosttrainError, match="does not exist"):
        from_pretrained(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path, hf_checkpoints):
    d = _copy(hf_checkpoints["llama"], tmp_path / "m")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(PosttrainError, match=r"config\.json: missing"):
        from_pretrained(d)


def test_unsupported_architecture(tmp_path, hf_checkpoints):
    d = _copy(hf_checkpoints["llama"], tmp_path / "m")
    cfg_file = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(PosttrainError, match=r"config\.json: model_type 'gpt2'.*not supported"):
        from_pretrained(d)


def test_missing_shard(tmp_path, hf_checkpoints):
    model = from_pretrained(hf_checkpoints["qwen3"])
    d = save_pretrained(model, str(tmp_path / "sharded"), max_shard_bytes=50_000)
    victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(d, victim))
    with pytest.raises(PosttrainError, match=f"{victim}: safetensors file is missing"):
        from_pretrained(d)


def test_truncated_safetensors(tmp_path, hf_checkpoints):
    d = _copy(hf_checkpoints["llama"], tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(PosttrainError, match=r"model\.safetensors: truncated"):
        from_pretrained(d)


def test_no_weights_at_all(tmp_path, hf_checkpoints):
    d = _copy(hf_checkpoints["llama"], tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(PosttrainError, match="no model.safetensors"):
        from_pretrained(d)


def test_tensor_of_wrong_shape(tmp_path, hf_checkpoints):
    d = _copy(hf_checkpoints["llama"], tmp_path / "m")
    cfg_file = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["intermediate_size"] = 128  # the weights were saved with 96
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(PosttrainError, match=r"shape mismatch for model\.layers\.0\.mlp\.\w+_proj\.weight.*"
                                             r"implies .*128"):
        from_pretrained(d)


def test_missing_tensor(tmp_path, hf_checkpoints):
    from safetensors.numpy import load_file, save_file

    d = _copy(hf_checkpoints["llama"], tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(PosttrainError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"):
        from_pretrained(d)
