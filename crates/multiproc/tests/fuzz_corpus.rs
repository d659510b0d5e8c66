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

/// The safetensors loader's corpus (`fuzz/corpus/safetensors_header/`), its seeds, and a
/// bounded, seeded run of byte mutations of the seeds: every input must load or be
/// refused, never panic or crash, and leak nothing.
#[cfg(feature = "safetensors")]
mod safetensors_header {
    use super::*;
    use multiproc::__fuzz::{run_safetensors_file, safetensors_seed_inputs};

    fn corpus_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/safetensors_header")
    }

    #[test]
    fn seeds_load_and_the_corpus_replays() {
        common::run(DEADLINE, || {
            for (i, s) in safetensors_seed_inputs().unwrap().iter().enumerate() {
                run_safetensors_file(s).unwrap_or_else(|e| panic!("seed {i} does not load: {e}"));
            }
            let files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
                .expect("fuzz/corpus/safetensors_header")
                .map(|e| e.unwrap().path())
                .collect();
            assert!(files.len() >= 3, "the corpus is missing: {files:?}");
            let ok = files
                .iter()
                .filter(|f| run_safetensors_file(&std::fs::read(f).unwrap()).is_ok())
                .count();
            assert!(
                ok > 0,
                "no corpus file loads: the corpus no longer matches the format"
            );
        });
    }

    #[test]
    fn mutated_seeds_are_loaded_or_refused() {
        common::run(DEADLINE, || {
            let seeds = safetensors_seed_inputs().unwrap();
            let mut rng = common::Rng(0x5afe_7e45);
            let (mut ok, mut refused) = (0, 0);
            for _ in 0..600 {
                let mut data = seeds[rng.below(seeds.len() as u64) as usize].clone();
                for _ in 0..=rng.below(4) {
                    match rng.below(4) {
                        // Flip a byte of the length or the header, where it matters most.
                        0 | 1 if !data.is_empty() => {
                            let end = data.len().min(200) as u64;
                            let i = rng.below(end) as usize;
                            data[i] = rng.next_u64() as u8;
                        }
                        2 => data.truncate(rng.below(data.len() as u64 + 1) as usize),
                        _ => data.extend((0..rng.below(16)).map(|_| rng.next_u64() as u8)),
                    }
                }
                match run_safetensors_file(&data) {
                    Ok(_) => ok += 1,
                    Err(_) => refused += 1,
                }
            }
            eprintln!("mutations: {ok} loaded, {refused} refused");
            assert!(refused > 0);
        });
    }

    /// Writes the seeds into the corpus directory.
    #[test]
    #[ignore = "writes fuzz/corpus/safetensors_header/seed-*; run by hand"]
    fn write_safetensors_seeds_into_the_corpus() {
        std::fs::create_dir_all(corpus_dir()).unwrap();
        let seeds = safetensors_seed_inputs().unwrap();
        for (i, s) in seeds.iter().enumerate() {
            std::fs::write(corpus_dir().join(format!("seed-{i}")), s).unwrap();
        }
        // The classes of bad file, one each: truncated, an oversized header length,
        // overlapping byte ranges.
        let all = &seeds[1];
        std::fs::write(corpus_dir().join("truncated"), &all[..all.len() - 3]).unwrap();
        let mut huge = all.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(corpus_dir().join("oversized-header"), huge).unwrap();
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let mut overlap = (header.len() as u64).to_le_bytes().to_vec();
        overlap.extend_from_slice(header.as_bytes());
        overlap.extend_from_slice(&[0; 12]);
        std::fs::write(corpus_dir().join("overlapping"), overlap).unwrap();
    }
}
