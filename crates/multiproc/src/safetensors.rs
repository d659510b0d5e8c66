//! Weights files in the [safetensors] format (feature `safetensors`), loaded as the
//! file's own pages: shared, read-only, and sent to workers by handle.
//!
//! [`load`] maps the file once, read-only and shared, and every tensor it returns is a
//! view of those pages — nothing is copied. Sending such a tensor through a queue (or as
//! a worker argument) attaches the file's fd, so N worker processes that receive the
//! weights map the same page-cache pages: the weights exist once in memory, and the
//! workers add no private memory for them (`examples/inference_workers.rs` prints each
//! worker's `/proc/PID/smaps_rollup` to show it).
//!
//! The tensors are read-only: every in-place operation ([`Tensor::fill_`],
//! [`Tensor::copy_`], [`Tensor::add_`], …) on one is an [`Error::Tensor`] naming the
//! tensor, never a SIGSEGV; [`Tensor::deep_clone`] makes a writable copy. Reads
//! ([`Tensor::to_vec`], `sum`, `to_ndarray`, `to_candle`) work as on any tensor. A
//! zero-copy ndarray view of a weight is the `unsafe` `as_array_view`: another process
//! that can open the file could write it under the borrow, so the safe `array_view`
//! refuses it.
//!
//! ```
//! # fn main() -> multiproc::Result<()> {
//! use std::collections::BTreeMap;
//! use multiproc::Tensor;
//!
//! let dir = std::env::temp_dir().join(format!("multiproc-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("model.safetensors");
//!
//! let mut weights = BTreeMap::new();
//! weights.insert("w".to_string(), Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?);
//! multiproc::safetensors::save(&path, &weights)?;
//!
//! let loaded = multiproc::safetensors::load(&path)?;
//! let w = &loaded["w"];
//! assert!(w.is_read_only() && w.is_shared());
//! assert_eq!(w.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0]);
//! assert!(w.fill_(0.0).unwrap_err().to_string().contains("\"w\""));
//! # drop(loaded); std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(()) }
//! ```
//!
//! Bad files are errors, never crashes: a file shorter than its header says, a header
//! length beyond [`MAX_HEADER_LEN`] or the file, a header that is not the format's JSON,
//! tensors whose byte ranges overlap, leave gaps or disagree with their shape and dtype,
//! a dtype multiproc does not have (the 8-, 6- and 4-bit floats, `c64`), or data not
//! aligned for its dtype. The size is taken with `fstat` before anything is mapped.
//!
//! A loaded file must not be truncated or rewritten in place while its tensors live (a
//! read of a page cut off by truncation is a SIGBUS in any program that maps files);
//! [`save`] writes a new file and renames it over the old one, which is safe: existing
//! mappings keep the old pages.
//!
//! [safetensors]: https://huggingface.co/docs/safetensors

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use ::safetensors::tensor::{Metadata, TensorInfo};
use ::safetensors::{Dtype, View};

use crate::error::{Error, Result};
use crate::shm::file::FileSegment;
use crate::tensor::dtype::dispatch;
use crate::tensor::{DType, Storage, Tensor};

/// The largest header [`load`] accepts, in bytes (the safetensors library's own limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor as the header describes it, checked against the file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// Where its bytes start in the file.
    pub(crate) file_offset: usize,
    pub(crate) nbytes: usize,
}

fn bad(path: &str, why: String) -> Error {
    Error::InvalidArgument(format!("{path} is not a valid safetensors file: {why}"))
}

fn dtype_of(name: &str, dtype: Dtype, path: &str) -> Result<DType> {
    Ok(match dtype {
        Dtype::BOOL => DType::Bool,
        Dtype::U8 => DType::U8,
        Dtype::I8 => DType::I8,
        Dtype::I16 => DType::I16,
        Dtype::U16 => DType::U16,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I32 => DType::I32,
        Dtype::U32 => DType::U32,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U64 => DType::U64,
        other => {
            return Err(Error::Tensor(format!(
                "tensor {name:?} in {path} has dtype {other:?}, which multiproc does not have; \
                 convert it to a supported dtype (f32, f16, bf16, …) before saving"
            )));
        }
    })
}

fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::Bool => Dtype::BOOL,
        DType::U8 => Dtype::U8,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::U16 => Dtype::U16,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::U32 => Dtype::U32,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::U64 => Dtype::U64,
    }
}

/// Parses and checks the header of a file of `file_len` bytes, reading it with
/// `read_at(offset, buf)`. Pure apart from `read_at`: the fuzz target drives it.
pub(crate) fn parse_header(
    path: &str,
    file_len: u64,
    read_at: impl Fn(u64, &mut [u8]) -> std::io::Result<()>,
) -> Result<Vec<Entry>> {
    if file_len < 8 {
        return Err(bad(
            path,
            format!("it is {file_len} bytes long, shorter than the 8-byte header length"),
        ));
    }
    let mut len_bytes = [0u8; 8];
    read_at(0, &mut len_bytes).map_err(|e| Error::os(format!("reading {path}"), e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_LEN {
        return Err(bad(
            path,
            format!(
                "its header claims {header_len} bytes, more than the limit of {MAX_HEADER_LEN}"
            ),
        ));
    }
    if header_len > file_len - 8 {
        return Err(bad(
            path,
            format!(
                "its header claims {header_len} bytes but only {} follow the length (truncated?)",
                file_len - 8
            ),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    read_at(8, &mut header).map_err(|e| Error::os(format!("reading {path}"), e))?;
    // `Metadata` checks what the format requires: byte ranges in order, contiguous and
    // non-overlapping, each exactly as long as its shape and dtype need.
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| bad(path, format!("its header is not valid: {e}")))?;
    let data_start = 8 + header_len;
    let data_len = metadata.data_len() as u64;
    if data_start.checked_add(data_len) != Some(file_len) {
        return Err(bad(
            path,
            format!(
                "its header describes {data_len} bytes of data after {data_start} bytes of \
                 header, but the file is {file_len} bytes long (truncated or padded?)"
            ),
        ));
    }
    let mut entries = Vec::new();
    // In file order, so that the first problem reported is the same on every run.
    for name in metadata.offset_keys() {
        let Some(info) = metadata.info(&name) else {
            continue;
        };
        let TensorInfo {
            dtype,
            shape,
            data_offsets: (start, end),
        } = info;
        let dtype = dtype_of(&name, *dtype, path)?;
        let file_offset = data_start as usize + start;
        if file_offset % dtype.size() != 0 {
            return Err(bad(
                path,
                format!(
                    "tensor {name:?} starts at byte {file_offset}, not aligned for {dtype}; \
                     save it again with multiproc::safetensors::save"
                ),
            ));
        }
        entries.push(Entry {
            name,
            dtype,
            shape: shape.clone(),
            file_offset,
            nbytes: end - start,
        });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

/// Loads every tensor of the safetensors file at `path`, backed by the file's own pages
/// mapped shared and read-only (see the [module docs](self)): no copy, and workers
/// that receive the tensors share the same pages.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a malformed file (truncated, oversized header,
/// overlapping or inconsistent offsets, misaligned data), [`Error::Tensor`] for a dtype
/// multiproc does not have, [`Error::Os`] when the file cannot be opened, read or mapped.
pub fn load(path: impl AsRef<Path>) -> Result<BTreeMap<String, Tensor>> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| Error::os(format!("opening {shown}"), e))?;
    let file_len = file
        .metadata()
        .map_err(|e| Error::os(format!("fstat of {shown}"), e))?
        .len();
    let entries = parse_header(&shown, file_len, |offset, buf| {
        file.read_exact_at(buf, offset)
    })?;
    let segment = FileSegment::from_fd(file.as_fd(), file_len, &shown)?;
    entries
        .into_iter()
        .map(|e| {
            let storage = Storage::from_file(segment.clone(), e.file_offset, e.nbytes, &e.name)?;
            let tensor =
                Tensor::from_storage(storage, e.dtype, &e.shape, &contiguous_strides(&e.shape), 0)?;
            Ok((e.name, tensor))
        })
        .collect()
}

/// Row-major strides, saturating: a header may describe an empty tensor whose other
/// sizes multiply past `usize` (its strides then address nothing, as `Tensor::zeros`'s
/// do), which must be an error or a tensor, never an overflow.
fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1].max(1));
    }
    strides
}

/// One tensor's bytes, ready for the writer.
struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` to `path` in the safetensors format (any layout: elements in
/// row-major order). The file is written beside `path` and renamed over it, so a file
/// that is loaded (mapped) somewhere keeps its old pages intact.
///
/// # Errors
///
/// [`Error::Os`] when the file cannot be written, [`Error::InvalidArgument`] when the
/// format refuses the set (e.g. the header would exceed its limit).
pub fn save(path: impl AsRef<Path>, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let path = path.as_ref();
    let mut prepared = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let data = dispatch!(t.dtype(), T => {
            crate::tensor::copy_in::element_bytes(&t.to_vec::<T>()?).to_vec()
        });
        prepared.push((
            name.as_str(),
            Bytes {
                dtype: st_dtype(t.dtype()),
                shape: t.shape().to_vec(),
                data,
            },
        ));
    }
    ::safetensors::serialize_to_file(prepared.iter().map(|(n, b)| (*n, b)), None, path).map_err(
        |e| match e {
            ::safetensors::SafeTensorError::IoError(io) => {
                Error::os(format!("writing {}", path.display()), io)
            }
            other => Error::InvalidArgument(format!("cannot save {}: {other}", path.display())),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_file(header: &str, data_len: usize) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.resize(f.len() + data_len, 0);
        f
    }

    fn parse(bytes: &[u8]) -> Result<Vec<Entry>> {
        parse_header("t.safetensors", bytes.len() as u64, |off, buf| {
            let off = off as usize;
            buf.copy_from_slice(&bytes[off..off + buf.len()]);
            Ok(())
        })
    }

    fn error_of(bytes: &[u8]) -> String {
        parse(bytes).unwrap_err().to_string()
    }

    #[test]
    fn a_valid_header_gives_checked_entries() {
        let f = header_file(
            r#"{"b":{"dtype":"U32","shape":[2],"data_offsets":[16,24]},"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}}"#,
            24,
        );
        // Writers pad the header to a multiple of 8; this one is 110 bytes, so `a` would
        // start at byte 118.
        let err = error_of(&f);
        assert!(err.contains("not aligned for float64"), "{err}");
        let padded = format!(
            "{:<112}",
            r#"{"b":{"dtype":"U32","shape":[2],"data_offsets":[16,24]},"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}}"#
        );
        let entries = parse(&header_file(&padded, 24)).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].name, "a");
        assert_eq!(entries[0].file_offset, 120);
        assert_eq!(entries[1].dtype, DType::U32);
        assert_eq!(entries[1].nbytes, 8);
    }

    #[test]
    fn malformed_files_are_errors_that_say_why() {
        assert!(error_of(&[1, 2, 3]).contains("shorter than the 8-byte header length"));
        let mut huge = (u64::MAX).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(error_of(&huge).contains("more than the limit"));
        let mut long = 1000u64.to_le_bytes().to_vec();
        long.extend_from_slice(b"{}");
        assert!(error_of(&long).contains("truncated"));
        let overlap = header_file(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
            6,
        );
        assert!(
            error_of(&overlap).contains("header is not valid"),
            "{}",
            error_of(&overlap)
        );
        let short_data = header_file(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            3,
        );
        assert!(error_of(&short_data).contains("truncated or padded"));
        let wrong_size = header_file(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(error_of(&wrong_size).contains("header is not valid"));
        let f8 = header_file(
            r#"{"a":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(error_of(&f8).contains("F8_E4M3"));
        assert!(error_of(&header_file("not json", 0)).contains("header is not valid"));
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), [12, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<usize>::new());
        assert_eq!(contiguous_strides(&[0, 3]), [3, 1]);
    }
}
