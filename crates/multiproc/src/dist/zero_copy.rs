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
//! The protocol is what the bulk kernels (`tensor::bulk`) rely on in phase 4: a piece
//! of every tensor is read and written only by the rank that claimed it (the counter
//! hands each piece out once), and the tensors' owners do not touch them (the call has
//! not returned). This file has no unsafe code: the tensors reach the kernels as
//! checked views ([`HostBytes`]), made only after every note is checked against the
//! storage it names, so a rank that breaks the protocol can make values wrong, not make
//! this process touch memory outside the mappings.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use super::arena::{Arena, LIVENESS_TICK, Note};
use super::group::{Inner, ReduceOp, State};
use super::peer_tensors::{Offer, SLOTS, send_offer};
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::sys::abstract_socket::{self, Errno, IoMode};
use crate::sys::shared_bytes::SharedBytes;
use crate::sys::{Readiness, wait_fd};
use crate::tensor::bulk::{self, HostBytes, PIECE_BYTES};
use crate::tensor::{DType, Storage, Tensor};
use crate::wire;

/// Tensors smaller than this take the arena path (their copy costs less than a round
/// of notes, and a small tensor is not moved into shared memory behind its owner's
/// back).
pub(crate) const MIN_BYTES: usize = 256 << 10;

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

impl Kind {
    fn call(self) -> Call {
        match self {
            Kind::AllReduce(op) => Call::AllReduce(op),
            Kind::Broadcast(src) => Call::Broadcast(src),
        }
    }
}

/// What a rank called, as its note says: the collective and its argument (the reduce
/// op, or the broadcast's source), beside the tensor's dtype (the note's `DType` word)
/// and its size (`Numel`) and the barrier epoch of the call (`Epoch`). Every collective
/// announces its call before its first barrier and checks every rank's after it
/// ([`Inner::check_calls`]): ranks that made different calls fail alike, and ranks out
/// of step fail the group, instead of reading each other's slots as if they agreed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Call {
    Barrier,
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
}

impl Call {
    /// The note's `DType` word: the dtype's code, the call (4 bits) and its argument.
    pub(super) fn word(self, dtype: DType) -> u32 {
        let (call, arg) = match self {
            Call::Barrier => (0, 0),
            Call::AllReduce(op) => (1, op as u32),
            Call::Broadcast(src) => (2, src as u32),
            Call::AllGather => (3, 0),
            Call::ReduceScatter(op) => (4, op as u32),
        };
        u32::from(dtype.code()) | call << 8 | arg << 12
    }

    /// A note's `DType` word and size in words: "all_reduce_ (Sum) of 6 float32".
    fn describe(word: u32, numel: u64) -> String {
        let arg = word >> 12;
        let op = |a: u32| {
            ["Sum", "Mean", "Max", "Min"]
                .get(a as usize)
                .copied()
                .unwrap_or("an unknown op")
        };
        let dtype = u8::try_from(word & 0xff)
            .ok()
            .and_then(DType::from_code)
            .map_or_else(|| format!("dtype #{}", word & 0xff), |d| d.to_string());
        let tensor = format!("{numel} elements of {dtype}");
        match (word >> 8) & 0xf {
            0 => "barrier".into(),
            1 => format!("all_reduce_ ({}) of {tensor}", op(arg)),
            2 => format!("broadcast_ from rank {arg} of {tensor}"),
            3 => format!("all_gather of {tensor}"),
            4 => format!("reduce_scatter ({}) of {tensor}", op(arg)),
            k => format!("an unknown collective (#{k})"),
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

/// Writes this rank's note for a collective that takes the arena path from the start
/// (every one but `zero_copy`, which writes its own): its call, on `numel` elements of
/// `dtype`, at barrier `epoch`.
pub(super) fn announce(arena: &Arena, me: usize, epoch: u32, call: Call, dtype: DType, numel: u64) {
    let note = NoteView {
        ready: false,
        dtype: call.word(dtype),
        numel,
        offset: 0,
        slot: 0,
        fresh: false,
    };
    write_note(arena, me, &note, 0);
    arena.note(me, Note::Epoch).store(epoch, Ordering::Relaxed);
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
            dtype: kind.call().word(t.dtype()),
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
        arena
            .note(me, Note::Epoch)
            .store(st.epoch, Ordering::Relaxed);
        self.sync(st)?;
        self.check_calls(st, me, mine.dtype, mine.numel)?;

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
        let mut views = Vec::with_capacity(p);
        for (r, storage) in storages.iter().enumerate() {
            let offset = usize::try_from(notes[r].offset).unwrap_or(usize::MAX);
            let view = (offset % size == 0)
                .then(|| HostBytes::of_storage(storage, offset, bytes, what).ok())
                .flatten();
            let Some(view) = view else {
                arena.abort(me);
                return Err(Error::InvalidMessage(format!(
                    "{what}: rank {r}'s tensor ({bytes} bytes at offset {offset}) does not \
                     lie in the {}-byte storage it shared; the group is now failed",
                    storage.nbytes()
                )));
            };
            views.push(view);
        }
        let tensors: Vec<SharedBytes<'_>> = views.iter().map(HostBytes::bytes).collect();
        let n = t.numel();
        // Every view is `n` elements of a mapped, writable host storage (checked above;
        // aligned: storages are 64-byte aligned and offsets multiples of the element
        // size, which the kernels check again); by the protocol, between the barriers
        // around this phase a piece claimed from the arena's counter is this rank's
        // alone in every tensor.
        let moved = match kind {
            Kind::AllReduce(op) => {
                let piece = PIECE_BYTES / size;
                let next = || claim(arena.pieces(), piece, n);
                bulk::reduce_into_all(t.dtype(), op.combine(), &tensors, next)
            }
            Kind::Broadcast(src) => {
                let next = || claim(arena.pieces(), PIECE_BYTES, bytes);
                bulk::copy_into_all(&tensors, src, next)
            }
        };
        if let Err(e) = moved {
            arena.abort(me);
            return Err(e);
        }
        drop(tensors);
        drop(views);
        self.sync(st)?;
        Ok(Outcome::Done)
    }

    /// Step 2's check, after the first barrier of every collective: each rank's note
    /// must name the call this rank made (`word`, on `numel` elements) at the same
    /// barrier epoch. Different calls at the same epoch: every rank sees the same notes
    /// and fails alike, after one more barrier (so that a fast rank does not write its
    /// next note before a slow one has read this one), and the group goes on. Different
    /// epochs: the ranks are out of step (one of them called a collective the others did
    /// not), which no barrier can mend: the group is failed.
    pub(super) fn check_calls(
        &self,
        st: &mut State,
        me: usize,
        word: u32,
        numel: u64,
    ) -> Result<()> {
        let arena = &self.arena;
        // The epoch this call's first barrier had (`sync` has counted it since).
        let epoch = st.epoch.wrapping_sub(1);
        for r in 0..arena.world_size() {
            let n = read_note(arena, r);
            let theirs = arena.note(r, Note::Epoch).load(Ordering::Relaxed);
            if theirs != epoch {
                arena.abort(me);
                return Err(Error::InvalidArgument(format!(
                    "collective on rank {me}: rank {r} is out of step (its call, {}, came at \
                     barrier {theirs}, this rank's, {}, at barrier {epoch}): every rank must \
                     make the same collective calls in the same order; the group is now failed",
                    Call::describe(n.dtype, n.numel),
                    Call::describe(word, numel)
                )));
            }
            if n.dtype != word || n.numel != numel {
                self.sync(st)?;
                return Err(Error::Tensor(format!(
                    "collective on rank {me}: rank {r} called {}, rank {me} {}: every rank must \
                     make the same call (the same collective and argument, on a tensor of the \
                     same size and dtype)",
                    Call::describe(n.dtype, n.numel),
                    Call::describe(word, numel)
                )));
            }
        }
        Ok(())
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
            let conn = match abstract_socket::accept(listener.as_fd(), IoMode::Blocking) {
                Ok(c) => c,
                Err(Errno::AGAIN) => continue, // it went before it was accepted: wait again
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
    let pid = abstract_socket::peer_credentials(conn.as_fd())
        .map_err(|e| Error::os("reading a zero-copy peer's credentials", e))?
        .pid;
    let Some(&r) = waiting.iter().find(|&&r| arena.pid(r) == pid) else {
        return Ok(None);
    };
    let packet = wire::recv_packet(conn.as_fd(), deadline)?
        .ok_or_else(|| Error::Closed(format!("rank {r} closed its zero-copy connection")))?;
    let offer: Offer = wire::decode(packet, &crate::shm::Returns::plain())?;
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
