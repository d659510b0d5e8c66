//! The collectives of a local [`ProcessGroup`](super::ProcessGroup), as the rank's
//! collective thread runs them: each moves its tensor through the [`Arena`] in chunks,
//! phase by phase, with a barrier between phases (see `arena` for the protocol), and
//! send/recv through the sender's slot and the pair's mailbox. An all-reduce or a broadcast
//! of a large tensor first tries `zero_copy`, which all ranks agree to take or not.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

use super::arena::{Arena, Mail, SLOT_BYTES};
use super::group::{Inner, ReduceOp, State};
use super::zero_copy::{Kind, Outcome};
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::sys::Deadline;
use crate::sys::futex;
use crate::tensor::{DType, Tensor};

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
        let bytes = Bytes::of(t, "send")?;
        let deadline = Self::deadline(st);
        let arena = &self.arena;
        let peers = &mut st.peers;
        let sent = arena.mail(me, dst, Mail::Sent);
        for (off, len) in chunks(bytes.len) {
            let s = sent.load(Ordering::Acquire);
            // The previous chunk must be taken before the slot is reused.
            wait_taken(arena, me, dst, s, deadline, peers)?;
            // SAFETY: our slot of set 0 is free (taken == sent, and this rank runs one
            // operation at a time); the tensor range is checked.
            unsafe { arena.copy_in(0, me, 0, bytes.ptr.add(off), len) };
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
    }

    pub(super) fn recv(&self, st: &mut State, t: &Tensor, src: usize) -> Result<()> {
        let me = self.my_rank()?;
        self.check_peer(me, src, "recv from")?;
        check(t, "recv", true)?;
        let bytes = Bytes::of(t, "recv")?;
        let deadline = Self::deadline(st);
        let arena = &self.arena;
        let peers = &mut st.peers;
        let taken = arena.mail(src, me, Mail::Taken);
        for (off, len) in chunks(bytes.len) {
            let k = taken.load(Ordering::Acquire);
            arena.wait_mail((src, me, Mail::Sent), k, deadline, || {
                Self::dead_peer(arena, me, peers)
            })?;
            let sent_len = arena.mail(src, me, Mail::Len).load(Ordering::Relaxed) as usize;
            if sent_len != len {
                arena.abort(me);
                return Err(Error::Tensor(format!(
                    "recv on rank {me}: rank {src} sent a chunk of {sent_len} bytes where this \
                     tensor expects {len} (at byte {off} of {}): send and recv need tensors of \
                     the same size; the group is now failed",
                    bytes.len
                )));
            }
            // SAFETY: the sender filled its slot and waits for `taken` before touching it
            // again; the tensor range is checked and ours to write.
            unsafe { arena.copy_out(0, src, 0, bytes.ptr.add(off), len) };
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
        let bytes = Bytes::of(t, "all_reduce_")?;
        let size = t.dtype().size();
        for (k, (off, len)) in chunks(bytes.len).enumerate() {
            let set = k % 2;
            let n = len / size;
            // This rank reduces elements lo..hi of the chunk, reading its own straight
            // from its tensor: it copies in (and later out) only the rest.
            let (lo, hi) = (me * n / p, (me + 1) * n / p);
            let (lo_b, hi_b) = (lo * size, hi * size);
            // SAFETY: the ranges are inside the tensor's storage (checked by
            // `Bytes::of`, whose guard keeps it mapped); slot `me` is ours during
            // copy-in.
            unsafe {
                let chunk = bytes.ptr.add(off);
                self.arena.copy_in(set, me, 0, chunk, lo_b);
                self.arena
                    .copy_in(set, me, hi_b, chunk.add(hi_b), len - hi_b);
            }
            self.sync(st)?;
            let own = Some((me, bytes.ptr.wrapping_add(off).cast_const()));
            // SAFETY: after the barrier no one writes the slots; elements lo..hi of the
            // result are this rank's alone until the next barrier; the tensor's chunk is
            // checked and not written during the collective.
            unsafe { reduce_dtype(&self.arena, t.dtype(), set, lo..hi, own, op, p) };
            self.sync(st)?;
            // SAFETY: the result is complete and read-only until every rank passes the
            // next barrier; the tensor's range is checked and ours to write.
            unsafe { self.arena.copy_out(set, p, 0, bytes.ptr.add(off), len) };
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
        let bytes = Bytes::of(t, "broadcast_")?;
        for (k, (off, len)) in chunks(bytes.len).enumerate() {
            let set = k % 2;
            if me == src {
                // SAFETY: as in `all_reduce`: our slot, the checked tensor range.
                unsafe { self.arena.copy_in(set, src, 0, bytes.ptr.add(off), len) };
            }
            self.sync(st)?;
            if me != src {
                // SAFETY: src's slot is read-only until the next barrier.
                unsafe { self.arena.copy_out(set, src, 0, bytes.ptr.add(off), len) };
            }
            self.sync(st)?;
        }
        Ok(())
    }

    pub(super) fn all_gather(&self, st: &mut State, out: &Tensor, inp: &Tensor) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        let i = Bytes::of(inp, "all_gather input")?;
        check(out, "all_gather output", true)?;
        let o = Bytes::of(out, "all_gather output")?;
        check_pair(out, inp, o.len, i.len * p, "all_gather", "output", p)?;
        for (k, (off, len)) in chunks(i.len).enumerate() {
            let set = k % 2;
            // SAFETY: as in `all_reduce`.
            unsafe { self.arena.copy_in(set, me, 0, i.ptr.add(off), len) };
            self.sync(st)?;
            for r in 0..p {
                // SAFETY: every slot is read-only until the next barrier; the output
                // range `r * i.len + off .. + len` is inside `o` (checked sizes).
                unsafe {
                    self.arena
                        .copy_out(set, r, 0, o.ptr.add(r * i.len + off), len)
                };
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
        let i = Bytes::of(inp, "reduce_scatter input")?;
        check(out, "reduce_scatter output", true)?;
        let o = Bytes::of(out, "reduce_scatter output")?;
        check_pair(out, inp, i.len, o.len * p, "reduce_scatter", "input", p)?;
        let size = inp.dtype().size();
        let (mine_lo, mine_hi) = (me * o.len, (me + 1) * o.len);
        for (k, (off, len)) in chunks(i.len).enumerate() {
            let set = k % 2;
            // SAFETY: as in `all_reduce`.
            unsafe { self.arena.copy_in(set, me, 0, i.ptr.add(off), len) };
            self.sync(st)?;
            let n = len / size;
            let (lo, hi) = (me * n / p, (me + 1) * n / p);
            // SAFETY: as in `all_reduce`.
            unsafe { reduce_dtype(&self.arena, inp.dtype(), set, lo..hi, None, op, p) };
            self.sync(st)?;
            let (a, b) = (off.max(mine_lo), (off + len).min(mine_hi));
            if a < b {
                // SAFETY: the result is read-only until the next barrier; `a - mine_lo
                // .. b - mine_lo` lies inside the output (its length is `o.len`).
                unsafe {
                    self.arena
                        .copy_out(set, p, a - off, o.ptr.add(a - mine_lo), b - a)
                };
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

/// The bytes of a contiguous tensor, with its storage's guard held.
struct Bytes<'a> {
    _guard: crate::tensor::StorageRead<'a>,
    ptr: *mut u8,
    len: usize,
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
    if !matches!(t.dtype(), DType::F32 | DType::F64 | DType::I32 | DType::I64) {
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

impl<'a> Bytes<'a> {
    /// The bytes of `t`, after [`check`] (`written`: the collective writes them).
    fn of(t: &'a Tensor, what: &str) -> Result<Bytes<'a>> {
        check(t, what, false)?;
        let guard = t.storage().read();
        let start = t.storage_offset() * t.dtype().size();
        let len = t.numel() * t.dtype().size();
        if start.checked_add(len).is_none_or(|end| end > guard.len()) {
            return Err(Error::Tensor(format!(
                "{what}: the tensor's {len} bytes at offset {start} overrun its {}-byte storage",
                guard.len()
            )));
        }
        let ptr = guard.ptr().wrapping_add(start);
        Ok(Bytes {
            _guard: guard,
            ptr,
            len,
        })
    }
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
    (0..len)
        .step_by(SLOT_BYTES)
        .map(move |off| (off, SLOT_BYTES.min(len - off)))
}

/// # Safety
/// As [`Arena::reduce`].
unsafe fn reduce_dtype(
    arena: &Arena,
    dtype: DType,
    set: usize,
    elements: std::ops::Range<usize>,
    own: Option<(usize, *const u8)>,
    op: ReduceOp,
    p: usize,
) {
    let (lo, hi) = (elements.start, elements.end);
    macro_rules! go {
        ($t:ty, $div:expr) => {{
            // One monomorphic loop per op, so each inlines and vectorises.
            let none: Option<fn($t) -> $t> = None;
            match op {
                // SAFETY: forwarded from the caller.
                ReduceOp::Sum => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| a + b,
                        none,
                    )
                },
                // SAFETY: forwarded from the caller.
                ReduceOp::Mean => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| a + b,
                        Some(move |x: $t| $div(x, p)),
                    )
                },
                // SAFETY: forwarded from the caller.
                ReduceOp::Max => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| if b > a { b } else { a },
                        none,
                    )
                },
                // SAFETY: forwarded from the caller.
                ReduceOp::Min => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| if b < a { b } else { a },
                        none,
                    )
                },
            }
        }};
    }
    match dtype {
        DType::F32 => go!(f32, |x: f32, p: usize| x / p as f32),
        DType::F64 => go!(f64, |x: f64, p: usize| x / p as f64),
        DType::I32 => go!(i32, |x: i32, p: usize| x.wrapping_div(p as i32)),
        DType::I64 => go!(i64, |x: i64, p: usize| x.wrapping_div(p as i64)),
        _ => {} // refused by `check`
    }
}
