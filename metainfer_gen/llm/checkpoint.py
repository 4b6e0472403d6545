"""Read a sharded safetensors checkpoint one tensor, or one rank's slice of a tensor, at a time.

:class:`SafetensorsCheckpoint` finds which shard holds each tensor (``model.safetensors.index.json``'s
``weight_map`` when present, else each shard's header), and :meth:`~SafetensorsCheckpoint.read` returns the
requested slice through safetensors' ``safe_open(...).get_slice``: only those bytes are read, as a view into the
memory-mapped shard, which the caller copies into its own (device) storage. Nothing ever reads a whole shard
(``load_file``) or keeps a dict of tensors.

Mapped pages that were read count in the process's resident memory until the mapping goes away, and a
``safe_open`` handle keeps its mapping as long as it is open: a handle is closed and reopened after every
``MAPPED_BYTES`` read through it (reopening costs one header parse), so the file-backed share of the resident set
stays near that bound plus the tensor in hand. Source followed: vLLM ``model_loader/weight_utils.py``
(``safetensors_weights_iterator``) and DeepSeek-V3 ``inference/convert.py`` (``safe_open`` per shard, slicing per
rank), written for this engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["MAPPED_BYTES", "SafetensorsCheckpoint"]

MAPPED_BYTES = 16 << 20
_INDEX = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """The ``*.safetensors`` shards of a checkpoint directory, opened lazily, one at a time.

    Args:
        path: the directory.
        mapped_bytes: bytes read through one ``safe_open`` handle before it is closed and reopened.
    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``path``, or an index naming a shard that is not there.
        ValueError: a tensor name present in two shards.
    """

    def __init__(self, path: Path, mapped_bytes: int = MAPPED_BYTES):
        self.path = Path(path)
        self.mapped_bytes = mapped_bytes
        self.file_of: dict[str, Path] = self._index()
        self._file: Path | None = None
        self._handle = None
        self._read_since_open = 0

    def _index(self) -> dict[str, Path]:
        from safetensors import safe_open

        index = self.path / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.path / file for name, file in weight_map.items()}
            absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if absent:
                raise FileNotFoundError(f"{index} names shards that are not in {self.path}: {absent[:5]}")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"{self.path} holds no *.safetensors weights")
        files: dict[str, Path] = {}
        for shard in shards:
            with safe_open(shard, framework="pt") as f:  # reads the header only
                for name in f.keys():
                    if name in files:
                        raise ValueError(f"tensor {name!r} is in both {files[name].name} and {shard.name}")
                    files[name] = shard
        return files

    def names(self) -> list[str]:
        """Every tensor name, grouped by shard (shards in file-name order), so reads go through one file at a
        time."""
        return sorted(self.file_of, key=lambda name: (str(self.file_of[name]), name))

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.file_of[name]
        if self._handle is None or file != self._file or self._read_since_open >= self.mapped_bytes:
            self.close()
            self._handle = safe_open(file, framework="pt")
            self._handle.__enter__()
            self._file = file
        return self._handle.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from the header; nothing is read)."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype of ``name`` as safetensors names it (``"BF16"``, ``"F32"``, ``"F8_E4M3"`` ...), from
        the header; nothing is read.

        Raises:
            KeyError: no tensor of that name.
        """
        if name not in self.file_of:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.path}")
        return self._slice(name).get_dtype()

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """``tensor[index]`` of ``name`` on the CPU in its stored dtype (ints and slices; step 1 only), read from
        its shard; a view into the mapped file until the handle is reopened: copy it out, do not keep it.

        Raises:
            KeyError: no tensor of that name.
        """
        if name not in self.file_of:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.path}")
        part = self._slice(name)[index] if index else self._slice(name)[:]
        self._read_since_open += part.numel() * part.element_size()
        return part

    def close(self) -> None:
        """Close the open shard (its mapped pages leave the resident set once no view of them is alive)."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._file, self._read_since_open = None, None, 0

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
