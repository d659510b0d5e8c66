//! Files by fd or by path: what `fstat` says about an fd, opening and unlinking a
//! shared-memory file's name.
//!
//! # Safety
//!
//! No unsafe code: `fstat` and `unlink` through rustix, which take a borrowed fd or a
//! path and return owned values, so nothing here can touch memory it does not own.
//!
//! An fd that came from another process may be anything (a pipe, a socket, a device):
//! callers decide what to map from [`FileStatus`], never from the fd's own claims.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// What `fstat` reports about the file behind an fd, in the units callers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileStatus {
    /// Whether it is a regular file (not a pipe, socket, device or directory).
    pub is_regular_file: bool,
    /// `st_mode`: the file type and permission bits, for error texts.
    pub mode: u32,
    /// Its size in bytes.
    pub size: u64,
    /// The device it lives on; with [`ino`](Self::ino), the file's identity.
    pub dev: u64,
    /// Its inode number.
    pub ino: u64,
    /// Its owner's user id.
    pub uid: u32,
}

/// `fstat` of `fd`; `what` names the file in the error (`fstat of <what>`).
pub(crate) fn status(fd: BorrowedFd<'_>, what: &str) -> Result<FileStatus> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::os(format!("fstat of {what}"), e))?;
    Ok(FileStatus {
        is_regular_file: FileType::from_raw_mode(st.st_mode) == FileType::RegularFile,
        mode: st.st_mode,
        size: st.st_size.max(0) as u64,
        dev: st.st_dev,
        ino: st.st_ino,
        uid: st.st_uid,
    })
}

/// Opens the `/dev/shm` file `path` read-write, close-on-exec, never through a symbolic
/// link (`ELOOP` then): a new one (`create`: it must not exist, and is made 0600, only
/// for this user) or an existing one.
pub(crate) fn open_shm_file(path: &str, create: bool) -> std::result::Result<OwnedFd, Errno> {
    let base = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    if create {
        rustix::fs::open(
            path,
            base | OFlags::CREATE | OFlags::EXCL,
            Mode::RUSR | Mode::WUSR,
        )
    } else {
        rustix::fs::open(path, base, Mode::empty())
    }
}

/// The effective user id of this process (who owns the files it creates).
pub(crate) fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Removes the name `path`: `Ok(true)` when it was removed, `Ok(false)` when nothing had
/// that name (someone else removed it first), else the kernel's reason.
pub(crate) fn unlink_if_present(path: impl AsRef<Path>) -> std::result::Result<bool, Errno> {
    match rustix::fs::unlink(path.as_ref()) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "fstat and unlink are foreign functions Miri cannot run"
    )]
    fn a_file_has_a_status_and_its_name_goes_once() {
        let path = std::env::temp_dir().join(format!("mp-sys-fs-{}", std::process::id()));
        std::fs::write(&path, b"four").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let st = status(file.as_fd(), "a test file").unwrap();
        assert!(st.is_regular_file);
        assert_eq!(st.size, 4);
        assert_eq!(unlink_if_present(&path), Ok(true));
        assert_eq!(unlink_if_present(&path), Ok(false));
        assert_eq!(status(file.as_fd(), "a test file").unwrap().ino, st.ino);
    }

    #[test]
    #[cfg_attr(miri, ignore = "fstat is a foreign function Miri cannot run")]
    fn a_pipe_is_not_a_regular_file() {
        let (reader, _writer) = rustix::pipe::pipe().unwrap();
        assert!(!status(reader.as_fd(), "a pipe").unwrap().is_regular_file);
    }
}
