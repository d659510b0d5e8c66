"""Tensors by handle: made in shared blocks, put and got without a copy, views and
dtypes kept."""

import numpy as np
import pytest
import torch

import multiproc as mp

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.uint16,
          torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype):
    q = mp.Queue()
    t = mp.full((3, 4), 1, dtype=dtype)
    assert t.dtype == dtype and t.shape == (3, 4)
    q.put(t)
    got = q.get()
    assert got.dtype == dtype and got.shape == (3, 4)
    assert got.data_ptr() == t.data_ptr()  # by handle: the same block
    assert torch.equal(got, t)


def test_constructors():
    assert torch.equal(mp.zeros(2, 3), torch.zeros(2, 3))
    assert torch.equal(mp.zeros((2, 3), dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))
    assert mp.empty([5], dtype="uint8").shape == (5,)
    assert torch.equal(mp.full((2,), 7.5, dtype=np.float64), torch.full((2,), 7.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="no dtype"):
        mp.zeros(2, dtype="complex64")


def test_a_block_tensor_travels_by_handle_and_writes_are_shared():
    q = mp.Queue()
    t = mp.zeros(8)
    q.put({"t": t})
    got = q.get()["t"]
    got += 3
    assert t.sum().item() == 24


def test_a_plain_tensor_is_copied_once_and_the_copy_travels_by_handle():
    q = mp.Queue()
    x = torch.arange(6.0)
    q.put(x)
    got = q.get()
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()
    q.put(got)  # now in a block: by handle
    again = q.get()
    assert again.data_ptr() == got.data_ptr()


def test_views_keep_shape_strides_offset_and_share_memory():
    q = mp.Queue()
    base = mp.zeros(4, 6)
    views = (base, base[1:3], base[:, ::2], base.t(), base[2, 1:])
    q.put(views)
    got = q.get()
    for v, g in zip(views, got):
        assert g.shape == v.shape and g.stride() == v.stride()
        assert g.storage_offset() == v.storage_offset()
        assert g.data_ptr() == v.data_ptr()
    got[1][0, 0] = 5.0
    assert base[1, 0] == 5.0


def test_two_views_of_a_plain_storage_arrive_sharing_memory():
    q = mp.Queue()
    x = torch.arange(10.0)
    q.put([x[:5], x[5:], x[::3]])
    a, b, c = q.get()
    assert torch.equal(a, x[:5]) and torch.equal(b, x[5:]) and torch.equal(c, x[::3])
    a[0] = 100.0
    assert c[0] == 100.0  # one copy of the storage, three views of it


def test_numpy_arrays():
    q = mp.Queue()
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    q.put((a, a[:, ::-1], a.T, np.zeros(0)))
    got = q.get()
    assert isinstance(got[0], torch.Tensor)  # torch is installed
    assert np.array_equal(got[0].numpy(), a)
    assert np.array_equal(got[1].numpy(), a[:, ::-1])
    assert np.array_equal(got[2].numpy(), a.T)
    assert got[3].shape == (0,)
    # An array over a received block goes back by handle.
    arr = got[0].numpy()
    q.put(arr[1:])
    assert q.get().data_ptr() == got[0][1:].data_ptr()


def test_a_tensor_received_by_torch_keeps_its_block_alive():
    q = mp.Queue()
    q.put(mp.full((1000,), 2.0))
    got = q.get()
    import gc
    gc.collect()
    q.put(got[10:20])
    assert q.get().sum().item() == 20.0


def test_a_non_cpu_tensor_is_a_clear_error():
    q = mp.Queue()
    with pytest.raises(ValueError, match="meta"):
        q.put(torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="layout"):
        q.put(torch.eye(2).to_sparse())
    assert q.empty()


def test_share_memory_moves_a_tensor_into_a_block():
    q = mp.Queue()
    x = torch.arange(4.0)
    assert mp.share_memory_(x) is x
    q.put(x)
    got = q.get()
    assert got.data_ptr() == x.data_ptr()
    got[0] = 9
    assert x[0] == 9


NUMPY_ONLY = r"""
import sys
sys.modules["torch"] = None  # as if torch were not installed
import numpy as np
import multiproc as mp

q = mp.Queue()
a = np.arange(12, dtype=np.float32).reshape(3, 4)
q.put((a, a[:, 1::2]))
whole, view = q.get()
assert type(whole) is np.ndarray and type(view) is np.ndarray
assert np.array_equal(whole, a) and np.array_equal(view, a[:, 1::2])
whole[0, 1] = 100  # one storage: the view sees it
assert view[0, 0] == 100
z = mp.zeros((2, 3), dtype="int64")
assert type(z) is np.ndarray and z.dtype == np.int64 and z.shape == (2, 3)
q.put(z[1:])
back = q.get()
assert back.__array_interface__["data"][0] == z[1:].__array_interface__["data"][0]
print("ok")
"""


def test_numpy_arrays_come_back_when_torch_is_absent():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NUMPY_ONLY], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_table_of_received_storages_is_swept_as_it_grows_and_after_a_drop():
    """5,000 received tensors kept at once, each a block of its own (above the library's
    small-tensor size), then dropped. The table of torch storages by block (weak
    references, swept of dead ones every so many inserts) holds them all while they
    live; its sweeps visit at most two entries per insert (a sweep on every insert
    above a fixed size visited thousands); and it lets go of the dead ones once blocks
    are received again, here at their old addresses (recycled blocks)."""
    from multiproc import _native

    n, elements = 5000, 16 * 1024 + 16
    entries, inserts, visited = _native._torch_storage_table()
    # Each sweep visits at most the entries the last one kept plus the inserts it
    # waited for, and waits for at least as many inserts as that one kept: the first
    # sweep of this test may visit what is in the table now, paid for before.
    budget = 2 * entries + 2048
    q = mp.Queue()
    kept = []
    for _ in range(n):
        q.put(mp.empty(elements, dtype=torch.float32))
        kept.append(q.get())
    assert len({t.data_ptr() for t in kept}) == n
    held, inserted, swept = _native._torch_storage_table()
    assert held >= n
    assert swept - visited <= 2 * (inserted - inserts) + budget
    del kept
    # A sweep comes within as many inserts as the last one kept live (fewer than the
    # table holds now); a round trip inserts twice (made, then received).
    for _ in range(held):
        q.put(mp.empty(elements, dtype=torch.float32))
        q.get()
        if _native._torch_storage_table()[0] < n // 4:
            break
    entries_now, inserted, swept = _native._torch_storage_table()
    assert entries_now < n // 4
    assert swept - visited <= 2 * (inserted - inserts) + budget
