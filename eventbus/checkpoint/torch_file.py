"""``torch.save``'s file written straight from a staged buffer, without importing torch.

A checkpoint daemon that imported torch to write each file paid ~2.4 s of CPU at its first save and held
torch's libraries in memory for the rest of the run, on machines whose CPUs the trainer shares; each save
also copied the whole state dict out of the buffer first. Here the buffer's tensors go from the map (or the
fetched frame) to the file as they lie, and the rest of the state dict becomes the pickle ``torch.save``
writes for it, so ``torch.load`` reads the file as its own (``weights_only``, ``mmap`` and
``calculate_storage_offsets`` included): the same zip archive, records aligned to 64 bytes as miniz writes
them (a data descriptor after each that holds data), storages named ``data/<key>`` in the order the pickle
refers to them.

What this writes: the staged skeleton's plain values (dicts, lists, tuples, str, int, float, bool, None) and
its tensors, of the dtypes in ``STORAGE_TYPES``, on a little-endian host, in archives under 4 GiB.
:func:`writable` says whether a checkpoint is one; anything else is saved by torch as before.
"""

from __future__ import annotations

import math
import random
import struct
import sys
import zlib
from typing import Any, BinaryIO

__all__ = ["STORAGE_TYPES", "writable", "write_checkpoint"]

#: A dtype's name in a staged layout -> the storage class ``torch.save`` names for it, and its item size.
STORAGE_TYPES = {
    "float32": ("FloatStorage", 4), "float64": ("DoubleStorage", 8), "float16": ("HalfStorage", 2),
    "bfloat16": ("BFloat16Storage", 2), "int64": ("LongStorage", 8), "int32": ("IntStorage", 4),
    "int16": ("ShortStorage", 2), "int8": ("CharStorage", 1), "uint8": ("ByteStorage", 1),
    "bool": ("BoolStorage", 1), "complex64": ("ComplexFloatStorage", 8), "complex128": ("ComplexDoubleStorage", 16),
}
_ALIGNMENT = 64
_SMALL = 0xFFFFFFFF  # past it a zip needs zip64 sizes and offsets: such archives are left to torch
_ARCHIVE = "archive"  # the name torch.save gives the archive's folder when it writes to a file object
_CHUNK = 64 << 20


def writable(skeleton_bytes: int, layout: list[list[Any]]) -> bool:
    """Whether :func:`write_checkpoint` writes this checkpoint (else torch.save does): an archive surely under
    4 GiB (its pickle at most twice the skeleton, ~310 bytes of pickle and headers a tensor, ~1.3 KB more)."""
    try:
        total = 2 * skeleton_bytes + sum(int(entry[3]) + 1024 for entry in layout) + (1 << 16)
        known = all(entry[0] in STORAGE_TYPES for entry in layout)
    except (TypeError, ValueError, IndexError, KeyError):
        return False  # a malformed layout: torch's path says what is wrong with it
    return sys.byteorder == "little" and total < _SMALL and known


def write_checkpoint(file: BinaryIO, skeleton: Any, layout: list[list[Any]], data: Any) -> None:
    """Write the state dict that ``skeleton`` describes (:func:`~eventbus.checkpoint.layout.flatten`'s form),
    its tensors ``layout``'s slices of ``data``, as ``torch.save`` would write it to ``file``."""
    pickle = _Pickle(layout)
    pickle.value(skeleton)
    archive = _Archive(file)
    archive.record("data.pkl", pickle.finish())
    archive.record(".format_version", b"1")
    archive.record(".storage_alignment", str(_ALIGNMENT).encode())
    archive.record("byteorder", b"little")
    with memoryview(data) as raw, raw.cast("B") as view:  # released even on an error: the map can then close
        for key, index in enumerate(pickle.storages):
            _, _, offset, nbytes = layout[index]
            if offset + nbytes > len(view):
                raise ValueError(f"staged tensor {index} lies outside its buffer (bytes {offset} to "
                                 f"{offset + nbytes} of {len(view)})")
            with view[offset:offset + nbytes] as tensor:
                archive.record(f"data/{key}", tensor)
    archive.record("version", b"3\n")
    archive.record(".data/serialization_id", str(random.getrandbits(128)).zfill(40).encode())
    archive.finish()


def _checked(layout: list[list[Any]], index: Any) -> tuple[str, list[int], int, int]:
    """Layout entry ``index``, checked: [dtype, shape, offset, bytes], the bytes those of the shape."""
    if index.__class__ is not int or not 0 <= index < len(layout):
        raise ValueError(f"the staged skeleton names tensor {index!r} of {len(layout)}")
    entry = layout[index]
    if entry.__class__ is not list or len(entry) != 4:
        raise ValueError(f"staged tensor {index}: its layout must be [dtype, shape, offset, bytes], got {entry!r:.80}")
    dtype, shape, offset, nbytes = entry
    if dtype not in STORAGE_TYPES:
        raise ValueError(f"staged tensor {index}: dtype {dtype!r:.40} is not one this writer knows")
    if shape.__class__ is not list or any(size.__class__ is not int or size < 0 for size in shape):
        raise ValueError(f"staged tensor {index}: shape {shape!r:.80} is not a list of sizes")
    if offset.__class__ is not int or offset < 0 or nbytes.__class__ is not int:
        raise ValueError(f"staged tensor {index}: offset {offset!r:.40} and bytes {nbytes!r:.40} must be integers")
    if math.prod(shape) * STORAGE_TYPES[dtype][1] != nbytes:
        raise ValueError(f"staged tensor {index}: shape {shape} of {dtype} does not hold {nbytes} bytes")
    return dtype, shape, offset, nbytes


class _Pickle:
    """The pickle (protocol 2) of a staged skeleton, each tensor as ``torch.save`` reduces it: torch's
    ``_rebuild_tensor_v2`` of a persistent storage reference. Written opcode by opcode: pickling torch's
    names through :mod:`pickle` would import torch to check them. One call of :meth:`value` per level of
    nesting, as :func:`~eventbus.checkpoint.layout.flatten` made it: as deep as the trainer could stage."""

    def __init__(self, layout: list[list[Any]]):
        self._layout = layout
        self._out = bytearray(b"\x80\x02")
        self.storages: list[int] = []  # layout indices, in the order of their keys (0, 1, ...)

    def finish(self) -> bytes:
        self._out += b"."
        return bytes(self._out)

    def value(self, value: Any) -> None:
        out, kind = self._out, value.__class__
        if value is None:
            out += b"N"
        elif kind is bool:
            out += b"\x88" if value else b"\x89"
        elif kind is int:
            self._int(value)
        elif kind is float:
            out += b"G" + struct.pack(">d", value)
        elif kind is str:
            encoded = value.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(encoded)) + encoded
        elif kind is list:
            out += b"](" if value else b"]"
            for item in value:
                self.value(item)
            out += b"e" if value else b""
        elif kind is not dict:
            raise TypeError(f"a staged checkpoint holds no {kind.__name__}")
        elif len(value) == 1 and "__tensor__" in value:
            self._tensor(value["__tensor__"])
        elif len(value) == 1 and value.get("__tuple__").__class__ is list:
            out += b"("
            for item in value["__tuple__"]:
                self.value(item)
            out += b"t"
        else:  # a dict; one whose keys are not all strings was staged as its items
            items = value["__items__"] if len(value) == 1 and value.get("__items__").__class__ is list \
                else value.items()
            out += b"}(" if items else b"}"
            for key, item in items:
                self.value(key)
                self.value(item)
            out += b"u" if items else b""

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self._out += b"K" + bytes((value,))
        elif -(1 << 31) <= value < (1 << 31):
            self._out += b"J" + struct.pack("<i", value)
        else:
            encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self._out += b"\x8a" + bytes((len(encoded),)) + encoded

    def _ints(self, values: list[int]) -> None:
        self._out += b"("
        for value in values:
            self._int(value)
        self._out += b"t"

    def _tensor(self, index: Any) -> None:
        dtype, shape, _, _ = _checked(self._layout, index)
        key = len(self.storages)
        self.storages.append(index)
        strides, step = [], 1
        for size in reversed(shape):  # contiguous: as staged
            strides.append(step)
            step *= size
        out = self._out
        out += b"ctorch._utils\n_rebuild_tensor_v2\n(("
        self.value("storage")
        out += f"ctorch\n{STORAGE_TYPES[dtype][0]}\n".encode()
        self.value(str(key))
        self.value("cpu")
        self._int(math.prod(shape))
        out += b"tQ"  # the storage reference: torch.load's persistent_load
        self._int(0)  # storage offset
        self._ints(shape)
        self._ints(strides[::-1])
        out += b"\x89ccollections\nOrderedDict\n)R"  # requires_grad False, no backward hooks
        out += b"tR"


class _Archive:
    """A zip archive as torch's writer (miniz) lays it out: each record stored, its data aligned to 64 bytes
    by an ``FB`` extra field, followed by a data descriptor; a zip64 end record before the usual one."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self._offset = 0
        self._central = bytearray()
        self._count = 0

    def _write(self, data: Any) -> None:
        self._file.write(data)
        self._offset += len(data)

    def record(self, name: str, data: Any) -> None:
        full = f"{_ARCHIVE}/{name}".encode()
        header_at = self._offset
        start = header_at + 30 + len(full) + 4
        padding = -start % _ALIGNMENT
        size = len(data)
        flags = 0x0808 if size else 0x0800  # names in UTF-8; the sizes of data in a descriptor after it (miniz's way)
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), 4 + padding))
        self._write(full + b"FB" + struct.pack("<H", padding) + b"Z" * padding)
        crc = 0
        with memoryview(data) as whole:
            for at in range(0, size, _CHUNK):
                with whole[at:at + _CHUNK] as chunk:
                    crc = zlib.crc32(chunk, crc)
                    self._write(chunk)
        if size:
            self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self._central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, 0, 0, crc, size, size,
                                     len(full), 0, 0, 0, 0, 0, header_at) + full
        self._count += 1

    def finish(self) -> None:
        central_at, central_size, count = self._offset, len(self._central), self._count
        self._write(self._central)
        end64_at = self._offset
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, count, count, central_size,
                                central_at))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end64_at, 1))
        short = min(count, 0xFFFF)  # past it, readers take the count from the zip64 record above
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, short, short, central_size, central_at, 0))
