//! The collectives of a local [`ProcessGroup`](super::ProcessGroup), as the rank's
//! collective thread runs them: each moves its tensor through the [`Arena`] in chunks,
//! phase by phase, with a barrier between phases (see `arena` for the protocol), and
//! send/recv through the sender's slot and the pair's mailbox. An all-reduce or a broadcast
//! of a large tensor first tries `zero_copy`, which all ranks agree to take or not.
//!
//! The bytes move through the kernels of `tensor::bulk`, between checked views of the
//! tensors ([`HostBytes`]) and of the arena's slots; this file only says which range
//! goes where in which phase, and has no unsafe code.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

use super::arena::{Arena, Mail, SLOT_BYTES};
use super::group::{Inner, ReduceOp, State};
use super::zero_copy::{Call, Kind, Outcome, announce};
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::sys::Deadline;
use crate::sys::futex;
use crate::sys::shared_bytes::SharedBytes;
use crate::tensor::bulk::{self, Combine, HostBytes};
use crate::tensor::{DType, Tensor};

impl ReduceOp {
    /// The elementwise operation of the kernels.
    pub(super) fn combine(self) -> Combine {
        match self {
            ReduceOp::Sum => Combine::Sum,
            ReduceOp::Mean => Combine::Mean,
            ReduceOp::Max => Combine::Max,
            ReduceOp::Min => Combine::Min,
        }
    }
}

impl Inner {
    fn check_peer(&self, me: usize, peer: usize, what: &str) -> Result<()> {
        let p = self.arena.world_size();
        if peer >= p || peer == me {
            return Err(Error::InvalidArgument(format!(
                "{what} rank {peer} from rank {me} in a group of {p} ranks: the peer must be \
                 another rank of the group"
            )));
        }
        Ok(())
    }

    pub(super) fn send(&self, st: &mut State, t: &Tensor, dst: usize) -> Result<()> {
        let me = self.my_rank()?;
        self.check_peer(me, dst, "send to")?;
        self.check_not_ended()?;
        let view = host_bytes(t, "send")?;
        let bytes = view.bytes();
        let deadline = Self::deadline(st);
        let arena = &self.arena;
        let peers = &mut st.peers;
        let sent = arena.mail(me, dst, Mail::Sent);
        let slot = arena.slot(0, me)?;
        for (off, len) in chunks(bytes.len()) {
            let s = sent.load(Ordering::Acquire);
            // The previous chunk must be taken before the slot is reused.
            wait_taken(arena, me, dst, s, deadline, peers).map_err(|e| arena.fail(me, e))?;
            // Our slot of set 0 is free (taken == sent, and this rank runs one operation
            // at a time).
            slot.range(0, len)?.copy_from(&bytes.range(off, len)?)?;
            arena
                .mail(me, dst, Mail::Len)
                .store(len as u32, Ordering::Relaxed);
            sent.store(s.wrapping_add(1), Ordering::Release);
            futex::wake_all(sent);
        }
        // Return once the last chunk is out of our slot.
        wait_taken(
            arena,
            me,
            dst,
            sent.load(Ordering::Acquire),
            deadline,
            peers,
        )
        .map_err(|e| arena.fail(me, e))
    }

    /// Fails when the group was ended (see `sync`).
    fn check_not_ended(&self) -> Result<()> {
        match self.arena.aborted_by() {
            Some(rank) => Err(self.arena.ended_by(rank)),
            None => Ok(()),
        }
    }

    /// A barrier, checked like every collective's first (see `zero_copy::Call`): every
    /// rank must be at a barrier too.
    pub(super) fn barrier(&self, st: &mut State) -> Result<()> {
        let me = self.my_rank()?;
        self.check_not_ended()?;
        let call = Call::Barrier;
        announce(&self.arena, me, st.epoch, call, DType::U8, 0);
        self.sync(st)?;
        self.check_calls(st, me, call.word(DType::U8), 0)
    }

    pub(super) fn recv(&self, st: &mut State, t: &Tensor, src: usize) -> Result<()> {
        let me = self.my_rank()?;
        self.check_peer(me, src, "recv from")?;
        self.check_not_ended()?;
        check(t, "recv", true)?;
        let view = host_bytes(t, "recv")?;
        let bytes = view.bytes();
        let deadline = Self::deadline(st);
        let arena = &self.arena;
        let peers = &mut st.peers;
        let taken = arena.mail(src, me, Mail::Taken);
        let slot = arena.slot(0, src)?;
        for (off, len) in chunks(bytes.len()) {
            let k = taken.load(Ordering::Acquire);
            arena
                .wait_mail((src, me, Mail::Sent), k, deadline, || {
                    Self::dead_peer(arena, me, peers)
                })
                .map_err(|e| arena.fail(me, e))?;
            let sent_len = arena.mail(src, me, Mail::Len).load(Ordering::Relaxed) as usize;
            if sent_len != len {
                arena.abort(me);
                return Err(Error::Tensor(format!(
                    "recv on rank {me}: rank {src} sent a chunk of {sent_len} bytes where this \
                     tensor expects {len} (at byte {off} of {}): send and recv need tensors of \
                     the same size; the group is now failed",
                    bytes.len()
                )));
            }
            // The sender filled its slot and waits for `taken` before touching it again.
            bytes.range(off, len)?.copy_from(&slot.range(0, len)?)?;
            taken.store(k.wrapping_add(1), Ordering::Release);
            futex::wake_all(taken);
        }
        Ok(())
    }

    pub(super) fn all_reduce(&self, st: &mut State, t: &Tensor, op: ReduceOp) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        check(t, "all_reduce_", true)?;
        if p == 1 {
            return Ok(()); // every op of one rank's values is those values
        }
        if let Outcome::Done = self.zero_copy(st, me, t, Kind::AllReduce(op))? {
            return Ok(());
        }
        let view = host_bytes(t, "all_reduce_")?;
        let bytes = view.bytes();
        let size = t.dtype().size();
        let arena = &self.arena;
        for (k, (off, len)) in chunks(bytes.len()).enumerate() {
            let set = k % 2;
            let n = len / size;
            let chunk = bytes.range(off, len)?;
            // This rank reduces elements lo..hi of the chunk, reading its own straight
            // from its tensor: it copies in (and later out) only the rest. Slot `me` is
            // ours during copy-in.
            let (lo, hi) = (me * n / p, (me + 1) * n / p);
            let (lo_b, hi_b) = (lo * size, hi * size);
            let mine = arena.slot(set, me)?;
            mine.range(0, lo_b)?.copy_from(&chunk.range(0, lo_b)?)?;
            mine.range(hi_b, len - hi_b)?
                .copy_from(&chunk.range(hi_b, len - hi_b)?)?;
            self.sync(st)?;
            // After the barrier no one writes the slots; elements lo..hi of the result
            // are this rank's alone until the next barrier; the tensor's chunk is not
            // written during the collective.
            let sources = (0..p)
                .map(|r| {
                    if r == me {
                        Ok(chunk)
                    } else {
                        arena.slot(set, r)
                    }
                })
                .collect::<Result<Vec<SharedBytes<'_>>>>()?;
            let result = arena.slot(set, p)?;
            bulk::reduce(t.dtype(), op.combine(), &sources, result, lo..hi)?;
            self.sync(st)?;
            // The result is complete and read-only until every rank passes the next
            // barrier.
            chunk.copy_from(&result.range(0, len)?)?;
        }
        Ok(())
    }

    pub(super) fn broadcast(&self, st: &mut State, t: &Tensor, src: usize) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        if src >= p {
            return Err(Error::InvalidArgument(format!(
                "broadcast_ from rank {src} in a group of {p} ranks"
            )));
        }
        check(t, "broadcast_", me != src)?;
        if p == 1 {
            return Ok(());
        }
        if let Outcome::Done = self.zero_copy(st, me, t, Kind::Broadcast(src))? {
            return Ok(());
        }
        let view = host_bytes(t, "broadcast_")?;
        let bytes = view.bytes();
        for (k, (off, len)) in chunks(bytes.len()).enumerate() {
            let set = k % 2;
            let slot = self.arena.slot(set, src)?.range(0, len)?;
            let chunk = bytes.range(off, len)?;
            if me == src {
                // As in `all_reduce`: our slot.
                slot.copy_from(&chunk)?;
            }
            self.sync(st)?;
            if me != src {
                // src's slot is read-only until the next barrier.
                chunk.copy_from(&slot)?;
            }
            self.sync(st)?;
        }
        Ok(())
    }

    pub(super) fn all_gather(&self, st: &mut State, out: &Tensor, inp: &Tensor) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        let in_view = host_bytes(inp, "all_gather input")?;
        check(out, "all_gather output", true)?;
        let out_view = host_bytes(out, "all_gather output")?;
        let (i, o) = (in_view.bytes(), out_view.bytes());
        check_pair(out, inp, o.len(), i.len() * p, "all_gather", "output", p)?;
        let call = Call::AllGather;
        let numel = inp.numel() as u64;
        announce(&self.arena, me, st.epoch, call, inp.dtype(), numel);
        for (k, (off, len)) in chunks(i.len()).enumerate() {
            let set = k % 2;
            // As in `all_reduce`.
            self.arena
                .slot(set, me)?
                .range(0, len)?
                .copy_from(&i.range(off, len)?)?;
            self.sync(st)?;
            if k == 0 {
                self.check_calls(st, me, call.word(inp.dtype()), numel)?;
            }
            for r in 0..p {
                // Every slot is read-only until the next barrier.
                o.range(r * i.len() + off, len)?
                    .copy_from(&self.arena.slot(set, r)?.range(0, len)?)?;
            }
            self.sync(st)?;
        }
        Ok(())
    }

    pub(super) fn reduce_scatter(
        &self,
        st: &mut State,
        out: &Tensor,
        inp: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        let in_view = host_bytes(inp, "reduce_scatter input")?;
        check(out, "reduce_scatter output", true)?;
        let out_view = host_bytes(out, "reduce_scatter output")?;
        let (i, o) = (in_view.bytes(), out_view.bytes());
        check_pair(out, inp, i.len(), o.len() * p, "reduce_scatter", "input", p)?;
        let size = inp.dtype().size();
        let (mine_lo, mine_hi) = (me * o.len(), (me + 1) * o.len());
        let arena = &self.arena;
        let call = Call::ReduceScatter(op);
        let numel = inp.numel() as u64;
        announce(arena, me, st.epoch, call, inp.dtype(), numel);
        for (k, (off, len)) in chunks(i.len()).enumerate() {
            let set = k % 2;
            // As in `all_reduce`.
            arena
                .slot(set, me)?
                .range(0, len)?
                .copy_from(&i.range(off, len)?)?;
            self.sync(st)?;
            if k == 0 {
                self.check_calls(st, me, call.word(inp.dtype()), numel)?;
            }
            let n = len / size;
            let (lo, hi) = (me * n / p, (me + 1) * n / p);
            // As in `all_reduce`.
            let sources = (0..p)
                .map(|r| arena.slot(set, r))
                .collect::<Result<Vec<SharedBytes<'_>>>>()?;
            let result = arena.slot(set, p)?;
            bulk::reduce(inp.dtype(), op.combine(), &sources, result, lo..hi)?;
            self.sync(st)?;
            let (a, b) = (off.max(mine_lo), (off + len).min(mine_hi));
            if a < b {
                // The result is read-only until the next barrier.
                o.range(a - mine_lo, b - a)?
                    .copy_from(&result.range(a - off, b - a)?)?;
            }
        }
        Ok(())
    }
}

/// Waits until `dst` has taken every chunk up to `sent` from `src`'s mailbox.
fn wait_taken(
    arena: &Arena,
    src: usize,
    dst: usize,
    sent: u32,
    deadline: Deadline,
    peers: &mut [Option<OwnedFd>],
) -> Result<()> {
    let taken = arena.mail(src, dst, Mail::Taken);
    loop {
        let k = taken.load(Ordering::Acquire);
        if k == sent {
            return Ok(());
        }
        arena.wait_mail((src, dst, Mail::Taken), k, deadline, || {
            Inner::dead_peer(arena, src, peers)
        })?;
    }
}

/// Refuses a tensor the collectives cannot move: not contiguous, of a dtype they do not
/// reduce, in device memory, or (when the collective writes it) read-only.
fn check(t: &Tensor, what: &str, written: bool) -> Result<()> {
    if !t.is_contiguous() {
        return Err(Error::Tensor(format!(
            "{what} needs a contiguous tensor (shape {:?}, strides {:?}): call .contiguous() first",
            t.shape(),
            t.strides()
        )));
    }
    if !bulk::reduces(t.dtype()) {
        return Err(Error::Tensor(format!(
            "{what} supports f32, f64, i32 and i64 tensors, not {}",
            t.dtype()
        )));
    }
    if t.device() != Device::Cpu {
        return Err(Error::Tensor(format!(
            "{what} moves host tensors through shared memory, not one on {}: copy it to the \
             CPU first",
            t.device()
        )));
    }
    if written {
        t.storage().check_writable(what)?;
    }
    Ok(())
}

/// The bytes of `t`, after [`check`] (which [`HostBytes`] leaves to its caller).
fn host_bytes<'a>(t: &'a Tensor, what: &str) -> Result<HostBytes<'a>> {
    check(t, what, false)?;
    HostBytes::of_tensor(t, what)
}

fn check_pair(
    out: &Tensor,
    inp: &Tensor,
    have: usize,
    want: usize,
    what: &str,
    which: &str,
    p: usize,
) -> Result<()> {
    if out.dtype() != inp.dtype() || have != want {
        return Err(Error::Tensor(format!(
            "{what}: the {which} must hold {p} times the other's elements of the same dtype \
             (output {:?} {}, input {:?} {})",
            out.shape(),
            out.dtype(),
            inp.shape(),
            inp.dtype()
        )));
    }
    Ok(())
}

/// `(offset, length)` of each chunk of a `len`-byte transfer.
fn chunks(len: usize) -> impl Iterator<Item = (usize, usize)> {
    // One chunk at least, empty for an empty tensor: every rank passes the same
    // barriers whatever its size, so a collective of nothing still keeps the ranks in
    // step (and a send of nothing still waits for its recv).
    (0..len.max(1))
        .step_by(SLOT_BYTES)
        .map(move |off| (off, SLOT_BYTES.min(len - off)))
}
