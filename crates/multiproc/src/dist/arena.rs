//! The shared segment of a local [`ProcessGroup`](super::ProcessGroup): control words,
//! then two sets of per-rank slots and a result area, and the barrier every collective
//! is built from.
//!
//! Layout (one sealed memfd, mapped by every rank):
//!
//! ```text
//! page 0       control words: magic, world size, slot bytes, barrier count and
//!              generation, abort word, zero-copy piece counter, the pid of each rank
//! set 0        slot[0] .. slot[P-1], result        (SLOT_BYTES each)
//! set 1        slot[0] .. slot[P-1], result
//! mailboxes    for each ordered pair (src, dst): chunks sent, chunks taken, length
//! notes        for each rank, one cache line of words describing its next zero-copy
//!              all-reduce (see `zero_copy`): its tensor's size and where peers find it
//! ```
//!
//! send/recv moves a chunk through the sender's slot of set 0: the sender waits until
//! its previous chunk was taken, copies in, bumps `sent`; the receiver waits for `sent`
//! to move, checks the length, copies out, bumps `taken`. The sender returns only once
//! its last chunk was taken, so its slot is free again for the next operation (each
//! rank runs one operation at a time).
//!
//! A collective moves its data in chunks of at most `SLOT_BYTES`; chunk `k` uses set
//! `k % 2`. Within a chunk every phase ends with a barrier, and the protocol gives each
//! byte one writer per phase: a rank writes only its own slot while copying in, only its
//! own slice of the result while reducing, and nothing shared while copying out. With
//! two sets, the copy-in of chunk `k + 2` (after chunk `k + 1`'s first barrier) cannot
//! overlap anyone's copy-out of chunk `k` (before that same barrier).
//!
//! The protocol is what the bulk kernels (`tensor::bulk`) rely on when they read and
//! write the slots: the control words are only touched as atomics, and slot and result
//! bytes are memory other processes write, reached only as checked
//! [`SharedBytes`] of the segment's [`SharedArea`] (this
//! file has no unsafe code). A rank that breaks the protocol (a bug, or a hostile
//! process holding the fd) can make the values wrong; it cannot make this process read
//! outside the mapping, which every word and range is checked against.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::shm::SharedArea;
use crate::sys::Deadline;
use crate::sys::futex;
use crate::sys::memfd;
use crate::sys::process as sysproc;
use crate::sys::shared_bytes::SharedBytes;

/// Bytes per slot: the chunk a collective moves per round.
pub(crate) const SLOT_BYTES: usize = 4 << 20;
/// The most ranks a local group holds (one pid word each in the control page).
pub(crate) const MAX_RANKS: usize = 512;
const CONTROL_BYTES: usize = 4096;
const MAGIC: u32 = 0x6d70_6467; // "mpdg"

const W_MAGIC: usize = 0;
const W_WORLD: usize = 1;
const W_ARRIVED: usize = 2;
const W_GENERATION: usize = 3;
/// 0, or 1 + the rank whose death or failure ended the group.
const W_ABORT: usize = 4;
/// The next piece of a zero-copy collective to claim (see `zero_copy`).
const W_PIECES: usize = 5;
const W_PIDS: usize = 16;

/// The words of one mailbox (one per ordered pair of ranks) of send/recv.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mail {
    /// Chunks the sender has put in its slot.
    Sent = 0,
    /// Chunks the receiver has copied out.
    Taken = 1,
    /// The byte length of the chunk in flight, for the receiver to check.
    Len = 2,
}

/// The words of one rank's note (see `zero_copy`), one cache line per rank so that
/// ranks writing their own do not contend.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Note {
    /// 1 when this rank can take part in a zero-copy all-reduce this time, else 0.
    Ready = 0,
    /// The tensor's dtype (its `DType` index) and element count (low, high words).
    DType = 1,
    NumelLo = 2,
    NumelHi = 3,
    /// Byte offset of the tensor in its storage (low, high words).
    OffsetLo = 4,
    OffsetHi = 5,
    /// The peers' cache slot that holds this rank's storage.
    Slot = 6,
    /// 1 when this rank sends its storage to every peer this time (a new slot).
    Fresh = 7,
    /// Slots whose storage this rank dropped: peers drop their mapping (a bit mask).
    Evicted = 8,
    /// 1 + the barrier epoch of an exchange in which this rank failed to send.
    SendFailed = 9,
    /// 1 when this rank received every fresh peer's storage, else 0.
    Received = 10,
    /// The barrier epoch at which this rank made its call (see `zero_copy::Call`):
    /// ranks in step made their calls at the same one.
    Epoch = 11,
}

/// Words per rank note: a cache line.
const NOTE_WORDS: usize = 16;

/// How often a waiting rank checks that its peers are alive.
pub(crate) const LIVENESS_TICK: Duration = Duration::from_millis(20);

/// One rank's mapping of the group segment.
#[derive(Debug)]
pub(crate) struct Arena {
    fd: OwnedFd,
    area: SharedArea,
    world_size: usize,
}

impl Arena {
    /// Where the mailboxes of send/recv start: after the slots.
    fn mailbox_offset(world_size: usize) -> usize {
        CONTROL_BYTES + 2 * (world_size + 1) * SLOT_BYTES
    }

    fn mail_bytes(world_size: usize) -> usize {
        (world_size * world_size * 12).div_ceil(4096) * 4096
    }

    /// Where the per-rank notes of zero-copy collectives start: after the mailboxes.
    fn notes_offset(world_size: usize) -> usize {
        Self::mailbox_offset(world_size) + Self::mail_bytes(world_size)
    }

    fn bytes_for(world_size: usize) -> usize {
        let notes = (world_size * NOTE_WORDS * 4).div_ceil(4096) * 4096;
        Self::notes_offset(world_size) + notes
    }

    /// A new segment for `world_size` ranks.
    pub(crate) fn create(world_size: usize) -> Result<Arena> {
        if world_size == 0 || world_size > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "a local process group holds 1..={MAX_RANKS} ranks, not {world_size}"
            )));
        }
        let len = Self::bytes_for(world_size);
        let fd = memfd::create("multiproc-group", len as u64)?;
        memfd::seal_size(fd.as_fd())?;
        let area = SharedArea::map(fd.as_fd(), len)?;
        let arena = Arena {
            fd,
            area,
            world_size,
        };
        arena
            .word(W_WORLD)
            .store(world_size as u32, Ordering::Relaxed);
        arena.word(W_MAGIC).store(MAGIC, Ordering::Release);
        Ok(arena)
    }

    /// Maps a received segment, checking that it is one.
    pub(crate) fn open(fd: OwnedFd) -> Result<Arena> {
        let bad = |what: String| Error::InvalidMessage(format!("process group handle: {what}"));
        if !memfd::is_shrink_sealed(fd.as_fd()) {
            return Err(bad("not a sealed multiproc memfd".into()));
        }
        let size = memfd::file_size(fd.as_fd())? as usize;
        if size < CONTROL_BYTES {
            return Err(bad(format!("{size} bytes is too small")));
        }
        let control = SharedArea::map(fd.as_fd(), CONTROL_BYTES)?;
        let magic = control.atomic_u32(W_MAGIC * 4).load(Ordering::Acquire);
        let world = control.atomic_u32(W_WORLD * 4).load(Ordering::Relaxed) as usize;
        drop(control);
        if magic != MAGIC || world == 0 || world > MAX_RANKS {
            return Err(bad(format!(
                "magic {magic:#x} and world size {world} are not a group's"
            )));
        }
        let len = Self::bytes_for(world);
        if size < len {
            return Err(bad(format!(
                "{size} bytes, fewer than the {len} of {world} ranks"
            )));
        }
        let area = SharedArea::map(fd.as_fd(), len)?;
        Ok(Arena {
            fd,
            area,
            world_size: world,
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    fn word(&self, index: usize) -> &AtomicU32 {
        assert!(
            index < CONTROL_BYTES / 4,
            "control word {index} out of range"
        );
        self.area.atomic_u32(index * 4)
    }

    /// Claims `rank` for this process: its pid goes in the rank's word.
    pub(crate) fn register(&self, rank: usize) -> Result<()> {
        let me = sysproc::current_pid() as u32;
        let word = self.word(W_PIDS + rank);
        match word.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(pid) if pid == me => Ok(()),
            Err(pid) => Err(Error::InvalidArgument(format!(
                "rank {rank} of this process group is already taken by pid {pid}: \
                 each process joins with its own RANK"
            ))),
        }
    }

    /// The pid registered for `rank` (0: not yet).
    pub(crate) fn pid(&self, rank: usize) -> u32 {
        self.word(W_PIDS + rank).load(Ordering::Acquire)
    }

    /// The counter through which ranks claim the pieces of a zero-copy collective.
    pub(crate) fn pieces(&self) -> &AtomicU32 {
        self.word(W_PIECES)
    }

    /// Marks the group failed because of `rank`, and wakes every waiter.
    pub(crate) fn abort(&self, rank: usize) {
        let _ = self.word(W_ABORT).compare_exchange(
            0,
            rank as u32 + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        futex::wake_all(self.word(W_GENERATION));
    }

    /// The rank whose failure ended the group, if one did.
    pub(crate) fn aborted_by(&self) -> Option<usize> {
        match self.word(W_ABORT).load(Ordering::Acquire) {
            0 => None,
            r => Some(r as usize - 1),
        }
    }

    /// Waits until all ranks have called `barrier` for the `epoch`-th time (this rank's
    /// count of barriers passed). `alive(rank)` says whether a peer still runs; it is
    /// asked every [`LIVENESS_TICK`] while waiting.
    pub(crate) fn barrier(
        &self,
        epoch: u32,
        deadline: Deadline,
        dead_peer: impl FnMut() -> Option<usize>,
    ) -> Result<()> {
        let p = self.world_size as u32;
        let target = epoch.wrapping_add(1).wrapping_mul(p);
        let generation = self.word(W_GENERATION);
        let arrived = self
            .word(W_ARRIVED)
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1);
        if arrived == target {
            generation.store(epoch.wrapping_add(1), Ordering::Release);
            futex::wake_all(generation);
            return Ok(());
        }
        self.wait_while(generation, epoch, deadline, dead_peer, || {
            let now_arrived = self.word(W_ARRIVED).load(Ordering::Acquire);
            timed_out(self.world_size, now_arrived, target)
        })
    }

    /// Waits while `word` holds `value`: spins briefly, then sleeps on the futex in
    /// [`LIVENESS_TICK`] slices, checking between them whether the group was aborted or
    /// `dead_peer` finds a peer gone (then it aborts the group). Every wait of the
    /// group goes through here.
    fn wait_while(
        &self,
        word: &AtomicU32,
        value: u32,
        deadline: Deadline,
        mut dead_peer: impl FnMut() -> Option<usize>,
        timed_out: impl FnOnce() -> Error,
    ) -> Result<()> {
        let passed = || word.load(Ordering::Acquire) != value;
        if futex::spin_until(deadline, passed) {
            return Ok(());
        }
        loop {
            if passed() {
                return Ok(());
            }
            if let Some(rank) = self.aborted_by() {
                return Err(self.ended_by(rank));
            }
            if let Some(rank) = dead_peer() {
                // A peer that ended this wait (the last to arrive at a barrier) may exit
                // at once: it changed the word before it exited, so a look after its
                // exit was seen tells a finished wait from a peer that died in it.
                if passed() {
                    return Ok(());
                }
                self.abort(rank);
                return Err(self.died(rank, "it exited"));
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(timed_out());
            }
            let tick = now + LIVENESS_TICK;
            let until = Some(deadline.map_or(tick, |d| d.min(tick)));
            futex::wait(word, value, until)?;
        }
    }

    /// Word `field` of the mailbox from `src` to `dst` (see [`Mail`]).
    pub(crate) fn mail(&self, src: usize, dst: usize, field: Mail) -> &AtomicU32 {
        let p = self.world_size;
        assert!(src < p && dst < p, "mailbox {src}->{dst} out of range");
        let offset = Self::mailbox_offset(p) + ((src * p + dst) * 3 + field as usize) * 4;
        self.area.atomic_u32(offset)
    }

    /// Word `field` of rank `rank`'s note (see [`Note`]).
    pub(crate) fn note(&self, rank: usize, field: Note) -> &AtomicU32 {
        assert!(rank < self.world_size, "note of rank {rank} out of range");
        let offset = Self::notes_offset(self.world_size) + (rank * NOTE_WORDS + field as usize) * 4;
        self.area.atomic_u32(offset)
    }

    /// Sleeps while the mailbox word `field` of `src -> dst` holds `value` (see
    /// [`wait_while`](Self::wait_while)); `peer` is the rank whose death ends the wait.
    pub(crate) fn wait_mail(
        &self,
        (src, dst, field): (usize, usize, Mail),
        value: u32,
        deadline: Deadline,
        dead_peer: impl FnMut() -> Option<usize>,
    ) -> Result<()> {
        let word = self.mail(src, dst, field);
        self.wait_while(word, value, deadline, dead_peer, || {
            Error::timeout(
                format!(
                    "send/recv between ranks {src} and {dst} timed out: every send needs the \
                 matching recv on the other rank"
                ),
                None,
            )
        })
    }

    /// Fails when the group was aborted or `dead_peer` finds a peer gone (then aborts
    /// the group): what a rank that waits outside the arena (on a socket) checks
    /// every [`LIVENESS_TICK`].
    pub(crate) fn check_peers(&self, dead_peer: impl FnOnce() -> Option<usize>) -> Result<()> {
        if let Some(rank) = self.aborted_by() {
            return Err(self.ended_by(rank));
        }
        if let Some(rank) = dead_peer() {
            self.abort(rank);
            return Err(self.died(rank, "it exited"));
        }
        Ok(())
    }

    /// Fails the group because this rank's wait failed (`e`: a peer died or a wait timed
    /// out), and returns `e`: the ranks no longer agree on where they are.
    pub(crate) fn fail(&self, me: usize, e: Error) -> Error {
        self.abort(me);
        e
    }

    /// The error of a call on a group that `rank` ended (see [`abort`](Self::abort)).
    pub(crate) fn ended_by(&self, rank: usize) -> Error {
        let pid = self.pid(rank);
        Error::RankDied {
            rank,
            pid: (pid != 0).then_some(pid),
            message: format!(
                "the process group was ended by rank {rank} (pid {pid}), whose collective \
                 failed (a peer died or stopped answering, a wait timed out, or the ranks \
                 fell out of step): the group cannot be used again; see that rank's own \
                 error, then restart the job"
            ),
        }
    }

    fn died(&self, rank: usize, how: &str) -> Error {
        let pid = self.pid(rank);
        Error::RankDied {
            rank,
            pid: (pid != 0).then_some(pid),
            message: format!(
                "rank {rank} (pid {pid}) of the process group is gone ({how}) while the \
                 others waited for it in a collective: the group cannot continue; see \
                 that rank's own error, then restart the job"
            ),
        }
    }

    /// Slot `slot` (`0..P`, or `P` for the result) of buffer set `set` (`0` or `1`):
    /// [`SLOT_BYTES`] of the segment, which only the protocol above keeps from being
    /// read and written at once.
    pub(crate) fn slot(&self, set: usize, slot: usize) -> Result<SharedBytes<'_>> {
        if set >= 2 || slot > self.world_size {
            return Err(Error::InvalidArgument(format!(
                "internal error: slot {slot} of set {set} in a group of {} ranks",
                self.world_size
            )));
        }
        let offset = CONTROL_BYTES + (set * (self.world_size + 1) + slot) * SLOT_BYTES;
        self.area.bytes(offset, SLOT_BYTES)
    }
}

fn timed_out(world: usize, arrived: u32, target: u32) -> Error {
    let missing = target.wrapping_sub(arrived) as usize;
    Error::timeout(
        format!(
            "a process group collective timed out with {missing} of {world} ranks not arrived: \
         every rank must call the same collectives in the same order (raise the group's \
         timeout if they are only slow)"
        ),
        None,
    )
}
