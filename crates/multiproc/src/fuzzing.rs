//! **Not public API.** Entry points for the wire decoder's fuzz target
//! (`fuzz/fuzz_targets/decode_packet.rs`) and for the stable-Rust test that replays its
//! corpus (`tests/fuzz_corpus.rs`). Anything here may change or vanish in any release.
//!
//! A fuzz input is a packet plus a description of the fds to attach to it:
//!
//! | bytes | what |
//! |---|---|
//! | 0 | `n`: the number of fd specs (`byte % 25`) |
//! | 1..=n | one spec per fd (see [`fds_for_fuzzing`](crate::__fuzz::fds_for_fuzzing)) |
//! | next 2 | `blob_len`, little-endian (clipped to what is left) |
//! | next `blob_len` | the blob: the contents of payload memfds (spec kind 2) |
//! | the rest | the packet's bytes, as they would arrive on a channel |
//!
//! The packet is decoded as [`FuzzMessage`](crate::__fuzz::FuzzMessage), a representative type with tensors (at
//! several depths), strings, an event, a lock, queues, a pipe end, a nested message and
//! an error; whatever decodes is then used (every element of a small tensor is read,
//! the lock is taken and released, …), so a handle that passed the checks but maps
//! less than it claims would crash the fuzzer.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::queue::{Connection, Queue, SimpleQueue};
use crate::shm::strategy::SharingStrategy;
use crate::sync::{Event, Lock};
use crate::sys::memfd;
use crate::sys::socket::Packet;
use crate::tensor::{DType, Tensor};
use crate::wire::{self, Opaque};

/// The most fds one input attaches.
const MAX_FDS: usize = 24;
/// How deep nested messages are decoded.
const MAX_DEPTH: usize = 3;
/// Tensors with more elements than this are checked at their ends only (a zero-stride
/// tensor may legally address 2^60 elements of a 4-byte storage).
const SUM_LIMIT: usize = 1 << 16;

/// The type the fuzzer decodes: a little of everything a message can carry.
#[derive(Serialize, Deserialize, Default)]
pub struct FuzzMessage {
    tag: u8,
    text: String,
    tensors: Vec<Tensor>,
    nested: Vec<Vec<(u32, Option<Tensor>)>>,
    event: Option<Event>,
    lock: Option<Lock>,
    queue: Option<Queue<u32>>,
    simple: Option<SimpleQueue<Tensor>>,
    conn: Option<Connection<u8>>,
    inner: Option<Opaque>,
    error: Option<Error>,
}

/// Runs one fuzz input: makes its fds, decodes its packet, uses what decoded. Returns
/// a one-line summary, or the decoder's error. Never panics on any input (that is
/// what the fuzzer checks).
pub fn run_input(data: &[u8]) -> Result<String> {
    let (specs, blob, packet) = split_input(data);
    let fds = fds_for_fuzzing(specs, blob);
    decode_packet_for_fuzzing(packet, fds)
}

/// Splits an input into fd specs, blob and packet bytes.
pub fn split_input(data: &[u8]) -> (&[u8], &[u8], &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return (&[], &[], &[]);
    };
    let n = (n as usize % (MAX_FDS + 1)).min(rest.len());
    let (specs, rest) = rest.split_at(n);
    let (blob_len, rest) = if rest.len() >= 2 {
        (u16::from_le_bytes([rest[0], rest[1]]) as usize, &rest[2..])
    } else {
        (0, rest)
    };
    let (blob, packet) = rest.split_at(blob_len.min(rest.len()));
    (specs, blob, packet)
}

/// Decodes `bytes` with `fds` attached, as a channel would, into a [`FuzzMessage`],
/// and uses what decoded.
pub fn decode_packet_for_fuzzing(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<String> {
    let message: FuzzMessage = wire::decode(
        Packet {
            bytes: bytes.to_vec(),
            fds,
        },
        &crate::shm::Returns::plain(),
    )?;
    exercise(message, 0)
}

fn exercise(m: FuzzMessage, depth: usize) -> Result<String> {
    let mut sum = 0.0;
    let mut count = 0usize;
    let mut touch = |t: &Tensor| -> Result<()> {
        count += 1;
        if t.numel() <= SUM_LIMIT {
            // A decoded storage not aligned for its dtype is a clear error: keep going.
            sum += t.sum().unwrap_or(0.0);
        } else {
            // The first and the last element along the flattened order.
            let flat = t.reshape(&[t.numel()]).or_else(|_| {
                t.contiguous()
                    .and_then(|c| c.reshape(&[c.numel()]))
                    .map_err(|e| Error::Tensor(e.to_string()))
            });
            if let Ok(flat) = flat {
                sum += flat.narrow(0, 0, 1)?.sum().unwrap_or(0.0)
                    + flat.narrow(0, flat.numel() - 1, 1)?.sum().unwrap_or(0.0);
            }
        }
        Ok(())
    };
    for t in &m.tensors {
        touch(t)?;
    }
    for t in m.nested.iter().flatten().filter_map(|(_, t)| t.as_ref()) {
        touch(t)?;
    }
    let event = m.event.as_ref().map(Event::is_set);
    if let Some(lock) = &m.lock {
        if let Some(held) = lock.try_lock()? {
            drop(held);
        }
    }
    if let Some(q) = &m.queue {
        let _ = q.len();
    }
    if let Some(c) = &m.conn {
        let _ = c.poll_timeout(Duration::ZERO);
    }
    let inner = match m.inner {
        Some(inner) if depth < MAX_DEPTH => Some(exercise(
            inner.decode(&crate::shm::Returns::plain())?,
            depth + 1,
        )?),
        _ => None,
    };
    Ok(format!(
        "tag {} text {} bytes, {count} tensors summing to {sum}, event {event:?}, inner {inner:?}, error {:?}",
        m.tag,
        m.text.len(),
        m.error.map(|e| e.to_string())
    ))
}

/// Makes one fd per spec byte: `kind = b % 8`, `arg = b / 8` (0..32).
///
/// | kind | fd |
/// |---|---|
/// | 0 | a memfd of `arg * 256` bytes, sealed against shrinking and growing (a tensor segment); for an odd `arg` it starts with a block header (a pooled segment, see `shm::recycler`) |
/// | 1 | an unsealed memfd of 4096 bytes |
/// | 2 | a memfd holding the blob, sealed against writing (a message payload) |
/// | 3 | one end of a `SOCK_SEQPACKET` pair (a queue or pipe end) |
/// | 4 | an [`Event`]'s shared block |
/// | 5 | a [`Lock`]'s shared block |
/// | 6 | a queue's ring (its shared block): a [`Queue`]'s for `arg % 3 == 0`, a [`SimpleQueue`]'s for 1, a `JoinableQueue`'s for 2 |
/// | 7 | one end of a `SOCK_STREAM` pair (a socket of the wrong kind) |
///
/// An fd that cannot be made (fd limit) is left out.
pub fn fds_for_fuzzing(specs: &[u8], blob: &[u8]) -> Vec<OwnedFd> {
    specs
        .iter()
        .take(MAX_FDS)
        .filter_map(|&b| make_fd(b % 8, u64::from(b / 8), blob).ok())
        .collect()
}

fn make_fd(kind: u8, arg: u64, blob: &[u8]) -> Result<OwnedFd> {
    Ok(match kind {
        0 => {
            let fd = memfd::create("fuzz-segment", arg * 256)?;
            if arg % 2 == 1 {
                // A block: the magic, then zero uses (all that a receiver reads of it).
                memfd::write_all_at(fd.as_fd(), &crate::shm::BLOCK_MAGIC_BYTES)?;
            }
            memfd::seal_size(fd.as_fd())?;
            fd
        }
        1 => memfd::create("fuzz-unsealed", 4096)?,
        2 => {
            let fd = memfd::create("fuzz-payload", 0)?;
            memfd::write_all_at(fd.as_fd(), blob)?;
            memfd::seal_contents(fd.as_fd())?;
            fd
        }
        3 => crate::sys::socket::seqpacket_pair()?.0,
        4 => first_fd(&Event::new()?)?,
        5 => first_fd(&Lock::new()?)?,
        6 => {
            // A queue travels as its sockets, its ring (where its counters live), then
            // the sockets of its block custody.
            let mut fds = match arg % 3 {
                0 => wire::encode(&Queue::<u32>::new()?),
                1 => wire::encode(&SimpleQueue::<u32>::new()?),
                _ => wire::encode(&crate::queue::JoinableQueue::<u32>::new()?),
            }?
            .into_packet()
            .fds;
            if fds.len() < 3 {
                return Err(Error::Encode("a queue without a ring".into()));
            }
            fds.swap_remove(2)
        }
        _ => OwnedFd::from(
            std::os::unix::net::UnixStream::pair()
                .map_err(|e| Error::os("socketpair(SOCK_STREAM)", e))?
                .0,
        ),
    })
}

fn first_fd<T: Serialize>(value: &T) -> Result<OwnedFd> {
    wire::encode(value)?
        .into_packet()
        .fds
        .into_iter()
        .next()
        .ok_or_else(|| Error::Encode("a handle without an fd".into()))
}

/// Well-formed inputs: representative messages encoded by the library itself, with fd
/// specs that recreate fds of the same kinds. The fuzzer starts from these; the corpus
/// replay test checks that each still decodes.
pub fn seed_inputs() -> Result<Vec<Vec<u8>>> {
    let tensor = |n: usize, v: f64| -> Result<Tensor> {
        let t = Tensor::full(&[n], v, DType::F32)?;
        t.storage()
            .share_memory_with(SharingStrategy::FileDescriptor)?;
        Ok(t)
    };
    let mut messages = Vec::new();
    messages.push(FuzzMessage::default());
    messages.push(FuzzMessage {
        tag: 1,
        text: "a tensor and a view of it".into(),
        tensors: {
            let t = tensor(60, 1.0)?;
            let v = t.reshape(&[6, 10])?.transpose(0, 1)?.narrow(0, 2, 3)?;
            vec![t, v]
        },
        ..FuzzMessage::default()
    });
    messages.push(FuzzMessage {
        tag: 2,
        text: "handles of every kind".into(),
        tensors: vec![tensor(100, 2.0)?],
        nested: vec![vec![(1, Some(tensor(30, 3.0)?)), (2, None)], vec![]],
        event: Some(Event::new()?),
        lock: Some(Lock::new()?),
        queue: Some(Queue::new()?),
        simple: Some(SimpleQueue::new()?),
        conn: Some(crate::queue::pipe::<u8>()?.0),
        error: Some(Error::timeout(
            "a test wait",
            Some(std::time::Duration::from_millis(5)),
        )),
        ..FuzzMessage::default()
    });
    messages.push(FuzzMessage {
        tag: 3,
        text: "a nested message".into(),
        inner: Some(Opaque::encode(&FuzzMessage {
            tag: 4,
            tensors: vec![tensor(20, 4.0)?],
            event: Some(Event::new()?),
            ..FuzzMessage::default()
        })?),
        ..FuzzMessage::default()
    });
    messages.push(FuzzMessage {
        tag: 5,
        text: "x".repeat(wire::INLINE_MAX + 100), // the payload travels in a memfd
        ..FuzzMessage::default()
    });
    let mut inputs = Vec::new();
    for m in &messages {
        let packet = wire::encode(m)?.into_packet();
        let mut specs = Vec::new();
        let mut blob = Vec::new();
        for fd in &packet.fds {
            specs.push(classify(fd.as_fd(), &mut blob)?);
        }
        let mut input = vec![specs.len() as u8];
        input.extend(&specs);
        input.extend((blob.len() as u16).to_le_bytes());
        input.extend(&blob);
        input.extend(&packet.bytes);
        inputs.push(input);
        // The packet counts as sent, so it carries uses of the tensors' blocks: received
        // here once, where the storages live, it gives them back (otherwise they would
        // pin the blocks for good, like any message sent and never received).
        let received: FuzzMessage = wire::decode(packet, &crate::shm::Returns::plain())?;
        if let Some(inner) = received.inner {
            drop(inner.decode::<FuzzMessage>(&crate::shm::Returns::plain())?);
        }
    }
    Ok(inputs)
}

/// The spec byte that recreates an fd like `fd` (for [`seed_inputs`]).
fn classify(fd: std::os::fd::BorrowedFd<'_>, blob: &mut Vec<u8>) -> Result<u8> {
    if let Ok(seqpacket) = crate::sys::socket::is_seqpacket(fd) {
        return Ok(if seqpacket { 3 } else { 7 });
    }
    let content_sealed = memfd::is_content_sealed(fd)
        .map_err(|e| Error::os("F_GET_SEALS", std::io::Error::other(e)))?;
    let size = memfd::file_size(fd)?;
    if content_sealed {
        let mut bytes = vec![0u8; size as usize];
        // A read that fails part way leaves the rest zero, as a short file would.
        let _ = memfd::read_at_start(fd, &mut bytes);
        *blob = bytes;
        return Ok(2);
    }
    // A queue's ring: its kind word, and the queue type that made it (see `make_fd`).
    let mut words = [0u8; 4 * (crate::queue::RING_FLAVOR_WORD + 1)];
    let _ = memfd::read_at_start(fd, &mut words);
    if u32::from_ne_bytes([words[0], words[1], words[2], words[3]]) == crate::queue::RING_KIND {
        let at = 4 * crate::queue::RING_FLAVOR_WORD;
        let flavor = u32::from_ne_bytes([words[at], words[at + 1], words[at + 2], words[at + 3]]);
        return Ok(6 + 8 * [0u8, 2, 1][flavor.clamp(1, 3) as usize - 1]);
    }
    if size == 4096 {
        let mut kind = [0u8; 4];
        let _ = memfd::read_at_start(fd, &mut kind);
        match u32::from_le_bytes(kind) {
            0x4556_4e54 => return Ok(4), // an Event's block
            0x4c4f_434b => return Ok(5), // a Lock's
            _ => {}
        }
    }
    // A tensor segment: the next multiple of 256 bytes, at most 31 * 256; an odd
    // multiple for a block (a segment with a block header), an even one otherwise.
    let mut magic = [0u8; 8];
    let _ = memfd::read_at_start(fd, &mut magic);
    let arg = size.div_ceil(256).min(31) as u8;
    let arg = if magic == crate::shm::BLOCK_MAGIC_BYTES {
        arg | 1
    } else {
        arg.next_multiple_of(2).min(30)
    };
    Ok(arg * 8)
}

/// A CUDA storage handle as forged inputs carry it: the fields of the wire form, the
/// allocation at fd #0 and the lease at fd #1 of the packet.
#[derive(Debug, Clone, Copy)]
pub struct ForgedCudaHandle {
    /// The device the handle names.
    pub device: u32,
    /// The allocation's length it claims.
    pub len: u64,
    /// Where the storage starts in it.
    pub offset: u64,
    /// The storage's length.
    pub nbytes: u64,
}

/// The bytes of a packet whose [`FuzzMessage`] carries one 1-D `u8` tensor of
/// `h.nbytes` elements on a CUDA storage described by `h` (fds #0 and #1 are the
/// caller's to attach: a real export, a memfd, anything).
pub fn cuda_handle_packet(h: ForgedCudaHandle) -> Result<Vec<u8>> {
    // Mirrors `FuzzMessage` field by field (postcard is not self-describing, and every
    // other field is empty or `None`, whose encoding does not depend on its type).
    #[derive(Serialize)]
    struct ForgedTensor {
        dtype: u8,
        shape: Vec<u64>,
        strides: Vec<u64>,
        offset: u64,
        storage: crate::tensor::ForgedStorageWire,
    }
    #[derive(Serialize)]
    struct ForgedMessage {
        tag: u8,
        text: String,
        tensors: Vec<ForgedTensor>,
        nested: Vec<()>,
        event: Option<()>,
        lock: Option<()>,
        queue: Option<()>,
        simple: Option<()>,
        conn: Option<()>,
        inner: Option<()>,
        error: Option<()>,
    }
    let message = ForgedMessage {
        tag: 9,
        text: "a forged CUDA handle".into(),
        tensors: vec![ForgedTensor {
            dtype: DType::U8.code(),
            shape: vec![h.nbytes],
            strides: vec![1],
            offset: 0,
            storage: crate::tensor::ForgedStorageWire::cuda(crate::cuda::CudaHandle {
                export: 0,
                lease: 1,
                id: 0x5eed,
                device: h.device,
                len: h.len,
                offset: h.offset,
                nbytes: h.nbytes,
            }),
        }],
        nested: Vec::new(),
        event: None,
        lock: None,
        queue: None,
        simple: None,
        conn: None,
        inner: None,
        error: None,
    };
    // The bytes only: postcard's payload behind a wire header of two fds.
    let mut packet = wire::encode(&message)?.into_packet();
    packet.bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    Ok(packet.bytes)
}

/// Fuzz inputs (in [`run_input`]'s layout) with forged CUDA handles: a memfd where the
/// allocation should be, a device that does not exist, a storage larger than its
/// allocation, an allocation that is not a whole number of granules. Each must be an
/// error — [`Error::CudaUnavailable`] where there is no CUDA, [`Error::InvalidMessage`]
/// where there is — never a crash.
pub fn cuda_handle_inputs() -> Result<Vec<(&'static str, Vec<u8>)>> {
    const MIB2: u64 = 2 << 20;
    let cases = [
        ("cuda-not-an-export", 0, MIB2, 0, 1024),
        ("cuda-no-such-device", 7, MIB2, 0, 1024),
        ("cuda-storage-past-allocation", 0, MIB2, 4096, MIB2),
        ("cuda-partial-granule", 0, 12345, 0, 1024),
    ];
    let mut inputs = Vec::new();
    for (name, device, len, offset, nbytes) in cases {
        let bytes = cuda_handle_packet(ForgedCudaHandle {
            device,
            len,
            offset,
            nbytes,
        })?;
        // fd #0: a sealed 512-byte memfd (kind 0, arg 2); fd #1: an unsealed one.
        let mut input = vec![2, 2 * 8, 1, 0, 0];
        input.extend(bytes);
        inputs.push((name, input));
    }
    Ok(inputs)
}

/// The fds a message carrying `value` attaches (for tests that forge handles around
/// real ones: a CUDA tensor's export is fd #0, its lease fd #1).
pub fn fds_of<T: Serialize>(value: &T) -> Result<Vec<OwnedFd>> {
    Ok(wire::encode(value)?.into_packet().fds)
}

/// The safetensors loader's fuzz entry (feature `safetensors`): `data` is a whole file,
/// loaded through the same path as [`crate::safetensors::load`] (from a memfd: `fstat`,
/// header parse and checks, read-only mapping); every tensor that loads is then read
/// whole, so a tensor that passed the checks but reaches past the file would crash.
/// Returns a one-line summary, or the loader's error; never panics.
#[cfg(feature = "safetensors")]
pub fn run_safetensors_file(data: &[u8]) -> Result<String> {
    use std::os::fd::AsRawFd;
    let fd = memfd::create("multiproc-fuzz-safetensors", data.len() as u64)?;
    memfd::write_all_at(fd.as_fd(), data)?;
    let tensors = crate::safetensors::load(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    let mut sum = 0.0;
    for t in tensors.values() {
        sum += t.sum()?;
    }
    Ok(format!("{} tensors, sum {sum}", tensors.len()))
}

/// Well-formed safetensors files for the fuzz corpus: every dtype, empty tensors, no
/// tensors, metadata.
#[cfg(feature = "safetensors")]
pub fn safetensors_seed_inputs() -> Result<Vec<Vec<u8>>> {
    use std::collections::BTreeMap;
    let dir = std::env::temp_dir().join(format!("multiproc-fuzz-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::os("making a seed directory", e))?;
    let mut sets: Vec<BTreeMap<String, Tensor>> = vec![BTreeMap::new()];
    let mut all = BTreeMap::new();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        all.insert(
            format!("t{i}"),
            Tensor::arange(0.0, 1.0 + i as f64, 1.0, dtype)?,
        );
    }
    sets.push(all);
    let mut views = BTreeMap::new();
    let grid = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
    views.insert("grid.t".into(), grid.transpose(0, 1)?);
    views.insert("empty".into(), Tensor::zeros(&[0, 4], DType::F64)?);
    views.insert("scalar".into(), Tensor::full(&[], 7.0, DType::I64)?);
    sets.push(views);
    let mut out = Vec::new();
    for (i, set) in sets.iter().enumerate() {
        let path = dir.join(format!("seed-{i}.safetensors"));
        crate::safetensors::save(&path, set)?;
        out.push(std::fs::read(&path).map_err(|e| Error::os("reading a seed", e))?);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}
