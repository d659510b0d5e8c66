//! Placeholder for the shm manager (written on another branch, replaced at merge).

/// Runs the shm manager daemon; `init()` calls it when `MULTIPROC_ROLE=shm-manager`.
pub(crate) fn serve_from_env() -> ! {
    eprintln!("shm manager not built in this branch");
    std::process::exit(2)
}
