//! Hostile input, the tools shared by tests/hostile_packets.rs and
//! tests/hostile_segments.rs: packets written raw onto the far end of a pipe
//! (`sendmsg` with `SCM_RIGHTS`), following the layout documented in `src/wire/mod.rs`;
//! payloads built with postcard from mirrors of the library's wire types below.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use multiproc::{Connection, DType, Error, Tensor, pipe};
use rustix::fs::{MemfdFlags, SealFlags};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub const DEADLINE: Duration = Duration::from_secs(90);
pub const WAIT: Duration = Duration::from_secs(20);

// ----- the wire, from the outside -----

pub const MAGIC: [u8; 4] = *b"MPW\x01";
pub const VERSION: u8 = 4;
pub const INLINE: u8 = 0;
pub const MEMFD: u8 = 1;
pub const F32: u8 = 0; // DType::ALL[0]

/// A header declaring an empty references section.
pub fn header(version: u8, kind: u8, nfds: u32, len: u32) -> Vec<u8> {
    header_with_section(version, kind, nfds, len, 0)
}

pub fn header_with_section(version: u8, kind: u8, nfds: u32, len: u32, section: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend([version, kind, 0, 0]);
    h.extend(nfds.to_le_bytes());
    h.extend(len.to_le_bytes());
    h.extend(section.to_le_bytes());
    h
}

/// What follows a packet's header: the payload, then the references section (the
/// block uses the message lists, see `src/wire/references.rs`).
pub trait Body {
    fn parts(&self) -> (&[u8], &[u8]);
}

impl Body for Vec<u8> {
    fn parts(&self) -> (&[u8], &[u8]) {
        (self, &[])
    }
}

/// A payload with block handles, and its references section.
pub struct WithReferences {
    pub payload: Vec<u8>,
    pub section: Vec<u8>,
}

impl Body for WithReferences {
    fn parts(&self) -> (&[u8], &[u8]) {
        (&self.payload, &self.section)
    }
}

/// A references section listing `entries`.
pub fn section(entries: &[Reference]) -> Vec<u8> {
    let mut s = (entries.len() as u32).to_le_bytes().to_vec();
    for e in entries {
        s.extend(payload(e));
    }
    s
}

/// A well-formed inline packet around `body`, declaring `nfds` fds.
pub fn packet(nfds: u32, body: &impl Body) -> Vec<u8> {
    let (payload, section) = body.parts();
    let mut p = header_with_section(
        VERSION,
        INLINE,
        nfds,
        payload.len() as u32,
        section.len() as u32,
    );
    p.extend_from_slice(payload);
    p.extend_from_slice(section);
    p
}

pub fn payload<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("postcard")
}

/// Mirrors of the library's wire types (same field order, same variants).
#[derive(Serialize)]
pub struct HandleWire {
    /// Its entry in the references section.
    pub reference: u32,
    pub offset: u64,
    pub nbytes: u64,
}

/// An entry of the references section.
#[derive(Serialize)]
pub enum Reference {
    Fd(u32),
    #[allow(dead_code)]
    Inode {
        dev: u64,
        ino: u64,
    },
    Name(String),
}

/// Where a block's data starts (after its use-counting header).
pub const BLOCK_HEADER: u64 = 128;

#[derive(Serialize)]
pub enum StorageWire {
    #[allow(dead_code)]
    Empty,
    Segment(HandleWire),
    /// A CUDA allocation's handle (feature `cuda`; forged in tests/cuda_tensors.rs).
    #[allow(dead_code)]
    Cuda,
    ReadOnlyFile(FileHandleWire),
}

/// A read-only file's handle (what `safetensors::load` tensors travel as).
#[derive(Serialize)]
pub struct FileHandleWire {
    pub index: u32,
    pub offset: u64,
    pub nbytes: u64,
    pub name: String,
}

#[derive(Serialize)]
pub struct TensorWire {
    pub dtype: u8,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
    pub offset: u64,
    pub storage: StorageWire,
}

/// `numel` f32 in a row on reference `reference`'s block, `offset` bytes into it
/// (the block header included), claiming `nbytes` of storage.
pub fn f32_row(numel: u64, reference: u32, offset: u64, nbytes: u64) -> TensorWire {
    TensorWire {
        dtype: F32,
        shape: vec![numel],
        strides: vec![1],
        offset: 0,
        storage: StorageWire::Segment(HandleWire {
            reference,
            offset,
            nbytes,
        }),
    }
}

/// A tensor on the block whose memfd is the packet's fd 0.
pub fn fd_tensor(
    dtype: u8,
    shape: &[u64],
    strides: &[u64],
    offset: u64,
    nbytes: u64,
) -> WithReferences {
    WithReferences {
        payload: payload(&TensorWire {
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
            storage: StorageWire::Segment(HandleWire {
                reference: 0,
                offset: BLOCK_HEADER,
                nbytes,
            }),
        }),
        section: section(&[Reference::Fd(0)]),
    }
}

/// A tensor of `numel` f32 at the start of named block `name`'s data.
pub fn named_tensor(name: &str, numel: u64) -> WithReferences {
    WithReferences {
        payload: payload(&f32_row(numel, 0, BLOCK_HEADER, numel * 4)),
        section: section(&[Reference::Name(name.to_owned())]),
    }
}

/// Writes one raw packet with `fds` attached.
pub fn send_raw(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len().max(1)))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    let n = sendmsg(
        sock,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::empty(),
    )
    .expect("sendmsg");
    assert_eq!(n, bytes.len());
}

/// Reads one raw packet (bytes and fds) that is already waiting.
pub fn recv_raw(sock: BorrowedFd<'_>) -> (Vec<u8>, Vec<OwnedFd>) {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut buf = vec![0u8; 1 << 17];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(253))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
    )
    .expect("recvmsg");
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    buf.truncate(msg.bytes);
    (buf, fds)
}

/// The raw packet the library makes for `value`.
pub fn capture<T: Serialize + DeserializeOwned>(value: T) -> (Vec<u8>, Vec<OwnedFd>) {
    let (a, b) = pipe::<T>().unwrap();
    a.send(value).map_err(|e| e.error).unwrap();
    recv_raw(b.as_fd())
}

pub fn memfd(len: u64, seals: SealFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("hostile", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

pub fn sealed(len: u64) -> OwnedFd {
    memfd(len, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
}

/// A sealed memfd laid out as a block: the block magic, then `data` bytes after the
/// header (what a `Block` handle names).
pub fn block(data: u64) -> OwnedFd {
    let fd = memfd(BLOCK_HEADER + data, SealFlags::empty());
    rustix::io::pwrite(&fd, b"MPBLOCK2", 0).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .unwrap();
    fd
}

pub fn seqpacket() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// The receiving end must refuse the next message with `InvalidMessage`; returns why.
pub fn refused<T: DeserializeOwned + Serialize>(here: &Connection<T>) -> String {
    match here.recv_timeout(WAIT) {
        Err(Error::InvalidMessage(m)) => m,
        Err(e) if e.is_timeout() => {
            panic!("no answer within {WAIT:?}: the hostile message was swallowed")
        }
        Err(e) => panic!("expected InvalidMessage, got {e:?}"),
        Ok(_) => panic!("a hostile message was accepted"),
    }
}

pub fn assert_says(why: &str, needles: &[&str]) {
    for n in needles {
        assert!(why.contains(n), "the error does not say {n:?}: {why}");
    }
}

/// The channel still carries a good tensor after whatever came before.
pub fn tensor_channel_works(here: &Connection<Tensor>, there: &Connection<Tensor>) {
    there
        .send(Tensor::full(&[8], 2.5, DType::F32).unwrap())
        .map_err(|e| e.error)
        .unwrap();
    let t = here.recv_timeout(WAIT).expect("the good tensor");
    assert_eq!(t.sum().unwrap(), 20.0);
}

/// The fds of a forged packet, borrowed.
pub fn with<'a, const N: usize>(fds: [&'a OwnedFd; N]) -> [BorrowedFd<'a>; N] {
    fds.map(|f| f.as_fd())
}

pub fn tensor_channel_works_for_bytes(here: &Connection<Vec<u8>>, there: &Connection<Vec<u8>>) {
    there.send(vec![1, 2, 3]).map_err(|e| e.error).unwrap();
    assert_eq!(here.recv_timeout(WAIT).unwrap(), vec![1, 2, 3]);
}
