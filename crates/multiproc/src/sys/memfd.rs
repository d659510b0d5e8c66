//! Anonymous memory files (`memfd_create`), their page reservation and their seals.
//!
//! # Safety
//!
//! No unsafe code. Every memfd is close-on-exec and its pages are reserved
//! (`fallocate`) before anyone maps it, so no access can SIGBUS for lack of memory;
//! received ones are checked for seals before they are mapped.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// Creates a close-on-exec memfd of `len` bytes whose pages are reserved now, so that a
/// later write can never SIGBUS for lack of memory. Sealing is allowed; call
/// [`seal_size`] once the size is final.
pub(crate) fn create(name: &str, len: u64) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| Error::os(format!("memfd_create({name})"), e))?;
    reserve(
        fd.as_fd(),
        len,
        "an anonymous shared-memory segment (memfd)",
        Place::Memfd,
    )?;
    Ok(fd)
}

/// Where a reservation's pages live, for the checks and the error texts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Place {
    /// An anonymous memfd: bounded by memory limits, not by `/dev/shm`.
    Memfd,
    /// A file in `/dev/shm` whose first `header` bytes are multiproc's header.
    DevShm {
        /// Bytes of the header included in the reservation.
        header: u64,
    },
}

/// Reservations at least this large are checked against the memory limits first (a
/// smaller one cannot be what sets off the OOM killer, and the check reads files).
const HEADROOM_CHECK_MIN: u64 = 1 << 20;

/// Sizes `fd` to `len` bytes and reserves its pages (`fallocate`), turning a full
/// filesystem into an error now instead of a SIGBUS later, and a reservation larger
/// than what this process may still commit (see [`memlimit`](super::memlimit)) into an
/// error instead of an OOM kill.
pub(crate) fn reserve(fd: BorrowedFd<'_>, len: u64, what: &str, place: Place) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if len >= HEADROOM_CHECK_MIN {
        if let Some(room) = super::memlimit::headroom() {
            if len > room.bytes {
                return Err(Error::out_of_shared_memory(
                    len,
                    Some(room.bytes),
                    room.source.clone(),
                    format!(
                        "cannot reserve {}{} for {what}: only {} more may be committed under \
                         {}; free memory, raise that limit, or share smaller tensors",
                        human_bytes(len),
                        header_note(len, place),
                        human_bytes(room.bytes),
                        room.source
                    ),
                ));
            }
        }
    }
    match rustix::fs::fallocate(fd, FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(e @ (Errno::NOSPC | Errno::NOMEM)) => Err(no_room(len, what, place, e)),
        Err(Errno::OPNOTSUPP) => {
            // Not every filesystem can reserve; fall back to sizing without reservation.
            rustix::fs::ftruncate(fd, len).map_err(|e| Error::os(format!("ftruncate({len})"), e))
        }
        Err(e) => Err(Error::os(format!("fallocate({len} bytes) for {what}"), e)),
    }
}

/// " (1.0 MiB of data plus its 128-byte header)" for a `/dev/shm` file; empty otherwise.
fn header_note(len: u64, place: Place) -> String {
    match place {
        Place::DevShm { header } if header > 0 => format!(
            " ({} of data plus its {header}-byte header)",
            human_bytes(len.saturating_sub(header))
        ),
        _ => String::new(),
    }
}

/// The error for a reservation the kernel refused for lack of room.
fn no_room(len: u64, what: &str, place: Place, e: Errno) -> Error {
    match place {
        Place::DevShm { .. } => {
            let free = rustix::fs::statvfs("/dev/shm")
                .ok()
                .map(|s| s.f_bavail * s.f_frsize);
            Error::out_of_shared_memory(
                len,
                free,
                "/dev/shm",
                format!(
                    "cannot reserve {}{} for {what}: {}. {}",
                    human_bytes(len),
                    header_note(len, place),
                    free_shm_description(),
                    SHM_ADVICE
                ),
            )
        }
        Place::Memfd => {
            let room = super::memlimit::headroom();
            Error::out_of_shared_memory(
                len,
                room.as_ref().map(|r| r.bytes),
                room.as_ref()
                    .map_or_else(|| "memory".to_string(), |r| r.source.clone()),
                format!(
                    "cannot reserve {} for {what}: the kernel has no memory for it ({e}; {}); \
                     free memory, raise the memory limit, or share smaller tensors",
                    human_bytes(len),
                    room.map_or_else(
                        || "the memory left is unknown".to_string(),
                        |r| format!("{} left under {}", human_bytes(r.bytes), r.source)
                    )
                ),
            )
        }
    }
}

/// How to get more shared memory, for error messages.
pub(crate) const SHM_ADVICE: &str = "Free shared memory, or grow /dev/shm: in docker run with \
     `--shm-size=8g` or `--ipc=host`; elsewhere `mount -o remount,size=8G /dev/shm`";

/// "/dev/shm has 12 MiB free of 16 MiB".
pub(crate) fn free_shm_description() -> String {
    match rustix::fs::statvfs("/dev/shm") {
        Ok(s) => format!(
            "/dev/shm has {} free of {}",
            human_bytes(s.f_bavail * s.f_frsize),
            human_bytes(s.f_blocks * s.f_frsize)
        ),
        Err(e) => format!("the free space of /dev/shm is unknown ({e})"),
    }
}

/// Bytes in the unit a person reads best.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Seals a memfd against shrinking and growing, so a receiver that checked its size
/// can map it without fear of SIGBUS.
pub(crate) fn seal_size(fd: BorrowedFd<'_>) -> Result<()> {
    rustix::fs::fcntl_add_seals(fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| Error::os("sealing a memfd (F_ADD_SEALS)", e))
}

/// Whether `fd` is a memfd sealed against shrinking.
pub(crate) fn is_shrink_sealed(fd: BorrowedFd<'_>) -> bool {
    rustix::fs::fcntl_get_seals(fd).is_ok_and(|s| s.contains(SealFlags::SHRINK))
}

/// The size in bytes of the file behind `fd`.
pub(crate) fn file_size(fd: BorrowedFd<'_>) -> Result<u64> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::os("fstat of a received segment", e))?;
    Ok(st.st_size as u64)
}

/// Seals a memfd against any change (its size and its bytes): a message payload.
pub(crate) fn seal_contents(fd: BorrowedFd<'_>) -> Result<()> {
    rustix::fs::fcntl_add_seals(
        fd,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
    )
    .map_err(|e| Error::os("sealing a memfd's contents (F_ADD_SEALS)", e))
}

/// Whether `fd` is sealed against shrinking and writing; an error when it has no seals
/// at all (not a memfd), with the kernel's reason.
pub(crate) fn is_content_sealed(fd: BorrowedFd<'_>) -> std::result::Result<bool, String> {
    rustix::fs::fcntl_get_seals(fd)
        .map(|s| s.contains(SealFlags::SHRINK | SealFlags::WRITE))
        .map_err(|e| e.to_string())
}

/// The size of the file behind `fd` and how many of its bytes have pages (a sparse
/// file has fewer).
pub(crate) fn size_and_allocated(fd: BorrowedFd<'_>) -> Result<(u64, u64)> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::os("fstat of a memfd", e))?;
    Ok((
        st.st_size.max(0) as u64,
        (st.st_blocks.max(0) as u64).saturating_mul(512),
    ))
}

/// The device and inode of the file behind `fd` (`None` when `fstat` fails).
pub(crate) fn identity(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    rustix::fs::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

/// Writes all of `bytes` at the start of `fd`.
pub(crate) fn write_all_at(fd: BorrowedFd<'_>, mut bytes: &[u8]) -> Result<()> {
    let mut offset = 0u64;
    while !bytes.is_empty() {
        match rustix::io::pwrite(fd, bytes, offset) {
            Ok(0) => return Err(Error::Encode("a memfd accepted no bytes".into())),
            Ok(n) => {
                bytes = &bytes[n..];
                offset += n as u64;
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(Error::os("writing into a memfd", e)),
        }
    }
    Ok(())
}

/// Fills `out` from the start of `fd`; `Ok(n)` with `n < out.len()` when the file
/// ended after `n` bytes.
pub(crate) fn read_at_start(fd: BorrowedFd<'_>, out: &mut [u8]) -> Result<usize> {
    let mut done = 0;
    while done < out.len() {
        match rustix::io::pread(fd, &mut out[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(Error::os("reading a memfd", e)),
        }
    }
    Ok(done)
}

/// The size of the `/dev/shm` mount in bytes (`None` when it cannot be read).
pub(crate) fn dev_shm_size() -> Option<u64> {
    rustix::fs::statvfs("/dev/shm")
        .ok()
        .map(|s| s.f_blocks * s.f_frsize)
}
