//! The `multiproc` command: `doctor` checks that a manager can start (and its exit code
//! matches its verdict) and reports the memory limit; two `gc` runs at once remove each
//! stale segment once, whether or not shm managers of this user run meanwhile;
//! `bench-floor --json` reports every floor, the futex and spin ping-pongs among them,
//! and leaves no child behind. Which files in /dev/shm are multiproc's, and whose, is
//! `multiproc::maintenance`'s to say.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// These tests watch the machine's shm managers and /dev/shm: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn multiproc(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_multiproc"));
    c.args(args);
    c
}

/// How long one command may run before its test fails (a watchdog, not a timing).
const DEADLINE: Duration = Duration::from_secs(120);

/// Runs `c` to its end with its output captured, failing the test (and killing it) if it
/// is still running after [`DEADLINE`]: a hung command fails its test instead of hanging
/// the suite.
fn output(c: &mut Command) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child)
}

/// [`output`] for a command already started with piped output.
fn finish(child: std::process::Child) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    // The pipes are read meanwhile (a child blocked on a full pipe would never end).
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(DEADLINE) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid as i32).unwrap(),
                rustix::process::Signal::KILL,
            );
            panic!("pid {pid} was still running after {DEADLINE:?}");
        }
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Pids of live processes whose environment contains `needle`.
fn processes_with_env(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if alive(pid) && env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn doctor_starts_a_throwaway_manager_and_its_exit_code_matches_its_verdict() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let out = output(&mut multiproc(&["doctor"]));
    let text = text(&out);
    let line = text
        .lines()
        .find(|l| l.contains("shm manager"))
        .unwrap_or_else(|| panic!("no manager check:\n{text}"));
    assert!(
        line.starts_with("[ ok ]"),
        "a manager can start here:\n{text}"
    );
    // The memory limit that shared tensors are checked against is reported.
    assert!(
        text.lines()
            .any(|l| l.contains("] memory") && l.contains("MemAvailable")),
        "doctor reports the memory limit:\n{text}"
    );
    // Exit code: 0 exactly when every check passed.
    let failed = text.lines().any(|l| l.starts_with("[FAIL]"));
    assert_eq!(out.status.code(), Some(i32::from(failed)), "{text}");
    assert_eq!(text.contains("healthy: "), !failed, "{text}");
    // The throwaway manager leaves by itself once doctor has gone.
    let addr = line
        .split('@')
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("the manager's address")
        .to_owned();
    let needle = format!("MULTIPROC_SHM_MANAGER={addr}");
    let until = Instant::now() + Duration::from_secs(15);
    while !processes_with_env(&needle).is_empty() {
        assert!(
            Instant::now() < until,
            "doctor's manager at @{addr} did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A pid that is not running (a child that has exited and been reaped).
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

fn random_hex(seed: &mut u64) -> String {
    (0..2)
        .map(|_| {
            *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            format!("{:016x}", z ^ (z >> 31))
        })
        .collect()
}

/// "removed /dev/shm/x (N bytes)" lines of a gc run: path → bytes.
fn removed(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("removed ")?;
            let (path, bytes) = rest.split_once(" (")?;
            Some((
                path.to_owned(),
                bytes.strip_suffix(" bytes)")?.parse().ok()?,
            ))
        })
        .collect()
}

fn reclaimed(text: &str) -> (u64, u64) {
    let l = text
        .lines()
        .find_map(|l| l.strip_prefix("reclaimed "))
        .unwrap_or_else(|| panic!("no summary:\n{text}"));
    let mut nums = l
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u64>().unwrap());
    (nums.next().unwrap(), nums.next().unwrap())
}

#[test]
fn two_gc_runs_at_once_remove_each_stale_segment_once() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Live shm managers of this user may run meanwhile (other tests, other programs):
    // gc asks them, and none holds these names, so every stale one goes.
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let dead = dead_pid();
    let mut stale = BTreeSet::new();
    for i in 0..60u64 {
        let path = PathBuf::from(format!(
            "/dev/shm/multiproc_{dead}_{}",
            random_hex(&mut seed)
        ));
        std::fs::write(&path, vec![0u8; 100 + i as usize]).unwrap();
        stale.insert(path.display().to_string());
    }
    // One of a live creator (this process): never removed.
    let live = PathBuf::from(format!(
        "/dev/shm/multiproc_{}_{}",
        std::process::id(),
        random_hex(&mut seed)
    ));
    std::fs::write(&live, b"in use").unwrap();

    // --dry-run lists, removes nothing.
    let dry = output(&mut multiproc(&["gc", "--dry-run"]));
    let td = text(&dry);
    assert!(dry.status.success(), "{td}");
    assert!(stale.iter().all(|p| std::path::Path::new(p).exists()));
    // (A manager that cannot be asked leaves every name alone, listed or not.)
    if !td.contains("could not ask") {
        for p in &stale {
            assert!(td.contains(&format!("would remove {p} (")), "{p}: {td}");
        }
    }
    assert!(
        !td.contains(&live.display().to_string()),
        "a live creator's segment was listed: {td}"
    );

    let start = || {
        multiproc(&["gc"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start(), start());
    let (a, b) = (finish(a), finish(b));
    let (ta, tb) = (text(&a), text(&b));
    assert!(a.status.success() && b.status.success(), "{ta}\n{tb}");
    assert!(
        !ta.contains("cannot remove") && !tb.contains("cannot remove"),
        "{ta}\n{tb}"
    );
    let (ra, rb) = (removed(&ta), removed(&tb));
    // Each run's summary counts exactly what it removed.
    for (r, t) in [(&ra, &ta), (&rb, &tb)] {
        assert_eq!(
            reclaimed(t),
            (r.len() as u64, r.iter().map(|(_, n)| n).sum()),
            "{t}"
        );
    }
    // No segment was removed twice; only stale ones were removed.
    let pa: BTreeSet<&String> = ra.iter().map(|(p, _)| p).collect();
    let pb: BTreeSet<&String> = rb.iter().map(|(p, _)| p).collect();
    assert!(
        pa.is_disjoint(&pb),
        "removed by both runs: {:?}",
        pa.intersection(&pb)
    );
    assert!(live.exists(), "a live creator's segment was removed");
    // Every live manager answers gc's query and none holds these names, so each goes,
    // removed by exactly one run — unless gc says a manager could not be asked (one of
    // an older multiproc, on a shared machine): then each is removed by one run or by
    // none, and never twice.
    let unasked = ta.contains("could not ask") || tb.contains("could not ask");
    if !unasked {
        assert!(
            !ta.contains("left alone") && !tb.contains("left alone"),
            "no live manager holds these names: {ta}\n{tb}"
        );
    }
    for p in &stale {
        let gone = !std::path::Path::new(p).exists();
        let by_one = pa.contains(p) as u8 + pb.contains(p) as u8;
        if unasked {
            assert!(
                gone == (by_one == 1),
                "{p}: gone {gone}, removed by {by_one} runs"
            );
        } else {
            assert!(
                gone && by_one == 1,
                "{p}: gone {gone}, removed by {by_one} runs\n{ta}\n{tb}"
            );
        }
    }
    eprintln!(
        "gc runs removed {} and {} of {} stale segments",
        pa.len(),
        pb.len(),
        stale.len()
    );
    for p in &stale {
        let _ = std::fs::remove_file(p);
    }
    std::fs::remove_file(&live).unwrap();
}

#[test]
fn bench_floor_reports_the_futex_and_spin_round_trips_and_leaves_no_child() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let run = multiproc(&["bench-floor", "--json", "--scale", "0.01"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = run.id();
    let out = finish(run);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let figures: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{all}")))
        .collect();
    for scenario in ["ping", "futex-ping", "spin-ping"] {
        let f = figures
            .iter()
            .find(|f| f["scenario"] == scenario)
            .unwrap_or_else(|| panic!("no {scenario} figure:\n{all}"));
        assert_eq!(f["impl"], "floor", "{f}");
        let us = f["us_per_roundtrip"].as_f64().unwrap_or(0.0);
        assert!(us.is_finite() && us > 0.0, "{scenario}: {f}");
        assert!(f["count"].as_u64().unwrap_or(0) > 0, "{scenario}: {f}");
    }
    // Every child was reaped before bench-floor exited, and nothing is left in /dev/shm.
    let children = floor_children_of(pid);
    assert!(children.is_empty(), "children left: {children:?}");
    let left: Vec<_> = multiproc::maintenance::segments()
        .into_iter()
        .filter(|s| s.creator() == pid)
        .map(|s| s.path())
        .collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

/// Live ping children of the `bench-floor` run `parent`: `multiproc bench-floor-child
/// <kind> <parent>`, whoever their parent is now.
fn floor_children_of(parent: u32) -> Vec<u32> {
    let tail = "\0bench-floor-child\0";
    let parent = format!("\0{parent}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = format!("\0{}", String::from_utf8_lossy(&cmdline));
            (cmdline.contains(tail) && cmdline.ends_with(&parent) && alive(pid)).then_some(pid)
        })
        .collect()
}

/// Whether `pid` runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].trim_start().chars().next())
            .is_some_and(|c| c != 'Z' && c != 'X')
    })
}

#[test]
fn bench_refuses_values_it_cannot_run_naming_the_valid_ones() {
    for (args, says) in [
        (
            &["bench", "--scenario", "bogus"][..],
            "possible values: fresh",
        ),
        (&["bench", "--scale", "inf"], "not above 0 and at most 100"),
        (&["bench", "--scale", "nan"], "not above 0 and at most 100"),
        (&["bench", "--scale", "0"], "not above 0 and at most 100"),
        (
            &["bench-floor", "--scale", "1e300"],
            "not above 0 and at most 100",
        ),
        (
            &[
                "bench",
                "--scenario",
                "fresh",
                "--bytes",
                "3",
                "--scale",
                "0.01",
            ],
            "fresh runs [4096",
        ),
    ] {
        let out = output(&mut multiproc(args));
        assert!(!out.status.success(), "{args:?} succeeded: {}", text(&out));
        assert!(text(&out).contains(says), "{args:?}: {}", text(&out));
    }
}
