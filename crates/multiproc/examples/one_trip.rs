//! One tensor's trip from `Queue::put` in one process to `Queue::get` in another,
//! repeated: the subject of `scripts/trip_files.sh`, which lists the library files
//! whose code runs once per trip.
//!
//! ```text
//! cargo run --release -p multiproc --example one_trip [-- put]
//! ```
//!
//! A child process puts one shared 256-byte tensor `TRIPS` times and the parent gets
//! each (dropping it, which gives its use back); with `put`, the parent puts and the
//! child gets. The tensor is made and checked once, and has fewer elements than there
//! are trips, so what runs `TRIPS` times is the trip alone. (A worker ends with
//! `_exit`, so a profile of the parent shows one side of the trip at a time.)

use multiproc::{DType, Queue, StartMethod, Tensor};

const TRIPS: usize = 200;

fn put_all(q: &Queue<Tensor>) -> multiproc::Result<()> {
    let t = Tensor::zeros_shared(&[64], DType::F32)?;
    t.fill_(1.0)?;
    for _ in 0..TRIPS {
        q.put(t.clone())?;
    }
    Ok(())
}

fn get_all(q: &Queue<Tensor>) -> multiproc::Result<()> {
    let mut last = None;
    for _ in 0..TRIPS {
        last = Some(q.get_timeout(std::time::Duration::from_secs(60))?);
    }
    match last {
        Some(t) if t.to_vec::<f32>()?.iter().all(|&x| x == 1.0) => Ok(()),
        _ => Err(multiproc::Error::user(std::io::Error::other(
            "the last trip arrived with the wrong sum",
        ))),
    }
}

fn child(_rank: usize, (q, parent_puts): (Queue<Tensor>, bool)) -> multiproc::Result<()> {
    if parent_puts {
        get_all(&q)
    } else {
        put_all(&q)
    }
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let parent_puts = std::env::args().nth(1).as_deref() == Some("put");
    let q = Queue::new()?;
    let mut ctx =
        multiproc::start_processes(child, (q.clone(), parent_puts), 1, StartMethod::Fork)?;
    if parent_puts {
        put_all(&q)?;
    } else {
        get_all(&q)?;
    }
    ctx.join()?;
    println!(
        "{TRIPS} trips, the parent {}",
        if parent_puts { "putting" } else { "getting" }
    );
    Ok(())
}
