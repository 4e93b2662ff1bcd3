//! Kubernetes resource quantities (`5Gi`, `500m`, `1.5e3`), parsed and converted exactly.
//!
//! Grammar (as Kubernetes `resource.Quantity`):
//!
//! ```text
//! quantity  = [sign] number [suffix]
//! number    = digits | digits "." [digits] | "." digits
//! suffix    = binary | decimal | exponent
//! binary    = "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei"            (powers of 1024)
//! decimal   = "n" | "u" | "m" | "" | "k" | "M" | "G" | "T" | "P" | "E"   (powers of 1000)
//! exponent  = ("e" | "E") [sign] digits                           (power of 10)
//! ```
//!
//! Invariant: a [`Quantity`] holds its value exactly as `±mantissa × 10^scale × 1024^binary`
//! with an arbitrary-size integer mantissa; no floating point is involved anywhere, so
//! `0.1Gi` is exactly 107374182.4 bytes and [`Quantity::to_bytes_ceil`] gives 107374183.
//! Input is limited to [`MAX_LEN`] characters so that parsing stays cheap on hostile input.

use std::fmt;

/// Longest accepted quantity text; real quantities are far shorter.
pub const MAX_LEN: usize = 64;
/// Largest accepted exponent magnitude (`e1000000`).
const MAX_EXPONENT: i64 = 1_000_000;

const BINARY: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
const DECIMAL: [(&str, i64); 10] = [
    ("n", -9),
    ("u", -6),
    ("m", -3),
    ("", 0),
    ("k", 3),
    ("M", 6),
    ("G", 9),
    ("T", 12),
    ("P", 15),
    ("E", 18),
];
const VALID: &str = "a number with an optional sign and decimals, then an optional suffix: \
    binary Ki Mi Gi Ti Pi Ei, decimal n u m k M G T P E, or an exponent e<N>/E<N> \
    (e.g. 5Gi, 500M, 1.5e3)";

/// Why a quantity could not be parsed or converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text does not follow the quantity grammar.
    #[error("invalid quantity {text:?}: {reason}; expected {VALID}")]
    Syntax {
        /// The offending text.
        text: String,
        /// What exactly is wrong.
        reason: String,
    },
    /// The value does not fit the requested integer type.
    #[error("quantity {0} is too large")]
    Overflow(String),
    /// A negative value was converted to an unsigned integer.
    #[error("quantity {0} is negative")]
    Negative(String),
}

/// How the quantity was written; picks the suffix family of the canonical display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Powers of 1024 (`Ki` .. `Ei`).
    BinarySi,
    /// Powers of 1000 (`n` .. `E`) or no suffix.
    DecimalSi,
    /// `e<N>` / `E<N>`.
    DecimalExponent,
}

/// An exactly represented Kubernetes quantity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantity {
    negative: bool,
    /// Little-endian base-2^32 digits, no trailing (most significant) zero limbs.
    mantissa: Big,
    scale: i64,
    binary: u32,
    format: Format,
}

impl Quantity {
    /// Parses a quantity (see the module documentation for the grammar).
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let err = |reason: &str| QuantityError::Syntax {
            text: text.to_owned(),
            reason: reason.to_owned(),
        };
        if text.is_empty() {
            return Err(err("empty"));
        }
        if text.len() > MAX_LEN {
            return Err(err(&format!("longer than {MAX_LEN} characters")));
        }
        let bytes = text.as_bytes();
        let mut pos = 0;
        let negative = match bytes[0] {
            b'-' => {
                pos = 1;
                true
            }
            b'+' => {
                pos = 1;
                false
            }
            _ => false,
        };
        let int_start = pos;
        while pos < bytes.len() && bytes[pos].is_ascii_digit() {
            pos += 1;
        }
        let int_digits = &text[int_start..pos];
        let mut frac_digits = "";
        if pos < bytes.len() && bytes[pos] == b'.' {
            pos += 1;
            let frac_start = pos;
            while pos < bytes.len() && bytes[pos].is_ascii_digit() {
                pos += 1;
            }
            frac_digits = &text[frac_start..pos];
        }
        if int_digits.is_empty() && frac_digits.is_empty() {
            return Err(err("no digits before the suffix"));
        }
        let suffix = &text[pos..];
        let mut scale: i64 = -(frac_digits.len() as i64);
        let mut binary = 0;
        let format;
        if let Some(i) = BINARY.iter().position(|s| *s == suffix) {
            binary = i as u32 + 1;
            format = Format::BinarySi;
        } else if let Some((_, exp)) = DECIMAL.iter().find(|(s, _)| *s == suffix) {
            scale += exp;
            format = Format::DecimalSi;
        } else if let Some(exp) = suffix
            .strip_prefix('e')
            .or_else(|| suffix.strip_prefix('E'))
        {
            let digits = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(err(&format!(
                    "exponent {suffix:?} must be e or E followed by an integer"
                )));
            }
            let value: i64 = exp
                .parse()
                .ok()
                .filter(|v: &i64| v.abs() <= MAX_EXPONENT)
                .ok_or_else(|| err("exponent out of range -1000000..=1000000"))?;
            scale += value;
            format = Format::DecimalExponent;
        } else {
            return Err(err(&format!("unknown suffix {suffix:?}")));
        }
        let mut mantissa = Big::zero();
        for b in int_digits.bytes().chain(frac_digits.bytes()) {
            mantissa.mul_add(10, u32::from(b - b'0'));
        }
        let mut q = Quantity {
            negative,
            mantissa,
            scale,
            binary,
            format,
        };
        q.normalize();
        // Bounding the overall scale keeps every displayed form parseable again.
        if q.scale.abs() > MAX_EXPONENT {
            return Err(err("exponent out of range -1000000..=1000000"));
        }
        Ok(q)
    }

    /// Moves trailing decimal zeros of the mantissa into the scale; zero is never negative.
    fn normalize(&mut self) {
        if self.mantissa.is_zero() {
            self.negative = false;
            self.scale = 0;
            return;
        }
        loop {
            let mut m = self.mantissa.clone();
            if m.div_rem(10) != 0 {
                break;
            }
            self.mantissa = m;
            self.scale += 1;
        }
    }

    /// A whole number of units (bytes for memory) written in `format`; with
    /// [`Format::BinarySi`] it displays as the API server returns such a capacity (`40Gi`).
    pub fn from_u64(value: u64, format: Format) -> Self {
        let mut mantissa = Big(vec![
            (value & u64::from(u32::MAX)) as u32,
            (value >> 32) as u32,
        ]);
        mantissa.trim();
        Quantity {
            negative: false,
            mantissa,
            scale: 0,
            binary: 0,
            format,
        }
    }

    /// The value as a whole number of units, or `None` when it is negative, fractional or
    /// larger than `u64` (`1.5Ki` gives 1536, `0.5` gives `None`).
    pub fn to_u64_exact(&self) -> Option<u64> {
        match self.whole_units() {
            Some((n, false)) if !self.negative => Some(n),
            _ => None,
        }
    }

    /// The magnitude truncated to whole units, and whether a fraction was dropped; `None` when
    /// it does not fit `u64`.
    fn whole_units(&self) -> Option<(u64, bool)> {
        let mut n = self.mantissa.clone();
        for _ in 0..self.binary {
            n.mul_add(1024, 0);
        }
        if self.scale >= 0 {
            for _ in 0..self.scale {
                n.mul_add(10, 0);
                n.to_u64()?;
            }
            return Some((n.to_u64()?, false));
        }
        let mut inexact = false;
        for _ in 0..self.scale.unsigned_abs() {
            if n.is_zero() {
                break;
            }
            inexact |= n.div_rem(10) != 0;
        }
        Some((n.to_u64()?, inexact))
    }

    /// Compares the values exactly (`1Gi` equals `1024Mi`), as Kubernetes' `Quantity.Cmp` and
    /// CEL's `quantity(a).compareTo(quantity(b))` do.
    pub fn cmp_value(&self, other: &Self) -> std::cmp::Ordering {
        let sign = |q: &Self| match (q.is_zero(), q.negative) {
            (true, _) => 0i8,
            (false, true) => -1,
            (false, false) => 1,
        };
        let (a, b) = (sign(self), sign(other));
        if a != b || a == 0 {
            return a.cmp(&b);
        }
        let magnitude = |q: &Self, down_to: i64| {
            let mut n = q.mantissa.clone();
            for _ in 0..q.binary {
                n.mul_add(1024, 0);
            }
            for _ in down_to..q.scale {
                n.mul_add(10, 0);
            }
            n
        };
        let low = self.scale.min(other.scale);
        // Scales far apart would need huge numbers; the larger exponent wins whenever the
        // mantissas (at most a few hundred bits here) cannot make up for the difference.
        let ordering = if self.scale.abs_diff(other.scale) > 400 {
            self.scale.cmp(&other.scale)
        } else {
            let (x, y) = (magnitude(self, low), magnitude(other, low));
            x.0.len()
                .cmp(&y.0.len())
                .then_with(|| x.0.iter().rev().cmp(y.0.iter().rev()))
        };
        if a < 0 { ordering.reverse() } else { ordering }
    }

    /// True for values below zero.
    pub fn is_negative(&self) -> bool {
        self.negative
    }

    /// True for zero (`0`, `0Gi`, `-0.0`).
    pub fn is_zero(&self) -> bool {
        self.mantissa.is_zero()
    }

    /// How the quantity was written.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The value rounded up to a whole number of units (bytes for memory), as Kubernetes
    /// does for `Value()`: `0.5` gives 1, `1.5Ki` gives 1536.
    pub fn to_bytes_ceil(&self) -> Result<u64, QuantityError> {
        if self.negative {
            return Err(QuantityError::Negative(self.to_string()));
        }
        let overflow = || QuantityError::Overflow(self.to_string());
        match self.whole_units() {
            Some((floor, true)) => floor.checked_add(1).ok_or_else(overflow),
            Some((whole, false)) => Ok(whole),
            None => Err(overflow()),
        }
    }
}

impl std::str::FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Canonical form, as Kubernetes writes it: binary quantities that are whole numbers of at
/// least 1024 keep the largest binary suffix that divides them exactly (`1024Mi` -> `1Gi`,
/// `1.5Ki` -> `1536`, `2000` stays `2000`); everything else is an integer mantissa with the
/// largest decimal suffix that keeps it whole (`1500` -> `1500`, `1000` -> `1k`, `0.5` ->
/// `500m`). Values below `1n` or above the `E` range are written with an exponent (`1e-12`).
impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_zero() {
            return f.write_str("0");
        }
        if self.negative {
            f.write_str("-")?;
        }
        // Exact integer value times 1024^binary, with decimal scale kept separately.
        let mut m = self.mantissa.clone();
        for _ in 0..self.binary {
            m.mul_add(1024, 0);
        }
        let mut scale = self.scale;
        // Renormalize: the binary multiplication may have produced trailing decimal zeros.
        loop {
            let mut t = m.clone();
            if t.div_rem(10) != 0 {
                break;
            }
            m = t;
            scale += 1;
        }
        if self.format == Format::BinarySi && scale >= 0 {
            let mut whole = m.clone();
            for _ in 0..scale {
                whole.mul_add(10, 0);
            }
            // Below 1024 Kubernetes switches to decimal SI (`1000` -> `1k`).
            if whole.at_least(1024) {
                let mut suffix = 0;
                while suffix < BINARY.len() {
                    let mut t = whole.clone();
                    if t.div_rem(1024) != 0 {
                        break;
                    }
                    whole = t;
                    suffix += 1;
                }
                let name = if suffix == 0 { "" } else { BINARY[suffix - 1] };
                return write!(f, "{whole}{name}");
            }
        }
        let mut exp3 = scale.div_euclid(3) * 3;
        if exp3 < -MAX_EXPONENT {
            // Keep the display parseable at the very edge of the exponent range.
            exp3 = scale;
        }
        for _ in 0..(scale - exp3) {
            m.mul_add(10, 0);
        }
        match DECIMAL.iter().find(|(_, e)| *e == exp3) {
            Some((s, _)) if self.format != Format::DecimalExponent || exp3 == 0 => {
                write!(f, "{m}{s}")
            }
            _ if exp3 > 18 && self.format != Format::DecimalExponent => {
                for _ in 0..(exp3 - 18) {
                    m.mul_add(10, 0);
                }
                write!(f, "{m}E")
            }
            _ => write!(f, "{m}e{exp3}"),
        }
    }
}

/// A minimal unsigned big integer: enough for exact quantity arithmetic (multiply by a small
/// number and add, divide by a small number), nothing more.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Big(Vec<u32>);

impl Big {
    fn zero() -> Self {
        Big(Vec::new())
    }

    fn is_zero(&self) -> bool {
        self.0.is_empty()
    }

    /// self = self * mul + add.
    fn mul_add(&mut self, mul: u32, add: u32) {
        let mut carry = u64::from(add);
        for limb in &mut self.0 {
            let v = u64::from(*limb) * u64::from(mul) + carry;
            *limb = v as u32;
            carry = v >> 32;
        }
        if carry != 0 {
            self.0.push(carry as u32);
        }
        self.trim();
    }

    /// self = self / div, returning the remainder. `div` must not be zero.
    fn div_rem(&mut self, div: u32) -> u32 {
        let mut rem = 0u64;
        for limb in self.0.iter_mut().rev() {
            let v = (rem << 32) | u64::from(*limb);
            *limb = (v / u64::from(div)) as u32;
            rem = v % u64::from(div);
        }
        self.trim();
        rem as u32
    }

    fn trim(&mut self) {
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    fn at_least(&self, n: u32) -> bool {
        self.0.len() > 1 || self.0.first().is_some_and(|&limb| limb >= n)
    }

    fn to_u64(&self) -> Option<u64> {
        match self.0.as_slice() {
            [] => Some(0),
            [a] => Some(u64::from(*a)),
            [a, b] => Some(u64::from(*a) | (u64::from(*b) << 32)),
            _ => None,
        }
    }
}

impl fmt::Display for Big {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_zero() {
            return f.write_str("0");
        }
        let mut chunks = Vec::new();
        let mut n = self.clone();
        while !n.is_zero() {
            chunks.push(n.div_rem(1_000_000_000));
        }
        let mut iter = chunks.iter().rev();
        if let Some(first) = iter.next() {
            write!(f, "{first}")?;
        }
        for c in iter {
            write!(f, "{c:09}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_byte_counts_display_as_the_api_server_returns_them() {
        let table: &[(u64, &str)] = &[
            (0, "0"),
            (14, "14"),
            (1000, "1k"),
            (1023, "1023"),
            (1024, "1Ki"),
            (1536, "1536"),
            (2000, "2000"),
            (40 << 30, "40Gi"),
            (4864 << 20, "4864Mi"),
            (u64::MAX, "18446744073709551615"),
        ];
        for &(value, text) in table {
            let q = Quantity::from_u64(value, Format::BinarySi);
            assert_eq!(q.to_string(), text, "{value}");
            assert_eq!(Quantity::parse(text).unwrap().to_u64_exact(), Some(value));
        }
        for text in ["0.5", "-1", "1.5", "1e-3", "18446744073709551616", "20E"] {
            assert_eq!(
                Quantity::parse(text).unwrap().to_u64_exact(),
                None,
                "{text}"
            );
        }
        assert_eq!(Quantity::parse("1.5Ki").unwrap().to_u64_exact(), Some(1536));
        assert_eq!(
            Quantity::parse("2M").unwrap().to_u64_exact(),
            Some(2_000_000)
        );
    }

    #[test]
    fn parses_and_converts_exactly() {
        // (input, bytes rounded up, canonical display)
        let table: &[(&str, u64, &str)] = &[
            ("0", 0, "0"),
            ("-0", 0, "0"),
            ("+0.0Gi", 0, "0"),
            ("1", 1, "1"),
            ("+1", 1, "1"),
            ("1024", 1024, "1024"),
            ("1500", 1500, "1500"),
            ("1000", 1000, "1k"),
            ("1k", 1000, "1k"),
            ("1.5k", 1500, "1500"),
            ("1M", 1_000_000, "1M"),
            ("5G", 5_000_000_000, "5G"),
            ("2T", 2_000_000_000_000, "2T"),
            ("1P", 1_000_000_000_000_000, "1P"),
            ("1E", 1_000_000_000_000_000_000, "1E"),
            ("1Ki", 1024, "1Ki"),
            ("1.5Ki", 1536, "1536"),
            ("1Mi", 1 << 20, "1Mi"),
            ("1024Mi", 1 << 30, "1Gi"),
            ("1536Mi", 1536 << 20, "1536Mi"),
            ("5Gi", 5 << 30, "5Gi"),
            ("0.5Gi", 512 << 20, "512Mi"),
            ("0.1Gi", 107_374_183, "107374182400m"),
            ("1Ti", 1 << 40, "1Ti"),
            ("1Pi", 1 << 50, "1Pi"),
            ("1Ei", 1 << 60, "1Ei"),
            ("15Ei", 15 << 60, "15Ei"),
            ("500m", 1, "500m"),
            ("0.5", 1, "500m"),
            (".5", 1, "500m"),
            ("5.", 5, "5"),
            ("1n", 1, "1n"),
            ("1u", 1, "1u"),
            ("1500m", 2, "1500m"),
            ("1e3", 1000, "1e3"),
            ("1E3", 1000, "1e3"),
            ("1.5E-3", 1, "1500e-6"),
            ("1e-12", 1, "1e-12"),
            ("15e2", 1500, "1500"),
            ("1e+3", 1000, "1e3"),
            ("0001", 1, "1"),
            (
                "12345678901234567890",
                12_345_678_901_234_567_890,
                "12345678901234567890",
            ),
            ("18446744073709551615", u64::MAX, "18446744073709551615"),
            ("1e-1000000", 1, "1e-1000000"),
        ];
        for (input, bytes, display) in table {
            let q = Quantity::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(q.to_bytes_ceil(), Ok(*bytes), "{input} bytes");
            assert_eq!(q.to_string(), *display, "{input} display");
            // Display is itself a valid quantity with the same value.
            let again = Quantity::parse(display).unwrap_or_else(|e| panic!("{display}: {e}"));
            assert_eq!(again.to_bytes_ceil(), Ok(*bytes), "{display} reparsed");
        }
    }

    #[test]
    fn large_values_display_without_loss() {
        assert_eq!(Quantity::parse("1e21").unwrap().to_string(), "1e21");
        assert_eq!(Quantity::parse("1000E").unwrap().to_string(), "1000E");
        assert_eq!(Quantity::parse("1000000E").unwrap().to_string(), "1000000E");
        assert_eq!(Quantity::parse("-5Gi").unwrap().to_string(), "-5Gi");
        assert_eq!(Quantity::parse("-1.5").unwrap().to_string(), "-1500m");
    }

    #[test]
    fn rejects_malformed_text_saying_what_is_valid() {
        for (input, reason) in [
            ("", "empty"),
            ("1Qi", "unknown suffix \"Qi\""),
            ("1.2.3", "unknown suffix \".3\""),
            ("--1", "no digits"),
            ("+-1", "no digits"),
            ("Mi", "no digits"),
            ("-", "no digits"),
            (".", "no digits"),
            ("1 Gi", "unknown suffix \" Gi\""),
            ("1gi", "unknown suffix \"gi\""),
            ("1KI", "unknown suffix \"KI\""),
            ("1K", "unknown suffix \"K\""),
            ("1e", "exponent \"e\""),
            ("1e1.5", "exponent \"e1.5\""),
            ("1e+", "exponent \"e+\""),
            ("1e99999999", "exponent out of range"),
            ("1e99999999999999999999", "exponent out of range"),
            ("1000e1000000", "exponent out of range"),
            ("0.1e-1000000", "exponent out of range"),
            ("0x10", "unknown suffix \"x10\""),
            ("١", "no digits"),
        ] {
            let err = Quantity::parse(input).expect_err(input).to_string();
            assert!(err.contains(reason), "{input}: {err}");
            assert!(err.contains("expected a number"), "{input}: {err}");
        }
        let long = "1".repeat(MAX_LEN + 1);
        assert!(Quantity::parse(&long).is_err());
    }

    #[test]
    fn conversion_reports_overflow_and_sign() {
        for input in [
            "16Ei",
            "18446744073709551616",
            "1e20",
            "100000E",
            "1e1000000",
        ] {
            let q = Quantity::parse(input).unwrap();
            assert!(
                matches!(q.to_bytes_ceil(), Err(QuantityError::Overflow(_))),
                "{input}"
            );
        }
        let q = Quantity::parse("-1Mi").unwrap();
        assert_eq!(
            q.to_bytes_ceil().unwrap_err().to_string(),
            "quantity -1Mi is negative"
        );
        // Rounding up past u64::MAX is an overflow too.
        let q = Quantity::parse("18446744073709551615.5").unwrap();
        assert!(matches!(q.to_bytes_ceil(), Err(QuantityError::Overflow(_))));
    }

    #[test]
    fn values_compare_exactly_across_suffixes() {
        use std::cmp::Ordering::*;
        let q = |s: &str| Quantity::parse(s).unwrap();
        assert_eq!(q("1Gi").cmp_value(&q("1024Mi")), Equal);
        assert_eq!(q("40Gi").cmp_value(&q("40G")), Greater);
        assert_eq!(q("0.5").cmp_value(&q("500m")), Equal);
        assert_eq!(q("-1").cmp_value(&q("1m")), Less);
        assert_eq!(q("-2Ki").cmp_value(&q("-1Ki")), Less);
        assert_eq!(q("0").cmp_value(&q("-0Gi")), Equal);
        assert_eq!(q("1e3").cmp_value(&q("1k")), Equal);
    }

    #[test]
    fn formats_are_remembered() {
        assert_eq!(Quantity::parse("1Ki").unwrap().format(), Format::BinarySi);
        assert_eq!(Quantity::parse("1k").unwrap().format(), Format::DecimalSi);
        assert_eq!(Quantity::parse("1").unwrap().format(), Format::DecimalSi);
        assert_eq!(
            Quantity::parse("1e3").unwrap().format(),
            Format::DecimalExponent
        );
        assert!(Quantity::parse("-1").unwrap().is_negative());
        assert!(Quantity::parse("0.000Ki").unwrap().is_zero());
    }
}
