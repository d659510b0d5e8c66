//! This process's limit on open fds (`RLIMIT_NOFILE`): reading it, and raising the soft
//! limit to the hard one.
//!
//! # Safety
//!
//! No unsafe code: `getrlimit` and `setrlimit` through rustix, on this process only.
//!
//! Every memfd block a process maps holds an fd (the blocks it pools, and each received
//! one while a tensor on it lives or while it is kept mapped for reuse), so the default
//! soft limit (often 1,024) is what a program holding many large tensors meets first;
//! the hard limit is as far as an unprivileged process may go.

use rustix::process::{Resource, Rlimit};

/// The soft and hard `RLIMIT_NOFILE` (`None` for unlimited).
pub(crate) fn soft_and_hard() -> (Option<u64>, Option<u64>) {
    let limit = rustix::process::getrlimit(Resource::Nofile);
    (limit.current, limit.maximum)
}

/// Raises the soft limit to the hard one. Best effort: a failure leaves the limit as it
/// was (the fd-limit errors then say how far it is).
pub(crate) fn raise_soft_to_hard() {
    let (soft, hard) = soft_and_hard();
    if soft != hard {
        let _ = rustix::process::setrlimit(
            Resource::Nofile,
            Rlimit {
                current: hard,
                maximum: hard,
            },
        );
    }
}
