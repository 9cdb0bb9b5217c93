"""A CPU stand-in for CUDA graph capture's rules: refuse what would synchronize with the host.

Inside :func:`no_host_sync`, reading a tensor's value on the host (``bool``, ``int``,
``float``, ``item``, ``tolist``, ``cpu``, ``numpy``), ops whose output size depends on the
data (``nonzero``, ``argwhere``, ``unique``, ``masked_select``, one-argument ``where``,
boolean-mask indexing), writing a Python scalar through a tensor index and making a tensor
from Python data with ``torch.tensor`` (host-to-device copies on CUDA) raise ``HostSyncError``. A step that passes on CPU has none of the syncs that make a
capture fail on the GPU. Let through are Triton's interpreter (a kernel launch is one
graph node on CUDA), ``kvcompose.device_constants`` (it makes each constant once, and
static decode runs every kind of step once eagerly before it captures one) and
``kvcompose.ops.paged_attention.cpu_bound`` (it reads a count only when it lies on the CPU). The torch
references of the ops are checked like everything else (on CUDA they run where a kernel
does not fit); so is the host code that launches the kernels, when the step runs with
the kernels forced into the interpreter (:func:`forced_step_kernels`)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

CONSTANTS = os.sep + os.path.join("kvcompose", "device_constants.py")
CPU_BOUND = os.sep + os.path.join("kvcompose", "ops", "paged_attention", "cpu_bound.py")  # reads only CPU tensors
try:  # Triton's own package folder (a checkout under some other folder named "triton" is not let through)
    import triton

    TRITON = os.path.dirname(triton.__file__) + os.sep
except ImportError:
    TRITON = os.sep + "no triton" + os.sep


def _inside_ops() -> bool:
    """Whether the caller runs inside Triton or a device constant."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(TRITON) or name.endswith(CONSTANTS) or name.endswith(CPU_BOUND):
            return True
        frame = frame.f_back
    return False


def forced_step_kernels(monkeypatch) -> set:
    """Make the per-step ops of ``kvcompose.ops`` launch their Triton kernels wherever they
    would pick a backend themselves (under ``TRITON_INTERPRET=1``: the interpreter on CPU);
    returns the set that collects the names of the kernels that were picked."""
    import importlib
    import pkgutil

    import kvcompose.ops
    from kvcompose.ops import dispatch

    runs = dispatch.step_kernel_runs

    picked = set()

    def forced(x, kernel, backend, fits=True):
        chosen = runs(x, kernel, "triton" if backend is None and fits else backend, fits)
        if chosen:
            picked.add(kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__)
        return chosen

    for info in pkgutil.walk_packages(kvcompose.ops.__path__, "kvcompose.ops."):
        module = importlib.import_module(info.name)
        if getattr(module, "step_kernel_runs", None) is runs:
            monkeypatch.setattr(module, "step_kernel_runs", forced)
    return picked


class HostSyncError(AssertionError):
    pass


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _has_tensor_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) for i in items)


@contextlib.contextmanager
def no_host_sync():
    T = torch.Tensor
    reads = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy")
    sized = ("nonzero", "argwhere", "unique", "masked_select")  # output size depends on the data
    names = (*reads, *sized, "__getitem__", "__setitem__")
    saved = {n: getattr(T, n) for n in names}
    own = {n for n in names if n in vars(T)}  # the others are inherited: delete the patch afterwards
    functions = {n: getattr(torch, n) for n in (*sized, "where")}

    def refuse(name, original, what="has a data-dependent output size"):
        def method(self, *args, **kwargs):
            if _inside_ops():
                return original(self, *args, **kwargs)
            raise HostSyncError(f"{name} {what}")
        return method

    def where(original):
        def method(condition, *args, **kwargs):
            if not args and not kwargs and not _inside_ops():
                raise HostSyncError("one-argument where has a data-dependent output size; give both values")
            return original(condition, *args, **kwargs)
        return method

    def getitem(self, index):
        if _has_bool_index(index) and not _inside_ops():
            raise HostSyncError("boolean-mask indexing: its output shape depends on the data")
        return saved["__getitem__"](self, index)

    def setitem(self, index, value):
        if _inside_ops():
            return saved["__setitem__"](self, index, value)
        if _has_bool_index(index):
            raise HostSyncError("boolean-mask assignment: use torch.where or masked_fill_")
        if _has_tensor_index(index) and isinstance(value, (bool, int, float)):
            raise HostSyncError(f"a Python scalar ({value!r}) written through a tensor index is a host copy")
        return saved["__setitem__"](self, index, value)

    patched = {n: refuse(f"Tensor.{n}", saved[n], "reads a device value on the host") for n in reads}
    patched.update({n: refuse(f"Tensor.{n}", saved[n]) for n in sized}, __getitem__=getitem, __setitem__=setitem)
    tensor = torch.tensor

    def from_host(*args, **kwargs):
        if _inside_ops():
            return tensor(*args, **kwargs)
        raise HostSyncError("torch.tensor copies Python data to the device; make the tensor outside the step")

    try:
        for n, f in patched.items():
            setattr(T, n, f)
        for n, f in functions.items():
            setattr(torch, n, where(f) if n == "where" else refuse(f"torch.{n}", f))
        torch.tensor = from_host
        yield
    finally:
        for n, f in saved.items():
            if n in own:
                setattr(T, n, f)
            else:
                delattr(T, n)
        for n, f in functions.items():
            setattr(torch, n, f)
        torch.tensor = tensor
