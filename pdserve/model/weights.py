"""Read the weights of a Hugging Face model folder: one safetensors file or an indexed set of shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def has_weights(folder: Path) -> bool:
    """True when ``folder`` holds ``model.safetensors`` or a sharded index."""
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def _shard_files(folder: Path) -> tuple[list[Path], set[str] | None]:
    """The files to read and, for a sharded folder, the tensor names its index promises."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE], None
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise ValueError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read shard index {index_path}: {e!r}") from None
    shards = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ValueError(
            f"{folder} lacks shard(s) {', '.join(missing)} listed in {INDEX_FILE}; download them again"
        )
    return shards, set(weight_map)


def load_state_dict(
    folder: Path, dtype: torch.dtype, names: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """The folder's tensors under their Hugging Face names, floating ones cast to ``dtype``; only
    ``names`` where given (a model whose projections are a GGUF's blocks reads only the rest).
    Read one tensor at a time: at most one tensor's copy beside the result."""
    from safetensors import safe_open  # torch: not for a gateway, which only finds the folder

    folder = Path(folder)
    shards, expected = _shard_files(folder)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if names is not None and name not in names:
                    continue
                tensor = f.get_tensor(name)
                state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if expected is not None:
        absent = sorted((expected if names is None else expected & names) - state.keys())
        if absent:
            raise ValueError(
                f"{folder}: {len(absent)} tensor(s) listed in {INDEX_FILE} are not in the shards, e.g. {absent[0]}"
            )
    return state
