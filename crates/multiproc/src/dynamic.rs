//! [`Dynamic`]: a message whose shape is decided at run time, what Python processes put
//! on multiproc queues, so that a Rust process can read and write the same queue.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::tensor::Tensor;

/// A value of any of the shapes a Python message takes: what the Python package puts on
/// a queue and gets from it. A Rust process that talks to Python uses
/// `Queue<Dynamic>` (or `Connection<Dynamic>`), and matches on the variants.
///
/// | Python | `Dynamic` |
/// |---|---|
/// | `None` | `None` |
/// | `bool` | `Bool` |
/// | `int` (64-bit) | `Int` (a larger int goes as `Pickled`) |
/// | `float` | `Float` |
/// | `str` | `Str` |
/// | `bytes`, `bytearray` | `Bytes` |
/// | `list` | `List` |
/// | `tuple` | `Tuple` |
/// | `dict` | `Dict`, its items in order |
/// | a CPU `torch.Tensor` or `numpy.ndarray` | `Tensor` (by handle; received as a `torch.Tensor`, or a numpy array without torch) |
/// | anything else | `Pickled`: the bytes of `pickle.dumps` (a Rust process passes them on untouched) |
///
/// ```
/// use multiproc::{DType, Dynamic, Queue, Tensor};
/// let q: Queue<Dynamic> = Queue::new()?;
/// let batch = Tensor::zeros(&[2, 3], DType::F32)?;
/// q.put(Dynamic::Dict(vec![
///     ("step".into(), 7.into()),
///     ("batch".into(), batch.into()),
/// ]))?;
/// let msg = q.get()?;
/// assert_eq!(msg.get("step").and_then(Dynamic::as_int), Some(7));
/// assert_eq!(msg.get("batch").and_then(Dynamic::as_tensor).map(Tensor::numel), Some(6));
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Dynamic {
    /// Python's `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int` that fits 64 bits.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes` (or a `bytearray`, received as `bytes`).
    Bytes(#[serde(with = "as_bytes")] Vec<u8>),
    /// A `list`.
    List(#[serde(deserialize_with = "nested")] Vec<Dynamic>),
    /// A `tuple`.
    Tuple(#[serde(deserialize_with = "nested")] Vec<Dynamic>),
    /// A `dict`: its items, in insertion order.
    Dict(#[serde(deserialize_with = "nested")] Vec<(Dynamic, Dynamic)>),
    /// A tensor, by handle.
    Tensor(Tensor),
    /// Any other Python object, pickled (protocol 5 or lower).
    Pickled(#[serde(with = "as_bytes")] Vec<u8>),
}

/// How deep a received value may nest: deeper is an invalid message, not a stack
/// overflow (a forged packet of a few kilobytes could otherwise nest thousands deep).
pub const MAX_NESTING: u32 = 128;

thread_local! {
    static NESTING: Cell<u32> = const { Cell::new(0) };
}

/// Leaves one level of nesting when dropped.
struct Level;

impl Drop for Level {
    fn drop(&mut self) {
        NESTING.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// Deserializes a container one level deeper, refusing to go past [`MAX_NESTING`].
fn nested<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    let depth = NESTING.with(|n| {
        n.set(n.get() + 1);
        n.get()
    });
    let _level = Level;
    if depth > MAX_NESTING {
        return Err(de::Error::custom(format!(
            "a Dynamic value nests deeper than {MAX_NESTING} levels"
        )));
    }
    T::deserialize(d)
}

impl Dynamic {
    /// The value of a `Dict`'s entry whose key is the string `key`.
    pub fn get(&self, key: &str) -> Option<&Dynamic> {
        match self {
            Dynamic::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Dynamic::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The tensor of a `Tensor`.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Dynamic::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The number of an `Int`.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Dynamic::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The number of a `Float`, or of an `Int` as a float.
    pub fn as_float(&self) -> Option<f64> {
        match self {
            Dynamic::Float(f) => Some(*f),
            Dynamic::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    /// The text of a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Dynamic::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a `List` or a `Tuple`.
    pub fn as_slice(&self) -> Option<&[Dynamic]> {
        match self {
            Dynamic::List(v) | Dynamic::Tuple(v) => Some(v),
            _ => None,
        }
    }
}

impl From<Tensor> for Dynamic {
    fn from(t: Tensor) -> Self {
        Dynamic::Tensor(t)
    }
}

impl From<i64> for Dynamic {
    fn from(i: i64) -> Self {
        Dynamic::Int(i)
    }
}

impl From<f64> for Dynamic {
    fn from(f: f64) -> Self {
        Dynamic::Float(f)
    }
}

impl From<bool> for Dynamic {
    fn from(b: bool) -> Self {
        Dynamic::Bool(b)
    }
}

impl From<&str> for Dynamic {
    fn from(s: &str) -> Self {
        Dynamic::Str(s.to_owned())
    }
}

impl From<String> for Dynamic {
    fn from(s: String) -> Self {
        Dynamic::Str(s)
    }
}

impl From<Vec<Dynamic>> for Dynamic {
    /// A `List`.
    fn from(v: Vec<Dynamic>) -> Self {
        Dynamic::List(v)
    }
}

/// Bytes as one serde byte string (one length and a copy), not a sequence of `u8`s.
mod as_bytes {
    use super::*;

    pub(super) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(BytesVisitor)
    }

    struct BytesVisitor;

    impl<'de> Visitor<'de> for BytesVisitor {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("bytes")
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // A bound on the up-front allocation: the hint is the sender's word.
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(b) = seq.next_element()? {
                v.push(b);
            }
            Ok(v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn bytes_travel_as_one_byte_string() {
        let v = Dynamic::Bytes(vec![1, 2, 3]);
        let enc = postcard::to_allocvec(&v).unwrap();
        // variant tag, length, the bytes
        assert_eq!(enc, [5, 3, 1, 2, 3]);
        let back: Dynamic = postcard::from_bytes(&enc).unwrap();
        assert!(matches!(back, Dynamic::Bytes(b) if b == [1, 2, 3]));
    }

    #[test]
    fn nesting_past_the_limit_is_an_error_not_a_stack_overflow() {
        let deep = |levels: usize| {
            let mut bytes = [6u8, 1].repeat(levels);
            bytes.push(0);
            postcard::from_bytes::<Dynamic>(&bytes)
        };
        assert!(deep(MAX_NESTING as usize).is_ok());
        assert!(deep(MAX_NESTING as usize + 1).is_err());
        assert!(deep(100_000).is_err());
        // The count is back at zero after an error: the next value decodes.
        assert!(deep(3).is_ok());
    }

    #[test]
    fn accessors() {
        let t = Tensor::zeros(&[2], DType::F32).unwrap();
        let d = Dynamic::Dict(vec![("a".into(), 1i64.into()), ("t".into(), t.into())]);
        assert_eq!(d.get("a").and_then(Dynamic::as_int), Some(1));
        assert_eq!(d.get("a").and_then(Dynamic::as_float), Some(1.0));
        assert!(d.get("t").and_then(Dynamic::as_tensor).is_some());
        assert!(d.get("b").is_none());
        let l: Dynamic = vec![Dynamic::from("x"), Dynamic::None].into();
        assert_eq!(l.as_slice().map(<[_]>::len), Some(2));
        assert_eq!(l.as_slice().unwrap()[0].as_str(), Some("x"));
    }
}
