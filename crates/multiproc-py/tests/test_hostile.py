"""Forged and truncated bytes raise a Python exception; they never crash the
interpreter. Each case writes raw packets into a pipe's socket and receives them as a
message."""

import os
import socket
import struct

import pytest

import multiproc as mp

HEADER = b"MPW\x01"


def packet(payload, nfds=0, version=4, kind=0, declared=None, section=b""):
    """A packet of wire version 4: the 20-byte header, the payload, then the
    references section (the block uses the message carries; none unless given)."""
    length = len(payload) if declared is None else declared
    return (HEADER + bytes([version, kind, 0, 0])
            + struct.pack("<III", nfds, length, len(section)) + payload + section)


@pytest.fixture
def raw_pipe():
    a, b = mp.Pipe()
    s = socket.socket(fileno=os.dup(a.fileno()))
    yield s, b
    s.close()
    a.close()
    b.close()


def receive(raw_pipe, data, fds=()):
    s, b = raw_pipe
    if fds:
        socket.send_fds(s, [data], list(fds))
    else:
        s.send(data)
    return b.recv()


CASES = {
    "empty": b"",
    "short header": HEADER + b"\x01",
    "bad magic": b"XXXX" + bytes(12),
    "wrong version": packet(b"\x00", version=99),
    "unknown kind": packet(b"\x00", kind=7),
    "length larger than payload": packet(b"\x06\x05\x00", declared=1000),
    "truncated list": packet(bytes([6, 200, 0])),
    "unknown variant": packet(bytes([99])),
    "truncated string": packet(bytes([4, 50]) + b"abc"),
    "invalid utf-8": packet(bytes([4, 2, 0xff, 0xfe])),
    "tensor without fds": packet(bytes([9, 0, 1, 4, 1, 1, 0, 0, 0, 0])),
    "fds claimed but absent": packet(bytes([9]), nfds=3),
    "deep nesting": packet(bytes([6, 1]) * 50_000 + bytes([0])),
    "random": bytes(range(256)) * 8,
}


@pytest.mark.parametrize("name", list(CASES))
def test_forged_bytes_raise(raw_pipe, name):
    with pytest.raises(mp.InvalidMessageError):
        receive(raw_pipe, CASES[name])
    # The connection stays usable.
    s, b = raw_pipe
    s.send(packet(bytes([4, 2]) + b"ok"))
    assert b.recv() == "ok"


def test_every_truncation_of_a_real_message_raises(raw_pipe):
    s, b = raw_pipe
    a2, b2 = mp.Pipe()
    a2.send({"x": [1, 2.5, "three", b"four", None, (True,)], "n": 2**40})
    good = socket.socket(fileno=os.dup(b2.fileno())).recv(65536)
    for cut in range(len(good)):
        s.send(good[:cut])
        with pytest.raises(mp.InvalidMessageError):
            b.recv()
    s.send(good)
    assert b.recv()["n"] == 2**40
    a2.close()
    b2.close()


def test_a_forged_handle_fd_is_refused(raw_pipe):
    # A real tensor message whose block fd is swapped for a regular file, not a
    # multiproc block: refused, and the connection goes on.
    a2, b2 = mp.Pipe()
    a2.send(mp.full((32 * 1024,), 7.0))
    reader = socket.socket(fileno=os.dup(b2.fileno()))
    data, fds, _, _ = socket.recv_fds(reader, 1 << 16, 16)
    assert fds, "a tensor above the small-tensor size travels with its block's fd"
    reader.close()
    with open("/dev/null", "rb") as f:
        with pytest.raises(mp.InvalidMessageError):
            receive(raw_pipe, data, fds=[f.fileno()] * len(fds))
    # The real block's use, given to this process for the receiver, goes back with
    # the real packet received whole.
    s, b = raw_pipe
    socket.send_fds(s, [data], fds)
    assert float(b.recv()[0]) == 7.0
    for fd in fds:
        os.close(fd)
    s.send(packet(bytes([4, 2]) + b"ok"))
    assert b.recv() == "ok"
    a2.close()
    b2.close()


def test_a_forged_pickle_raises_a_python_error(raw_pipe):
    body = b"\x80\x05garbage"
    with pytest.raises(Exception) as info:
        receive(raw_pipe, packet(bytes([10, len(body)]) + body))
    assert not isinstance(info.value, SystemError)


def test_a_parcel_that_is_not_one():
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError, match="not a socket"):
        mp.open_parcel(r, mp.Queue)
    fd, parcel = mp.parcel_for_child(mp.Event())
    ev = mp.open_parcel(os.dup(fd), mp.Event)
    with pytest.raises(ValueError, match="opened already"):
        mp.open_parcel(os.dup(fd), mp.Event)
    parcel.close()
    del ev
    with pytest.raises(ValueError):
        mp.open_parcel(-1, mp.Queue)
