//! The system layer: the only place that talks to the kernel directly.
//!
//! # Safety
//!
//! This file has no unsafe code; each submodule says what its unsafe calls rely on.
//!
//! Everything above this module sees owned file descriptors, byte buffers and our
//! [`Error`](crate::Error); everything below is rustix (and, where rustix has no safe
//! wrapper, a few `libc` calls, each with a `// SAFETY:` comment), and, with the `cuda`
//! feature, the CUDA driver through cudarc's FFI (`cuda_driver`). Memory that others
//! may write — mappings, shared tensors — reaches the code that copies it as a
//! checked `shared_bytes::SharedBytes`, never as a reference.
//!
//! Contract: every fd created here is close-on-exec; every fd received from another
//! process is an [`OwnedFd`](std::os::fd::OwnedFd) from the moment it arrives; sockets
//! are non-blocking and every wait goes through [`wait_fd`] with a deadline.

pub(crate) mod abstract_socket;
// The CUDA driver's FFI (feature `cuda`), under `crate::cuda`.
#[cfg(feature = "cuda")]
pub(crate) mod cuda_driver;
pub(crate) mod daemon;
pub(crate) mod fd_limit;
pub(crate) mod fork_local;
// Used by the `cuda` feature's memory (tested either way).
pub(crate) mod file_map;
pub(crate) mod fs;
pub(crate) mod futex;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod lease;
pub(crate) mod memfd;
pub(crate) mod memlimit;
pub(crate) mod mmap;
mod os_errors;
pub(crate) mod peer_lease;
pub(crate) mod process;
// The wake-up path of the `*_async` futures (feature `async`).
#[cfg(feature = "async")]
pub(crate) mod reactor;
// Used by the collectives' kernels, and the `cuda` feature's host copies.
pub(crate) mod shared_bytes;
pub(crate) mod socket;

pub(crate) use socket::{Deadline, Readiness, deadline_after, wait_fd};
