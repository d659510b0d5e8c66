//! The fuzz target's corpus, replayed on stable Rust: every file in
//! `fuzz/corpus/decode_packet/` goes through the same entry point as the fuzzer
//! (`multiproc::__fuzz::run_input`), which must return — `Ok` or `Err` — without a
//! panic or a crash, and leak nothing. The seeds (well-formed messages the library
//! encodes itself) must decode.

multiproc::test_init!();

mod common;

use std::path::PathBuf;
use std::time::Duration;

use multiproc::__fuzz::{run_input, seed_inputs};

const DEADLINE: Duration = Duration::from_secs(120);

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/decode_packet")
}

#[test]
fn seeds_decode() {
    common::run(DEADLINE, || {
        let seeds = seed_inputs().unwrap();
        assert!(seeds.len() >= 5);
        for (i, s) in seeds.iter().enumerate() {
            let summary = run_input(s).unwrap_or_else(|e| panic!("seed {i} does not decode: {e}"));
            assert!(summary.starts_with("tag "), "{summary}");
        }
    });
}

#[test]
fn corpus_replays_without_a_crash() {
    common::run(DEADLINE, || {
        let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
            .expect("fuzz/corpus/decode_packet")
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(files.len() >= 10, "the corpus is missing: {files:?}");
        let (mut ok, mut refused) = (0, 0);
        for f in &files {
            let data = std::fs::read(f).unwrap();
            match run_input(&data) {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        eprintln!(
            "corpus: {} inputs, {ok} decoded, {refused} refused",
            files.len()
        );
        assert!(
            ok > 0,
            "no corpus input decodes: the corpus no longer matches the wire"
        );
    });
}

/// Writes the seeds into the corpus directory (run after a wire format change).
#[test]
#[ignore = "writes fuzz/corpus/decode_packet/seed-*; run by hand"]
fn write_seeds_into_the_corpus() {
    for (i, s) in seed_inputs().unwrap().iter().enumerate() {
        std::fs::write(corpus_dir().join(format!("seed-{i}")), s).unwrap();
    }
}
