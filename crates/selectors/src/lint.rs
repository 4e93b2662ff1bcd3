//! Static checks of CEL selectors against the schema of what our driver publishes.
//!
//! The schema is `gpu_dra_core::slices::{ATTRIBUTES, CAPACITIES}`, the table the renderer is
//! checked against, so a name that the renderer starts to publish is known here at once.
//!
//! The `cel` crate parses but has no type checker, so [`lint_expression`] walks the AST and
//! infers types only where it can be sure: values read from `device.attributes[domain][name]`
//! (typed by the schema) and `device.capacity[...]` (quantities), literals, and the results of
//! `quantity()`, `semver()` and their member functions. Everything else is unknown, and an
//! unknown operand never produces a finding: a false warning teaches users to ignore the lint.
//!
//! Findings are [`Severity::Warning`] (the selector is almost certainly wrong for our devices)
//! or [`Severity::Info`] (legitimate in some set-ups, e.g. another driver's domain). They are
//! never errors: the webhook only warns; `gpu-dra validate --strict` fails on warnings.

use std::collections::BTreeSet;

use cel::common::ast::{Expr, IdedExpr, LiteralValue, operators};
use gpu_dra_core::slices::{self, AttributeType, DeviceKind};
use serde::Serialize;
use serde_json::Value;

use crate::unparse::unparse;

/// The domain of the standard attributes (`resource.kubernetes.io/pciBusID`).
pub const STANDARD_DOMAIN: &str = "resource.kubernetes.io";

/// How sure a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Legitimate in some set-ups; worth a look.
    Info,
    /// Almost certainly a mistake for our devices.
    Warning,
}

impl Severity {
    /// `info` or `warning`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::Warning => "warning",
        }
    }
}

/// One finding about one selector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// How sure.
    pub severity: Severity,
    /// What is wrong and what to write instead.
    pub message: String,
}

/// What a selector is checked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    /// Our driver name: the domain of our unqualified attribute names.
    pub driver: &'a str,
    /// The kinds of devices the selector can see (one for our DeviceClasses, both otherwise).
    pub kinds: &'a [DeviceKind],
    /// The DeviceClass the selector is used with, for messages.
    pub class: Option<&'a str>,
}

/// Names users write that neither this driver nor NVIDIA's publishes, with what to do instead.
const HINTS: &[(&str, &str)] = &[(
    "index",
    "GPU indexes are not published by either driver (NVML's enumeration order is not stable \
     across reboots); to get several GPUs set `count` on the request, to pick one select on \
     `uuid`, `productName` or `resource.kubernetes.io/pciBusID`",
)];

/// The static type of an expression, as far as it is known.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ty {
    Unknown,
    Bool,
    Int,
    Double,
    String,
    Version,
    Quantity,
    Device,
    /// `device.attributes` or `device.capacity`.
    Domains {
        capacity: bool,
    },
    /// `device.attributes['d']`: `ours` when the domain is one we publish in.
    Names {
        capacity: bool,
        domain: String,
        ours: bool,
    },
}

/// A typed expression: its type and, when it is read from a device, what it is (for messages).
struct Typed {
    ty: Ty,
    what: Option<String>,
}

impl Typed {
    fn of(ty: Ty) -> Self {
        Typed { ty, what: None }
    }
    fn unknown() -> Self {
        Self::of(Ty::Unknown)
    }
}

fn type_word(ty: &Ty) -> &'static str {
    match ty {
        Ty::Bool => "bool",
        Ty::Int => "int",
        Ty::Double => "double",
        Ty::String => "string",
        Ty::Version => "version",
        Ty::Quantity => "quantity",
        _ => "value",
    }
}

/// Parses `source` and checks it for `target`. A parse error is the only finding then.
pub fn lint_expression(source: &str, target: &Target<'_>) -> Vec<Finding> {
    let expr = match cel::parser::Parser::new().parse(source) {
        Ok(e) => e,
        Err(errs) => {
            return errs
                .errors
                .iter()
                .take(1)
                .map(|e| Finding {
                    severity: Severity::Warning,
                    message: format!(
                        "does not parse: line {}, column {}: {}",
                        e.pos.0, e.pos.1, e.msg
                    ),
                })
                .collect();
        }
    };
    let mut linter = Linter {
        target,
        findings: Vec::new(),
        seen: BTreeSet::new(),
    };
    linter.infer(&expr);
    linter.findings
}

struct Linter<'t, 'a> {
    target: &'t Target<'a>,
    findings: Vec<Finding>,
    seen: BTreeSet<String>,
}

fn string_literal(e: &IdedExpr) -> Option<&str> {
    match &e.expr {
        Expr::Literal(LiteralValue::String(s)) => Some(s.inner()),
        _ => None,
    }
}

fn is_ordering(op: &str) -> bool {
    [
        operators::LESS,
        operators::LESS_EQUALS,
        operators::GREATER,
        operators::GREATER_EQUALS,
    ]
    .contains(&op)
}

const STRING_FUNCTIONS: &[&str] = &[
    "startsWith",
    "endsWith",
    "contains",
    "matches",
    "lowerAscii",
    "upperAscii",
    "split",
    "trim",
    "replace",
    "indexOf",
    "lastIndexOf",
    "substring",
    "charAt",
];

impl Linter<'_, '_> {
    fn push(&mut self, severity: Severity, message: String) {
        if self.seen.insert(message.clone()) {
            self.findings.push(Finding { severity, message });
        }
    }

    fn class_words(&self) -> String {
        match (self.target.class, self.target.kinds) {
            (Some(c), [DeviceKind::Gpu]) => format!("DeviceClass {c} selects whole GPUs"),
            (Some(c), [DeviceKind::Mig]) => format!("DeviceClass {c} selects MIG devices"),
            (Some(c), _) => format!("DeviceClass {c}"),
            (None, _) => "this selector".to_owned(),
        }
    }

    fn infer(&mut self, e: &IdedExpr) -> Typed {
        match &e.expr {
            Expr::Literal(lit) => Typed::of(match lit {
                LiteralValue::Boolean(_) => Ty::Bool,
                LiteralValue::Int(_) | LiteralValue::UInt(_) => Ty::Int,
                LiteralValue::Double(_) => Ty::Double,
                LiteralValue::String(_) => Ty::String,
                _ => Ty::Unknown,
            }),
            Expr::Ident(name) if name == "device" => Typed::of(Ty::Device),
            Expr::Ident(_) => Typed::unknown(),
            Expr::Select(s) => {
                let operand = self.infer(&s.operand);
                let t = self.member(e, &operand, &s.field, s.test);
                if s.test { Typed::of(Ty::Bool) } else { t }
            }
            Expr::Call(c) => self.call(e, &c.func_name, c.target.as_deref(), &c.args),
            Expr::List(l) => {
                for el in &l.elements {
                    self.infer(el);
                }
                Typed::unknown()
            }
            Expr::Comprehension(c) => {
                for part in [
                    &c.iter_range,
                    &c.accu_init,
                    &c.loop_cond,
                    &c.loop_step,
                    &c.result,
                ] {
                    self.infer(part);
                }
                Typed::unknown()
            }
            Expr::Map(_) | Expr::Struct(_) | Expr::Unspecified => Typed::unknown(),
        }
    }

    /// `operand.field` or `operand['field']`.
    fn member(&mut self, e: &IdedExpr, operand: &Typed, field: &str, guard: bool) -> Typed {
        match &operand.ty {
            Ty::Device => match field {
                "driver" => Typed::of(Ty::String),
                "allowMultipleAllocations" => Typed::of(Ty::Bool),
                "attributes" => Typed::of(Ty::Domains { capacity: false }),
                "capacity" => Typed::of(Ty::Domains { capacity: true }),
                _ => Typed::unknown(),
            },
            Ty::Domains { capacity } => {
                let ours = field == self.target.driver || field == STANDARD_DOMAIN;
                if !ours {
                    let what = if *capacity {
                        "capacities"
                    } else {
                        "attributes"
                    };
                    self.push(
                        Severity::Info,
                        format!(
                            "`{}`: {} devices have no {what} in domain {field:?} (theirs are \
                             under {:?} and {STANDARD_DOMAIN:?}); fine if {} also selects \
                             another driver's devices",
                            unparse(e),
                            self.target.driver,
                            self.target.driver,
                            self.class_words(),
                        ),
                    );
                }
                Typed::of(Ty::Names {
                    capacity: *capacity,
                    domain: field.to_owned(),
                    ours,
                })
            }
            Ty::Names {
                capacity,
                domain,
                ours: true,
            } => self.name(e, *capacity, domain.clone(), field, guard),
            _ => Typed::unknown(),
        }
    }

    /// The attribute or capacity `name` in one of our domains.
    fn name(
        &mut self,
        e: &IdedExpr,
        capacity: bool,
        domain: String,
        name: &str,
        guard: bool,
    ) -> Typed {
        let driver = self.target.driver;
        let full = if domain == driver {
            name.to_owned()
        } else {
            format!("{domain}/{name}")
        };
        let in_domain = |n: &str| {
            if domain == driver {
                (!n.contains('/')).then(|| n.to_owned())
            } else {
                n.strip_prefix(&format!("{domain}/")).map(str::to_owned)
            }
        };
        let (word, other_word) = if capacity {
            ("capacity", "attribute")
        } else {
            ("attribute", "capacity")
        };
        let kinds = if capacity {
            slices::capacity_spec(&full).map(|c| c.kinds)
        } else {
            slices::attribute_spec(&full).map(|a| a.kinds)
        };
        let Some(kinds) = kinds else {
            let consequence = if guard {
                "so this test is always false".to_owned()
            } else {
                format!(
                    "so evaluating it fails with \"no such key: {name}\" on every {driver} device and none is selected"
                )
            };
            let other_exists = if capacity {
                slices::attribute_spec(&full).is_some()
            } else {
                slices::capacity_spec(&full).is_some()
            };
            let hint = if other_exists {
                let (table, accessor) = if capacity {
                    ("attributes", "")
                } else {
                    ("capacity", ", a quantity: compare it with quantity(...)")
                };
                format!(
                    "; {name} is a{} {other_word}: device.{table}['{domain}'].{name}{accessor}",
                    if other_word.starts_with('a') { "n" } else { "" }
                )
            } else if let Some((_, hint)) = HINTS.iter().find(|(n, _)| *n == name) {
                format!("; {hint}")
            } else {
                let names: Vec<String> = if capacity {
                    slices::CAPACITIES
                        .iter()
                        .filter_map(|c| in_domain(c.name))
                        .collect()
                } else {
                    slices::ATTRIBUTES
                        .iter()
                        .filter_map(|a| in_domain(a.name))
                        .collect()
                };
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                match gpu_dra_api::suggest(name, &refs) {
                    Some(s) => format!("; did you mean {s:?}?"),
                    None => format!("; published {word}s in this domain: {}", refs.join(", ")),
                }
            };
            self.push(
                Severity::Warning,
                format!(
                    "`{}`: {word} {name:?} is not published by {driver}, {consequence}{hint}",
                    unparse(e)
                ),
            );
            return Typed::unknown();
        };
        if !self.target.kinds.iter().any(|k| kinds.contains(k)) {
            let only = if kinds == [DeviceKind::Mig] {
                "MIG devices"
            } else {
                "whole GPUs"
            };
            self.push(
                Severity::Warning,
                format!(
                    "`{}`: {word} {name:?} is published only on {only}, but {}; no device can match",
                    unparse(e),
                    self.class_words()
                ),
            );
        }
        let ty = if capacity {
            Ty::Quantity
        } else {
            match slices::attribute_spec(&full).map(|a| a.ty) {
                Some(AttributeType::String) => Ty::String,
                Some(AttributeType::Int) => Ty::Int,
                Some(AttributeType::Bool) => Ty::Bool,
                Some(AttributeType::Version) => Ty::Version,
                None => Ty::Unknown,
            }
        };
        Typed {
            ty,
            what: Some(format!("{word} {name}")),
        }
    }

    fn call(
        &mut self,
        e: &IdedExpr,
        func: &str,
        target: Option<&IdedExpr>,
        args: &[IdedExpr],
    ) -> Typed {
        // Index with a literal key is member access.
        if func == operators::INDEX
            && target.is_none()
            && let [base, key] = args
        {
            let base_t = self.infer(base);
            return match string_literal(key) {
                Some(k) => self.member(e, &base_t, k, false),
                None => {
                    self.infer(key);
                    Typed::unknown()
                }
            };
        }
        if func == operators::IN
            && target.is_none()
            && let [needle, hay] = args
        {
            {
                let hay_t = self.infer(hay);
                if let (
                    Some(name),
                    Ty::Names {
                        capacity,
                        domain,
                        ours: true,
                    },
                ) = (string_literal(needle), &hay_t.ty)
                {
                    self.name(e, *capacity, domain.clone(), name, true);
                } else {
                    self.infer(needle);
                }
                return Typed::of(Ty::Bool);
            }
        }
        let target_t = target.map(|t| self.infer(t));
        let arg_ts: Vec<Typed> = args.iter().map(|a| self.infer(a)).collect();
        if target.is_none() {
            match func {
                operators::LOGICAL_AND | operators::LOGICAL_OR | operators::LOGICAL_NOT => {
                    return Typed::of(Ty::Bool);
                }
                operators::EQUALS
                | operators::NOT_EQUALS
                | operators::LESS
                | operators::LESS_EQUALS
                | operators::GREATER
                | operators::GREATER_EQUALS => {
                    if let [l, r] = &arg_ts[..] {
                        self.comparison(e, func, l, r, &args[0], &args[1]);
                    }
                    return Typed::of(Ty::Bool);
                }
                "quantity" => {
                    if let Some(lit) = args.first().and_then(string_literal)
                        && let Err(err) = gpu_dra_api::quantity::Quantity::parse(lit)
                    {
                        self.push(
                            Severity::Warning,
                            format!("`{}` fails at evaluation: {err}", unparse(e)),
                        );
                    }
                    return Typed::of(Ty::Quantity);
                }
                "semver" => {
                    if let (Some(lit), 1) = (args.first().and_then(string_literal), args.len())
                        && let Err(err) = crate::values::Semver::parse(lit)
                    {
                        self.push(
                            Severity::Warning,
                            format!("`{}` fails at evaluation: {err}", unparse(e)),
                        );
                    }
                    return Typed::of(Ty::Version);
                }
                "size" | "int" => return Typed::of(Ty::Int),
                "string" => return Typed::of(Ty::String),
                "double" => return Typed::of(Ty::Double),
                "isQuantity" | "isSemver" => return Typed::of(Ty::Bool),
                _ => return Typed::unknown(),
            }
        }
        let Some(t) = target_t else {
            return Typed::unknown();
        };
        let Some(what) = t.what.clone() else {
            // A member call on something not read from a device: only results we know.
            return Typed::of(match (&t.ty, func) {
                (Ty::Quantity | Ty::Version, "compareTo") => Ty::Int,
                (Ty::Quantity | Ty::Version, "isGreaterThan" | "isLessThan") => Ty::Bool,
                _ => Ty::Unknown,
            });
        };
        let recv = unparse(target.unwrap_or(e));
        match func {
            "compareTo" | "isGreaterThan" | "isLessThan" => {
                let result = if func == "compareTo" {
                    Ty::Int
                } else {
                    Ty::Bool
                };
                match (&t.ty, arg_ts.first().map(|a| &a.ty)) {
                    (Ty::Version, Some(Ty::String)) => {
                        let lit = args.first().and_then(string_literal).unwrap_or("1.2.3");
                        self.push(Severity::Warning, format!(
                            "`{}`: {what} is a version: compare it with a version, `{recv}.{func}(semver('{lit}'))`",
                            unparse(e)));
                    }
                    (Ty::Quantity, Some(Ty::String | Ty::Int | Ty::Double)) => {
                        let lit = args.first().map(unparse).unwrap_or_default();
                        let lit = lit.trim_matches('\'');
                        self.push(Severity::Warning, format!(
                            "`{}`: {what} is a quantity: compare it with a quantity, `{recv}.{func}(quantity('{lit}'))`",
                            unparse(e)));
                    }
                    (Ty::Version, Some(Ty::Quantity)) | (Ty::Quantity, Some(Ty::Version)) => {
                        self.push(
                            Severity::Warning,
                            format!(
                                "`{}`: {what} is a {} but is compared with a {}; evaluation fails",
                                unparse(e),
                                type_word(&t.ty),
                                type_word(&arg_ts[0].ty)
                            ),
                        );
                    }
                    (Ty::String | Ty::Int | Ty::Bool, _) => {
                        self.push(
                            Severity::Warning,
                            format!(
                                "`{}`: {what} is a {}, which has no {func}(); evaluation fails",
                                unparse(e),
                                type_word(&t.ty)
                            ),
                        );
                    }
                    _ => {}
                }
                Typed::of(result)
            }
            "major" | "minor" | "patch" if t.ty == Ty::Version => Typed::of(Ty::Int),
            f if STRING_FUNCTIONS.contains(&f) => {
                if matches!(t.ty, Ty::Version | Ty::Quantity | Ty::Int | Ty::Bool) {
                    self.push(
                        Severity::Warning,
                        format!(
                            "`{}`: {what} is a {}, not a string: {func}() fails at evaluation{}",
                            unparse(e),
                            type_word(&t.ty),
                            if t.ty == Ty::Version {
                                "; compare versions with compareTo(semver('...'))"
                            } else {
                                ""
                            }
                        ),
                    );
                }
                Typed::unknown()
            }
            _ => Typed::unknown(),
        }
    }

    fn comparison(
        &mut self,
        e: &IdedExpr,
        op: &str,
        l: &Typed,
        r: &Typed,
        le: &IdedExpr,
        re: &IdedExpr,
    ) {
        // Put the device value on the left.
        let (dev, other, other_e) = match (&l.what, &r.what) {
            (Some(_), _) => (l, r, re),
            (None, Some(_)) => (r, l, le),
            (None, None) => return,
        };
        let what = dev.what.clone().unwrap_or_default();
        let expr = unparse(e);
        let problem = match (&dev.ty, &other.ty) {
            (_, Ty::Unknown) | (Ty::Unknown, _) => None,
            (Ty::Version, Ty::String) => {
                let lit = string_literal(other_e).unwrap_or("1.2.3");
                Some(format!(
                    "{what} is a version, compared here with a string, which fails at evaluation; \
                     write `{}.compareTo(semver('{lit}')) {} 0`",
                    unparse(if l.what.is_some() { le } else { re }),
                    if l.what.is_some() {
                        op_text(op)
                    } else {
                        flip(op)
                    }
                ))
            }
            (Ty::Quantity, Ty::String | Ty::Int | Ty::Double) => {
                let lit = unparse(other_e);
                Some(format!(
                    "{what} is a quantity, compared here with a{} {}, which fails at evaluation; \
                     write `{}.compareTo(quantity('{}')) {} 0`",
                    article(&other.ty),
                    type_word(&other.ty),
                    unparse(if l.what.is_some() { le } else { re }),
                    lit.trim_matches('\''),
                    if l.what.is_some() {
                        op_text(op)
                    } else {
                        flip(op)
                    }
                ))
            }
            (Ty::Version | Ty::Quantity, Ty::Version | Ty::Quantity) if is_ordering(op) => {
                Some(format!(
                    "{what} is a {}: `{}` has no overload for it; use compareTo(), isGreaterThan() or isLessThan()",
                    type_word(&dev.ty),
                    op_text(op)
                ))
            }
            (Ty::Version, Ty::Quantity) | (Ty::Quantity, Ty::Version) => Some(format!(
                "{what} is a {}, compared here with a {}",
                type_word(&dev.ty),
                type_word(&other.ty)
            )),
            (Ty::String, Ty::Int | Ty::Double | Ty::Bool | Ty::Version | Ty::Quantity)
            | (Ty::Int, Ty::String | Ty::Bool | Ty::Version | Ty::Quantity)
            | (Ty::Bool, Ty::String | Ty::Int | Ty::Double | Ty::Version | Ty::Quantity) => {
                Some(format!(
                    "{what} is a{} {}, compared here with a{} {}; no device can match",
                    article(&dev.ty),
                    type_word(&dev.ty),
                    article(&other.ty),
                    type_word(&other.ty)
                ))
            }
            _ => None,
        };
        if let Some(p) = problem {
            self.push(Severity::Warning, format!("`{expr}`: {p}"));
        }
    }
}

fn article(ty: &Ty) -> &'static str {
    if matches!(ty, Ty::Int) { "n" } else { "" }
}

fn op_text(op: &str) -> &'static str {
    match op {
        operators::EQUALS => "==",
        operators::NOT_EQUALS => "!=",
        operators::LESS => "<",
        operators::LESS_EQUALS => "<=",
        operators::GREATER => ">",
        operators::GREATER_EQUALS => ">=",
        _ => "?",
    }
}

/// The operator with its operands swapped (`1 < x` is `x > 1`).
fn flip(op: &str) -> &'static str {
    match op {
        operators::LESS => ">",
        operators::LESS_EQUALS => ">=",
        operators::GREATER => "<",
        operators::GREATER_EQUALS => "<=",
        other => op_text(other),
    }
}

/// A finding about one selector of an object, with the selector's full field path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObjectFinding {
    /// `spec.devices.requests[0].exactly.selectors[1].cel.expression`.
    pub path: String,
    /// How sure.
    pub severity: Severity,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ObjectFinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The device kinds of one of our DeviceClasses, by name: `gpu.nvidia.com` (or the driver name)
/// for whole GPUs, `mig.nvidia.com` (or the driver name with `gpu.` turned into `mig.`) for MIG
/// devices. `None` for any other class.
pub fn class_kinds(class: &str, driver: &str) -> Option<&'static [DeviceKind]> {
    const GPU: &[DeviceKind] = &[DeviceKind::Gpu];
    const MIG: &[DeviceKind] = &[DeviceKind::Mig];
    let mig_class = driver
        .strip_prefix("gpu.")
        .map(|rest| format!("mig.{rest}"));
    if class == "gpu.nvidia.com" || class == driver {
        Some(GPU)
    } else if class == "mig.nvidia.com" || mig_class.as_deref() == Some(class) {
        Some(MIG)
    } else {
        None
    }
}

/// True when `expr` names our driver (`device.driver == 'gpu.nvidia.com'` or our domain).
fn mentions_driver(expr: &str, driver: &str) -> bool {
    expr.contains(&format!("'{driver}'")) || expr.contains(&format!("\"{driver}\""))
}

const BOTH: &[DeviceKind] = &[DeviceKind::Gpu, DeviceKind::Mig];

/// The device kinds a class and its selectors target: those of one of our classes, else both
/// kinds when a selector names our driver, else `None` (not ours: left alone).
fn target_kinds(
    class: &str,
    selectors: &[(String, String)],
    driver: &str,
) -> Option<&'static [DeviceKind]> {
    class_kinds(class, driver).or_else(|| {
        selectors
            .iter()
            .any(|(_, e)| mentions_driver(e, driver))
            .then_some(BOTH)
    })
}

/// Checks every CEL selector in `obj` (a ResourceClaim, ResourceClaimTemplate or DeviceClass of
/// any `resource.k8s.io` version) that targets our DeviceClasses or names our driver. Other
/// selectors are none of our business. Paths are full paths from the object root.
pub fn lint_object(obj: &Value, driver: &str) -> Vec<ObjectFinding> {
    use gpu_dra_api::objects::{ObjectKind, object_kind};
    let mut out = Vec::new();
    match object_kind(obj) {
        Some(ObjectKind::DeviceClass) => {
            let name = obj
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let selectors = selectors_at(obj.pointer("/spec/selectors"), "spec.selectors");
            let kinds = target_kinds(name, &selectors, driver);
            if let Some(kinds) = kinds {
                let target = Target {
                    driver,
                    kinds,
                    class: Some(name),
                };
                lint_all(&selectors, &target, &mut out);
            }
        }
        Some(ObjectKind::ResourceClaim) => lint_requests(
            obj.pointer("/spec/devices"),
            "spec.devices",
            driver,
            &mut out,
        ),
        Some(ObjectKind::ResourceClaimTemplate) => lint_requests(
            obj.pointer("/spec/spec/devices"),
            "spec.spec.devices",
            driver,
            &mut out,
        ),
        None => {}
    }
    out
}

fn lint_all(selectors: &[(String, String)], target: &Target<'_>, out: &mut Vec<ObjectFinding>) {
    for (path, expr) in selectors {
        for f in lint_expression(expr, target) {
            out.push(ObjectFinding {
                path: path.clone(),
                severity: f.severity,
                message: f.message,
            });
        }
    }
}

/// `(path, expression)` of every `selectors[i].cel.expression` under `list`.
pub(crate) fn selectors_at(list: Option<&Value>, path: &str) -> Vec<(String, String)> {
    list.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, s)| {
            let expr = s.pointer("/cel/expression")?.as_str()?;
            Some((format!("{path}[{i}].cel.expression"), expr.to_owned()))
        })
        .collect()
}

fn lint_requests(devices: Option<&Value>, path: &str, driver: &str, out: &mut Vec<ObjectFinding>) {
    let requests = devices
        .and_then(|d| d.get("requests"))
        .and_then(Value::as_array);
    for (i, req) in requests.into_iter().flatten().enumerate() {
        let rpath = format!("{path}.requests[{i}]");
        // v1: `exactly` or `firstAvailable[]`; v1beta1: the fields on the request itself.
        let mut alternatives: Vec<(String, &Value)> = Vec::new();
        if let Some(exactly) = req.get("exactly") {
            alternatives.push((format!("{rpath}.exactly"), exactly));
        } else if req.get("deviceClassName").is_some() {
            alternatives.push((rpath.clone(), req));
        }
        for (j, sub) in req
            .get("firstAvailable")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            alternatives.push((format!("{rpath}.firstAvailable[{j}]"), sub));
        }
        for (apath, alt) in alternatives {
            let class = alt
                .get("deviceClassName")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let selectors = selectors_at(alt.get("selectors"), &format!("{apath}.selectors"));
            let kinds = target_kinds(class, &selectors, driver);
            if let Some(kinds) = kinds {
                let target = Target {
                    driver,
                    kinds,
                    class: Some(class).filter(|c| !c.is_empty()),
                };
                lint_all(&selectors, &target, out);
            }
        }
    }
}
