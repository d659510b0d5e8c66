//! The `multiproc` command: tools around the multiproc library.

mod doctor;
mod gc;

use clap::{Parser, Subcommand};

/// Tools for multiproc: shared-memory tensors and worker processes for Rust.
#[derive(Parser, Debug)]
#[command(name = "multiproc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check /dev/shm, fd limits, memfd support and leftovers; advise what to change.
    /// Exits 0 when healthy, 1 otherwise.
    Doctor,
    /// Remove multiproc segments in /dev/shm whose creator is dead.
    Gc {
        /// List what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

fn main() {
    // TODO(merge): multiproc::init() once the process module lands.
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Doctor => i32::from(!doctor::run()),
        Command::Gc { dry_run } => {
            gc::run(dry_run);
            0
        }
    };
    std::process::exit(code);
}
