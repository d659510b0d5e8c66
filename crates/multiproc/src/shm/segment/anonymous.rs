//! The anonymous backend: a sealed memfd, created here or received (checked before it
//! is mapped). A memfd block (see the blocks of `segment`) is one of these with a block header.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use super::{ARENA_LEN, BLOCK_HEADER_LEN};
use super::{Attachment, Backing, Segment};
use crate::error::{Error, Result};
use crate::sys::mmap::SharedMapping;
use crate::sys::{lease, memfd};

impl Segment {
    /// Creates an anonymous segment of `len > 0` bytes: a memfd whose pages are
    /// reserved and whose size is sealed.
    #[cfg(any(test, feature = "bench-internals"))]
    pub(crate) fn create_anonymous(len: usize) -> Result<Segment> {
        Segment::create_anonymous_marked(len, None)
    }

    /// [`create_anonymous`](Self::create_anonymous), mapped through a description of
    /// its own that carries this process's `mark` (see `sys::lease`) when there is one:
    /// the fd the segment keeps, which messages carry, holds none.
    fn create_anonymous_marked(len: usize, mark: Option<i64>) -> Result<Segment> {
        let fd = memfd::create("multiproc-tensor", len as u64)?;
        memfd::seal_size(fd.as_fd())?;
        let st = crate::sys::fs::status(fd.as_fd(), "a new memfd")?;
        let mapping = match mark {
            Some(byte) => {
                let marked = lease::marked_description(fd.as_fd(), byte, false)?;
                SharedMapping::map(marked.as_fd(), len)?
            }
            None => SharedMapping::map(fd.as_fd(), len)?,
        };
        Ok(Segment {
            attachment: Attachment::default(),
            mapping,
            data_offset: 0,
            len,
            backing: Backing::Anonymous {
                fd: Arc::new(fd),
                dev: st.dev,
                ino: st.ino,
            },
            is_block: false,
            creator: 0,
            local_uses: AtomicU32::new(0),
        })
    }

    /// Creates a block: an anonymous segment of `len > BLOCK_HEADER_LEN` bytes that
    /// starts with a block header (see the blocks of `segment`) with no uses, pooled by this process,
    /// and mapped with this process's creator mark.
    pub(crate) fn create_anonymous_block(len: usize) -> Result<Segment> {
        let mut segment = Segment::create_anonymous_marked(
            len.max(BLOCK_HEADER_LEN + 1),
            Some(lease::MARK_CREATOR),
        )?;
        segment.init_block();
        Ok(segment)
    }

    /// Maps a received memfd after checking it: it must be sealed against shrinking and
    /// hold at least `claimed` bytes. Only the claimed range is mapped (rounded up to a
    /// page): a peer that sends a huge sparse file and claims a little of it costs
    /// this process no more than the claim. The segment is plain, never a block,
    /// whatever its first bytes say.
    #[cfg(test)]
    pub(crate) fn open_anonymous(fd: OwnedFd, claimed: u64) -> Result<Segment> {
        Segment::open_received(fd, claimed, false)
    }

    /// [`open_anonymous`](Self::open_anonymous) for a handle that names a block: the
    /// file must also start with a block header. An arena-sized block is mapped whole
    /// (later storages are carved anywhere in it); a larger one holds one storage and
    /// only the claimed range is mapped.
    pub(crate) fn open_block(fd: OwnedFd, claimed: u64) -> Result<Segment> {
        Segment::open_received(fd, claimed, true)
    }

    fn open_received(fd: OwnedFd, claimed: u64, as_block: bool) -> Result<Segment> {
        let st = crate::sys::fs::status(fd.as_fd(), "a received segment")?;
        if !memfd::is_shrink_sealed(fd.as_fd()) {
            return Err(Error::InvalidMessage(
                "a received tensor's segment is not a memfd sealed against shrinking; \
                 refusing to map it (it could shrink under us and crash this process)"
                    .into(),
            ));
        }
        let size = st.size;
        if size < claimed || size == 0 {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle claims {claimed} bytes but its segment holds {size}"
            )));
        }
        if as_block && size <= BLOCK_HEADER_LEN as u64 {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle names a pooled block, but its segment of {size} \
                 bytes is too short for a block header"
            )));
        }
        let page = crate::sys::mmap::page_size() as u64;
        let wanted = if as_block && size <= ARENA_LEN as u64 {
            size
        } else {
            claimed.max(1).next_multiple_of(page).min(size)
        };
        let len = usize::try_from(wanted).map_err(|_| {
            Error::InvalidMessage(format!(
                "a received segment of {wanted} bytes cannot be mapped"
            ))
        })?;
        // A block is mapped through a description of this process's own that carries
        // its holder mark (see the blocks of `segment`); the received fd, which it may send on, none.
        let mapping = if as_block {
            let marked = lease::marked_description(fd.as_fd(), lease::MARK_HOLDER, false)?;
            SharedMapping::map(marked.as_fd(), len)?
        } else {
            SharedMapping::map(fd.as_fd(), len)?
        };
        let mut segment = Segment {
            attachment: Attachment::default(),
            mapping,
            data_offset: 0,
            len,
            backing: Backing::Anonymous {
                fd: Arc::new(fd),
                dev: st.dev,
                ino: st.ino,
            },
            is_block: as_block,
            creator: 0,
            local_uses: AtomicU32::new(0),
        };
        if as_block && !segment.read_block_header() {
            return Err(Error::InvalidMessage(
                "a received tensor's handle names a pooled block, but its segment has no \
                 block header"
                    .into(),
            ));
        }
        Ok(segment)
    }
}
