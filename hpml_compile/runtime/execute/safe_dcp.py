"""DCP storage whose index is JSON, so that loading a checkpoint never unpickles anything from its folder.

torch.distributed.checkpoint (DCP) keeps a checkpoint's index (which tensor,
which chunk, in which file at which offset) in a ``.metadata`` file written
with ``pickle.dump`` and read with ``pickle.load``: whoever can write that file
can make a ``--resume`` run their code. A digest of ``.metadata`` kept next to
it would not help, since whoever crafts the checkpoint writes the digest too.
So the index is kept in a form that cannot run code: :class:`JsonWriter` writes
it as ``index.json`` (and no ``.metadata`` at all), and :class:`JsonReader`
rebuilds DCP's ``Metadata`` from that JSON, never opening ``.metadata``. The
tensors themselves are read by DCP's own ``FileSystemReader.read_data``, which
uses ``torch.load(weights_only=True)`` (tensors only, no arbitrary objects);
non-tensor items (DCP's ``BYTE_IO``, which it reads with
``torch.load(weights_only=False)``) are refused by name on both sides.

``index.json`` (``version`` 1)::

    {"version": 1,
     "tensors": {"model.0.weight": {"dtype": "float32", "size": [8, 8],
                  "chunks": [{"offsets": [0, 0], "sizes": [8, 8],
                              "file": "__0_0.distcp", "offset": 0, "length": 1577}]}}}

Each chunk names the file (a plain name inside the checkpoint folder) and the
byte range of its ``torch.save`` record. Everything is checked on reading:
an unknown version, field or dtype, a path outside the folder, or a chunk
outside its tensor is a :class:`IndexFormatError` naming the field.

Example:
    >>> import tempfile, torch, torch.distributed.checkpoint as dcp
    >>> d = tempfile.mkdtemp()
    >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=JsonWriter(d), no_dist=True)
    >>> out = {"w": torch.zeros(2)}
    >>> dcp.load(out, storage_reader=JsonReader(d), no_dist=True)
    >>> out["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ...errors import IndexFormatError
from ...schema import write_json_atomic

__all__ = ["INDEX_FILE", "INDEX_VERSION", "IndexFormatError", "JsonReader", "JsonWriter", "index_to_json",
           "index_from_json"]

INDEX_FILE = "index.json"
INDEX_VERSION = 1
_DTYPES = {name: v for name in dir(torch) if isinstance(v := getattr(torch, name), torch.dtype)}



def index_to_json(md: Metadata) -> dict[str, Any]:
    """DCP's metadata of a completed save as plain JSON data (see the module docstring).

    Args:
        md: what ``dcp.save`` computed; ``storage_data`` filled in by the writer.

    Returns:
        The ``index.json`` document.

    Raises:
        IndexFormatError: an item that is not a plain strided tensor (named), or storage with stream transforms.
    """
    where: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {
        (k.fqn, tuple(k.offset or ())): v for k, v in md.storage_data.items()}
    tensors: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise IndexFormatError(f"checkpoint item {fqn!r} is not a tensor ({type(item).__name__}): only tensors "
                              "are saved, so that loading never unpickles objects; convert it to a tensor")
        if item.properties.layout != torch.strided:
            raise IndexFormatError(f"checkpoint item {fqn!r} has layout {item.properties.layout}: only dense tensors")
        chunks = []
        for c in item.chunks:
            info = where[(fqn, tuple(c.offsets))]
            if info.transform_descriptors:
                raise IndexFormatError(f"checkpoint item {fqn!r} was written with stream transforms "
                                  f"{list(info.transform_descriptors)}: save without DCP extensions")
            chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": info.relative_path,
                           "offset": int(info.offset), "length": int(info.length)})
        tensors[fqn] = {"dtype": str(item.properties.dtype).removeprefix("torch."), "size": list(item.size),
                        "chunks": chunks}
    return {"version": INDEX_VERSION, "tensors": tensors}


def _ints(value: Any, where: str, n: int | None = None) -> list[int]:
    if (not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                               for x in value) or (n is not None and len(value) != n)):
        raise IndexFormatError(f"{where}: expected a list of {'' if n is None else f'{n} '}non-negative integers, "
                          f"got {value!r}")
    return value


def _fields(doc: Any, where: str, names: set[str]) -> dict[str, Any]:
    if not isinstance(doc, dict) or set(doc) != names:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise IndexFormatError(f"{where}: expected the fields {sorted(names)}, got {got}")
    return doc


def index_from_json(doc: Any, source: Path, files: set[str]) -> Metadata:
    """DCP's ``Metadata`` from an ``index.json`` document, every field checked.

    Args:
        doc: the parsed JSON.
        source: the file it came from (named in errors).
        files: the file names the index may point at (those of the checkpoint, digests checked).

    Returns:
        Metadata with tensor items only and ``storage_data`` keyed as DCP's reader expects.

    Raises:
        IndexFormatError: an unknown version or field, a dtype that is not torch's, a file not in ``files``,
            or a chunk outside its tensor; the message names the file and the field.
    """
    doc = _fields(doc, str(source), {"version", "tensors"})
    if doc["version"] != INDEX_VERSION:
        raise IndexFormatError(f"{source}: version {doc['version']!r} is not known (this hpml-compile reads version "
                          f"{INDEX_VERSION}); was it written by a newer version?")
    if not isinstance(doc["tensors"], dict):
        raise IndexFormatError(f"{source}: tensors: expected an object keyed by state-dict name")
    items: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for fqn, t in doc["tensors"].items():
        at = f"{source}: tensors.{fqn}"
        t = _fields(t, at, {"dtype", "size", "chunks"})
        if t["dtype"] not in _DTYPES:
            raise IndexFormatError(f"{at}.dtype: {t['dtype']!r} is not a torch dtype")
        size = _ints(t["size"], f"{at}.size")
        if not isinstance(t["chunks"], list) or not t["chunks"]:
            raise IndexFormatError(f"{at}.chunks: expected a non-empty list")
        chunks = []
        for i, c in enumerate(t["chunks"]):
            cat = f"{at}.chunks[{i}]"
            c = _fields(c, cat, {"offsets", "sizes", "file", "offset", "length"})
            offsets, sizes = _ints(c["offsets"], f"{cat}.offsets", len(size)), _ints(c["sizes"], f"{cat}.sizes",
                                                                                     len(size))
            if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
                raise IndexFormatError(f"{cat}: offsets {offsets} + sizes {sizes} lie outside the tensor's size {size}")
            if c["file"] not in files or "/" in c["file"] or c["file"] in (".", ".."):
                raise IndexFormatError(f"{cat}.file: {c['file']!r} is not one of the checkpoint's files "
                                  f"(those in meta.json's digests)")
            start, length = _ints([c["offset"], c["length"]], f"{cat}.offset/length", 2)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[MetadataIndex(fqn, offsets, i)] = _StorageInfo(c["file"], start, length)
        items[fqn] = TensorStorageMetadata(TensorProperties(dtype=_DTYPES[t["dtype"]]), torch.Size(size), chunks)
    return Metadata(state_dict_metadata=items, planner_data={k: (k,) for k in items}, storage_data=storage)


class JsonWriter(FileSystemWriter):
    """DCP's file-system writer, with the index written as ``index.json`` instead of a pickled ``.metadata``."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse non-tensor items before anything is written (they would need pickle to read back)."""
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise IndexFormatError(f"checkpoint item {item.index.fqn!r} is not a tensor: only tensors are saved, "
                                  "so that loading never unpickles objects; convert it to a tensor")
        return super().prepare_local_plan(plan)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write the index (coordinator only, after every rank's data is written).

        Args:
            metadata: the global metadata DCP computed.
            results: every rank's write results (where each item went).

        Raises:
            IndexFormatError: an item that JSON cannot describe (see :func:`index_to_json`).
        """
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        write_json_atomic(index_to_json(metadata), Path(self.path) / INDEX_FILE)


class JsonReader(FileSystemReader):
    """DCP's file-system reader, with the index read from ``index.json``; ``.metadata`` is never opened.

    Args:
        path: the checkpoint folder.
        files: the file names the index may point at; None: every file in the folder.
    """

    def __init__(self, path: str | Path, files: set[str] | None = None) -> None:
        super().__init__(path)
        self._files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, rebuilt from ``index.json`` (see :func:`index_from_json`).

        Raises:
            IndexFormatError: no ``index.json`` (an older checkpoint), or one that does not parse or check.
        """
        folder = Path(self.path)
        source = folder / INDEX_FILE
        if not source.is_file():
            raise IndexFormatError(f"{folder} has no {INDEX_FILE}: it was written by an older version of hpml-compile "
                              "whose index is a pickle (.metadata) that cannot be loaded safely (unpickling runs "
                              "whatever it holds); write the checkpoint again with this version")
        try:
            doc = json.loads(source.read_text(), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError) as e:
            raise IndexFormatError(f"{source} is not valid JSON ({e}); the checkpoint is damaged") from e
        files = self._files if self._files is not None else {p.name for p in folder.iterdir() if p.is_file()}
        md = index_from_json(doc, source, files)
        md.storage_meta = StorageMeta(load_id=self.load_id)
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the planned tensors with DCP's reader (``torch.load(weights_only=True)``); refuse anything else.

        Raises:
            IndexFormatError: a non-tensor item was asked for (it could only be read by unpickling).
        """
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise IndexFormatError(f"{self.path}: item {item.dest_index.fqn!r} is not a tensor; non-tensor items "
                                  "are never read (they would be unpickled)")
        return super().read_data(plan, planner)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


