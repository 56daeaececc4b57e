"""Reading safetensors files as memory maps: each tensor is a read-only numpy view of the file, so nothing is copied
on the host. The device copy (models/weights.py: place) is the only copy a weight makes on its way in; the kernel
reads the file ahead of it (madvise), a few tensors at a time, instead of reader threads copying into fresh buffers.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
READ_AHEAD = 8  # tensors whose pages the kernel is asked to fetch before they are needed


class SafetensorsFile:
    """One file's header and its memory map; `tensor(name)` is a read-only view, valid while the map lives (a view
    keeps it alive)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 2 <= size <= 100 << 20:
                    raise ValueError(f"header size {size} is not plausible")
                header = json.loads(fh.read(size))
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ValueError(f"could not read safetensors file {path}: {exc}") from exc
        header.pop("__metadata__", None)
        self.start, self.header = 8 + size, header
        self._buffer = np.frombuffer(self._map, np.uint8)
        for name, info in header.items():
            begin, end = info.get("data_offsets", (0, -1))
            dtype = DTYPES.get(info.get("dtype"))
            nbytes = int(np.prod(info.get("shape", ()), dtype=np.int64)) * (np.dtype(dtype).itemsize if dtype else 0)
            if dtype is None or end - begin != nbytes or self.start + end > len(self._buffer):
                raise ValueError(
                    f"could not read tensor {name} from {path}: dtype {info.get('dtype')}, shape {info.get('shape')} "
                    f"and offsets {info.get('data_offsets')} do not fit a {len(self._buffer)}-byte file"
                )

    def names(self) -> list[str]:
        return list(self.header)

    def nbytes(self, name: str) -> int:
        begin, end = self.header[name]["data_offsets"]
        return end - begin

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, end = info["data_offsets"]
        view = self._buffer[self.start + begin : self.start + end]
        return view.view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def will_need(self, name: str) -> None:
        """Ask the kernel to start reading this tensor's pages now (asynchronously)."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        begin, end = self.header[name]["data_offsets"]
        first = (self.start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > begin:
            self._map.madvise(mmap.MADV_WILLNEED, first, self.start + end - first)


def open_files(files: Iterable[Path]) -> dict[str, SafetensorsFile]:
    """Each tensor name -> the file holding it (the first, where shards repeat a name)."""
    where: dict[str, SafetensorsFile] = {}
    for path in files:
        handle = SafetensorsFile(path)
        for name in handle.names():
            where.setdefault(name, handle)
    return where


def tensors_in_order(where: dict[str, SafetensorsFile]) -> Iterator[tuple[str, np.ndarray, str]]:
    """(name, view, file) for every tensor in the order it lies on disk, the kernel fetching the next READ_AHEAD
    tensors meanwhile."""
    names = sorted(where, key=lambda n: (str(where[n].path), where[n].header[n]["data_offsets"][0]))  # file order
    for name in names[:READ_AHEAD]:
        where[name].will_need(name)
    for i, name in enumerate(names):
        if i + READ_AHEAD < len(names):
            ahead = names[i + READ_AHEAD]
            where[ahead].will_need(ahead)
        yield name, where[name].tensor(name), str(where[name].path)
