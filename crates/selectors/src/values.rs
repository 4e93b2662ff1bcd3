//! The Kubernetes CEL library types selectors use, for the `cel` crate: `quantity()` and
//! `semver()` values as opaques, with the member functions the Kubernetes library gives them
//! (`compareTo`, `isGreaterThan`, `isLessThan`; `major`/`minor`/`patch` on versions;
//! `asInteger`, `isInteger` (both for values of at least zero) and `sign` on quantities).
//! Arithmetic on quantities (`add`, `sub`) and `asApproximateFloat` are not provided; a
//! selector using them evaluates to an error.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use cel::extractors::This;
use cel::objects::Opaque;
use cel::{Context, ExecutionError, Value};
use gpu_dra_api::quantity::Quantity as ApiQuantity;

/// A Kubernetes quantity (`quantity('40Gi')`, and every `device.capacity` value).
#[derive(Clone)]
pub(crate) struct Quantity(pub(crate) ApiQuantity);

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.0.cmp_value(&other.0) == Ordering::Equal
    }
}
impl Eq for Quantity {}

impl fmt::Debug for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quantity('{}')", self.0)
    }
}

impl Opaque for Quantity {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Quantity"
    }
}

/// A semantic version (`semver('580.95.5')`, and every version attribute).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Semver {
    core: [u64; 3],
    pre: Vec<String>,
    text: String,
}

impl fmt::Debug for Semver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "semver('{}')", self.text)
    }
}

impl Opaque for Semver {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Semver"
    }
}

impl Semver {
    /// Strict semver as Kubernetes' `semver()` takes it: `major.minor.patch`, no leading
    /// zeros, optional `-prerelease` and `+build`.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let (rest, _build) = text.split_once('+').unwrap_or((text, ""));
        let (core, pre) = match rest.split_once('-') {
            Some((c, p)) => (c, p.split('.').map(str::to_owned).collect()),
            None => (rest, Vec::new()),
        };
        let parts: Vec<&str> = core.split('.').collect();
        let [major, minor, patch] = parts[..] else {
            return Err(format!(
                "{text:?} is not a semantic version: semver() needs major.minor.patch, e.g. '1.2.3'"
            ));
        };
        let mut nums = [0u64; 3];
        for (slot, part) in nums.iter_mut().zip([major, minor, patch]) {
            let ok = !part.is_empty()
                && part.bytes().all(|b| b.is_ascii_digit())
                && (part == "0" || !part.starts_with('0'));
            *slot = part
                .parse()
                .ok()
                .filter(|_| ok)
                .ok_or_else(|| format!("{text:?} is not a semantic version: {part:?} is not a number without leading zeros"))?;
        }
        Ok(Semver {
            core: nums,
            pre,
            text: text.to_owned(),
        })
    }

    fn cmp(&self, other: &Self) -> Ordering {
        self.core
            .cmp(&other.core)
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&other.pre) {
                        let o = match (a.parse::<u64>(), b.parse::<u64>()) {
                            (Ok(x), Ok(y)) => x.cmp(&y),
                            (Ok(_), Err(_)) => Ordering::Less,
                            (Err(_), Ok(_)) => Ordering::Greater,
                            (Err(_), Err(_)) => a.cmp(b),
                        };
                        if o != Ordering::Equal {
                            return o;
                        }
                    }
                    self.pre.len().cmp(&other.pre.len())
                }
            })
    }
}

pub(crate) fn quantity_value(q: ApiQuantity) -> Value {
    Value::Opaque(Arc::new(Quantity(q)))
}

pub(crate) fn semver_value(v: Semver) -> Value {
    Value::Opaque(Arc::new(v))
}

fn as_quantity(v: &Value) -> Option<&Quantity> {
    match v {
        Value::Opaque(o) => o.downcast_ref::<Quantity>(),
        _ => None,
    }
}

fn as_semver(v: &Value) -> Option<&Semver> {
    match v {
        Value::Opaque(o) => o.downcast_ref::<Semver>(),
        _ => None,
    }
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Opaque(o) => o.runtime_type_name().to_owned(),
        other => other.type_of().to_string(),
    }
}

fn compare(func: &str, this: &Value, other: &Value) -> Result<Ordering, ExecutionError> {
    if let (Some(a), Some(b)) = (as_quantity(this), as_quantity(other)) {
        return Ok(a.0.cmp_value(&b.0));
    }
    if let (Some(a), Some(b)) = (as_semver(this), as_semver(other)) {
        return Ok(a.cmp(b));
    }
    Err(ExecutionError::no_such_member_overload(
        func,
        vec![type_name(this), type_name(other)],
    ))
}

fn ordering_int(o: Ordering) -> Value {
    Value::Int(match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    })
}

/// Adds `quantity`, `semver`, `isQuantity`, `isSemver` and the member functions of both types.
pub(crate) fn register(ctx: &mut Context<'_, '_>) -> Result<(), cel::DeclarationError> {
    ctx.add_function(
        "quantity",
        |s: Arc<String>| -> Result<Value, ExecutionError> {
            ApiQuantity::parse(&s)
                .map(quantity_value)
                .map_err(|e| ExecutionError::function_error("quantity", e))
        },
    )?;
    ctx.add_function("isQuantity", |s: Arc<String>| {
        ApiQuantity::parse(&s).is_ok()
    })?;
    ctx.add_function(
        "semver",
        |s: Arc<String>| -> Result<Value, ExecutionError> {
            Semver::parse(&s)
                .map(semver_value)
                .map_err(|e| ExecutionError::function_error("semver", e))
        },
    )?;
    ctx.add_function("isSemver", |s: Arc<String>| Semver::parse(&s).is_ok())?;
    ctx.add_function(
        "compareTo",
        |This(this): This<Value>, other: Value| -> Result<Value, ExecutionError> {
            compare("compareTo", &this, &other).map(ordering_int)
        },
    )?;
    ctx.add_function(
        "isGreaterThan",
        |This(this): This<Value>, other: Value| -> Result<bool, ExecutionError> {
            compare("isGreaterThan", &this, &other).map(Ordering::is_gt)
        },
    )?;
    ctx.add_function(
        "isLessThan",
        |This(this): This<Value>, other: Value| -> Result<bool, ExecutionError> {
            compare("isLessThan", &this, &other).map(Ordering::is_lt)
        },
    )?;
    for (name, at) in [("major", 0usize), ("minor", 1), ("patch", 2)] {
        ctx.add_function(
            name,
            move |This(this): This<Value>| -> Result<Value, ExecutionError> {
                as_semver(&this)
                    .map(|v| Value::Int(v.core[at] as i64))
                    .ok_or_else(|| {
                        ExecutionError::no_such_member_overload(name, vec![type_name(&this)])
                    })
            },
        )?;
    }
    ctx.add_function(
        "isInteger",
        |This(this): This<Value>| -> Result<bool, ExecutionError> {
            as_quantity(&this)
                .map(|q| q.0.to_u64_exact().is_some() || q.0.is_zero())
                .ok_or_else(|| {
                    ExecutionError::no_such_member_overload("isInteger", vec![type_name(&this)])
                })
        },
    )?;
    ctx.add_function(
        "asInteger",
        |This(this): This<Value>| -> Result<Value, ExecutionError> {
            let q = as_quantity(&this).ok_or_else(|| {
                ExecutionError::no_such_member_overload("asInteger", vec![type_name(&this)])
            })?;
            q.0.to_u64_exact()
                .and_then(|n| i64::try_from(n).ok())
                .map(Value::Int)
                .ok_or_else(|| ExecutionError::function_error("asInteger", "not an integer"))
        },
    )?;
    ctx.add_function(
        "sign",
        |This(this): This<Value>| -> Result<Value, ExecutionError> {
            let q = as_quantity(&this).ok_or_else(|| {
                ExecutionError::no_such_member_overload("sign", vec![type_name(&this)])
            })?;
            Ok(Value::Int(if q.0.is_zero() {
                0
            } else if q.0.is_negative() {
                -1
            } else {
                1
            }))
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_registers_and_evaluates() {
        let mut ctx = Context::default();
        register(&mut ctx).expect("no clash with the standard library");
        for expr in [
            "quantity('1Gi').compareTo(quantity('1024Mi')) == 0",
            "quantity('2').isGreaterThan(quantity('1500m'))",
            "!quantity('1').isLessThan(quantity('1'))",
            "isQuantity('1Gi') && !isQuantity('1GB')",
            "semver('1.2.3').major() == 1 && semver('1.2.3').minor() == 2",
            "semver('1.2.3').patch() == 3 && semver('1.2.3') == semver('1.2.3')",
            "isSemver('1.2.3') && !isSemver('1.2')",
            "semver('1.10.0').isGreaterThan(semver('1.9.0'))",
            "quantity('3').asInteger() == 3 && !quantity('1.5').isInteger()",
            "quantity('-1').sign() == -1 && quantity('0').sign() == 0",
        ] {
            let program = cel::Program::compile(expr).expect("parses");
            assert_eq!(program.execute(&ctx), Ok(Value::Bool(true)), "{expr}");
        }
        let mixed = cel::Program::compile("quantity('1').compareTo(semver('1.0.0'))").unwrap();
        assert!(program_error(&mixed.execute(&ctx)).contains("compareTo"));
    }

    fn program_error(r: &Result<Value, ExecutionError>) -> String {
        match r {
            Ok(v) => panic!("evaluated to {v:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn versions_order_as_semver_does() {
        let v = |s: &str| Semver::parse(s).unwrap();
        assert_eq!(v("580.95.5").cmp(&v("575.0.0")), Ordering::Greater);
        assert_eq!(v("1.0.0-rc.1").cmp(&v("1.0.0")), Ordering::Less);
        assert_eq!(v("1.0.0-2").cmp(&v("1.0.0-10")), Ordering::Less);
        assert!(Semver::parse("575").is_err());
        assert!(Semver::parse("01.0.0").is_err());
    }
}
