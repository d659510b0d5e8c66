"""Tensors: made in shared blocks, sent by handle, received without a copy (DLPack)."""

import operator
import pickle
import sys

from . import _native

_torch = None  # the torch module once looked up; False when it is not installed


def _torch_module():
    global _torch
    if _torch is None:
        try:
            import torch
        except ImportError:
            _torch = False
        else:
            _torch = torch
    return _torch or None


def _decode_tensor(native):
    """A received storage (a 1-D ``NativeTensor`` over all of it): a torch.Tensor over
    the shared block (no copy) and its storage, or a numpy array (and None) when torch
    is not installed."""
    torch = _torch_module()
    if torch is not None:
        base = torch.from_dlpack(native)
        return base, base.untyped_storage()
    import numpy

    return numpy.from_dlpack(native), None


def _view_tensor(base, shape, strides, offset):
    """A received tensor: a view of its storage's ``base`` (strides in elements)."""
    torch = _torch_module()
    if torch is not None:
        return base.as_strided(shape, strides, offset)
    from numpy.lib.stride_tricks import as_strided

    itemsize = base.itemsize
    return as_strided(base[offset:], shape, tuple(s * itemsize for s in strides))


_CUDA_ERROR = (
    "a {} tensor cannot travel through multiproc's Python package, which shares CPU "
    "tensors; move it with .cpu() first"
)


_DTYPE_NAMES = {}  # torch.dtype -> its name without "torch." (str() of a dtype is slow)


def _torch_memory(t, torch):
    if not t.is_cpu:
        raise ValueError(_CUDA_ERROR.format(t.device.type))
    if t.layout is not torch.strided:
        raise ValueError(f"a tensor of layout {t.layout} cannot travel; only strided tensors")
    dtype = t.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    s = t.untyped_storage()
    # torch.Size is a tuple, and stride() returns one: no copies.
    return (s.data_ptr(), s.nbytes(), name, t.shape, t.stride(), t.storage_offset(), t)


def _numpy_memory(a):
    import numpy

    if a.dtype.kind not in "biuf" or not a.dtype.isnative:
        return None
    itemsize = a.itemsize
    if any(s < 0 or s % itemsize for s in a.strides):
        a = numpy.ascontiguousarray(a)
    strides = tuple(s // itemsize for s in a.strides)
    addr = a.__array_interface__["data"][0]
    # The array that owns the memory plays torch's storage: views of one array then
    # travel as views of one copy (or of one block), and arrive sharing memory.
    root = a
    while isinstance(root.base, numpy.ndarray):
        root = root.base
    if root is not a and (root.flags.c_contiguous or root.flags.f_contiguous):
        start = root.__array_interface__["data"][0]
        if (addr - start) % itemsize == 0 and start <= addr:
            return (start, root.nbytes, a.dtype.name, tuple(a.shape), strides,
                    (addr - start) // itemsize, a)
    extent = 0 if a.size == 0 else (
        sum((n - 1) * s for n, s in zip(a.shape, strides)) + 1) * itemsize
    return (addr, extent, a.dtype.name, tuple(a.shape), strides, 0, a)


def _goes_as_torch_sends_it(t):
    """Whether a CPU tensor travels by torch's own reductions rather than by a
    multiproc handle or copy: one outside multiproc's blocks that torch already shares
    (``share_memory_()``: a copy would lose the receiver's writes), a ``Parameter`` or
    a tensor that requires grad (torch keeps both). torch then shares its storage,
    moving it into shared memory in place if need be, as ``torch.multiprocessing``
    does."""
    torch = _torch_module()
    if not t.is_cpu or t.layout is not torch.strided:
        return False  # refused, with the reason, by `_torch_memory`
    s = t.untyped_storage()
    if _native.is_shared_block(s.data_ptr(), s.nbytes()):
        return False
    return s.is_shared() or t.requires_grad or type(t) is not torch.Tensor


_torch_pickler = None  # multiprocessing's pickler with torch's tensor reductions


def _torch_pickle(t):
    """``t`` pickled as ``torch.multiprocessing``'s queues pickle it: its storage by
    torch's fd (or file name), shared with the receiver, which unpickles it (a Rust
    receiver gets ``Dynamic::Pickled``). The package registers its own reduction for
    tensors on ``ForkingPickler`` itself, so torch's is put back on a subclass."""
    global _torch_pickler
    if _torch_pickler is None:
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing import reductions

        torch = _torch_module()

        class TorchPickler(ForkingPickler):
            _extra_reducers = {**ForkingPickler._extra_reducers,
                               torch.Tensor: reductions.reduce_tensor,
                               torch.nn.Parameter: reductions.reduce_tensor}

        _torch_pickler = TorchPickler
        # Importing torch.multiprocessing may have put torch's reduction back on
        # ForkingPickler: multiproc's goes first there (process arguments).
        from ._handles import register_torch_reducers

        register_torch_reducers()
    return bytes(_torch_pickler.dumps(t, pickle.HIGHEST_PROTOCOL))


def _encode_other(obj):
    """What the native layer does with a value it has no rule for: a tensor's memory
    (address, bytes, dtype, shape, strides, offset, owner), or the object's pickle."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if _goes_as_torch_sends_it(obj):
            return _torch_pickle(obj)
        return _torch_memory(obj, torch)
    numpy = sys.modules.get("numpy")
    masked = sys.modules.get("numpy.ma")
    # A masked array is more than its data: it goes pickled, mask and all.
    if (numpy is not None and isinstance(obj, numpy.ndarray)
            and not (masked is not None and isinstance(obj, masked.MaskedArray))):
        memory = _numpy_memory(obj)
        if memory is not None:
            return memory
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _dtype_name(dtype):
    if dtype is None:
        return "float32"
    if isinstance(dtype, str):
        return dtype
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype)
        return name
    try:
        import numpy

        return numpy.dtype(dtype).name
    except (ImportError, TypeError) as e:
        raise TypeError(f"not a dtype: {dtype!r}") from e


def _shape(shape):
    """A shape as a list of sizes: an int, or a sequence of ints (a torch.Size, numpy
    integers); a float, a string or a negative size is refused, as torch refuses it."""
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"a shape is an int or a sequence of ints, not {shape!r}")
    try:
        dims = [operator.index(shape)]
    except TypeError:
        try:
            dims = list(shape)
        except TypeError:
            raise TypeError(
                f"a shape is an int or a sequence of ints, not {type(shape).__name__} "
                f"{shape!r}") from None
    sizes = []
    for n in dims:
        try:
            n = operator.index(n)
        except TypeError:
            raise TypeError(
                f"shape {shape!r}: size {n!r} is a {type(n).__name__}, not an int") from None
        if n < 0:
            raise ValueError(f"shape {shape!r}: size {n} is negative; a size is 0 or more")
        sizes.append(n)
    return sizes


def empty(*shape, dtype=None):
    """A tensor in a new shared block, uninitialised: it travels by handle."""
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = shape[0]
    return _native.new_python_tensor(_shape(shape), _dtype_name(dtype), None)


def zeros(*shape, dtype=None):
    """A tensor of zeros in a new shared block: it travels by handle."""
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = shape[0]
    return _native.new_python_tensor(_shape(shape), _dtype_name(dtype), 0.0)


def full(shape, fill_value, dtype=None):
    """A tensor filled with ``fill_value`` in a new shared block: it travels by handle.
    Without ``dtype``, as torch's ``full``: ``bool`` for a bool, ``int64`` for an int,
    ``float32`` otherwise. The value is stored exactly (an int64 above 2**53 too)."""
    if dtype is None:
        if isinstance(fill_value, bool):
            dtype = "bool"
        elif isinstance(fill_value, int):
            dtype = "int64"
    tensor = _native.new_python_tensor(_shape(shape), _dtype_name(dtype), None)
    if hasattr(tensor, "fill_"):
        tensor.fill_(fill_value)  # torch
    else:
        tensor.fill(fill_value)  # numpy
    return tensor


def share_memory_(tensor):
    """Moves a CPU torch tensor's elements into a multiproc block (one copy), as torch's
    ``share_memory_``: afterwards it travels by handle. Other tensors on its old storage
    keep the old memory. Returns the tensor."""
    torch = _torch_module()
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise TypeError("share_memory_ takes a torch.Tensor")
    # detach(): a Parameter or a tensor that requires grad is moved as its data (the
    # tensor itself keeps its type and grad; `set_` below swaps only its storage).
    shared = _native.to_python(_native.as_native(tensor.detach()))
    with torch.no_grad():
        tensor.set_(shared.untyped_storage(), shared.storage_offset(), shared.shape,
                    shared.stride())
    return tensor
