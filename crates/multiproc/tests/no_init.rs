//! A program that forgets `multiproc::init()`: no `test_init!` here, and a `main` of its
//! own (`harness = false`), so every worker it starts with `Spawn` (and its fork server)
//! runs this `main` again, as a careless user's program would. Each way of starting
//! workers must report that, naming the binary, instead of `Ok`.

use std::time::Duration;

use multiproc::{Error, Pool, Process, SpawnOptions, StartMethod, spawn, start_processes};

fn noop(_rank: usize, _: ()) {}

fn square(x: u64) -> Result<u64, String> {
    Ok(x * x)
}

fn assert_names_init(what: &str, e: &Error) {
    let text = e.to_string();
    let exe = std::env::current_exe().unwrap().display().to_string();
    assert!(
        text.contains("multiproc::init()") && text.contains(&exe),
        "{what}: the error must name init() and the binary {exe}: {text}"
    );
}

fn main() {
    if std::env::var_os("MULTIPROC_ROLE").is_some() {
        // A worker or fork server that runs `main` again: the user's side effects.
        eprintln!("no_init: main ran again in pid {}", std::process::id());
        return;
    }
    // A hang is a failure, not a stuck CI.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        eprintln!("no_init: exceeded its deadline of 120 s");
        std::process::exit(1);
    });

    // spawn
    let e = spawn(noop, (), 2).expect_err("spawn without init must fail");
    assert!(
        matches!(
            e,
            Error::ProcessExited {
                exit_code: Some(0),
                ..
            }
        ),
        "spawn: {e:?}"
    );
    assert_names_init("spawn", &e);

    // start_processes + join
    let mut ctx = start_processes(noop, (), 1, StartMethod::Spawn).unwrap();
    let e = ctx
        .join()
        .expect_err("start_processes: join returned Ok without init");
    assert_names_init("start_processes", &e);

    // Process
    let mut p = Process::builder(noop, 0, ()).start().unwrap();
    p.join().unwrap();
    let e = p
        .error()
        .expect("Process::error after an exit without a report");
    assert_names_init("Process", &e);

    // Pool
    let pool = Pool::builder().processes(1).build().unwrap();
    let e = pool
        .map(square, [3u64])
        .expect_err("a pool without init must fail");
    assert_names_init("Pool", &e);
    drop(pool);

    // Forkserver: the server itself is this program run again.
    let e = SpawnOptions::new()
        .start_method(StartMethod::Forkserver)
        .spawn(noop, (), 1)
        .expect_err("the fork server cannot start without init");
    assert_names_init("Forkserver", &e);

    // Fork needs no init: the child runs the job without executing anything.
    SpawnOptions::new()
        .start_method(StartMethod::Fork)
        .spawn(noop, (), 2)
        .expect("fork runs the job without init");

    println!("no_init: 6 checks passed");
}
