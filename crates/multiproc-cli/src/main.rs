//! The `multiproc` command: tools around the multiproc library. Safe code only: what
//! needs `unsafe` (mappings, fds) is the library's.

#![deny(unsafe_code)]

mod bench;
mod doctor;
mod floor;
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
    /// Run the benchmark scenarios (fresh, small, ping, spawn, disconnect) with both strategies.
    Bench {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Scale every count by this factor (0.1 for a quick look; above 0, at most 100).
        #[arg(long, default_value_t = 1.0, value_parser = parse_scale)]
        scale: f64,
        /// Run only these scenarios (fresh, small, ping, spawn, disconnect; memory, the
        /// burst-then-idle curve, and stopped, 16 processes with one stopped, run only
        /// when named); repeatable.
        #[arg(long = "scenario", value_parser = clap::builder::PossibleValuesParser::new(SCENARIOS))]
        only: Vec<String>,
        /// Only this sharing strategy (file_descriptor or file_system).
        #[arg(long)]
        strategy: Option<multiproc::SharingStrategy>,
        /// Only the sizes of fresh and ping with this many bytes (4096, 1048576, ...;
        /// 0 is ping's message of a number, no tensor); repeatable.
        #[arg(long = "bytes")]
        sizes: Vec<u64>,
        /// Instead: all_reduce_ of 64 MiB f32 across 2 local ranks beside the memory
        /// bandwidth floor (memcpy of 64 MiB), measured in the same run.
        #[arg(long)]
        collectives: bool,
        /// Instead: the wake-up latency of an awaited `get` (feature `async`) beside a
        /// blocking one, in the same run, and `disconnect` with the get awaited.
        #[arg(long = "async")]
        async_wake: bool,
    },
    /// Measure the raw floor: a SEQPACKET + SCM_RIGHTS ping-pong, a futex and a spinning
    /// ping-pong over one shared word, and an in-process fill+sum on a reused buffer
    /// (what `scripts/compare_torch.py` divides by).
    BenchFloor {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Scale every count by this factor (above 0, at most 100).
        #[arg(long, default_value_t = 1.0, value_parser = parse_scale)]
        scale: f64,
    },
    /// Run the shm manager daemon in the foreground (normally started for you).
    ShmManager,
    /// A ping child of `bench-floor` (what it shares with its parent is on its stdin).
    #[command(name = floor::CHILD_COMMAND, hide = true)]
    BenchFloorChild {
        /// socket, futex or spin.
        kind: String,
        /// The pid of the `bench-floor` run that started it.
        parent: i32,
    },
}

/// What `bench --scenario` takes.
const SCENARIOS: [&str; 7] = [
    "fresh",
    "small",
    "ping",
    "spawn",
    "disconnect",
    "memory",
    "stopped",
];

/// A `--scale`: a number above 0 and at most 100 (a count scaled past that runs for
/// hours; NaN or infinity would run for ever).
fn parse_scale(s: &str) -> Result<f64, String> {
    let scale: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number ({e})"))?;
    if scale.is_finite() && scale > 0.0 && scale <= 100.0 {
        Ok(scale)
    } else {
        Err(format!("{s} is not above 0 and at most 100"))
    }
}

fn main() {
    multiproc::init();
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Bench {
            json,
            scale,
            async_wake: true,
            ..
        } => match bench::wake(scale) {
            Ok(figures) => {
                if !json {
                    println!("{}", bench::header());
                }
                for f in &figures {
                    if json {
                        println!("{}", serde_json::to_string(f).unwrap_or_default());
                    } else {
                        println!("{}", bench::row(f));
                    }
                }
                0
            }
            Err(e) => {
                eprintln!("benchmark failed: {e}");
                1
            }
        },
        Command::Bench {
            json,
            scale,
            only,
            strategy,
            sizes,
            collectives: true,
            ..
        } => match bench::collectives(scale) {
            Ok(figures) => {
                for f in &figures {
                    if json {
                        println!("{}", serde_json::to_string(f).unwrap_or_default());
                    } else {
                        println!("{}", bench::row(f));
                    }
                }
                if let [reduce, floor] = &figures[..] {
                    if let (Some(a), Some(b)) = (reduce.gb_s(), floor.gb_s()) {
                        eprintln!("all_reduce / memcpy floor: {:.2}x", a / b);
                    }
                }
                let _ = (only, strategy, sizes);
                0
            }
            Err(e) => {
                eprintln!("benchmark failed: {e}");
                1
            }
        },
        Command::Bench {
            json,
            scale,
            only,
            strategy,
            sizes,
            collectives: false,
            ..
        } => {
            let plan = bench::Plan {
                scale,
                only,
                strategy,
                sizes,
            };
            if !json {
                println!("{}", bench::header());
            }
            let result = bench::run(&plan, |f| {
                if json {
                    println!("{}", serde_json::to_string(f).unwrap_or_default());
                } else {
                    println!("{}", bench::row(f));
                }
            });
            match result {
                Ok(_) => 0,
                Err(e) => {
                    eprintln!("benchmark failed: {e}");
                    1
                }
            }
        }
        Command::BenchFloor { json, scale } => match floor::run(scale) {
            Ok(figures) => {
                if !json {
                    println!("{}", bench::header());
                }
                for f in &figures {
                    if json {
                        println!("{}", serde_json::to_string(f).unwrap_or_default());
                    } else {
                        println!("{}", bench::row(f));
                    }
                }
                0
            }
            Err(e) => {
                eprintln!("floor benchmark failed: {e}");
                1
            }
        },
        Command::ShmManager => match multiproc::maintenance::run_shm_manager_from_env() {
            Ok(_) => 0,
            Err(e) => {
                eprintln!("shm manager: {e}");
                1
            }
        },
        Command::BenchFloorChild { kind, parent } => match floor::serve_child(&kind, parent) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("multiproc bench-floor: the {kind} ping child failed: {e}");
                // The parent reads the exit status.
                1
            }
        },
        Command::Doctor => i32::from(!doctor::run()),
        Command::Gc { dry_run } => {
            gc::run(dry_run);
            0
        }
    };
    std::process::exit(code);
}
