//! `test_init!` in a test crate that forbids unsafe code: the macro's registration in
//! `.init_array` must compile there (it adds no `allow(unsafe_code)`, which `forbid`
//! refuses), and the workers it makes possible must run their job.
#![forbid(unsafe_code)]

multiproc::test_init!();

fn report(
    rank: usize,
    (n, results): (u64, multiproc::Queue<(usize, u64)>),
) -> multiproc::Result<()> {
    results.put((rank, n * 10 + rank as u64))?;
    Ok(())
}

#[test]
fn workers_start_from_a_crate_that_forbids_unsafe_code() {
    // The deadline: this file cannot use tests/common (which may use unsafe code).
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(60));
        eprintln!("forbid_unsafe: the test exceeded its deadline of 60 s (a hang is a bug)");
        std::process::abort();
    });
    {
        let results = multiproc::Queue::new().unwrap();
        multiproc::spawn(report, (7u64, results.clone()), 2).unwrap();
        let mut got: Vec<(usize, u64)> = (0..2).map(|_| results.get().unwrap()).collect();
        got.sort_unstable();
        assert_eq!(got, vec![(0, 70), (1, 71)], "each worker ran its job once");
    }
}
