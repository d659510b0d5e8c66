//! Element types: the runtime [`DType`] and the compile-time [`Element`] trait that
//! ties each Rust type to its `DType`.
//!
//! Invariant: every element type is 1, 2, 4 or 8 bytes, stored little-endian in the
//! machine's native layout, and is read and written through an atomic of the same width
//! (see `raw`). A stored value is always turned back into the Rust type with a total
//! conversion (`from_bits`), so any bit pattern another process writes — a `2` where a
//! `bool` lives — reads as a valid value, never as undefined behaviour.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// Names follow torch (`torch.float32` is [`DType::F32`]); [`DType::name`] gives torch's
/// spelling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit float (`f32`, torch `float32`).
    F32,
    /// 64-bit float (`f64`, torch `float64`).
    F64,
    /// IEEE half precision ([`half::f16`], torch `float16`).
    F16,
    /// bfloat16 ([`half::bf16`], torch `bfloat16`).
    BF16,
    /// `i8` (torch `int8`).
    I8,
    /// `i16` (torch `int16`).
    I16,
    /// `i32` (torch `int32`).
    I32,
    /// `i64` (torch `int64`).
    I64,
    /// `u8` (torch `uint8`).
    U8,
    /// `bool`, one byte per element (torch `bool`).
    Bool,
    /// `u16` (torch `uint16`).
    U16,
    /// `u32` (torch `uint32`; candle's `argmax` returns it).
    U32,
    /// `u64` (torch `uint64`).
    U64,
}

impl DType {
    /// Every dtype, in wire-code order (new dtypes are appended, so codes never change).
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_floating_point(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// torch's name for it: `float32`, `bfloat16`, `int64`, `bool`…
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::Bool => "bool",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
        }
    }

    /// The one-byte code used on the wire.
    pub(crate) fn code(self) -> u8 {
        Self::ALL.iter().position(|d| *d == self).unwrap_or(0) as u8
    }

    /// The dtype of a wire code, if there is one.
    pub(crate) fn from_code(code: u8) -> Option<DType> {
        Self::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses torch's or numpy's spelling of a dtype: [`DType::name`]'s (`"float32"`), with
/// or without `torch.` in front, and torch's aliases (`float`, `double`, `half`,
/// `short`, `int`, `long`).
///
/// ```
/// use multiproc::DType;
/// assert_eq!("torch.long".parse::<DType>().unwrap(), DType::I64);
/// assert!("complex64".parse::<DType>().is_err());
/// ```
impl std::str::FromStr for DType {
    type Err = crate::error::Error;

    fn from_str(name: &str) -> crate::error::Result<DType> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        let alias = match bare {
            "float" => Some(DType::F32),
            "double" => Some(DType::F64),
            "half" => Some(DType::F16),
            "short" => Some(DType::I16),
            "int" => Some(DType::I32),
            "long" => Some(DType::I64),
            _ => None,
        };
        alias
            .or_else(|| DType::ALL.into_iter().find(|d| d.name() == bare))
            .ok_or_else(|| {
                let known: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                crate::error::Error::InvalidArgument(format!(
                    "multiproc has no dtype {name:?}: it has {}",
                    known.join(", ")
                ))
            })
    }
}

pub(crate) mod sealed {
    /// What the kernels need from an element type. Not implementable outside the crate.
    pub trait Sealed: Copy + Send + Sync + PartialEq + 'static {
        /// The raw bits, zero-extended.
        fn to_bits(self) -> u64;
        /// The value whose raw bits are the low bytes of `bits`; total (any pattern is a
        /// value).
        fn from_bits(bits: u64) -> Self;
        /// The value as an f64 (exact for all but `i64` beyond 2^53).
        fn to_f64(self) -> f64;
        /// The nearest value to `v` (saturating, truncating toward zero for integers;
        /// `v != 0` for bool), as Rust's `as` does.
        fn from_f64_lossy(v: f64) -> Self;
        /// `v` itself if this type can hold it exactly (integers: integral and in
        /// range; bool: 0 or 1; floats: rounded to nearest, unless a finite `v`
        /// would overflow to infinity).
        fn from_f64_exact(v: f64) -> Option<Self>;
        /// `self + other` (wrapping for integers, logical or for bool).
        fn add(self, other: Self) -> Self;
        /// `self * other` (wrapping for integers, logical and for bool).
        fn mul(self, other: Self) -> Self;
    }
}

/// A Rust type that can be a tensor element: `f32 f64 f16 bf16 i8 i16 i32 i64 u8 u16 u32
/// u64 bool`.
///
/// Sealed: the set of element types is fixed by [`DType`].
pub trait Element: sealed::Sealed {
    /// The dtype whose elements are this type.
    const DTYPE: DType;
}

macro_rules! int_element {
    ($t:ty, $u:ty, $d:ident) => {
        impl sealed::Sealed for $t {
            fn to_bits(self) -> u64 {
                self as $u as u64
            }
            fn from_bits(bits: u64) -> Self {
                bits as $u as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64_lossy(v: f64) -> Self {
                v as $t
            }
            fn from_f64_exact(v: f64) -> Option<Self> {
                // `<$t>::MAX as f64` may round up (i64), so compare against the first value
                // past the range, which is a power of two and exact.
                let past_max = (<$t>::MAX as f64) + 1.0;
                (v.fract() == 0.0 && v >= <$t>::MIN as f64 && v < past_max).then(|| v as $t)
            }
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn mul(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }
        }
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    };
}

int_element!(i8, u8, I8);
int_element!(i16, u16, I16);
int_element!(i32, u32, I32);
int_element!(i64, u64, I64);
int_element!(u8, u8, U8);
int_element!(u16, u16, U16);
int_element!(u32, u32, U32);
int_element!(u64, u64, U64);

macro_rules! float_element {
    ($t:ty, $bits:ty, $d:ident, $to:expr, $from:expr) => {
        impl sealed::Sealed for $t {
            fn to_bits(self) -> u64 {
                self.to_bits() as u64
            }
            fn from_bits(bits: u64) -> Self {
                <$t>::from_bits(bits as $bits)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64_lossy(v: f64) -> Self {
                $from(v)
            }
            fn from_f64_exact(v: f64) -> Option<Self> {
                // Rounding is fine; overflowing a finite value to infinity is not (torch
                // refuses it too).
                let r = $from(v);
                (!v.is_finite() || $to(r).is_finite()).then_some(r)
            }
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn mul(self, other: Self) -> Self {
                self * other
            }
        }
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    };
}

float_element!(f32, u32, F32, |x: f32| x as f64, |v: f64| v as f32);
float_element!(f64, u64, F64, |x: f64| x, |v: f64| v);
float_element!(f16, u16, F16, f16::to_f64, f16::from_f64);
float_element!(bf16, u16, BF16, bf16::to_f64, bf16::from_f64);

impl sealed::Sealed for bool {
    fn to_bits(self) -> u64 {
        self as u64
    }
    fn from_bits(bits: u64) -> Self {
        bits as u8 != 0
    }
    fn to_f64(self) -> f64 {
        if self { 1.0 } else { 0.0 }
    }
    fn from_f64_lossy(v: f64) -> Self {
        v != 0.0
    }
    fn from_f64_exact(v: f64) -> Option<Self> {
        match v {
            0.0 => Some(false),
            1.0 => Some(true),
            _ => None,
        }
    }
    fn add(self, other: Self) -> Self {
        self | other
    }
    fn mul(self, other: Self) -> Self {
        self & other
    }
}

impl Element for bool {
    const DTYPE: DType = DType::Bool;
}

/// Runs `$body` with `$t` bound to the Rust type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::tensor::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::tensor::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::tensor::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::tensor::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::tensor::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::tensor::DType::I16 => {
                type $t = i16;
                $body
            }
            $crate::tensor::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::tensor::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::tensor::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::tensor::DType::Bool => {
                type $t = bool;
                $body
            }
            $crate::tensor::DType::U16 => {
                type $t = u16;
                $body
            }
            $crate::tensor::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::tensor::DType::U64 => {
                type $t = u64;
                $body
            }
        }
    };
}
pub(crate) use dispatch;

#[cfg(test)]
mod tests {
    use super::sealed::Sealed;
    use super::*;

    #[test]
    fn sizes_codes_and_names() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            let size = dispatch!(d, T => std::mem::size_of::<T>());
            assert_eq!(size, d.size(), "{d}");
            assert_eq!(dispatch!(d, T => T::DTYPE), d);
        }
        assert_eq!(DType::from_code(DType::ALL.len() as u8), None);
        assert_eq!(
            DType::U32.code(),
            11,
            "wire codes of existing dtypes never move"
        );
        assert_eq!(DType::BF16.to_string(), "bfloat16");
    }

    #[test]
    fn exact_conversions_refuse_what_does_not_fit() {
        assert_eq!(i8::from_f64_exact(127.0), Some(127));
        assert_eq!(i8::from_f64_exact(128.0), None);
        assert_eq!(i8::from_f64_exact(-128.0), Some(-128));
        assert_eq!(u8::from_f64_exact(-1.0), None);
        assert_eq!(u16::from_f64_exact(65_535.0), Some(u16::MAX));
        assert_eq!(u32::from_f64_exact(-1.0), None);
        assert_eq!(u64::from_f64_exact(18_446_744_073_709_551_616.0), None);
        assert_eq!(u64::from_f64_exact(9_007_199_254_740_992.0), Some(1 << 53));
        assert_eq!(i32::from_f64_exact(1.5), None);
        assert_eq!(i64::from_f64_exact(9_223_372_036_854_775_808.0), None);
        assert_eq!(
            i64::from_f64_exact(-9_223_372_036_854_775_808.0),
            Some(i64::MIN)
        );
        assert_eq!(bool::from_f64_exact(2.0), None);
        assert_eq!(f16::from_f64_exact(0.5), Some(f16::from_f32(0.5)));
        assert!(f32::from_f64_exact(f64::NAN).is_some_and(f32::is_nan));
    }

    #[test]
    fn bits_round_trip_and_any_pattern_is_a_value() {
        assert_eq!(f32::from_bits((-2.5f32).to_bits()), -2.5);
        assert_eq!(<i16 as Sealed>::from_bits((-3i16).to_bits()), -3);
        assert!(<bool as Sealed>::from_bits(2));
        assert_eq!(
            bf16::from_bits(bf16::from_f32(1.0).to_bits() as u64 as u16),
            bf16::ONE
        );
    }
}
