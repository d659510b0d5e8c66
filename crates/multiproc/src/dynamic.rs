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
    List(#[serde(serialize_with = "nested_ser", deserialize_with = "nested")] Vec<Dynamic>),
    /// A `tuple`.
    Tuple(#[serde(serialize_with = "nested_ser", deserialize_with = "nested")] Vec<Dynamic>),
    /// A `dict`: its items, in insertion order.
    Dict(
        #[serde(serialize_with = "nested_ser", deserialize_with = "nested")]
        Vec<(Dynamic, Dynamic)>,
    ),
    /// A tensor, by handle.
    Tensor(Tensor),
    /// Any other Python object, pickled (protocol 5 or lower).
    Pickled(#[serde(with = "as_bytes")] Vec<u8>),
}

/// See [`Dynamic::MAX_NESTING`].
const MAX_NESTING: u32 = Dynamic::MAX_NESTING;

thread_local! {
    /// How many containers deep the serialization running on this thread is.
    static SER_NESTING: Cell<u32> = const { Cell::new(0) };
    /// How many containers deep the deserialization running on this thread is.
    static DE_NESTING: Cell<u32> = const { Cell::new(0) };
}

/// One level of nesting in `counter`, left when dropped.
struct Level(&'static std::thread::LocalKey<Cell<u32>>);

impl Level {
    /// Enters a level; `None` (the level not entered) past [`MAX_NESTING`].
    fn enter(counter: &'static std::thread::LocalKey<Cell<u32>>) -> Option<Level> {
        let depth = counter.with(|n| n.get()) + 1;
        if depth > MAX_NESTING {
            return None;
        }
        counter.with(|n| n.set(depth));
        Some(Level(counter))
    }
}

impl Drop for Level {
    fn drop(&mut self) {
        self.0.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// Serializes a container one level deeper, refusing to go past [`MAX_NESTING`]: so a
/// value the receiver would refuse is not sent (inside a channel's encode, `put` or
/// `send` returns [`Error::Encode`](crate::Error::Encode) and nothing is sent).
fn nested_ser<S: Serializer, T: Serialize>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::Error as _;
    let Some(_level) = Level::enter(&SER_NESTING) else {
        let why = format!(
            "a Dynamic value nests deeper than {MAX_NESTING} levels (lists, tuples and \
             dicts inside one another), more than a receiver accepts: flatten it, or send \
             it pickled (Dynamic::Pickled)"
        );
        return Err(S::Error::custom(
            match crate::wire::Encoder::current("a Dynamic value") {
                Ok(enc) => enc.fail(crate::error::Error::Encode(why)),
                Err(_) => why,
            },
        ));
    };
    v.serialize(s)
}

/// Deserializes a container one level deeper, refusing to go past [`MAX_NESTING`].
fn nested<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    let Some(_level) = Level::enter(&DE_NESTING) else {
        let why = format!(
            "a Dynamic value nests deeper than {MAX_NESTING} levels (lists, tuples and \
             dicts inside one another): the sender must flatten it"
        );
        return Err(de::Error::custom(
            match crate::wire::Decoder::current("a Dynamic value") {
                Ok(dec) => dec.fail(crate::error::Error::InvalidMessage(why)),
                Err(_) => why,
            },
        ));
    };
    T::deserialize(d)
}

impl Dynamic {
    /// How deep a value may nest (lists, tuples and dicts inside one another): deeper
    /// is refused when it is sent ([`Error::Encode`](crate::Error::Encode), nothing
    /// sent), and an invalid message when it is received, never a stack overflow (a
    /// forged packet of a few kilobytes could otherwise nest thousands deep).
    pub const MAX_NESTING: u32 = 128;

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
    fn a_value_nested_past_the_limit_is_refused_by_put_and_nothing_is_sent() {
        let deep = |levels: usize| {
            (0..levels).fold(Dynamic::Int(7), |inner, _| Dynamic::List(vec![inner]))
        };
        let q: crate::Queue<Dynamic> = crate::Queue::new().unwrap();
        // A second holder: a lone handle's empty queue is `Disconnected`, not empty.
        let _other = q.clone();
        let err = q.put(deep(MAX_NESTING as usize + 1)).unwrap_err();
        assert!(
            matches!(&err.error, crate::Error::Encode(why) if why.contains("deeper than 128 levels")),
            "{err:?}"
        );
        // The value comes back whole; nothing was sent.
        assert!(matches!(err.item, Dynamic::List(_)), "{err:?}");
        assert!(q.try_get().unwrap().is_none());
        // The count is back at zero after the refusal: the deepest value allowed goes.
        q.put(deep(MAX_NESTING as usize)).unwrap();
        let mut back = q.try_get().unwrap().unwrap();
        let mut levels = 0;
        while let Dynamic::List(mut items) = back {
            back = items.pop().unwrap();
            levels += 1;
        }
        assert_eq!((levels, back.as_int()), (MAX_NESTING, Some(7)));
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
