"""The wire between the judge (trusted) and the runner (candidate code): framing, the reply codec
and the shared input arena. Both processes import it; each function says which side uses it.

Every message is a frame: an 8-byte little-endian length, then that many bytes, over one Unix
stream socket (what `multiprocessing.Pipe()` is on Linux; used raw so that reads have deadlines).

- judge → runner: one frame, a pickled request dict (the runner trusts the judge). A request may
  carry file descriptors (SCM_RIGHTS) on its first byte: the memfd of an input `Arena`.
- runner → judge: a JSON header frame, then one frame per tensor the header announces, holding
  its raw bytes. **The judge never unpickles what the runner sends** — a hostile runner would
  send a pickle that runs code in the judge — and it reads fds from no runner message. It reads
  JSON (strict: no NaN), checks every field's type and range, and reads a tensor's bytes only
  when their length is the one the header's dtype and shape imply.

Inputs travel the other way through shared memory (`Arena`): a memfd that the judge fills and the
runner maps, so the judge sees what a call did to its inputs without asking the runner. The
judge's own reference outputs and pristine copies never enter it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import mmap
import os
import pickle
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import torch

_LEN = struct.Struct("<Q")
#: A reply header larger than this is refused before it is read.
MAX_HEADER_BYTES = 4 << 20
_ALIGN = 64
_DRAIN_CHUNK = 1 << 20


class RunnerGone(Exception):
    """The other end closed or reset the socket (the runner crashed or exited)."""


class Deadline(Exception):
    """No complete message before the deadline."""


class ProtocolError(Exception):
    """A message the judge will not read: malformed, oversized, or not what was announced."""


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"non-finite number {name} in a reply")


class Channel:
    """One end of the socket. Judge-side reads take a deadline (`time.monotonic()` seconds)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        self.sock.close()

    # ---------------------------------------------------------------- judge side

    def _arm(self, deadline: float | None) -> None:
        if deadline is None:
            self.sock.settimeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise Deadline()
        self.sock.settimeout(left)

    def _recv_exact(self, n: int, deadline: float | None) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self._arm(deadline)
            try:
                k = self.sock.recv_into(view[got:], n - got)  # never recvmsg: fds sent to the judge are dropped
            except TimeoutError as exc:
                raise Deadline() from exc
            except (ConnectionError, OSError) as exc:
                raise RunnerGone(str(exc)) from exc
            if k == 0:
                raise RunnerGone("end of stream")
            got += k
        return buf

    def _frame_length(self, deadline: float | None) -> int:
        return _LEN.unpack(self._recv_exact(_LEN.size, deadline))[0]

    def send_request(self, request: dict[str, Any], fds: tuple[int, ...] = (), deadline: float | None = None) -> None:
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        head = _LEN.pack(len(payload))
        self._arm(deadline)
        try:
            sent = socket.send_fds(self.sock, [head], list(fds)) if fds else 0
            self.sock.sendall(head[sent:] + payload)
        except TimeoutError as exc:
            raise Deadline() from exc
        except (ConnectionError, OSError) as exc:
            raise RunnerGone(str(exc)) from exc

    def recv_header(self, deadline: float | None) -> dict[str, Any]:
        n = self._frame_length(deadline)
        if n > MAX_HEADER_BYTES:
            raise ProtocolError(f"a reply header of {n} bytes (at most {MAX_HEADER_BYTES})")
        raw = self._recv_exact(n, deadline)
        try:
            header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"a reply header that is not JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise ProtocolError(f"a reply header that is a {type(header).__name__}, not an object")
        return header

    def recv_blob(self, nbytes: int, deadline: float | None) -> bytearray:
        n = self._frame_length(deadline)
        if n != nbytes:
            raise ProtocolError(f"a tensor frame of {n} bytes where its header announced {nbytes}")
        return self._recv_exact(n, deadline)

    def skip_blob(self, nbytes: int, deadline: float | None) -> None:
        """Read and discard a tensor frame (one the judge has already judged from its header)."""
        n = self._frame_length(deadline)
        if n != nbytes:
            raise ProtocolError(f"a tensor frame of {n} bytes where its header announced {nbytes}")
        while n:
            n -= len(self._recv_exact(min(n, _DRAIN_CHUNK), deadline))

    # ---------------------------------------------------------------- runner side

    def recv_request(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next request and the fds that came with it; None when the judge has gone."""
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, _LEN.size, 4)
        except (ConnectionError, OSError):
            return None
        head = bytearray(data)
        while 0 < len(head) < _LEN.size:
            more = self.sock.recv(_LEN.size - len(head))
            if not more:
                return None
            head += more
        if not head:
            return None
        n = _LEN.unpack(head)[0]
        body = bytearray()
        while len(body) < n:
            more = self.sock.recv(min(n - len(body), 1 << 24))
            if not more:
                return None
            body += more
        return pickle.loads(body), list(fds)

    def send_reply(self, header: dict[str, Any], blobs: list[memoryview]) -> None:
        payload = json.dumps(header, allow_nan=False).encode()
        self.sock.sendall(_LEN.pack(len(payload)) + payload)
        for blob in blobs:
            self.sock.sendall(_LEN.pack(blob.nbytes))
            self.sock.sendall(blob)


# ------------------------------------------------------------------------------ tensors in replies

_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
                "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
#: The dtypes a reply may name (those this torch has); anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}


#: At most this many parts in a tuple output (a top-k's (values, indices) has two).
MAX_PARTS = 32  # a Mega step returns its hidden vector and 14 state tensors


def encode_output(value: object, slots: OutputSlots | None = None) -> tuple[dict[str, Any], list[memoryview]]:
    """Runner side: a call's result as (header entry, raw byte frames). A plain tuple or list of
    up to MAX_PARTS values is a "tuple" entry with one entry per part (never nested). With `slots`
    (the reply's place in the judge's output area), a tensor that fits there is a "shared" entry
    (its offset, no frame), else a "tensor" entry and a frame."""
    if type(value) in (tuple, list) and 0 < len(value) <= MAX_PARTS:  # type: ignore[arg-type]
        parts = [_encode_one(v, slots) for v in value]  # type: ignore[union-attr]
        return {"kind": "tuple", "parts": [m for m, _ in parts]}, [b for _, b in parts if b is not None]
    meta, blob = _encode_one(value, slots)
    return meta, [] if blob is None else [blob]


def _encode_one(value: object, slots: OutputSlots | None) -> tuple[dict[str, Any], memoryview | None]:
    """Anything but a plain, strided, materialised tensor is described by its type name only."""
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind is not torch.Tensor:
        return {"kind": "other", "type": name}, None
    assert isinstance(value, torch.Tensor)
    if value.layout != torch.strided or value.device.type == "meta" or value.is_quantized:
        return {"kind": "other", "type": f"{name} ({value.layout}, {value.device.type})"}, None
    value = value.detach().resolve_conj().resolve_neg()
    described = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                 "device": str(value.device), "nbytes": value.numel() * value.element_size()}
    at = slots.place(value) if slots is not None else None
    if at is not None:
        return {"kind": "shared", "at": at, **described}, None
    flat = value.cpu().contiguous().reshape(-1)
    meta = {"kind": "tensor", **described}
    if flat.numel() == 0:
        return meta, memoryview(b"")
    return meta, memoryview(flat.view(torch.uint8).numpy()).cast("B")


def tensor_meta(entry: object) -> tuple[tuple[int, ...], torch.dtype, str, int]:
    """Judge side: (shape, dtype, device, nbytes) of a tensor header entry, checked."""
    if not isinstance(entry, dict):
        raise ProtocolError("an output entry that is not an object")
    shape, dtype, device, nbytes = (entry.get(k) for k in ("shape", "dtype", "device", "nbytes"))
    if not (isinstance(shape, list) and len(shape) <= 64
            and all(type(d) is int and 0 <= d < (1 << 48) for d in shape)):
        raise ProtocolError(f"an output shape {str(shape)[:80]!r}")
    if dtype not in DTYPES:
        raise ProtocolError(f"an output dtype {str(dtype)[:40]!r}")
    if not (isinstance(device, str) and len(device) <= 64):
        raise ProtocolError("an output device that is not a short string")
    dt = DTYPES[dtype]
    expected = math.prod(shape) * torch.empty((), dtype=dt).element_size()
    if type(nbytes) is not int or nbytes != expected:
        raise ProtocolError(f"an output of {nbytes!r} bytes where shape and dtype make {expected}")
    return tuple(shape), dt, device, nbytes


def decode_tensor(blob: bytearray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Judge side: a private CPU tensor from a reply's bytes (copied: the judge owns it)."""
    if not blob:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(blob, dtype=torch.uint8).view(dtype).reshape(shape).clone()


# ------------------------------------------------------------------------------ shared inputs


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor lies in an arena: contiguous bytes, plus the strides it must be given."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: contiguous


def view_of(base: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """`ref`'s bytes in a mapped arena as a contiguous tensor (shared, not a copy)."""
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=ref.dtype)
    return base[ref.offset:ref.offset + ref.nbytes].view(ref.dtype).view(ref.shape)


def _replace(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_replace(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, fn) for k, v in value.items()}
    return value


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the alignment every tensor in shared memory starts at."""
    return -(-nbytes // _ALIGN) * _ALIGN


class Arena:
    """Judge side: one shape's inputs copied into a memfd that the runner maps (stops nothing by
    itself; it lets the judge check in-place writes without trusting the runner's word). Tensors
    in `values` become `TensorRef`s in `encoded`; a tensor object used twice is stored once, so
    inputs that checks share stay shared, as in the plan. Filled from the GPU, it stays pinned
    (`pin_host`) until `unpin`, since every check copies its inputs back for the judge to compare."""

    def __init__(self, values: Any) -> None:
        refs: dict[int, TensorRef] = {}
        sources: list[tuple[torch.Tensor, TensorRef]] = []
        size = 0

        def place(t: torch.Tensor) -> TensorRef:
            nonlocal size
            if id(t) not in refs:
                nbytes = t.numel() * t.element_size()
                ref = TensorRef(size, nbytes, t.dtype, tuple(t.shape), None if t.is_contiguous() else tuple(t.stride()))
                refs[id(t)] = ref
                sources.append((t, ref))
                size += aligned(nbytes)
            return refs[id(t)]

        self.encoded = _replace(values, place)
        self.size = max(size, _ALIGN)
        self.fd, self._map, self.base = shared_bytes("kernelboard-inputs", self.size)
        self.pinned = any(t.is_cuda for t, _ in sources) and pin_host(self.base)
        with torch.no_grad():
            for t, ref in sources:
                if ref.nbytes:
                    self.view(ref).copy_(t.detach())

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The shared bytes of `ref` as a (contiguous) tensor: what the runner's call left there."""
        return view_of(self.base, ref)

    def close_fd(self) -> None:
        """Once the runner has its copy of the descriptor; the mapping stays."""
        os.close(self.fd)

    def unpin(self) -> None:
        """When the shape's checks are done: the mapping may go after this."""
        if self.pinned:
            unpin_host(self.base)
            self.pinned = False


def shared_bytes(name: str, size: int) -> tuple[int, mmap.mmap, torch.Tensor]:
    """A memfd of `size` bytes sealed at that size, its mapping, and the mapping as a byte tensor. Sealed:
    the runner, which gets the descriptor, cannot shrink it under the judge's mapping (a judge that read
    past the new end would die of SIGBUS) nor grow it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    mapped = mmap.mmap(fd, size)
    return fd, mapped, torch.frombuffer(mapped, dtype=torch.uint8)


class OutputArea:
    """Judge side: shared memory the runner lays a reply's output tensors in (`OutputSlots`), one reply
    at a time from its start, so that a GB-sized output crosses at memory speed, not the socket's (06's
    headline: 16 outputs of 0.8 GB took 12.3 s through the socket on the H100, 2026-12-06). An output that
    does not fit comes as a frame. The judge copies each output out before it reads it (`read`): the
    runner can write here whenever it likes, and what is judged must be one snapshot."""

    def __init__(self, size: int) -> None:
        self.size = max(aligned(size), _ALIGN)
        self.fd, self._map, self.base = shared_bytes("kernelboard-outputs", self.size)

    def holds(self, at: object, nbytes: int) -> bool:
        """Whether an entry's offset `at` names `nbytes` bytes inside the area, aligned."""
        return type(at) is int and at >= 0 and at % _ALIGN == 0 and at + nbytes <= self.size

    def read(self, at: int, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """A private copy of the tensor at `at`, made on `device` (the reference's: on a GPU grading
        the judge compares there, and one copy from here is cheaper than a host copy and then another)."""
        if not nbytes:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.base[at:at + nbytes].view(dtype).reshape(shape).to(device, copy=True)

    def close_fd(self) -> None:
        """Once the runner has its copy of the descriptor; the mapping stays."""
        os.close(self.fd)


def slots_bytes(outputs: list[Any]) -> int:
    """Bytes one reply's outputs (tensors, or tuples of them) take in an `OutputArea`."""
    parts = (t for out in outputs for t in (out if isinstance(out, tuple) else (out,)))
    return sum(aligned(t.numel() * t.element_size()) for t in parts)


class OutputSlots:
    """Runner side: one reply's output tensors laid into the judge's `OutputArea`, from its start."""

    def __init__(self, base: torch.Tensor | None) -> None:
        self.base, self.used = base, 0

    def place(self, value: torch.Tensor) -> int | None:
        """Copy `value` in (from its device, by DMA where the area is page-locked); its offset, or None
        where there is no area or no room left."""
        nbytes = value.numel() * value.element_size()
        at = self.used
        if self.base is None or at + nbytes > self.base.numel():
            return None
        if nbytes:
            self.base[at:at + nbytes].view(value.dtype).view(value.shape).copy_(value)
        self.used = at + aligned(nbytes)
        return at


def pin_host(base: torch.Tensor) -> bool:
    """Page-lock a mapping for CUDA copies (either side): copies between it and the GPU then run by
    DMA instead of through a staging buffer — 06's 35 GB arena took 29 s to fill unpinned, and each
    of its checks moved 5 GB at about 1.2 GB/s. False (nothing pinned, copies still work) without
    CUDA or when the driver refuses; a refusal's error is consumed here, so that it is not reported
    by the next kernel launch as that kernel's own."""
    if not torch.cuda.is_available() or not base.numel():
        return False
    if int(torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), 0)) == 0:
        return True
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda").add_(1)  # a launch check reads (and so clears) the last error
    return False


def unpin_host(base: torch.Tensor) -> None:
    """Undo `pin_host` before the mapping goes (a mapping unmapped while pinned stays locked)."""
    torch.cuda.cudart().cudaHostUnregister(base.data_ptr())


def map_arena(fd: int, size: int) -> torch.Tensor:
    """Runner side: the judge's arena as a byte tensor (the fd is closed, the mapping stays)."""
    try:
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def resolve(encoded: Any, base: torch.Tensor) -> Any:
    """Runner side: `encoded` with each `TensorRef` replaced by its (contiguous) view of the arena."""
    if isinstance(encoded, TensorRef):
        return view_of(base, encoded)
    if isinstance(encoded, list | tuple):
        return type(encoded)(resolve(v, base) for v in encoded)
    if isinstance(encoded, dict):
        return {k: resolve(v, base) for k, v in encoded.items()}
    return encoded
