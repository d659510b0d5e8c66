//! The `multiproc` command: tools around the multiproc library.

use clap::Parser;

/// Tools for multiproc: shared-memory tensors and worker processes for Rust.
#[derive(Parser, Debug)]
#[command(name = "multiproc", version, about, long_about = None)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
}
