"""A simple lossless coder of bf16 weights: the compressed GPU tier of expert paging, stored and
decompressed for real.

A bf16 value is a sign bit, an 8-bit exponent and a 7-bit mantissa. Trained (and random) weights
use few exponents: most values of a matrix lie within a few powers of two of its scale, so the
exponent carries ~2.5 bits of information in its 8, while sign and mantissa are close to random.
The coder therefore keeps each value's sign and mantissa as one raw byte, and codes its exponent
with `bits` bits (2-4, whichever stores least): the `2**bits - 1` most frequent exponents get a
code each, the last code is an escape whose exponent is stored raw in a side array (in value
order). This is FluxMoE's idea (a lossless exponent coding, SERVING.md "Mechanisms") without its
entropy coder: ~69% of the bf16 size on Gaussian weights, against FluxMoE's 67.9% on real ones.

Decoding is a few vectorised torch ops (unpack the codes, look up the table, fill the escapes,
join the bytes), so it runs where the tensors are: on the CPU in tests, on the GPU under CUDA.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

CODE_BITS = (2, 3, 4)  # code widths tried; eight codes pack into `bits` bytes
TAKE_CHUNK = 1 << 18  # values looked up at once (2 MB of index)
HEADER_BYTES = 16  # count, bits, escape count: what a stored image holds besides its arrays


@dataclass(frozen=True)
class Compressed:
    """One compressed run of bf16 values (`count` of them)."""

    count: int
    bits: int
    table: torch.Tensor  # int32 [2**bits - 1]: the exponent of each code
    codes: torch.Tensor  # uint8 [ceil(count / 8) * bits]: the codes, eight to `bits` bytes, big-endian
    escapes: torch.Tensor  # uint8: the raw exponents of escaped values, in value order
    low: torch.Tensor  # uint8 [count]: sign (bit 7) and mantissa (bits 0-6) of each value

    @property
    def nbytes(self) -> int:
        """Bytes the compressed image stores (what the compressed tier holds)."""
        return HEADER_BYTES + len(self.table) + self.codes.numel() + self.escapes.numel() + self.low.numel()

    @property
    def raw_bytes(self) -> int:
        return 2 * self.count

    def to(self, device: torch.device | str) -> "Compressed":
        return Compressed(
            self.count,
            self.bits,
            self.table.to(device),
            self.codes.to(device),
            self.escapes.to(device),
            self.low.to(device),
        )


def _bits16(values: torch.Tensor) -> np.ndarray:
    if values.dtype != torch.bfloat16:
        raise TypeError(f"the coder stores bf16 values, got {values.dtype}")
    return values.detach().reshape(-1).cpu().view(torch.int16).numpy().view(np.uint16)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (< 2**bits) -> eight codes to `bits` bytes, big-endian."""
    pad = (-len(codes)) % 8
    groups = np.concatenate([codes, np.zeros(pad, np.uint8)]).reshape(-1, 8) if pad else codes.reshape(-1, 8)
    word = np.zeros(len(groups), np.uint32)
    for k in range(8):
        word <<= bits
        word |= groups[:, k]
    out = np.empty((len(groups), bits), np.uint8)
    for k in range(bits):
        out[:, k] = word >> (8 * (bits - 1 - k))
    return out.reshape(-1)


def encode(values: torch.Tensor) -> Compressed:
    """Compress bf16 `values` (any shape, read flat) losslessly."""
    raw = _bits16(values)
    exponent = ((raw >> 7) & 0xFF).astype(np.uint8)
    low = (((raw >> 8) & 0x80) | (raw & 0x7F)).astype(np.uint8)
    counts = np.bincount(exponent, minlength=256)
    order = np.argsort(-counts, kind="stable")

    def size(bits: int) -> int:
        coded = int(counts[order[: (1 << bits) - 1]].sum())
        return (-(-len(raw) // 8)) * bits + (len(raw) - coded) + (1 << bits) - 1

    bits = min(CODE_BITS, key=size)
    table = order[: (1 << bits) - 1].astype(np.int32)
    escape = (1 << bits) - 1
    lookup = np.full(256, escape, np.uint8)
    lookup[table] = np.arange(len(table), dtype=np.uint8)
    codes = lookup[exponent]
    escapes = exponent[codes == escape]
    return Compressed(
        len(raw),
        bits,
        torch.from_numpy(table),
        torch.from_numpy(_pack(codes, bits)),
        torch.from_numpy(np.ascontiguousarray(escapes)),
        torch.from_numpy(low),
    )


def decode(c: Compressed, out: torch.Tensor | None = None, impl: str = "") -> torch.Tensor:
    """The bf16 values of `c`, written into `out` (a bf16 tensor of `c.count` values, or a uint8 one
    of `2 * c.count` bytes, on c's device) when given. `impl`: `numpy` (the CPU's: one table look-up
    per value, 0.4-0.7 GB/s on one core here) or `torch` (any device); default: numpy on the CPU."""
    impl = impl or ("numpy" if c.codes.device.type == "cpu" else "torch")
    if out is not None:
        out = out.view(torch.bfloat16) if out.dtype == torch.uint8 else out
        if out.numel() != c.count or out.dtype != torch.bfloat16:
            raise ValueError(f"decode into {out.numel()} {out.dtype} values; the image holds {c.count} bf16 values")
    if impl == "numpy":
        values = _decode_numpy(c, None if out is None else out.view(-1).view(torch.int16).numpy().view(np.uint16))
        return out if out is not None else torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    if impl != "torch":
        raise ValueError(f"decode impl must be numpy or torch, got {impl!r}")
    decoded = _decode_torch(c)
    if out is None:
        return decoded
    out.view(-1).copy_(decoded)
    return out


class _Scratch:
    """The work arrays of numpy decoding, grown to the largest image seen and reused: fresh arrays
    of a matrix's size are fresh pages, faulted in on every decode (a third of its time). Each decode
    takes one from a pool (threads decode at once with their own) and gives it back."""

    def __init__(self) -> None:
        self.size = 0

    def get(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        groups = -(-count // 8)
        if not self.size:
            self.wide = np.ones(TAKE_CHUNK, np.intp)
        if groups * 8 > self.size:
            self.size = groups * 8
            # (np.ones, not np.zeros: calloc's zeros are pages not yet faulted in, and the first decode
            # would fault them, a third of its time)
            self.word = np.ones(groups, np.uint32)
            self.part = np.ones(groups, np.uint32)
            self.index = np.ones(groups * 8, np.uint16)
            self.flag = np.ones(groups * 8, np.bool_)
        return self.word[:groups], self.part[:groups], self.index[: groups * 8], self.flag[:count], self.wide


_POOL: list[_Scratch] = []
_POOL_LOCK = threading.Lock()


def warm(count: int) -> None:
    """Make (and touch) the work arrays for images of up to `count` values before a timed run."""
    with _POOL_LOCK:
        scratch = _POOL.pop() if _POOL else _Scratch()
    scratch.get(count)
    with _POOL_LOCK:
        _POOL.append(scratch)


def _decode_numpy(c: Compressed, out: np.ndarray | None) -> np.ndarray:
    with _POOL_LOCK:
        scratch = _POOL.pop() if _POOL else _Scratch()
    try:
        return _decode_into(c, out, *scratch.get(c.count))
    finally:
        with _POOL_LOCK:
            _POOL.append(scratch)


def _decode_into(
    c: Compressed,
    out: np.ndarray | None,
    word: np.ndarray,
    part: np.ndarray,
    index: np.ndarray,
    flag: np.ndarray,
    wide: np.ndarray,
) -> np.ndarray:
    """One table look-up per value of `code << 8 | low` (module docstring), in the work arrays given."""
    packed = c.codes.numpy().reshape(-1, c.bits)
    word.fill(0)
    for k in range(c.bits):
        np.left_shift(word, 8, out=word)
        np.bitwise_or(word, packed[:, k], out=word)
    mask = (1 << c.bits) - 1
    rows = index.reshape(-1, 8)
    for k in range(8):
        np.right_shift(word, c.bits * (7 - k), out=part)
        np.bitwise_and(part, mask, out=part)
        rows[:, k] = part
    index = index[: c.count]
    np.left_shift(index, 8, out=index)
    np.bitwise_or(index, c.low.numpy(), out=index)
    words = _word_table(c.table.numpy())
    if out is None:
        out = np.empty(c.count, np.uint16)
    # the look-up in chunks through an index of numpy's own integer type: np.take converts any other index
    # to a whole new array first (8 bytes a value), fresh pages in a fresh thread, faulted in slowly
    for at in range(0, c.count, TAKE_CHUNK):
        n = min(TAKE_CHUNK, c.count - at)
        np.copyto(wide[:n], index[at : at + n])
        np.take(words, wide[:n], out=out[at : at + n], mode="clip")  # ("raise" would buffer `out`)
    if c.escapes.numel():
        np.greater_equal(index, mask << 8, out=flag)  # (the escape code is the largest)
        out[np.flatnonzero(flag)] |= c.escapes.numpy().astype(np.uint16) << 7
    return out


def _word_table(table: np.ndarray) -> np.ndarray:
    """[code << 8 | low] -> the bf16 bits: sign and mantissa from `low`, exponent from the code."""
    low = np.arange(256, dtype=np.uint16)
    exponent = np.concatenate([table.astype(np.uint16), np.zeros(1, np.uint16)])
    return (((low & 0x80) << 8)[None, :] | (exponent << 7)[:, None] | (low & 0x7F)[None, :]).reshape(-1)


def _decode_torch(c: Compressed) -> torch.Tensor:
    device = c.codes.device
    words = c.codes.reshape(-1, c.bits).to(torch.int32)
    word = torch.zeros(words.shape[0], dtype=torch.int32, device=device)
    for k in range(c.bits):
        word = (word << 8) | words[:, k]
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=device) * c.bits
    codes = ((word[:, None] >> shifts) & ((1 << c.bits) - 1)).reshape(-1)[: c.count]
    table = torch.cat([c.table, torch.zeros(1, dtype=torch.int32, device=device)])
    exponent = table[codes.long()]
    if c.escapes.numel():
        exponent[codes == (1 << c.bits) - 1] = c.escapes.to(torch.int32)
    low = c.low.to(torch.int32)
    word16 = ((low & 0x80) << 8) | (exponent << 7) | (low & 0x7F)
    return (word16 - ((word16 >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def encoded_share(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(compressed bytes, bf16 bytes) of `tensors`, each compressed on its own."""
    stored = raw = 0
    for t in tensors:
        c = encode(t)
        stored, raw = stored + c.nbytes, raw + c.raw_bytes
    return stored, raw
