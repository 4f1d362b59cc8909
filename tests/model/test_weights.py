"""load_state_dict on single-file and sharded safetensors folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.model.weights import INDEX_FILE, load_state_dict


def _tiny_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 4, generator=g) for i in range(3)
    }
    state["model.embed_tokens.weight"] = torch.randn(16, 4, generator=g)
    state["model.norm.weight"] = torch.randn(4, generator=g).to(torch.bfloat16)
    state["model.step"] = torch.tensor([7], dtype=torch.int64)
    return state


def _save_sharded(state: dict[str, torch.Tensor], folder: Path, num_shards: int) -> list[str]:
    names = sorted(state)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = names[i::num_shards]
        save_file({n: state[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_equals_single_file(tmp_path: Path, dtype: torch.dtype) -> None:
    state = _tiny_state_dict()
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    save_file(state, str(single / "model.safetensors"))
    _save_sharded(state, sharded, num_shards=3)

    a, b = load_state_dict(single, dtype), load_state_dict(sharded, dtype)
    assert set(a) == set(b) == set(state)
    for name in state:
        assert torch.equal(a[name], b[name]), name
    assert a["model.embed_tokens.weight"].dtype == dtype
    assert torch.equal(a["model.embed_tokens.weight"], state["model.embed_tokens.weight"].to(dtype))
    assert a["model.step"].dtype == torch.int64  # integers are not cast


def test_missing_shard_is_named(tmp_path: Path) -> None:
    files = _save_sharded(_tiny_state_dict(), tmp_path, num_shards=2)
    (tmp_path / files[1]).unlink()
    with pytest.raises(ValueError, match=files[1]):
        load_state_dict(tmp_path, torch.float32)


def test_index_promising_absent_tensor(tmp_path: Path) -> None:
    files = _save_sharded(_tiny_state_dict(), tmp_path, num_shards=2)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = files[0]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_state_dict(tmp_path, torch.float32)


def test_folder_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model.safetensors"):
        load_state_dict(tmp_path, torch.float32)


def test_only_the_names_asked_for_are_read_and_an_absent_one_is_still_named(tmp_path: Path) -> None:
    state = _tiny_state_dict()
    files = _save_sharded(state, tmp_path, num_shards=2)
    names = {"model.norm.weight", "model.step"}
    got = load_state_dict(tmp_path, torch.float32, names=names)
    assert set(got) == names
    assert torch.equal(got["model.norm.weight"], state["model.norm.weight"].float())
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = files[0]  # promised, absent, but not asked for
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    assert set(load_state_dict(tmp_path, torch.float32, names=names)) == names
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_state_dict(tmp_path, torch.float32, names=names | {"lm_head.weight"})
