//! The zero-copy all-reduce and broadcast of a local
//! [`ProcessGroup`](super::ProcessGroup): every rank's tensor lives in shared memory,
//! each rank maps its peers' tensors once, and rank `r` reduces slice `r` of all the
//! tensors and writes the result into all of them (a reduce-scatter and an all-gather
//! fused, between two barriers), or, for a broadcast, copies slice `r` of the source's
//! tensor into all the others. Each rank reads and writes about as many bytes as a
//! `memcpy` of its tensor; nothing passes through the arena.
//!
//! One call, on every rank:
//!
//! 1. Write this rank's [`Note`]: whether it can take part (its tensor is large
//!    enough, on the host, writable, and in shared memory — a private tensor is moved
//!    there in place, as `share_memory_` does), dtype, size, byte offset, the slot of
//!    the peers' caches that holds its storage, whether that slot is new (then its
//!    storage is sent this time), and the slots it dropped. Barrier.
//! 2. Read every note. Sizes or dtypes that differ are an error on every rank. If a
//!    rank cannot take part, every rank takes the arena path: all decide from the same
//!    notes, so all decide the same.
//! 3. When some rank's slot is new, it sends its tensor (the segment's fd, through
//!    `wire`) to every peer's abstract Unix socket, and the peers receive it; each
//!    writes whether it got everything; barrier. If one did not, every rank forgets
//!    this call's new entries and takes the arena path.
//! 4. The ranks claim 64 KiB pieces of the tensors one at a time from a counter in the
//!    arena (rank 0 resets it in step 1, when no rank can still be claiming from the
//!    previous call): the claimer reduces that piece of every tensor into a small
//!    buffer (so the sources and the buffer stay in cache) and copies it into every
//!    tensor (a broadcast copies the source's piece into the others). A rank the
//!    scheduler leaves waiting does not hold the others back: they claim its share.
//!    Barrier: no rank returns — and lets its caller touch its tensor — before every
//!    piece is written.
//!
//! Caches: a rank assigns its storages to [`SLOTS`](super::peer_tensors::SLOTS) slots (see `peer_tensors`) and its peers' caches mirror
//! that assignment (they receive exactly what the notes announce), so no rank ever has
//! to ask for what it lacks. A storage that its owner dropped is announced in the note
//! and unmapped by the peers; until then the peers' mapping keeps the owner's block from
//! being recycled (a received storage holds a use of it, see `shm`). A slot is found by
//! the storage's identity, so views of one storage share it.
//!
//! # Safety
//!
//! A peer's tensor is memory other processes write. During phase 4, by the protocol,
//! a piece of every tensor is read and written only by the rank that claimed it (the
//! counter hands each piece out once), and the tensors' owners do not touch them (the
//! call has not returned); the kernel views a piece as a slice only inside that phase,
//! and never a piece it reads and one it writes at once. A rank that breaks the protocol can make values wrong, not make
//! this process touch memory outside the mappings: every note is checked against the
//! storage it names before any pointer is made.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use rustix::net::SocketFlags;

use super::arena::{Arena, LIVENESS_TICK, Note};
use super::group::{Inner, ReduceOp, State};
use super::peer_tensors::{Offer, SLOTS, send_offer};
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::sys::{Readiness, wait_fd};
use crate::tensor::{DType, Storage, StorageRead, Tensor};
use crate::wire;

/// Tensors smaller than this take the arena path (their copy costs less than a round
/// of notes, and a small tensor is not moved into shared memory behind its owner's
/// back).
pub(crate) const MIN_BYTES: usize = 256 << 10;
/// Bytes of a piece of phase 4: the sources' and the buffer's pieces stay in cache.
const PIECE_BYTES: usize = 64 << 10;

/// The collective a call runs.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    /// `all_reduce_` with this op.
    AllReduce(ReduceOp),
    /// `broadcast_` from this rank.
    Broadcast(usize),
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce_",
            Kind::Broadcast(_) => "broadcast_",
        }
    }
}

/// What a call did.
pub(crate) enum Outcome {
    /// The tensor holds the reduction.
    Done,
    /// Every rank agreed to take the arena path instead.
    UseArena,
}

/// This rank's note, as it wrote it or read it from the arena.
#[derive(Clone, Copy, PartialEq, Eq)]
struct NoteView {
    ready: bool,
    dtype: u32,
    numel: u64,
    offset: u64,
    slot: usize,
    fresh: bool,
}

fn read_note(arena: &Arena, r: usize) -> NoteView {
    let w = |f: Note| arena.note(r, f).load(Ordering::Relaxed);
    let wide = |lo: Note, hi: Note| u64::from(w(lo)) | (u64::from(w(hi)) << 32);
    NoteView {
        ready: w(Note::Ready) == 1,
        dtype: w(Note::DType),
        numel: wide(Note::NumelLo, Note::NumelHi),
        offset: wide(Note::OffsetLo, Note::OffsetHi),
        slot: w(Note::Slot) as usize,
        fresh: w(Note::Fresh) == 1,
    }
}

fn write_note(arena: &Arena, me: usize, n: &NoteView, evicted: u32) {
    let set = |f: Note, v: u32| arena.note(me, f).store(v, Ordering::Relaxed);
    set(Note::Ready, u32::from(n.ready));
    set(Note::DType, n.dtype);
    set(Note::NumelLo, n.numel as u32);
    set(Note::NumelHi, (n.numel >> 32) as u32);
    set(Note::OffsetLo, n.offset as u32);
    set(Note::OffsetHi, (n.offset >> 32) as u32);
    set(Note::Slot, n.slot as u32);
    set(Note::Fresh, u32::from(n.fresh));
    set(Note::Evicted, evicted);
}

/// Whether this rank can take part with `t`, making its storage shared if need be.
fn can_take_part(t: &Tensor, bytes: usize) -> bool {
    let storage = t.storage();
    if bytes < MIN_BYTES || storage.device() != Device::Cpu || storage.is_read_only() {
        return false;
    }
    if let Err(e) = storage.share_memory_() {
        tracing::debug!(error = %e, "a collective takes the arena path: the tensor cannot be shared");
        return false;
    }
    storage.segment().is_some()
}

impl Inner {
    /// Steps 1 to 4 of the module docs for `t` (contiguous, of a reducible dtype, on
    /// the host and writable: checked by the caller).
    pub(super) fn zero_copy(
        &self,
        st: &mut State,
        me: usize,
        t: &Tensor,
        kind: Kind,
    ) -> Result<Outcome> {
        let what = kind.name();
        let arena = &self.arena;
        let p = arena.world_size();
        let size = t.dtype().size();
        let bytes = t.numel() * size;
        st.zero_copy.sized(p);
        let evicted = st.zero_copy.sweep();
        let ready = can_take_part(t, bytes) && st.zero_copy.listen(arena, me);
        let (slot, fresh) = if ready {
            st.zero_copy.slot_of(t.storage())
        } else {
            (0, false)
        };
        let mine = NoteView {
            ready,
            dtype: u32::from(t.dtype().code()),
            numel: t.numel() as u64,
            offset: (t.storage_offset() * size) as u64,
            slot,
            fresh,
        };
        if me == 0 {
            // Every rank passed the previous call's last barrier, so none still claims.
            arena.pieces().store(0, Ordering::Relaxed);
        }
        write_note(arena, me, &mine, evicted);
        self.sync(st)?;

        // Step 2: a snapshot, as a peer may write its next note once this call is over.
        let notes: Vec<NoteView> = (0..p).map(|r| read_note(arena, r)).collect();
        let evictions: Vec<u32> = (0..p)
            .map(|r| arena.note(r, Note::Evicted).load(Ordering::Relaxed))
            .collect();
        for (r, &gone) in evictions.iter().enumerate() {
            if r != me && gone != 0 {
                for (i, s) in st.zero_copy.theirs[r].iter_mut().enumerate() {
                    if gone & (1 << i) != 0 {
                        *s = None;
                    }
                }
            }
        }
        for (r, n) in notes.iter().enumerate() {
            if n.dtype != mine.dtype || n.numel != mine.numel {
                let dtype = |c: u32| {
                    u8::try_from(c)
                        .ok()
                        .and_then(DType::from_code)
                        .map_or_else(|| format!("dtype #{c}"), |d| d.to_string())
                };
                // Every rank sees the same notes and fails here; the barrier keeps a
                // fast one from writing its next note before a slow one has read this.
                self.sync(st)?;
                return Err(Error::Tensor(format!(
                    "{what}: rank {r} passed {} elements of {}, rank {me} {} of {}: every \
                     rank must pass a tensor of the same size and dtype",
                    n.numel,
                    dtype(n.dtype),
                    mine.numel,
                    dtype(mine.dtype)
                )));
            }
        }
        if !notes.iter().all(|n| n.ready) {
            return Ok(Outcome::UseArena);
        }
        for (r, n) in notes.iter().enumerate() {
            if n.slot >= SLOTS {
                arena.abort(me);
                return Err(Error::InvalidMessage(format!(
                    "{what}: rank {r} named cache slot {} of {SLOTS}; the group is now failed",
                    n.slot
                )));
            }
        }

        // Step 3.
        if notes.iter().any(|n| n.fresh) && !self.exchange(st, me, t, &notes)? {
            return Ok(Outcome::UseArena);
        }

        // Step 4.
        let storages: Vec<Storage> = (0..p)
            .map(|r| {
                if r == me {
                    Some(t.storage().clone())
                } else {
                    st.zero_copy.theirs[r][notes[r].slot].clone()
                }
            })
            .collect::<Option<_>>()
            .ok_or_else(|| {
                arena.abort(me);
                Error::InvalidMessage(format!(
                    "{what}: a peer named a cache slot it never filled; the group is now failed"
                ))
            })?;
        let guards: Vec<StorageRead<'_>> = storages.iter().map(Storage::read).collect();
        let mut bases = Vec::with_capacity(p);
        for (r, g) in guards.iter().enumerate() {
            let offset = usize::try_from(notes[r].offset).unwrap_or(usize::MAX);
            let fits = offset % size == 0
                && g.is_host()
                && offset.checked_add(bytes).is_some_and(|end| end <= g.len());
            if !fits {
                arena.abort(me);
                return Err(Error::InvalidMessage(format!(
                    "{what}: rank {r}'s tensor ({bytes} bytes at offset {offset}) does not \
                     lie in the {}-byte storage it shared; the group is now failed",
                    g.len()
                )));
            }
            bases.push(g.ptr().wrapping_add(offset));
        }
        let n = t.numel();
        // Every base points at `n` elements of a mapped, writable host storage (checked
        // above; aligned: storages are 64-byte aligned and offsets multiples of the
        // element size); by the protocol, between the barriers around this phase a piece
        // claimed from the arena's counter is this rank's alone in every tensor.
        match kind {
            Kind::AllReduce(op) => {
                let piece = PIECE_BYTES / size;
                let next = || claim(arena.pieces(), piece, n);
                // SAFETY: as said above.
                unsafe { reduce_dtype(t.dtype(), &bases, next, op, p) }
            }
            Kind::Broadcast(src) => {
                let next = || claim(arena.pieces(), PIECE_BYTES, bytes);
                // SAFETY: as said above, in bytes.
                unsafe { copy_into_all(&bases, src, next) }
            }
        }
        drop(guards);
        self.sync(st)?;
        Ok(Outcome::Done)
    }

    /// Step 3: the fresh ranks send their storages, every rank receives the others';
    /// `false` when some rank failed (every rank then takes the arena path).
    fn exchange(&self, st: &mut State, me: usize, t: &Tensor, notes: &[NoteView]) -> Result<bool> {
        let arena = &self.arena;
        let p = arena.world_size();
        let epoch = st.epoch;
        if notes[me].fresh {
            let sent = (0..p).filter(|&q| q != me).try_for_each(|q| {
                let offer = Offer {
                    rank: me as u32,
                    epoch,
                    slot: notes[me].slot as u32,
                    tensor: t.clone(),
                };
                send_offer(arena, q, &offer, Self::deadline(st))
            });
            if let Err(e) = sent {
                tracing::debug!(error = %e, "zero-copy exchange: sending failed");
                arena
                    .note(me, Note::SendFailed)
                    .store(epoch.wrapping_add(1), Ordering::Release);
            }
        }
        let mut got: Vec<Option<Storage>> = (0..p).map(|_| None).collect();
        let received = self.receive(st, me, epoch, notes, &mut got)?;
        arena
            .note(me, Note::Received)
            .store(u32::from(received), Ordering::Relaxed);
        self.sync(st)?;
        let all = (0..p).all(|r| arena.note(r, Note::Received).load(Ordering::Relaxed) == 1);
        if all {
            if notes[me].fresh {
                st.zero_copy.mine[notes[me].slot] = Some(t.storage().downgrade());
            }
            for (r, s) in got.into_iter().enumerate() {
                if let Some(s) = s {
                    st.zero_copy.theirs[r][notes[r].slot] = Some(s);
                }
            }
        }
        Ok(all)
    }

    /// Receives the storage of every fresh peer; `false` when one failed to send or
    /// sent something unusable. Errors only for a dead peer or the deadline.
    fn receive(
        &self,
        st: &mut State,
        me: usize,
        epoch: u32,
        notes: &[NoteView],
        got: &mut [Option<Storage>],
    ) -> Result<bool> {
        let arena = &self.arena;
        let deadline = Self::deadline(st);
        let mut waiting: Vec<usize> = (0..notes.len())
            .filter(|&r| r != me && notes[r].fresh)
            .collect();
        let mut ok = true;
        let Some(listener) = st.zero_copy.listener.as_ref() else {
            return Ok(waiting.is_empty());
        };
        while !waiting.is_empty() {
            let peers = &mut st.peers;
            arena.check_peers(|| Self::dead_peer(arena, me, peers))?;
            waiting.retain(|&r| {
                let failed = arena.note(r, Note::SendFailed).load(Ordering::Acquire)
                    == epoch.wrapping_add(1);
                ok &= !failed;
                !failed
            });
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::timeout(
                    format!(
                        "a collective on rank {me}: ranks {waiting:?} did not send their tensors \
                         within the group's timeout"
                    ),
                    None,
                ));
            }
            let tick = now + LIVENESS_TICK;
            if !wait_fd(
                listener.as_fd(),
                Readiness::Readable,
                Some(deadline.map_or(tick, |d| d.min(tick))),
            )? {
                continue;
            }
            let conn = match rustix::net::accept_with(listener, SocketFlags::CLOEXEC) {
                Ok(c) => c,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(Error::os("accepting a peer's tensor", e)),
            };
            match take_offer(arena, &conn, epoch, notes, &waiting, deadline) {
                Ok(Some((r, storage))) => {
                    waiting.retain(|&w| w != r);
                    got[r] = Some(storage);
                }
                Ok(None) => {} // stale or foreign: not one we wait for
                Err(e) => {
                    tracing::debug!(error = %e, "zero-copy exchange: a bad offer");
                    ok = false;
                    // Who sent it is unknown when it did not decode: stop waiting for
                    // anyone; every rank will take the arena path.
                    waiting.clear();
                }
            }
        }
        Ok(ok)
    }
}

/// Reads one offer from `conn`: the storage and its sender when it is one this rank
/// waits for in this exchange, from that rank's process, and covers the tensor its
/// note describes; `None` for a stale or foreign connection.
fn take_offer(
    arena: &Arena,
    conn: &OwnedFd,
    epoch: u32,
    notes: &[NoteView],
    waiting: &[usize],
    deadline: crate::sys::Deadline,
) -> Result<Option<(usize, Storage)>> {
    let cred = rustix::net::sockopt::socket_peercred(conn)
        .map_err(|e| Error::os("reading a zero-copy peer's credentials", e))?;
    let pid = cred.pid.as_raw_nonzero().get() as u32;
    let Some(&r) = waiting.iter().find(|&&r| arena.pid(r) == pid) else {
        return Ok(None);
    };
    let packet = wire::recv_packet(conn.as_fd(), deadline)?
        .ok_or_else(|| Error::Closed(format!("rank {r} closed its zero-copy connection")))?;
    let offer: Offer = wire::decode(packet)?;
    if offer.epoch != epoch {
        return Ok(None);
    }
    let n = &notes[r];
    let storage = offer.tensor.storage().clone();
    let end = n
        .offset
        .checked_add(n.numel * offer.tensor.dtype().size() as u64);
    let fits = offer.rank as usize == r
        && offer.slot as usize == n.slot
        && storage.device() == Device::Cpu
        && !storage.is_read_only()
        && storage.segment().is_some()
        && end.is_some_and(|e| e <= storage.nbytes() as u64);
    if !fits {
        return Err(Error::InvalidMessage(format!(
            "rank {r} offered a tensor that is not the one its note describes"
        )));
    }
    Ok(Some((r, storage)))
}

/// The next piece of `len` units (elements or bytes), `piece` units each, that no
/// rank has claimed from `counter`: its start and length.
fn claim(counter: &AtomicU32, piece: usize, len: usize) -> Option<(usize, usize)> {
    let i = counter.fetch_add(1, Ordering::Relaxed) as usize;
    let at = i.checked_mul(piece).filter(|&at| at < len)?;
    Some((at, piece.min(len - at)))
}

/// Copies each piece that `claim` hands out (in bytes) from tensor `src` of `bases`
/// into the same bytes of the others.
///
/// # Safety
/// Each base points at a writable tensor at least as long as the pieces reach; no one
/// else reads or writes a claimed piece of any of them now.
unsafe fn copy_into_all(
    bases: &[*mut u8],
    src: usize,
    mut claim: impl FnMut() -> Option<(usize, usize)>,
) {
    while let Some((at, len)) = claim() {
        for (r, &dst) in bases.iter().enumerate() {
            if r != src {
                // SAFETY: the claimed piece is this rank's alone in every tensor; the
                // source and the destination are different tensors.
                unsafe { std::ptr::copy_nonoverlapping(bases[src].add(at), dst.add(at), len) };
            }
        }
    }
}

/// Reduces each piece that `claim` hands out (in elements) of every tensor of `bases`
/// with `op` and writes the result into all of them.
///
/// # Safety
/// Each base points at a writable, aligned tensor of `dtype` at least as long as the
/// pieces reach; no one else reads or writes a claimed piece of any of them now.
unsafe fn reduce_dtype(
    dtype: DType,
    bases: &[*mut u8],
    claim: impl FnMut() -> Option<(usize, usize)>,
    op: ReduceOp,
    p: usize,
) {
    macro_rules! go {
        ($t:ty, $div:expr) => {{
            let tensors: Vec<*mut $t> = bases.iter().map(|b| b.cast::<$t>()).collect();
            let none: Option<fn($t) -> $t> = None;
            // One monomorphic loop per op, so each inlines and vectorises.
            // SAFETY: forwarded from the caller.
            unsafe {
                match op {
                    ReduceOp::Sum => reduce_into_all(&tensors, claim, |a, b| a + b, none),
                    ReduceOp::Mean => reduce_into_all(
                        &tensors,
                        claim,
                        |a, b| a + b,
                        Some(move |x: $t| $div(x, p)),
                    ),
                    ReduceOp::Max => {
                        reduce_into_all(&tensors, claim, |a, b| if b > a { b } else { a }, none)
                    }
                    ReduceOp::Min => {
                        reduce_into_all(&tensors, claim, |a, b| if b < a { b } else { a }, none)
                    }
                }
            }
        }};
    }
    match dtype {
        DType::F32 => go!(f32, |x: f32, p: usize| x / p as f32),
        DType::F64 => go!(f64, |x: f64, p: usize| x / p as f64),
        DType::I32 => go!(i32, |x: i32, p: usize| x.wrapping_div(p as i32)),
        DType::I64 => go!(i64, |x: i64, p: usize| x.wrapping_div(p as i64)),
        _ => {} // refused by the caller
    }
}

/// # Safety
/// As [`reduce_dtype`], for `tensors` of `T`.
unsafe fn reduce_into_all<T: Copy + Default>(
    tensors: &[*mut T],
    mut claim: impl FnMut() -> Option<(usize, usize)>,
    op: impl Fn(T, T) -> T,
    finish: Option<impl Fn(T) -> T>,
) {
    let piece = (PIECE_BYTES / std::mem::size_of::<T>()).max(1);
    let mut buf = vec![T::default(); piece];
    while let Some((at, len)) = claim() {
        let acc = &mut buf[..len.min(piece)];
        let len = acc.len();
        // SAFETY: the claimed piece `at..at + len` is this rank's alone in every tensor
        // (the caller's contract); each slice lives only within its statement's loop, so
        // no piece is viewed as read and written at once.
        unsafe {
            let src = |r: usize| std::slice::from_raw_parts(tensors[r].add(at).cast_const(), len);
            if tensors.len() == 1 {
                acc.copy_from_slice(src(0));
            } else {
                for ((a, x), y) in acc.iter_mut().zip(src(0)).zip(src(1)) {
                    *a = op(*x, *y);
                }
            }
            for r in 2..tensors.len() {
                for (a, x) in acc.iter_mut().zip(src(r)) {
                    *a = op(*a, *x);
                }
            }
            if let Some(finish) = &finish {
                for a in acc.iter_mut() {
                    *a = finish(*a);
                }
            }
            for &t in tensors {
                std::slice::from_raw_parts_mut(t.add(at), len).copy_from_slice(acc);
            }
        }
    }
}
