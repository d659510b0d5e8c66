//! The launcher: one long-lived thread per process that makes every direct child.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked a child exits, not when the
//! process does. Users start workers from short-lived threads (test threads, thread
//! pools), and a worker must not be killed because the thread that started it returned.
//! So every fork — for `Spawn` (fork + exec), for `Fork` and for the fork server —
//! happens on this one thread, which lives until the process exits: then, and only
//! then, the children get their SIGKILL.
//!
//! Invariant: a launch request is answered with the child's pid and a pidfd opened
//! before the child can have been reaped, so the pidfd names exactly that child.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{Receiver, Sender, channel};

use crate::error::{Error, Result};
use crate::sys::process as sys;

/// A started direct child.
#[derive(Debug)]
pub(crate) struct Launched {
    pub pid: i32,
    pub pidfd: OwnedFd,
}

/// What to start.
pub(crate) enum Launch {
    /// Re-execute this program with `env`, passing `fd` (its number goes in the
    /// environment under `fd_var`).
    Exec {
        env: Vec<(String, String)>,
        fd_var: &'static str,
        fd: OwnedFd,
    },
    /// Fork; the child runs `run` and exits with the code it returns. The child is
    /// single-threaded (only the launcher thread is copied); `run` was made, and its
    /// captures allocated, before the fork.
    Fork { run: ForkedJob },
}

/// What a forked child runs (its exit code is the result).
pub(crate) type ForkedJob = Box<dyn FnOnce() -> i32 + Send>;

struct Request {
    launch: Launch,
    reply: Sender<Result<Launched>>,
}

/// The launcher of this process. Keyed by pid: a forked child inherits the memory of
/// the sender but not the thread behind it, so it must start its own.
static LAUNCHER: crate::sys::fork_local::ForkLocal<Option<(i32, Sender<Request>)>> =
    crate::sys::fork_local::ForkLocal::new();

fn launcher() -> Result<Sender<Request>> {
    let me = sys::current_pid();
    let mut slot = LAUNCHER.lock();
    if let Some((pid, tx)) = slot.as_ref() {
        if *pid == me {
            return Ok(tx.clone());
        }
    }
    let (tx, rx) = channel::<Request>();
    std::thread::Builder::new()
        .name("multiproc-launcher".into())
        .spawn(move || serve(rx))
        .map_err(|e| Error::os("starting the multiproc launcher thread", e))?;
    *slot = Some((me, tx.clone()));
    Ok(tx)
}

/// Starts a child on the launcher thread and waits for its pid.
pub(crate) fn launch(launch: Launch) -> Result<Launched> {
    let (reply, answer) = channel();
    launcher()?
        .send(Request { launch, reply })
        .map_err(|_| Error::Closed("the multiproc launcher thread is gone".into()))?;
    answer
        .recv()
        .map_err(|_| Error::Closed("the multiproc launcher thread did not answer".into()))?
}

fn serve(requests: Receiver<Request>) {
    for Request { launch, reply } in requests {
        let _ = reply.send(start(launch));
    }
}

fn start(launch: Launch) -> Result<Launched> {
    let pid = match launch {
        Launch::Exec {
            mut env,
            fd_var,
            fd,
        } => {
            env.push((
                fd_var.to_string(),
                std::os::fd::AsRawFd::as_raw_fd(&fd).to_string(),
            ));
            sys::spawn_self(&env, fd.as_fd())?
            // `fd` (the child's end) closes here, in the parent.
        }
        Launch::Fork { run } => sys::fork_child(run)?,
    };
    let pidfd = match sys::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) => {
            // Without a pidfd we cannot track the child: do not leave it behind.
            sys::kill_and_reap_by_pid(pid);
            return Err(e);
        }
    };
    Ok(Launched { pid, pidfd })
}
