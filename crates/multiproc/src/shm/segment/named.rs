//! The named backend: a file in `/dev/shm` (0600, created with `O_EXCL | O_NOFOLLOW`)
//! whose 64-byte header holds a cross-process refcount — one reference per process that
//! maps it, one per message in flight — and whose last user unlinks it.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use rustix::io::Errno;

use super::super::name::{SegmentName, shm_path};
use super::{Attachment, Backing, Segment, pid};
use crate::error::{Error, Result};
use crate::sys::mmap::SharedMapping;
use crate::sys::{fs, lease, memfd};

/// Bytes before the data of a named segment.
pub(crate) const HEADER_LEN: usize = 64;
/// `b"MPSHMSEG"` as a little-endian u64.
const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"MPSHMSEG");
/// The header layout version; a segment of another version is refused.
const HEADER_VERSION: u32 = 1;
/// [`Header::kind`] of a plain named segment.
const KIND_PLAIN: u32 = 0;
/// [`Header::kind`] of a named block (see the blocks of `segment`).
const KIND_BLOCK: u32 = 1;

/// The header at the start of a named segment. All fields are atomics because every
/// process that maps the segment may read or write them at any time.
#[repr(C)]
pub(super) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    /// How many processes hold a reference (one per process that maps it, plus one per
    /// message in flight). Whoever takes it to zero unlinks the name.
    pub(super) refcount: AtomicU32,
    /// Bytes of data after the header.
    data_len: AtomicU64,
    /// Pid of the creator (for diagnostics and `multiproc gc`).
    creator_pid: AtomicU32,
    /// [`KIND_PLAIN`] or [`KIND_BLOCK`]: what the creator made. A receiver refuses a
    /// handle of the other kind (it never trusts this word to accept anything).
    kind: AtomicU32,
    _reserved: [AtomicU32; 8],
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_LEN);

impl Segment {
    /// Creates the named segment `name` with `len` bytes of data, refcount 1 (ours).
    /// On failure nothing is left in `/dev/shm`.
    #[cfg(test)]
    pub(crate) fn create_named(name: SegmentName, len: usize) -> Result<Segment> {
        Segment::create_named_with(name, len, HEADER_LEN)
    }

    /// [`create_named`](Self::create_named); `headers` is how many bytes of it are
    /// headers (this one's, and a block's), for the error that says what did not fit.
    pub(super) fn create_named_with(
        name: SegmentName,
        len: usize,
        headers: usize,
    ) -> Result<Segment> {
        let path = shm_path(&name);
        let total = HEADER_LEN
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument(format!("a {len}-byte segment is too large")))?;
        let fd = fs::open_shm_file(&path, true)
            .map_err(|e| Error::os(format!("creating shared-memory segment {path}"), e))?;
        let made = memfd::reserve(
            fd.as_fd(),
            total as u64,
            &format!("the shared-memory segment {path}"),
            memfd::Place::DevShm {
                header: headers as u64,
            },
        )
        .and_then(|()| {
            // A block's creator maps it with its creator mark (see the blocks of `segment`); the fd is
            // this process's own description, opened here and never sent.
            if headers > HEADER_LEN {
                lease::marked_description(fd.as_fd(), lease::MARK_CREATOR, true).map(drop)?;
            }
            SharedMapping::map(fd.as_fd(), total)
        });
        let mapping = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = fs::unlink_if_present(&path);
                return Err(e);
            }
        };
        let segment = Segment {
            attachment: Attachment::default(),
            mapping,
            data_offset: HEADER_LEN,
            len,
            backing: Backing::Named {
                name,
                owner_pid: AtomicI32::new(pid()),
            },
            is_block: false,
            creator: 0,
            local_uses: AtomicU32::new(0),
        };
        if let Some(h) = segment.named_header() {
            h.data_len.store(len as u64, Ordering::Relaxed);
            h.version.store(HEADER_VERSION, Ordering::Relaxed);
            h.creator_pid.store(pid() as u32, Ordering::Relaxed);
            h.refcount.store(1, Ordering::Relaxed);
            h.magic.store(HEADER_MAGIC, Ordering::Release);
        }
        Ok(segment)
    }

    /// Marks a named segment this process just created as a block (see the blocks of `segment`): its
    /// header says so, and this value holds no reference (the pool's is the one).
    pub(super) fn mark_named_block(&self) {
        if let Backing::Named { owner_pid, .. } = &self.backing {
            owner_pid.store(0, Ordering::Release);
        }
        if let Some(h) = self.named_header() {
            h.kind.store(KIND_BLOCK, Ordering::Release);
        }
    }

    /// Maps the named segment `name` after checking it (a regular file of ours, mode
    /// 0600, with our header, holding at least `claimed` bytes of data). The
    /// in-flight reference the sender took becomes this process's reference; for a
    /// block (`as_block`, from the handle's kind) the message's use holds it instead
    /// (see the blocks of `segment`), and this value holds none.
    pub(crate) fn open_named(name: SegmentName, claimed: u64, as_block: bool) -> Result<Segment> {
        let path = shm_path(&name);
        let fd = match fs::open_shm_file(&path, false) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                return Err(Error::InvalidMessage(format!(
                    "shared-memory segment {path} no longer exists: its last user released it, or the \
                     shm manager removed it after every process that used it had exited"
                )));
            }
            Err(Errno::LOOP) => {
                return Err(Error::InvalidMessage(format!(
                    "{path} is a symbolic link, not a shared-memory segment; refusing to open it"
                )));
            }
            Err(e) => {
                return Err(Error::os(
                    format!("opening shared-memory segment {path}"),
                    e,
                ));
            }
        };
        let st = fs::status(fd.as_fd(), &path)?;
        if !st.is_regular_file || st.uid != fs::effective_uid() || st.mode & 0o077 != 0 {
            return Err(Error::InvalidMessage(format!(
                "{path} is not a private shared-memory segment of this user (uid {}, mode {:o}); \
                 refusing to map it",
                st.uid,
                st.mode & 0o7777
            )));
        }
        let size = st.size;
        let needed = claimed.checked_add(HEADER_LEN as u64);
        if needed.is_none_or(|n| size < n) {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle claims {claimed} bytes but segment {path} holds {}",
                size.saturating_sub(HEADER_LEN as u64)
            )));
        }
        // The whole file is mapped (the size is known to cover the claim and the header);
        // the header then says how much of it is data.
        let total = usize::try_from(size).map_err(|_| {
            Error::InvalidMessage(format!("segment {path} of {size} bytes cannot be mapped"))
        })?;
        if as_block {
            // Mapped with this process's holder mark (see the blocks of `segment`): the description was
            // opened here, by name, and is never sent.
            lease::marked_description(fd.as_fd(), lease::MARK_HOLDER, true).map(drop)?;
        }
        let mapping = SharedMapping::map(fd.as_fd(), total)?;
        let mut segment = Segment {
            attachment: Attachment::default(),
            mapping,
            data_offset: HEADER_LEN,
            len: 0,
            // No reference yet: if a check below fails, dropping must not release the
            // sender's in-flight reference on our behalf.
            backing: Backing::Named {
                name,
                owner_pid: AtomicI32::new(0),
            },
            is_block: false,
            creator: 0,
            local_uses: AtomicU32::new(0),
        };
        let h = segment
            .named_header()
            .ok_or_else(|| Error::InvalidMessage(format!("{path} has no header")))?;
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Relaxed);
        let data_len = h.data_len.load(Ordering::Relaxed);
        if magic != HEADER_MAGIC || version != HEADER_VERSION {
            return Err(Error::InvalidMessage(format!(
                "{path} does not carry a multiproc segment header of version {HEADER_VERSION}"
            )));
        }
        if data_len < claimed || data_len > size - HEADER_LEN as u64 {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle claims {claimed} bytes; the header of {path} says {data_len} \
                 and the file holds {}",
                size - HEADER_LEN as u64
            )));
        }
        if h.refcount.load(Ordering::Acquire) == 0 {
            return Err(Error::InvalidMessage(format!(
                "{path} has no references left (it is being removed); the message that named it \
                 was probably sent twice or forged"
            )));
        }
        let kind = h.kind.load(Ordering::Acquire);
        if kind != if as_block { KIND_BLOCK } else { KIND_PLAIN } {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle names a {} but {path} is a {}",
                if as_block {
                    "pooled block"
                } else {
                    "plain segment"
                },
                if kind == KIND_BLOCK {
                    "pooled block"
                } else {
                    "plain segment"
                },
            )));
        }
        segment.len = data_len as usize;
        if as_block {
            segment.is_block = true;
            if !segment.read_block_header() {
                return Err(Error::InvalidMessage(format!(
                    "a received tensor's handle names a pooled block, but {path} has no block \
                     header"
                )));
            }
        } else {
            segment.adopt_reference();
        }
        Ok(segment)
    }

    pub(super) fn named_header(&self) -> Option<&Header> {
        match self.backing {
            Backing::Named { .. } if self.mapping.len() >= HEADER_LEN => {
                let ptr = self.mapping.as_ptr().cast::<Header>();
                // SAFETY: the mapping is page-aligned and at least HEADER_LEN bytes long and
                // lives as long as `&self`; Header is all atomics, valid for any bit pattern
                // and for concurrent access from other processes.
                Some(unsafe { &*ptr })
            }
            _ => None,
        }
    }

    /// The current cross-process refcount of a named segment (tests).
    #[cfg(test)]
    pub(crate) fn refcount(&self) -> Option<u32> {
        self.named_header()
            .map(|h| h.refcount.load(Ordering::Acquire))
    }

    /// Makes the in-flight reference a message carried this process's own reference.
    fn adopt_reference(&self) {
        if let Backing::Named { owner_pid, .. } = &self.backing {
            owner_pid.store(pid(), Ordering::Release);
        }
    }

    /// Takes a reference on behalf of a message about to carry this named segment's
    /// name. Fails when no reference is left (the name is being removed).
    #[cfg(test)]
    pub(crate) fn acquire_in_flight(&self) -> Result<()> {
        let Some(h) = self.named_header() else {
            return Ok(());
        };
        take_reference(&h.refcount).map_err(|cur| {
            Error::Encode(format!(
                "shared-memory segment {} cannot be sent: its reference count is {cur}",
                self.name().map_or_else(String::new, shm_path)
            ))
        })
    }

    /// Drops one reference of a named segment; the last one unlinks the name and tells
    /// the shm manager. Never goes below zero (a forged count is left alone).
    pub(crate) fn release_reference(&self) {
        let (Some(h), Some(name)) = (self.named_header(), self.name()) else {
            return;
        };
        let Some(last) = drop_reference(&h.refcount) else {
            tracing::warn!(segment = %name, "released a segment whose refcount is already 0");
            return;
        };
        if last {
            self.unlink_name();
        }
    }
}

impl Segment {
    /// Removes a named segment's name from `/dev/shm` and tells the shm manager; for
    /// whoever dropped its last reference.
    pub(super) fn unlink_name(&self) {
        let Some(name) = self.name() else {
            return;
        };
        if let Err(e) = fs::unlink_if_present(shm_path(name)) {
            tracing::warn!(segment = %name, "cannot unlink: {e}");
        }
        super::super::registry::unregister(name);
    }
}

/// Takes one more reference on a cross-process count, unless none is left (the name is
/// being removed) or the count is saturated; `Err(count)` then.
pub(super) fn take_reference(refcount: &AtomicU32) -> std::result::Result<(), u32> {
    let mut cur = refcount.load(Ordering::Acquire);
    loop {
        if cur == 0 || cur == u32::MAX {
            return Err(cur);
        }
        match refcount.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok(()),
            Err(v) => cur = v,
        }
    }
}

/// Drops one reference; `Some(true)` when it was the last one, `None` when the count
/// was already 0 (a forged or doubly released count is left alone, never wrapped).
pub(super) fn drop_reference(refcount: &AtomicU32) -> Option<bool> {
    let mut cur = refcount.load(Ordering::Acquire);
    loop {
        if cur == 0 {
            return None;
        }
        match refcount.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(cur == 1),
            Err(v) => cur = v,
        }
    }
}

impl Segment {
    /// Releases the reference this process holds, if any, so that a process about to
    /// end without running destructors (a worker leaving with `_exit`, whose memory
    /// still holds copies of its parent's handles after a `fork`) leaves no count
    /// behind, and stops pooling a named block it created (its pool's reference goes;
    /// see the blocks of `segment`). The mapping stays valid until the process ends.
    pub(crate) fn release_before_exit(&self) {
        if let Backing::Named { owner_pid, .. } = &self.backing {
            if self.is_own_block() {
                self.unpool();
            }
            let me = pid();
            if owner_pid
                .compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.release_reference();
            }
        }
    }
}

/// The cross-process refcount's logic on process-local memory (runs under Miri).
#[cfg(test)]
mod refcount_tests {
    use super::*;

    #[test]
    fn references_are_counted_and_never_wrap() {
        let count = AtomicU32::new(1);
        assert_eq!(take_reference(&count), Ok(()));
        assert_eq!(drop_reference(&count), Some(false));
        assert_eq!(drop_reference(&count), Some(true), "the last one");
        assert_eq!(drop_reference(&count), None, "never below zero");
        assert_eq!(
            take_reference(&count),
            Err(0),
            "a removed name is not revived"
        );
        let full = AtomicU32::new(u32::MAX);
        assert_eq!(take_reference(&full), Err(u32::MAX), "never wraps");
    }

    #[test]
    fn concurrent_takes_and_drops_balance_and_one_drop_is_the_last() {
        let count = std::sync::Arc::new(AtomicU32::new(1));
        let rounds = if cfg!(miri) { 20 } else { 10_000 };
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let count = std::sync::Arc::clone(&count);
                std::thread::spawn(move || {
                    for _ in 0..rounds {
                        take_reference(&count).unwrap();
                        assert_eq!(drop_reference(&count), Some(false));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(count.load(Ordering::Acquire), 1);
        assert_eq!(drop_reference(&count), Some(true));
    }
}
