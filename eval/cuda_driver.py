"""The few CUDA driver calls that let two processes share device memory and order their streams on it.

Why: the judge and the sandboxed runner are separate processes, each with its own CUDA context, and the
runner has its own PID namespace, where the driver refuses legacy IPC handles (measured in
bench/cross_process_timing.py: "mapping of buffer object failed"). A device allocation made with
`cuMemCreate` and exported as a POSIX file descriptor crosses any namespace as an inherited descriptor; both
processes map it, and their streams wait on and write 32-bit words in it (`cuStreamWaitValue32`,
`cuStreamWriteValue32`), so one process's stream can hold until the other's reaches a point. torch exposes
none of this; ctypes reaches libcuda, which every CUDA build of torch loads. Used by eval/gpu_witness.py and
bench/cross_process_timing.py.
"""

from __future__ import annotations

import ctypes
import types
from typing import Any

PINNED, POSIX_FD, ON_DEVICE, READ_WRITE, WAIT_GEQ = 1, 1, 1, 3, 0


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


class Driver:
    """libcuda's calls by name; each failure raises with the call's name and the driver's error text."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args: object) -> None:
        for symbol in (f"{name}_v2", name):
            fn = getattr(self.lib, symbol, None)
            if fn is not None:
                break
        else:
            raise RuntimeError(f"libcuda has no {name}")
        code = fn(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: {code} {text.value.decode() if text.value else ''}")

    def prop(self, device: int) -> AllocationProp:
        return AllocationProp(PINNED, POSIX_FD, Location(ON_DEVICE, device), None, AllocFlags())

    def granular(self, size: int, device: int) -> int:
        """`size` rounded up to the allocation granularity (2 MiB on the H100 and H200)."""
        granularity = ctypes.c_size_t()
        self("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop(device)), 0)
        return -(-size // granularity.value) * granularity.value

    def create_exported(self, size: int, device: int) -> tuple[int, int]:
        """A device allocation of `size` bytes (granular) and a file descriptor that shares it."""
        handle, fd = ctypes.c_ulonglong(), ctypes.c_int()
        self("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop(device)),
             ctypes.c_ulonglong(0))
        self("cuMemExportToShareableHandle", ctypes.byref(fd), handle, POSIX_FD, ctypes.c_ulonglong(0))
        return handle.value, fd.value

    def import_fd(self, fd: int) -> int:
        handle = ctypes.c_ulonglong()
        self("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD)
        return handle.value

    def map(self, handle: int, size: int, device: int) -> int:
        """Map an allocation handle into this process, readable and writable from `device`: its address."""
        ptr = ctypes.c_ulonglong()
        self("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
             ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        self("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
             ctypes.c_ulonglong(0))
        desc = AccessDesc(Location(ON_DEVICE, device), READ_WRITE)
        self("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))
        return ptr.value

    def unmap(self, address: int, size: int, handle: int) -> None:
        """Undo `map` and drop this process's reference to the allocation (freed once no process maps it)."""
        self("cuMemUnmap", ctypes.c_ulonglong(address), ctypes.c_size_t(size))
        self("cuMemAddressFree", ctypes.c_ulonglong(address), ctypes.c_size_t(size))
        self("cuMemRelease", ctypes.c_ulonglong(handle))

    def wait(self, stream: int, address: int, value: int) -> None:
        """`stream` holds until the word at `address` is at least `value`."""
        self("cuStreamWaitValue32", ctypes.c_void_p(stream), ctypes.c_ulonglong(address), ctypes.c_uint32(value),
             WAIT_GEQ)

    def write(self, stream: int, address: int, value: int) -> None:
        """`stream` writes `value` to the word at `address` once its earlier work is done."""
        self("cuStreamWriteValue32", ctypes.c_void_p(stream), ctypes.c_ulonglong(address), ctypes.c_uint32(value), 0)


def bytes_at(address: int, nbytes: int) -> Any:
    """A uint8 torch view of `nbytes` of device memory this process mapped itself (no allocator owns it);
    `.view(dtype)` of a slice gives any dtype, those without a `__cuda_array_interface__` typestr included."""
    import torch

    interface = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None}
    return torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=interface), device="cuda")
