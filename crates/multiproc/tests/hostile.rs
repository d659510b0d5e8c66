//! Hostile input: forged, truncated and malformed messages, handles that lie about
//! their segments, fds of the wrong kind. Every one is an `Err` that says what was
//! wrong — never a panic, a crash or a SIGBUS — and the channel stays usable after it.
//!
//! The packets are written raw onto the far end of a pipe (`sendmsg` with
//! `SCM_RIGHTS`), following the layout documented in `src/wire/mod.rs`; payloads are
//! built with postcard from mirrors of the library's wire types below.

multiproc::test_init!();

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use multiproc::{
    Connection, DType, Error, Event, Lock, Queue, SharingStrategy, SimpleQueue, Tensor, pipe,
    start_processes,
};
use rustix::fs::{MemfdFlags, SealFlags};
use serde::Serialize;
use serde::de::DeserializeOwned;

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(20);

// ----- the wire, from the outside -----

const MAGIC: [u8; 4] = *b"MPW\x01";
const VERSION: u8 = 3;
const INLINE: u8 = 0;
const MEMFD: u8 = 1;
const F32: u8 = 0; // DType::ALL[0]

/// A header declaring an empty references section.
fn header(version: u8, kind: u8, nfds: u32, len: u32) -> Vec<u8> {
    header_with_section(version, kind, nfds, len, 0)
}

fn header_with_section(version: u8, kind: u8, nfds: u32, len: u32, section: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend([version, kind, 0, 0]);
    h.extend(nfds.to_le_bytes());
    h.extend(len.to_le_bytes());
    h.extend(section.to_le_bytes());
    h
}

/// What follows a packet's header: the payload, then the references section (the
/// block uses the message lists, see `src/wire/references.rs`).
trait Body {
    fn parts(&self) -> (&[u8], &[u8]);
}

impl Body for Vec<u8> {
    fn parts(&self) -> (&[u8], &[u8]) {
        (self, &[])
    }
}

/// A payload with block handles, and its references section.
struct WithReferences {
    payload: Vec<u8>,
    section: Vec<u8>,
}

impl Body for WithReferences {
    fn parts(&self) -> (&[u8], &[u8]) {
        (&self.payload, &self.section)
    }
}

/// A references section listing `entries`.
fn section(entries: &[Reference]) -> Vec<u8> {
    let mut s = (entries.len() as u32).to_le_bytes().to_vec();
    for e in entries {
        s.extend(payload(e));
    }
    s
}

/// A well-formed inline packet around `body`, declaring `nfds` fds.
fn packet(nfds: u32, body: &impl Body) -> Vec<u8> {
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

fn payload<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("postcard")
}

/// Mirrors of the library's wire types (same field order, same variants).
#[derive(Serialize)]
struct HandleWire {
    /// Its entry in the references section.
    reference: u32,
    offset: u64,
    nbytes: u64,
}

/// An entry of the references section.
#[derive(Serialize)]
enum Reference {
    Fd(u32),
    #[allow(dead_code)]
    Inode {
        dev: u64,
        ino: u64,
    },
    Name(String),
}

/// Where a block's data starts (after its use-counting header).
const BLOCK_HEADER: u64 = 64;

#[derive(Serialize)]
enum StorageWire {
    #[allow(dead_code)]
    Empty,
    Segment(HandleWire),
    /// A CUDA allocation's handle (feature `cuda`; forged in tests/cuda.rs).
    #[allow(dead_code)]
    Cuda,
    ReadOnlyFile(FileHandleWire),
}

/// A read-only file's handle (what `safetensors::load` tensors travel as).
#[derive(Serialize)]
struct FileHandleWire {
    index: u32,
    offset: u64,
    nbytes: u64,
    name: String,
}

#[derive(Serialize)]
struct TensorWire {
    dtype: u8,
    shape: Vec<u64>,
    strides: Vec<u64>,
    offset: u64,
    storage: StorageWire,
}

/// A tensor on the block whose memfd is the packet's fd 0.
fn fd_tensor(
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
fn named_tensor(name: &str, numel: u64) -> WithReferences {
    WithReferences {
        payload: payload(&TensorWire {
            dtype: F32,
            shape: vec![numel],
            strides: vec![1],
            offset: 0,
            storage: StorageWire::Segment(HandleWire {
                reference: 0,
                offset: BLOCK_HEADER,
                nbytes: numel * 4,
            }),
        }),
        section: section(&[Reference::Name(name.to_owned())]),
    }
}

/// Writes one raw packet with `fds` attached.
fn send_raw(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
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
fn recv_raw(sock: BorrowedFd<'_>) -> (Vec<u8>, Vec<OwnedFd>) {
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
fn capture<T: Serialize + DeserializeOwned>(value: T) -> (Vec<u8>, Vec<OwnedFd>) {
    let (a, b) = pipe::<T>().unwrap();
    a.send(value).map_err(|e| e.error).unwrap();
    recv_raw(b.as_fd())
}

fn memfd(len: u64, seals: SealFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("hostile", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

fn sealed(len: u64) -> OwnedFd {
    memfd(len, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
}

/// A sealed memfd laid out as a block: the block magic, then `data` bytes after the
/// header (what a `Block` handle names).
fn block(data: u64) -> OwnedFd {
    let fd = memfd(BLOCK_HEADER + data, SealFlags::empty());
    rustix::io::pwrite(&fd, b"MPBLOCK1", 0).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .unwrap();
    fd
}

fn seqpacket() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// The receiving end must refuse the next message with `InvalidMessage`; returns why.
fn refused<T: DeserializeOwned + Serialize>(here: &Connection<T>) -> String {
    match here.recv_timeout(WAIT) {
        Err(Error::InvalidMessage(m)) => m,
        Err(e) if e.is_timeout() => {
            panic!("no answer within {WAIT:?}: the hostile message was swallowed")
        }
        Err(e) => panic!("expected InvalidMessage, got {e:?}"),
        Ok(_) => panic!("a hostile message was accepted"),
    }
}

fn assert_says(why: &str, needles: &[&str]) {
    for n in needles {
        assert!(why.contains(n), "the error does not say {n:?}: {why}");
    }
}

/// The channel still carries a good tensor after whatever came before.
fn tensor_channel_works(here: &Connection<Tensor>, there: &Connection<Tensor>) {
    there
        .send(Tensor::full(&[8], 2.5, DType::F32).unwrap())
        .map_err(|e| e.error)
        .unwrap();
    let t = here.recv_timeout(WAIT).expect("the good tensor");
    assert_eq!(t.sum().unwrap(), 20.0);
}

// ----- the classes -----

#[test]
fn wrong_magic_version_and_kind() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        let body = payload(&0u8);
        let cases: [(Vec<u8>, &[&str]); 6] = [
            (
                {
                    let mut p = packet(0, &body);
                    p[0] = b'X';
                    p
                },
                &["magic"],
            ),
            (
                {
                    let mut p = header(0, INLINE, 0, body.len() as u32);
                    p.extend(&body);
                    p
                },
                &["wire version 0", "version 3"],
            ),
            (
                {
                    let mut p = header(1, INLINE, 0, body.len() as u32);
                    p.extend(&body);
                    p
                },
                &["wire version 1"],
            ),
            (header(255, INLINE, 0, 0), &["wire version 255"]),
            (
                {
                    let mut p = header(VERSION, 7, 0, body.len() as u32);
                    p.extend(&body);
                    p
                },
                &["unknown packet kind 7"],
            ),
            (
                {
                    let mut p = header(VERSION, MEMFD, 0, 4);
                    p.extend([1, 2, 3, 4]);
                    p
                },
                &["fds"],
            ),
        ];
        for (bytes, says) in cases {
            send_raw(there.as_fd(), &bytes, &[]);
            assert_says(&refused(&here), says);
        }
        tensor_channel_works(&here, &there);
    });
}

#[test]
fn truncated_messages() {
    common::run(DEADLINE, || {
        for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
            multiproc::set_sharing_strategy(strategy);
            let (here, there) = pipe::<Tensor>().unwrap();
            let t = Tensor::arange(0.0, 64.0, 1.0, DType::F32).unwrap();
            let (good, fds) = capture(t.clone());
            let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            // Cut anywhere: inside the header, inside the payload.
            for cut in 0..good.len() {
                send_raw(there.as_fd(), &good[..cut], &fds);
                let why = refused(&here);
                if cut == 0 && fds.is_empty() {
                    assert_says(&why, &["empty packet"]);
                } else if cut < 20 {
                    assert_says(&why, &["shorter than the 20-byte header"]);
                } else {
                    assert_says(&why, &["declares a", "bytes arrived"]);
                }
            }
            // Cut, with the header's lengths fixed up to match (all payload, no
            // references section): the value itself ends early, or names a reference
            // the packet does not list.
            for cut in 20..good.len() {
                let mut bytes = good[..cut].to_vec();
                bytes[12..16].copy_from_slice(&((cut - 20) as u32).to_le_bytes());
                bytes[16..20].copy_from_slice(&[0; 4]);
                send_raw(there.as_fd(), &bytes, &fds);
                let why = refused(&here);
                assert!(!why.is_empty());
            }
            // An empty packet is not the end of the stream.
            send_raw(there.as_fd(), &[], &[]);
            assert_says(&refused(&here), &["empty packet"]);
            tensor_channel_works(&here, &there);
            // The captured message carries a use of t's block, which no receiver has
            // adopted yet: delivered whole once, it is (here, where t holds one, it is
            // given back), and the block can be recycled again.
            send_raw(there.as_fd(), &good, &fds);
            let back: Tensor = here.recv_timeout(WAIT).unwrap();
            assert_eq!(back.data_ptr(), t.data_ptr());
            drop((fds, back, t));
        }
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}

#[test]
fn more_or_fewer_fds_than_declared_and_indices_out_of_range() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        let seg = block(4096);
        let other = block(4096);
        let body = fd_tensor(F32, &[4], &[1], 0, 16);
        // Declares two, one arrives.
        send_raw(there.as_fd(), &packet(2, &body), &[seg.as_fd()]);
        assert_says(&refused(&here), &["declares 2 fds but 1 arrived"]);
        // Declares none, one arrives.
        send_raw(there.as_fd(), &packet(0, &payload(&0u8)), &[seg.as_fd()]);
        assert_says(&refused(&here), &["declares 0 fds but 1 arrived"]);
        // Two declared and sent, the payload uses one.
        send_raw(
            there.as_fd(),
            &packet(2, &body),
            &[seg.as_fd(), other.as_fd()],
        );
        assert_says(&refused(&here), &["fd #1 is not referred to"]);
        // A reference pointing past the fd table, and a handle past the references.
        let tensor = |reference: u32, entries: &[Reference]| WithReferences {
            payload: payload(&TensorWire {
                dtype: F32,
                shape: vec![4],
                strides: vec![1],
                offset: 0,
                storage: StorageWire::Segment(HandleWire {
                    reference,
                    offset: BLOCK_HEADER,
                    nbytes: 16,
                }),
            }),
            section: section(entries),
        };
        for index in [1u32, 252, u32::MAX] {
            let body = tensor(0, &[Reference::Fd(index)]);
            send_raw(there.as_fd(), &packet(1, &body), &[seg.as_fd()]);
            assert_says(
                &refused(&here),
                &[&format!("file descriptor #{index}"), "carried 1"],
            );
            let body = tensor(index, &[Reference::Fd(0)]);
            send_raw(there.as_fd(), &packet(1, &body), &[seg.as_fd()]);
            assert_says(
                &refused(&here),
                &[&format!("reference #{index}"), "lists 1"],
            );
        }
        // Two handles naming one reference, and a reference no handle names.
        let two = WithReferences {
            payload: payload(&(
                TensorWire {
                    dtype: F32,
                    shape: vec![4],
                    strides: vec![1],
                    offset: 0,
                    storage: StorageWire::Segment(HandleWire {
                        reference: 0,
                        offset: BLOCK_HEADER,
                        nbytes: 16,
                    }),
                },
                TensorWire {
                    dtype: F32,
                    shape: vec![4],
                    strides: vec![1],
                    offset: 0,
                    storage: StorageWire::Segment(HandleWire {
                        reference: 0,
                        offset: BLOCK_HEADER,
                        nbytes: 16,
                    }),
                },
            )),
            section: section(&[Reference::Fd(0)]),
        };
        let (pair_here, pair_there) = pipe::<(Tensor, Tensor)>().unwrap();
        send_raw(pair_there.as_fd(), &packet(1, &two), &[seg.as_fd()]);
        assert_says(&refused(&pair_here), &["reference #0", "named already"]);
        let extra = tensor(0, &[Reference::Fd(0), Reference::Fd(0)]);
        send_raw(there.as_fd(), &packet(1, &extra), &[seg.as_fd()]);
        assert_says(&refused(&here), &["lists 2 references", "#1 is not named"]);
        // A references section that lies about its entries.
        let mut lying = tensor(0, &[Reference::Fd(0)]);
        lying.section[0] = 9;
        send_raw(there.as_fd(), &packet(1, &lying), &[seg.as_fd()]);
        assert_says(&refused(&here), &["references section"]);
        tensor_channel_works(&here, &there);
    });
}

#[test]
fn memfd_segments_that_are_short_unsealed_or_not_memfds() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        let body = fd_tensor(F32, &[1024], &[1], 0, 4096);
        let send = |fd: BorrowedFd<'_>| send_raw(there.as_fd(), &packet(1, &body), &[fd]);
        // Smaller than claimed.
        send(block(4095).as_fd());
        assert_says(&refused(&here), &["claims 4160 bytes", "holds 4159"]);
        // Not sealed: it could shrink under us and SIGBUS the receiver.
        send(memfd(4096, SealFlags::empty()).as_fd());
        assert_says(&refused(&here), &["not a memfd sealed against shrinking"]);
        // Sealed, but only against growing.
        send(memfd(4096, SealFlags::GROW).as_fd());
        assert_says(&refused(&here), &["not a memfd sealed against shrinking"]);
        // Not a memfd at all: a socket, a regular file.
        send(seqpacket().0.as_fd());
        assert_says(&refused(&here), &["not a memfd"]);
        let file = tempfile_with(4096);
        send(file.as_fd());
        assert_says(&refused(&here), &["not a memfd"]);
        // A storage at an offset that runs past the segment, or overflows.
        let at = |offset: u64, nbytes: u64| WithReferences {
            payload: payload(&TensorWire {
                dtype: F32,
                shape: vec![1],
                strides: vec![1],
                offset: 0,
                storage: StorageWire::Segment(HandleWire {
                    reference: 0,
                    offset: BLOCK_HEADER + offset,
                    nbytes,
                }),
            }),
            section: section(&[Reference::Fd(0)]),
        };
        send_raw(
            there.as_fd(),
            &packet(1, &at(4000, 200)),
            &[block(4096).as_fd()],
        );
        assert_says(&refused(&here), &["claims 4264 bytes", "holds 4160"]);
        send_raw(
            there.as_fd(),
            &packet(1, &at(u64::MAX - BLOCK_HEADER, 4)),
            &[block(4096).as_fd()],
        );
        assert_says(&refused(&here), &["past any segment"]);
        // An empty sealed memfd claimed as a segment.
        let body0 = fd_tensor(F32, &[0], &[1], 0, 0);
        send_raw(there.as_fd(), &packet(1, &body0), &[sealed(0).as_fd()]);
        assert_says(&refused(&here), &["holds 0"]);
        tensor_channel_works(&here, &there);
    });
}

/// A read-only file handle: what a loaded weight travels as.
fn file_tensor(numel: u64, offset: u64, nbytes: u64) -> Vec<u8> {
    payload(&TensorWire {
        dtype: F32,
        shape: vec![numel],
        strides: vec![1],
        offset: 0,
        storage: StorageWire::ReadOnlyFile(FileHandleWire {
            index: 0,
            offset,
            nbytes,
            name: "layer.weight".into(),
        }),
    })
}

#[test]
fn read_only_file_handles_that_lie_about_their_file() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        // A file shorter than the handle claims: refused before it is mapped (a read
        // past its end would be a SIGBUS).
        let short = tempfile_with(100);
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(64, 0, 256)),
            &[short.as_fd()],
        );
        assert_says(&refused(&here), &["claims 256 bytes", "holds 100"]);
        // A range that starts inside the file but runs past it.
        let file = tempfile_with(4096);
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(64, 4000, 256)),
            &[file.as_fd()],
        );
        assert_says(&refused(&here), &["claims 4256 bytes", "holds 4096"]);
        // A range whose end overflows.
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(1, u64::MAX, 4)),
            &[file.as_fd()],
        );
        assert_says(&refused(&here), &["layer.weight", "past any file"]);
        // Not a regular file: a socket, a pipe.
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(1, 0, 4)),
            &[seqpacket().0.as_fd()],
        );
        assert_says(&refused(&here), &["not a regular file"]);
        let (r, _w) = rustix::pipe::pipe().unwrap();
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(1, 0, 4)),
            &[r.as_fd()],
        );
        assert_says(&refused(&here), &["not a regular file"]);
        // A layout that reaches past the claimed bytes (the file holds enough).
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(64, 0, 16)),
            &[file.as_fd()],
        );
        assert_says(&refused(&here), &["layout is invalid"]);
        // A well-formed handle maps; the tensor reads the file and refuses writes by name.
        send_raw(
            there.as_fd(),
            &packet(1, &file_tensor(4, 8, 16)),
            &[file.as_fd()],
        );
        let t = here.recv_timeout(WAIT).expect("a good read-only tensor");
        assert!(t.is_read_only());
        assert_eq!(t.to_vec::<f32>().unwrap(), [0.0; 4]);
        let err = t.fill_(1.0).unwrap_err().to_string();
        assert_says(&err, &["fill_", "layer.weight", "read-only"]);
        drop(t);
        // No handle count: a missing fd is an error too.
        send_raw(there.as_fd(), &packet(0, &file_tensor(4, 8, 16)), &[]);
        assert_says(&refused(&here), &["file descriptor #0"]);
        tensor_channel_works(&here, &there);
    });
}

fn tempfile_with(len: u64) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("mp-hostile-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len(len).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

#[test]
fn layouts_that_overflow_or_point_past_the_storage_and_unknown_dtypes() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        let seg = block(4096); // 1024 f32
        let cases: [(WithReferences, &[&str]); 9] = [
            (
                fd_tensor(F32, &[1025], &[1], 0, 4096),
                &["past the storage"],
            ),
            (
                fd_tensor(F32, &[4], &[1], 1021, 4096),
                &["past the storage"],
            ),
            (fd_tensor(F32, &[3], &[u64::MAX], 0, 4096), &["overflow"]),
            (
                fd_tensor(F32, &[1], &[1], u64::MAX, 4096),
                &["past the storage"],
            ),
            (
                fd_tensor(F32, &[1 << 62, 4], &[4, 1], 0, 4096),
                &["more elements than memory can hold"],
            ),
            (
                fd_tensor(F32, &[u64::MAX], &[0], 0, 4096),
                &["more elements than memory can hold"],
            ),
            (
                fd_tensor(F32, &[2, 2], &[1], 0, 4096),
                &["2 dimensions and 1 strides"],
            ),
            (
                fd_tensor(F32, &[1; 65], &[1; 65], 0, 4096),
                &["65 dimensions"],
            ),
            (
                fd_tensor(200, &[4], &[1], 0, 4096),
                &["unknown dtype code 200"],
            ),
        ];
        for (body, says) in cases {
            send_raw(there.as_fd(), &packet(1, &body), &[seg.as_fd()]);
            assert_says(&refused(&here), says);
        }
        // The storage may be shorter than the segment, never longer; the layout is
        // judged against the storage.
        send_raw(
            there.as_fd(),
            &packet(1, &fd_tensor(F32, &[8], &[1], 0, 16)),
            &[seg.as_fd()],
        );
        assert_says(&refused(&here), &["past the storage"]);
        // A legal zero-stride tensor (torch's expand) is accepted: it reads in bounds.
        send_raw(
            there.as_fd(),
            &packet(1, &fd_tensor(F32, &[1000], &[0], 3, 16)),
            &[seg.as_fd()],
        );
        let t = here.recv_timeout(WAIT).unwrap();
        assert_eq!((t.numel(), t.sum().unwrap()), (1000, 0.0));
        drop(t);
        tensor_channel_works(&here, &there);
    });
}

#[test]
fn payload_memfds_that_are_unsealed_short_or_not_memfds() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Vec<u8>>().unwrap();
        let body = payload(&vec![7u8; 1000]);
        let len = body.len() as u32;
        let filled = |seals: SealFlags| {
            let fd = memfd(0, SealFlags::empty());
            rustix::io::pwrite(&fd, &body, 0).unwrap();
            if !seals.is_empty() {
                rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
            }
            fd
        };
        let all = SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL;
        let oob = header(VERSION, MEMFD, 0, len);
        send_raw(there.as_fd(), &oob, &[filled(SealFlags::empty()).as_fd()]);
        assert_says(
            &refused(&here),
            &["not sealed against writing and shrinking"],
        );
        send_raw(there.as_fd(), &oob, &[filled(SealFlags::SHRINK).as_fd()]);
        assert_says(
            &refused(&here),
            &["not sealed against writing and shrinking"],
        );
        let short = header(VERSION, MEMFD, 0, len + 1);
        send_raw(there.as_fd(), &short, &[filled(all).as_fd()]);
        assert_says(&refused(&here), &["payload but its memfd holds"]);
        send_raw(there.as_fd(), &oob, &[seqpacket().0.as_fd()]);
        assert_says(&refused(&here), &["not a sealed memfd"]);
        // The same payload, well formed, is accepted.
        send_raw(there.as_fd(), &oob, &[filled(all).as_fd()]);
        assert_eq!(here.recv_timeout(WAIT).unwrap(), vec![7u8; 1000]);
    });
}

#[test]
fn queue_event_and_lock_handles_whose_fd_is_of_the_wrong_kind() {
    common::run(DEADLINE, || {
        // A queue whose ends are not SEQPACKET sockets.
        let (here, there) = pipe::<Queue<u32>>().unwrap();
        let (_real, raw) = capture(Queue::<u32>::new().unwrap());
        assert_eq!(
            raw.len(),
            6,
            "a queue travels as two sockets, its ring, the two sockets of its custody and \
             its holder lease"
        );
        let body = payload(&(0u32, 1u32, 2u32, 3u32, 4u32, 5u32));
        let m = sealed(4096);
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&m, &m, &raw[2], &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["queue end is not a socket"]);
        let (s1, _s2) = std::os::unix::net::UnixStream::pair().unwrap();
        let s1 = OwnedFd::from(s1);
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&s1, &s1, &raw[2], &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["not SEQPACKET"]);
        // A custody socket of the wrong kind.
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &raw[2], &s1, &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["not SEQPACKET"]);
        // Sockets, a short memfd, or a block of another kind where the ring should be.
        let (a, b) = seqpacket();
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&a, &b, &a, &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(
            &refused(&here),
            &["queue ring handle is not a sealed multiproc memfd"],
        );
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &m, &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["queue ring segment holds 4096 bytes"]);
        // Big enough, but not a ring (its kind word says so).
        let not_a_ring = sealed(4096 + (1 << 20));
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &not_a_ring, &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["another kind"]);
        // A holder lease that is a socket.
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &raw[2], &raw[3], &raw[4], &s1]),
        );
        assert_says(&refused(&here), &["holder lease", "not a regular file"]);
        // And the real thing works.
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &raw[2], &raw[3], &raw[4], &raw[5]]),
        );
        let q = here.recv_timeout(WAIT).unwrap();
        q.put(5).map_err(|e| e.error).unwrap();
        assert_eq!(q.get_timeout(WAIT).unwrap(), 5);
        drop((q, here, there));

        // Events and locks: a socket, a short memfd, a block of another kind.
        let (here, there) = pipe::<Event>().unwrap();
        let event = Event::new().unwrap();
        let lock = Lock::new().unwrap();
        let (_, event_fds) = capture(event.clone());
        let (_, lock_fds) = capture(lock.clone());
        let idx = payload(&0u32);
        send_raw(there.as_fd(), &packet(1, &idx), &[a.as_fd()]);
        assert_says(
            &refused(&here),
            &["Event handle is not a sealed multiproc memfd"],
        );
        send_raw(there.as_fd(), &packet(1, &idx), &[sealed(100).as_fd()]);
        assert_says(&refused(&here), &["holds 100 bytes", "fewer than"]);
        send_raw(there.as_fd(), &packet(1, &idx), &[lock_fds[0].as_fd()]);
        assert_says(&refused(&here), &["another kind"]);
        send_raw(there.as_fd(), &packet(1, &idx), &[event_fds[0].as_fd()]);
        let ev = here.recv_timeout(WAIT).unwrap();
        ev.set();
        assert!(event.is_set(), "the received event is the real one");
        drop((ev, here, there));

        let (here, there) = pipe::<Lock>().unwrap();
        send_raw(there.as_fd(), &packet(1, &idx), &[event_fds[0].as_fd()]);
        assert_says(&refused(&here), &["sent as a Lock", "another kind"]);
        send_raw(there.as_fd(), &packet(1, &idx), &[lock_fds[0].as_fd()]);
        let l = here.recv_timeout(WAIT).unwrap();
        l.acquire_timeout(Duration::ZERO).unwrap();
        assert!(lock.is_locked(), "the received lock is the real one");
        l.release().unwrap();
    });
}

// --- named segments: received by another process, which has not mapped them ---

/// The fds of a forged packet, borrowed.
fn with<'a, const N: usize>(fds: [&'a OwnedFd; N]) -> [BorrowedFd<'a>; N] {
    fds.map(|f| f.as_fd())
}

/// Receives `count` tensors once `go` is set, answering each with `Ok(sum)` or the
/// error's text.
fn receive_and_report(
    _rank: usize,
    (conn, results, go, count): (
        Connection<Tensor>,
        SimpleQueue<Result<f64, String>>,
        Event,
        u32,
    ),
) -> Result<(), String> {
    go.wait_timeout(WAIT)
        .map_err(|e| format!("never told to go: {e}"))?;
    for _ in 0..count {
        let r = match conn.recv_timeout(WAIT) {
            Ok(t) => t.sum().map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        results.put(r).map_err(|e| e.error.to_string())?;
    }
    Ok(())
}

/// Named segments are judged when they are mapped: the name must parse, the file must
/// exist, be a regular 0600 file of ours (not a symlink), hold our header and at least
/// the bytes the handle claims. That includes a segment shrunk after it was sent.
///
/// Residual risk (documented in `src/shm/mod.rs`): a named segment cannot be sealed, so
/// a hostile process *of the same user* that truncates it after the receiver mapped it
/// can still make the receiver's next access SIGBUS. memfds (`file_descriptor`, the
/// default) are sealed and immune.
#[test]
fn named_segments_that_lie_or_shrank_after_they_were_sent() {
    common::run(DEADLINE, || {
        multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
        let (here, there) = pipe::<Tensor>().unwrap();
        let results = SimpleQueue::new().unwrap();
        let go = Event::new().unwrap();
        let mut ctx = start_processes(
            receive_and_report,
            (there, results.clone(), go.clone(), 8),
            1,
            multiproc::StartMethod::Spawn,
        )
        .unwrap();
        let small = Tensor::full(&[250], 1.0, DType::F32).unwrap();
        small.share_memory_().unwrap();
        let small_name = small.storage().shm_name().unwrap();
        // 1: claims more than the segment (small's 1 MiB arena) holds.
        send_raw(
            here.as_fd(),
            &packet(0, &named_tensor(&small_name, 1 << 19)),
            &[],
        );
        // 2: a valid name that names nothing.
        let ghost = format!(
            "multiproc_{}_{}",
            std::process::id(),
            "0123456789abcdef".repeat(2)
        );
        send_raw(here.as_fd(), &packet(0, &named_tensor(&ghost, 4)), &[]);
        // 3: not one of our names.
        send_raw(
            here.as_fd(),
            &packet(0, &named_tensor("../../etc/passwd", 4)),
            &[],
        );
        // 4: a symbolic link under one of our names.
        let link = format!(
            "multiproc_{}_{}",
            std::process::id(),
            "fedcba9876543210".repeat(2)
        );
        std::os::unix::fs::symlink(format!("/dev/shm/{small_name}"), format!("/dev/shm/{link}"))
            .unwrap();
        send_raw(here.as_fd(), &packet(0, &named_tensor(&link, 250)), &[]);
        // 4b: a handle of the old wire (version 1, which also had plain segments).
        let old = named_tensor(&small_name, 250);
        let mut v1 = header(1, INLINE, 0, old.payload.len() as u32);
        v1.extend(old.payload);
        send_raw(here.as_fd(), &v1, &[]);
        // 5: a real send of a 4 MiB tensor, shrunk before the receiver maps it.
        let big = Tensor::full(&[1 << 20], 1.0, DType::F32).unwrap();
        big.share_memory_().unwrap();
        let big_name = big.storage().shm_name().unwrap();
        here.send(big.clone()).map_err(|e| e.error).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/shm/{big_name}"))
            .unwrap()
            .set_len(64 + 16)
            .unwrap();
        // From here on this process must not read `big` either: its pages are gone.
        // 6, 7: the channel still works.
        here.send(small.clone()).map_err(|e| e.error).unwrap();
        here.send(Tensor::full(&[4], 2.0, DType::F32).unwrap())
            .map_err(|e| e.error)
            .unwrap();
        go.set();
        let mut got = Vec::new();
        for _ in 0..8 {
            got.push(results.get_timeout(WAIT).expect("a result"));
        }
        ctx.join_timeout(WAIT)
            .expect("the receiver did not finish cleanly");
        let err = |i: usize| got[i].clone().expect_err("a hostile handle was accepted");
        assert_says(&err(0), &["claims 2097216 bytes", "holds 1048576"]);
        assert_says(&err(1), &["no longer exists"]);
        assert_says(&err(2), &["not a multiproc segment name"]);
        assert_says(&err(3), &["symbolic link"]);
        assert_says(&err(4), &["wire version 1 is not supported"]);
        assert_says(&err(5), &["claims 4194368 bytes", "holds 16"]);
        assert_eq!(got[6], Ok(250.0));
        assert_eq!(got[7], Ok(8.0));
        // Clean up what the hostile cases left: the link, and the shrunk segment, whose
        // in-flight reference no receiver adopted (the tree's shm manager would remove
        // it once every process of the tree had exited).
        std::fs::remove_file(format!("/dev/shm/{link}")).unwrap();
        std::mem::forget(big); // its mapping is past the file's end now: never touch it
        let _ = std::fs::remove_file(format!("/dev/shm/{big_name}"));
        drop(small);
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}

// --- random bytes, from another process ---

use common::Rng;

const RANDOM_PACKETS: u32 = 3000;

/// Sends random packets: pure noise, a valid header over noise, and real messages with
/// bytes flipped, with 0–3 fds of assorted kinds; then a sentinel.
fn send_random(_rank: usize, (conn, seed): (Connection<(u64, Tensor)>, u64)) -> Result<(), String> {
    let mut rng = Rng(seed);
    let t = Tensor::arange(0.0, 256.0, 1.0, DType::F32).map_err(|e| e.to_string())?;
    let (real, real_fds) = capture((7u64, t.narrow(0, 3, 100).map_err(|e| e.to_string())?));
    let pool: Vec<OwnedFd> = vec![
        sealed(4096),
        sealed(64),
        memfd(4096, SealFlags::empty()),
        seqpacket().0,
        real_fds[0].try_clone().map_err(|e| e.to_string())?,
    ];
    for _ in 0..RANDOM_PACKETS {
        let mut bytes: Vec<u8> = match rng.below(3) {
            0 => (0..rng.below(200)).map(|_| rng.next_u64() as u8).collect(),
            1 => {
                let mut b = header(VERSION, rng.below(3) as u8, rng.below(4) as u32, 0);
                let body: Vec<u8> = (0..rng.below(120)).map(|_| rng.next_u64() as u8).collect();
                b[12..16].copy_from_slice(&(body.len() as u32).to_le_bytes());
                b.extend(body);
                b
            }
            _ => real.clone(),
        };
        for _ in 0..rng.below(4) {
            if !bytes.is_empty() {
                let i = rng.below(bytes.len() as u64) as usize;
                bytes[i] ^= 1 << rng.below(8);
            }
        }
        let fds: Vec<BorrowedFd<'_>> = (0..rng.below(4))
            .map(|_| pool[rng.below(pool.len() as u64) as usize].as_fd())
            .collect();
        send_raw(conn.as_fd(), &bytes, &fds);
    }
    conn.send((
        u64::MAX,
        Tensor::full(&[3], 1.0, DType::F32).map_err(|e| e.to_string())?,
    ))
    .map_err(|e| e.error.to_string())
}

#[test]
fn random_bytes_from_another_process() {
    let seed = std::env::var("MULTIPROC_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    random_packets_then_a_valid_message(seed);
}

/// Seeds that once lost the final valid message: an empty packet queued behind the
/// sender's exit was read as the end of the stream, and a forged plain-segment handle
/// to the sender's arena made the real block handle that followed look wrong.
#[test]
fn random_bytes_seeds_that_once_lost_the_last_message() {
    for seed in [1796322591613810451, 1796322639706174250] {
        random_packets_then_a_valid_message(seed);
    }
}

/// Empty packets (which read as 0 bytes, like the end of the stream) queued before and
/// after a real message, with the sender gone: each one before it is refused, the real
/// message arrives, and only then is the channel closed (the empty packet behind the
/// last message reads as that end: nothing is left to lose).
#[test]
fn empty_packets_behind_a_hung_up_sender_are_not_the_end() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<u32>().unwrap();
        send_raw(there.as_fd(), &[], &[]);
        send_raw(there.as_fd(), &[], &[]);
        there.send(7).map_err(|e| e.error).unwrap();
        send_raw(there.as_fd(), &[], &[]);
        drop(there);
        assert_says(&refused(&here), &["empty packet"]);
        assert_says(&refused(&here), &["empty packet"]);
        assert_eq!(here.recv_timeout(WAIT).unwrap(), 7);
        for _ in 0..2 {
            match here.recv_timeout(WAIT) {
                Err(Error::Disconnected(_)) => {}
                other => panic!("expected the end of the channel, got {other:?}"),
            }
        }
    });
}

fn random_packets_then_a_valid_message(seed: u64) {
    common::run(DEADLINE, move || {
        eprintln!("random packets seed: {seed} (MULTIPROC_FAULT_SEED={seed} replays it)");
        let (here, there) = pipe::<(u64, Tensor)>().unwrap();
        let mut ctx =
            start_processes(send_random, (there, seed), 1, multiproc::StartMethod::Spawn).unwrap();
        let (mut refused, mut accepted) = (0u32, 0u32);
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < until, "the random packets took too long");
            match here.recv_timeout(WAIT) {
                Ok((u64::MAX, t)) => {
                    assert_eq!(t.sum().unwrap(), 3.0);
                    break;
                }
                // A mutation that still decodes is a valid message: it must be safe
                // to use (this reads every element it addresses; a storage that is not
                // aligned for its dtype is a clear error, never a crash).
                Ok((_, t)) => {
                    let _ = t.sum();
                    accepted += 1;
                }
                Err(e) if e.is_timeout() => panic!("the sender went quiet (seed {seed})"),
                Err(Error::InvalidMessage(_)) | Err(Error::FdLimit { .. }) => refused += 1,
                Err(e) => panic!(
                    "packet {}: unexpected {e} (seed {seed})",
                    refused + accepted
                ),
            }
        }
        assert_eq!(
            refused + accepted,
            RANDOM_PACKETS,
            "every packet had one outcome"
        );
        eprintln!("random packets: {refused} refused, {accepted} accepted, 0 crashes");
        ctx.join_timeout(WAIT).unwrap();
    });
}

/// Forged packets written straight into a bounded queue's socket took no place, so
/// taking them must give none back: the capacity stays exact.
#[test]
fn forged_packets_never_give_a_bounded_queue_extra_places() {
    common::run(DEADLINE, || {
        const CAPACITY: u32 = 8;
        let q = Queue::<u32>::with_capacity(CAPACITY as usize).unwrap();
        let (_, raw) = capture(q.clone());
        let tx = raw[0].as_fd();
        let mut flagged = header(VERSION, INLINE, 0, 3);
        flagged[6] = 1; // claims a put counted it
        flagged.extend([0xff, 0xff, 0xff]); // but the payload is no u32
        let mut forged: Vec<Vec<u8>> = vec![
            b"random bytes, not a packet".to_vec(),
            header(VERSION + 1, INLINE, 0, 0),
            header(VERSION, 7, 0, 0),
            packet(0, &vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            flagged,
        ];
        let mut seed = 0x5eed_u64;
        while forged.len() < 20 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            forged.push(seed.to_le_bytes().to_vec());
        }
        for (i, bytes) in forged.iter().enumerate() {
            send_raw(tx, bytes, &[]);
            match q.get_timeout(WAIT) {
                Err(Error::InvalidMessage(_)) => {}
                other => {
                    panic!("forged packet {i} ({bytes:?}): expected InvalidMessage, got {other:?}")
                }
            }
        }
        let mut accepted = 0;
        for v in 0..CAPACITY + 20 {
            // A full queue has no place: the put times out at once (nobody gets).
            match q.put_timeout(v, Duration::from_millis(50)) {
                Ok(()) => accepted += 1,
                Err(e) => {
                    assert!(matches!(e.error, Error::Timeout { .. }), "{:?}", e.error);
                    break;
                }
            }
        }
        assert_eq!(
            accepted, CAPACITY,
            "a queue of capacity {CAPACITY} accepted {accepted} puts after 20 forged packets"
        );
        assert!(q.is_full());
        assert_eq!(q.len(), CAPACITY as usize);
        for v in 0..CAPACITY {
            assert_eq!(q.get_timeout(WAIT).unwrap(), v);
        }
        assert_eq!(q.len(), 0);
    });
}

/// Bytes of a memfd that are allocated (committed), from `st_blocks`.
fn committed(fd: BorrowedFd<'_>) -> u64 {
    rustix::fs::fstat(fd).unwrap().st_blocks as u64 * 512
}

/// A forged "block" handle naming 4 KiB of a huge sparse sealed memfd that starts with
/// the block magic: the receiver maps and faults in only what the tensor covers.
#[test]
fn a_forged_block_handle_over_a_huge_sparse_memfd_commits_only_the_tensor() {
    common::run(DEADLINE, || {
        const SPARSE: u64 = 256 << 20;
        let (here, there) = pipe::<Tensor>().unwrap();
        let fd = memfd(0, SealFlags::empty());
        rustix::fs::ftruncate(&fd, SPARSE).unwrap();
        rustix::io::pwrite(&fd, b"MPBLOCK1", 0).unwrap();
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .unwrap();
        let body = WithReferences {
            payload: payload(&TensorWire {
                dtype: F32,
                shape: vec![1024],
                strides: vec![1],
                offset: 0,
                storage: StorageWire::Segment(HandleWire {
                    reference: 0,
                    offset: 4096,
                    nbytes: 4096,
                }),
            }),
            section: section(&[Reference::Fd(0)]),
        };
        let start = Instant::now();
        send_raw(there.as_fd(), &packet(1, &body), &[fd.as_fd()]);
        let t = here.recv_timeout(WAIT).expect("the tensor");
        let took = start.elapsed();
        assert_eq!(t.sum().unwrap(), 0.0);
        let used = committed(fd.as_fd());
        assert!(
            used <= 64 << 10,
            "receiving a 4 KiB tensor committed {used} bytes of a {SPARSE}-byte sparse memfd (took {took:?})"
        );
        eprintln!("forged block handle: {used} bytes committed, received in {took:?}");
        drop(t);

        tensor_channel_works(&here, &there);
    });
}

/// A message payload "spilled" into a sealed but sparse memfd is refused before a byte
/// of it is read.
#[test]
fn a_sparse_payload_memfd_is_refused_before_it_is_read() {
    common::run(DEADLINE, || {
        const LEN: u32 = 64 << 20;
        let (here, there) = pipe::<Vec<u8>>().unwrap();
        let fd = memfd(0, SealFlags::empty());
        rustix::fs::ftruncate(&fd, u64::from(LEN)).unwrap();
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
        )
        .unwrap();
        let start = Instant::now();
        send_raw(
            there.as_fd(),
            &header(VERSION, MEMFD, 0, LEN),
            &[fd.as_fd()],
        );
        let why = refused(&here);
        eprintln!("sparse payload memfd refused in {:?}", start.elapsed());
        assert_says(&why, &["sparse", "refusing to read it"]);
        assert_eq!(committed(fd.as_fd()), 0, "nothing was read into it");
        tensor_channel_works_for_bytes(&here, &there);
    });
}

fn tensor_channel_works_for_bytes(here: &Connection<Vec<u8>>, there: &Connection<Vec<u8>>) {
    there.send(vec![1, 2, 3]).map_err(|e| e.error).unwrap();
    assert_eq!(here.recv_timeout(WAIT).unwrap(), vec![1, 2, 3]);
}
