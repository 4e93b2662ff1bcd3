//! Why a claim's devices are (not) selected: each request's selectors (its DeviceClass's, then
//! its own) evaluated against every published device of our driver, as the scheduler does.
//!
//! The CEL environment follows the scheduler's: `device.driver`,
//! `device.attributes[domain][name]` (strings, ints, bools, versions as `semver` values),
//! `device.capacity[domain][name]` (quantities), `device.allowMultipleAllocations`, and the
//! `quantity()`/`semver()` libraries. A domain the device has nothing in reads as an empty map;
//! a missing name is the evaluation error "no such key", as in the scheduler, where it makes
//! the device unusable for the request.
//!
//! `matchAttribute` constraints are reported per node: the devices that pass the selectors of
//! the constraint's requests, grouped by the attribute's value (list values put a device in
//! each of its values' groups), with those other claims hold, and whether one value has as many
//! free devices as the requests need. That is a necessary condition only: the scheduler also
//! needs the devices of several requests to be distinct, which is not checked here.
//!
//! Inputs are plain JSON objects (a claim, DeviceClasses, ResourceSlices, all claims), so the
//! CLI fetches and this module only computes; `resource.k8s.io/v1` and `v1beta1` shapes work.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use cel::common::ast::{Expr, IdedExpr, LiteralValue, operators};
use cel::{Context, Value as Cel};
use serde::Serialize;
use serde_json::Value;

use crate::lint::{ObjectFinding, lint_object, selectors_at};
use crate::unparse::unparse;
use crate::values;

/// The answer for one claim.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// `namespace/name`.
    pub claim: String,
    /// Our driver name.
    pub driver: String,
    /// True when the claim has an allocation.
    pub allocated: bool,
    /// Static findings on the claim's selectors (see [`crate::lint`]).
    pub findings: Vec<ObjectFinding>,
    /// One entry per request (`req`) or `firstAvailable` subrequest (`req/sub`).
    pub requests: Vec<RequestReport>,
    /// One entry per `matchAttribute` constraint of the claim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<ConstraintReport>,
}

/// A `matchAttribute` constraint: per node, the devices that match its requests grouped by
/// the attribute's value, so "no node has N free devices with one value" is visible.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConstraintReport {
    /// The fully qualified attribute, e.g. `gpu.nvidia.com/nvlinkDomain`.
    pub attribute: String,
    /// The requests it names (all of the claim's when the constraint names none).
    pub requests: Vec<String>,
    /// Devices one value must hold for the named requests together, when every one of them
    /// asks for an exact count (a `firstAvailable` request counts its smallest alternative).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub needed: Option<usize>,
    /// Per node (or pool), in name order.
    pub nodes: Vec<ConstraintNode>,
}

/// One node's devices for a constraint.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConstraintNode {
    /// Node name, or `pool <name>`.
    pub node: String,
    /// One entry per value, in value order.
    pub values: Vec<ValueGroup>,
    /// Matching devices without the attribute: never chosen under the constraint.
    pub without_attribute: Vec<String>,
}

/// The matching devices of one node that share one value of the attribute.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ValueGroup {
    /// The value as shown (strings quoted); a device with a list value is in each of its
    /// values' groups.
    pub value: String,
    /// Devices with this value that match one of the constraint's requests.
    pub devices: Vec<String>,
    /// Those allocated to another claim, with the claim (`namespace/name`).
    pub taken: Vec<(String, String)>,
}

impl ValueGroup {
    /// How many of its devices are free (or this claim's).
    pub fn free(&self) -> usize {
        self.devices.len() - self.taken.len()
    }
}

/// One request and what each device makes of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestReport {
    /// `req` or `req/sub`.
    pub request: String,
    /// Its DeviceClass.
    pub device_class: String,
    /// False when the DeviceClass does not exist (nothing can be allocated then).
    pub device_class_found: bool,
    /// The selectors in evaluation order: the class's, then the request's.
    pub selectors: Vec<SelectorRef>,
    /// How many devices pass every selector.
    pub matching: usize,
    /// How many of those are not allocated to another claim.
    pub available: usize,
    /// Per node (or pool, for slices without a node), in name order.
    pub nodes: Vec<NodeReport>,
}

/// Where a selector comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SelectorRef {
    /// `DeviceClass <name>` or `request`.
    pub source: String,
    /// Position among that source's selectors.
    pub index: usize,
    /// The CEL expression.
    pub expression: String,
}

impl std::fmt::Display for SelectorRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} selector {}", self.source, self.index)
    }
}

/// The devices of one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    /// Node name, or `pool <name>` for a pool without one.
    pub node: String,
    /// Devices in publication order.
    pub devices: Vec<DeviceReport>,
}

/// One device against one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceReport {
    /// Device name.
    pub device: String,
    /// Pool name.
    pub pool: String,
    /// True when every selector accepts it.
    pub matches: bool,
    /// The first selector that rejects it (index into [`RequestReport::selectors`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rejected_by: Option<usize>,
    /// Why: the sub-expression that is false with the values seen, or the evaluation error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The claim (`namespace/name`, or `this claim`) it is allocated to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocated_to: Option<String>,
}

/// One published device, read from a ResourceSlice.
struct Published {
    node: String,
    pool: String,
    name: String,
    driver: String,
    allow_multiple: bool,
    attributes: BTreeMap<String, HashMap<String, Cel>>,
    capacity: BTreeMap<String, HashMap<String, Cel>>,
    /// `(capacity?, domain, name)` -> display of the value.
    shown: BTreeMap<(bool, String, String), String>,
    /// `(domain, name)` -> display of each element of a list-type attribute (`strings`,
    /// `ints`): selectors do not see them, constraints do.
    lists: BTreeMap<(String, String), Vec<String>>,
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn label(obj: &Value) -> String {
    format!(
        "{}/{}",
        str_at(obj, "/metadata/namespace"),
        str_at(obj, "/metadata/name")
    )
}

/// Splits a published name into (domain, name): unqualified names are the driver's.
fn qualify<'a>(driver: &'a str, key: &'a str) -> (&'a str, &'a str) {
    key.rsplit_once('/').unwrap_or((driver, key))
}

/// A slice's pool name and generation (0 when unset).
fn pool_generation(slice: &Value) -> (&str, i64) {
    let generation = slice
        .pointer("/spec/pool/generation")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    (str_at(slice, "/spec/pool/name"), generation)
}

fn read_devices(slices: &[Value], driver: &str) -> Vec<Published> {
    // Only the newest generation of each pool counts, as for the scheduler.
    let mut newest: HashMap<&str, i64> = HashMap::new();
    for s in slices
        .iter()
        .filter(|s| str_at(s, "/spec/driver") == driver)
    {
        let (pool, generation) = pool_generation(s);
        let g = newest.entry(pool).or_insert(generation);
        *g = (*g).max(generation);
    }
    let mut out = Vec::new();
    for s in slices
        .iter()
        .filter(|s| str_at(s, "/spec/driver") == driver)
    {
        let (pool, generation) = pool_generation(s);
        if newest.get(pool) != Some(&generation) {
            continue;
        }
        let node = match str_at(s, "/spec/nodeName") {
            "" => format!("pool {pool}"),
            n => n.to_owned(),
        };
        for d in s
            .pointer("/spec/devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.push(read_device(d, driver, &node, pool));
        }
    }
    out
}

fn read_device(d: &Value, driver: &str, node: &str, pool: &str) -> Published {
    // v1beta1 nests attributes and capacity under `basic`.
    let d = d.get("basic").unwrap_or(d);
    let mut attrs: BTreeMap<String, HashMap<String, Cel>> = BTreeMap::new();
    let mut caps: BTreeMap<String, HashMap<String, Cel>> = BTreeMap::new();
    let mut shown = BTreeMap::new();
    let mut lists = BTreeMap::new();
    for (key, v) in d
        .get("attributes")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let (domain, name) = qualify(driver, key);
        let (value, show) = if let Some(s) = v.get("string").and_then(Value::as_str) {
            (Cel::from(s), format!("{s:?}"))
        } else if let Some(i) = v.get("int").and_then(Value::as_i64) {
            (Cel::Int(i), i.to_string())
        } else if let Some(b) = v.get("bool").and_then(Value::as_bool) {
            (Cel::Bool(b), b.to_string())
        } else if let Some(s) = v.get("version").and_then(Value::as_str) {
            match values::Semver::parse(s) {
                Ok(sv) => (values::semver_value(sv), format!("version {s}")),
                Err(_) => continue,
            }
        } else {
            let elements = v
                .get("strings")
                .or_else(|| v.get("ints"))
                .and_then(Value::as_array);
            if let Some(elements) = elements {
                lists.insert(
                    (domain.to_owned(), name.to_owned()),
                    elements.iter().map(ToString::to_string).collect(),
                );
            }
            continue;
        };
        attrs
            .entry(domain.to_owned())
            .or_default()
            .insert(name.to_owned(), value);
        shown.insert((false, domain.to_owned(), name.to_owned()), show);
    }
    for (key, v) in d
        .get("capacity")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let (domain, name) = qualify(driver, key);
        let Some(text) = v.get("value").and_then(Value::as_str) else {
            continue;
        };
        let Ok(q) = gpu_dra_api::quantity::Quantity::parse(text) else {
            continue;
        };
        caps.entry(domain.to_owned())
            .or_default()
            .insert(name.to_owned(), values::quantity_value(q));
        shown.insert(
            (true, domain.to_owned(), name.to_owned()),
            format!("quantity {text}"),
        );
    }
    Published {
        node: node.to_owned(),
        pool: pool.to_owned(),
        name: str_at(d, "/name").to_owned(),
        driver: driver.to_owned(),
        allow_multiple: d
            .get("allowMultipleAllocations")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        attributes: attrs,
        capacity: caps,
        shown,
        lists,
    }
}

impl Published {
    /// The `device` variable. Domains in `read` that the device has nothing in are empty maps,
    /// as the scheduler presents them.
    fn value(&self, read: &BTreeSet<(bool, String)>) -> Cel {
        let table = |capacity: bool, m: &BTreeMap<String, HashMap<String, Cel>>| {
            let mut out: HashMap<String, Cel> = m
                .iter()
                .map(|(k, v)| (k.clone(), Cel::from(v.clone())))
                .collect();
            for (_, d) in read.iter().filter(|(c, _)| *c == capacity) {
                out.entry(d.clone())
                    .or_insert_with(|| Cel::from(HashMap::<String, Cel>::new()));
            }
            Cel::from(out)
        };
        let mut device: HashMap<String, Cel> = HashMap::new();
        device.insert("driver".into(), Cel::from(self.driver.as_str()));
        device.insert("attributes".into(), table(false, &self.attributes));
        device.insert("capacity".into(), table(true, &self.capacity));
        device.insert(
            "allowMultipleAllocations".into(),
            Cel::Bool(self.allow_multiple),
        );
        Cel::from(device)
    }
}

/// `device.attributes['d']` / `device.capacity['d']` with a literal domain: `(capacity?, d)`.
fn domain_of(e: &IdedExpr) -> Option<(bool, String)> {
    let Expr::Call(c) = &e.expr else { return None };
    if c.func_name != operators::INDEX || c.target.is_some() {
        return None;
    }
    let [base, key] = &c.args[..] else {
        return None;
    };
    let Expr::Select(s) = &base.expr else {
        return None;
    };
    let capacity = match s.field.as_str() {
        "attributes" => false,
        "capacity" => true,
        _ => return None,
    };
    if !matches!(&s.operand.expr, Expr::Ident(n) if n == "device") {
        return None;
    }
    match &key.expr {
        Expr::Literal(LiteralValue::String(d)) => Some((capacity, d.inner().to_owned())),
        _ => None,
    }
}

/// `device.attributes['d'].n` / `device.attributes['d']['n']`: `(capacity?, d, n)`.
fn reference_of(e: &IdedExpr) -> Option<(bool, String, String)> {
    match &e.expr {
        Expr::Select(s) if !s.test => domain_of(&s.operand).map(|(c, d)| (c, d, s.field.clone())),
        Expr::Call(c) if c.func_name == operators::INDEX && c.target.is_none() => {
            let [base, key] = &c.args[..] else {
                return None;
            };
            let (cap, d) = domain_of(base)?;
            match &key.expr {
                Expr::Literal(LiteralValue::String(n)) => Some((cap, d, n.inner().to_owned())),
                _ => None,
            }
        }
        _ => None,
    }
}

fn children(e: &IdedExpr) -> Vec<&IdedExpr> {
    match &e.expr {
        Expr::Select(s) => vec![&s.operand],
        Expr::Call(c) => c.target.as_deref().into_iter().chain(&c.args).collect(),
        Expr::List(l) => l.elements.iter().collect(),
        Expr::Comprehension(c) => vec![
            &c.iter_range,
            &c.accu_init,
            &c.loop_cond,
            &c.loop_step,
            &c.result,
        ],
        _ => Vec::new(),
    }
}

fn visit<'e>(e: &'e IdedExpr, f: &mut dyn FnMut(&'e IdedExpr)) {
    f(e);
    for c in children(e) {
        visit(c, f);
    }
}

/// A compiled selector.
struct Compiled {
    program: Result<cel::Program, String>,
}

fn compile(expr: &str) -> Compiled {
    Compiled {
        program: cel::Program::compile(expr).map_err(|e| {
            e.errors
                .first()
                .map(|e| {
                    format!(
                        "does not parse: line {}, column {}: {}",
                        e.pos.0, e.pos.1, e.msg
                    )
                })
                .unwrap_or_else(|| "does not parse".to_owned())
        }),
    }
}

/// Why `e` (which evaluated to false or failed) rejects the device: the first false or
/// failing operand of `&&` chains, with the device values it reads.
fn why(e: &IdedExpr, ctx: &Context<'_, '_>, device: &Published) -> String {
    if let Expr::Call(c) = &e.expr
        && c.func_name == operators::LOGICAL_AND
        && c.target.is_none()
    {
        for arg in &c.args {
            match ctx.resolve(arg) {
                Ok(Cel::Bool(true)) => continue,
                _ => return why(arg, ctx, device),
            }
        }
    }
    let mut seen = Vec::new();
    visit(e, &mut |sub| {
        if let Some((cap, d, n)) = reference_of(sub) {
            let text = match device.shown.get(&(cap, d.clone(), n.clone())) {
                Some(v) => format!("{n} is {v}"),
                None => format!("{n} is not published"),
            };
            if !seen.contains(&text) {
                seen.push(text);
            }
        }
    });
    let seen = if seen.is_empty() {
        String::new()
    } else {
        format!(" ({})", seen.join("; "))
    };
    match ctx.resolve(e) {
        Ok(Cel::Bool(false)) => format!("`{}` is false{seen}", unparse(e)),
        Ok(other) => format!(
            "`{}` gives {:?}, not a bool{seen}",
            unparse(e),
            other.type_of().to_string()
        ),
        Err(err) => format!(
            "`{}`: evaluation error: {}{seen}",
            unparse(e),
            err.to_string().to_lowercase()
        ),
    }
}

/// The first selector rejecting `device`, and why; `None` when all accept it.
fn first_rejection(
    compiled: &[Compiled],
    root: &Context<'_, '_>,
    device: &Published,
    extra_domains: &BTreeSet<(bool, String)>,
) -> Option<(usize, String)> {
    let value = device.value(extra_domains);
    let mut ctx = root.new_inner_scope();
    ctx.add_variable_from_value("device", value);
    for (i, c) in compiled.iter().enumerate() {
        let program = match &c.program {
            Ok(p) => p,
            Err(e) => return Some((i, e.clone())),
        };
        match program.execute(&ctx) {
            Ok(Cel::Bool(true)) => {}
            _ => return Some((i, why(program.expression(), &ctx, device))),
        }
    }
    None
}

/// `(request name, class, selectors with paths)`.
type RequestSelectors = (String, String, Vec<(String, String)>);

/// The request and subrequests of a claim with their classes and selectors.
fn requests(claim: &Value) -> Vec<RequestSelectors> {
    let mut out = Vec::new();
    let list = claim
        .pointer("/spec/devices/requests")
        .and_then(Value::as_array);
    for req in list.into_iter().flatten() {
        let name = str_at(req, "/name");
        if let Some(subs) = req.get("firstAvailable").and_then(Value::as_array) {
            for sub in subs {
                out.push((
                    format!("{name}/{}", str_at(sub, "/name")),
                    str_at(sub, "/deviceClassName").to_owned(),
                    selectors_at(sub.get("selectors"), "selectors"),
                ));
            }
            continue;
        }
        let alt = req.get("exactly").unwrap_or(req);
        out.push((
            name.to_owned(),
            str_at(alt, "/deviceClassName").to_owned(),
            selectors_at(alt.get("selectors"), "selectors"),
        ));
    }
    out
}

/// Explains `claim` (a ResourceClaim object) against `classes` (DeviceClasses), `slices`
/// (ResourceSlices) and `claims` (every ResourceClaim, for devices already allocated).
pub fn explain(
    claim: &Value,
    classes: &[Value],
    slices: &[Value],
    claims: &[Value],
    driver: &str,
) -> Explanation {
    let me = label(claim);
    let my_uid = str_at(claim, "/metadata/uid");
    let mut allocated_to: HashMap<(String, String), String> = HashMap::new();
    for c in claims {
        let who = if (!my_uid.is_empty() && str_at(c, "/metadata/uid") == my_uid) || label(c) == me
        {
            "this claim".to_owned()
        } else {
            label(c)
        };
        let results = c
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array);
        for r in results.into_iter().flatten() {
            if str_at(r, "/driver") == driver {
                allocated_to.insert(
                    (
                        str_at(r, "/pool").to_owned(),
                        str_at(r, "/device").to_owned(),
                    ),
                    who.clone(),
                );
            }
        }
    }
    let devices = read_devices(slices, driver);
    let mut root = Context::default();
    // Registration fails only on a name clash with the standard library, which the names
    // above do not have; a test evaluates every function.
    let _ = values::register(&mut root);

    let mut reports = Vec::new();
    // Request -> the (pool, device) pairs that pass its selectors.
    let mut matched: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    for (request, class, own) in requests(claim) {
        let class_obj = classes
            .iter()
            .find(|c| str_at(c, "/metadata/name") == class);
        let mut selectors: Vec<SelectorRef> = Vec::new();
        if let Some(c) = class_obj {
            for (i, (_, e)) in selectors_at(c.pointer("/spec/selectors"), "")
                .into_iter()
                .enumerate()
            {
                selectors.push(SelectorRef {
                    source: format!("DeviceClass {class}"),
                    index: i,
                    expression: e,
                });
            }
        }
        for (i, (_, e)) in own.into_iter().enumerate() {
            selectors.push(SelectorRef {
                source: "request".into(),
                index: i,
                expression: e,
            });
        }
        let compiled: Vec<Compiled> = selectors.iter().map(|s| compile(&s.expression)).collect();
        let mut domains = BTreeSet::new();
        for c in &compiled {
            if let Ok(p) = &c.program {
                visit(p.expression(), &mut |e| {
                    if let Some(d) = domain_of(e) {
                        domains.insert(d);
                    }
                });
            }
        }
        let mut nodes: BTreeMap<String, Vec<DeviceReport>> = BTreeMap::new();
        let matched_here = matched.entry(request.clone()).or_default();
        let (mut matching, mut available) = (0, 0);
        for d in &devices {
            let rejection = if class_obj.is_some() {
                first_rejection(&compiled, &root, d, &domains)
            } else {
                None
            };
            let allocated = allocated_to.get(&(d.pool.clone(), d.name.clone())).cloned();
            let matches = class_obj.is_some() && rejection.is_none();
            if matches {
                matched_here.insert((d.pool.clone(), d.name.clone()));
                matching += 1;
                if allocated.as_deref().is_none_or(|a| a == "this claim") {
                    available += 1;
                }
            }
            let (rejected_by, reason) = match rejection {
                Some((i, r)) => (Some(i), Some(r)),
                None if class_obj.is_none() => {
                    (None, Some(format!("DeviceClass {class} does not exist")))
                }
                None => (None, None),
            };
            nodes.entry(d.node.clone()).or_default().push(DeviceReport {
                device: d.name.clone(),
                pool: d.pool.clone(),
                matches,
                rejected_by,
                reason,
                allocated_to: allocated,
            });
        }
        reports.push(RequestReport {
            request,
            device_class: class,
            device_class_found: class_obj.is_some(),
            selectors,
            matching,
            available,
            nodes: nodes
                .into_iter()
                .map(|(node, devices)| NodeReport { node, devices })
                .collect(),
        });
    }
    Explanation {
        claim: me,
        driver: driver.to_owned(),
        allocated: claim
            .pointer("/status/allocation")
            .is_some_and(|a| !a.is_null()),
        findings: lint_object(claim, driver),
        requests: reports,
        constraints: constraint_reports(claim, &devices, &matched, &allocated_to),
    }
}

/// The `matchAttribute` constraints of `claim` against the devices that match their
/// requests (`matched`: request or `req/sub` -> devices).
fn constraint_reports(
    claim: &Value,
    devices: &[Published],
    matched: &BTreeMap<String, BTreeSet<(String, String)>>,
    allocated_to: &HashMap<(String, String), String>,
) -> Vec<ConstraintReport> {
    let counts = request_counts(claim);
    let constraints = claim
        .pointer("/spec/devices/constraints")
        .and_then(Value::as_array);
    let mut out = Vec::new();
    for c in constraints.into_iter().flatten() {
        let attribute = str_at(c, "/matchAttribute");
        let Some((domain, name)) = attribute.rsplit_once('/') else {
            continue;
        };
        let named: Vec<String> = c
            .get("requests")
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .filter(|r: &Vec<String>| !r.is_empty())
            .unwrap_or_else(|| counts.keys().cloned().collect());
        // A main request covers its subrequests.
        let covers = |r: &str| {
            named.iter().any(|n| {
                r == n
                    || r.strip_prefix(n.as_str())
                        .is_some_and(|t| t.starts_with('/'))
            })
        };
        let needed = named
            .iter()
            .map(|n| counts.get(n).copied().flatten())
            .sum::<Option<usize>>();
        let chosen: BTreeSet<&(String, String)> = matched
            .iter()
            .filter(|(r, _)| covers(r))
            .flat_map(|(_, d)| d)
            .collect();
        let mut nodes: BTreeMap<String, ConstraintNode> = BTreeMap::new();
        for d in devices
            .iter()
            .filter(|d| chosen.contains(&(d.pool.clone(), d.name.clone())))
        {
            let node = nodes
                .entry(d.node.clone())
                .or_insert_with(|| ConstraintNode {
                    node: d.node.clone(),
                    values: Vec::new(),
                    without_attribute: Vec::new(),
                });
            let key = (domain.to_owned(), name.to_owned());
            let values: Vec<String> = match d.shown.get(&(false, key.0.clone(), key.1.clone())) {
                Some(v) => vec![v.clone()],
                None => d.lists.get(&key).cloned().unwrap_or_default(),
            };
            if values.is_empty() {
                node.without_attribute.push(d.name.clone());
            }
            let taken = allocated_to
                .get(&(d.pool.clone(), d.name.clone()))
                .filter(|c| *c != "this claim");
            for v in values {
                let i = match node.values.iter().position(|g| g.value == v) {
                    Some(i) => i,
                    None => {
                        node.values.push(ValueGroup {
                            value: v,
                            devices: Vec::new(),
                            taken: Vec::new(),
                        });
                        node.values.len() - 1
                    }
                };
                let group = &mut node.values[i];
                group.devices.push(d.name.clone());
                if let Some(c) = taken {
                    group.taken.push((d.name.clone(), c.clone()));
                }
            }
        }
        let mut nodes: Vec<ConstraintNode> = nodes.into_values().collect();
        for n in &mut nodes {
            n.values.sort_by(|a, b| a.value.cmp(&b.value));
        }
        out.push(ConstraintReport {
            attribute: attribute.to_owned(),
            requests: named,
            needed,
            nodes,
        });
    }
    out
}

/// Request name -> its exact device count (`None` for `All`); a `firstAvailable` request
/// counts its smallest alternative, and each `req/sub` its own.
fn request_counts(claim: &Value) -> BTreeMap<String, Option<usize>> {
    let count = |r: &Value| -> Option<usize> {
        match str_at(r, "/allocationMode") {
            "" | "ExactCount" => Some(
                r.get("count")
                    .and_then(Value::as_u64)
                    .map_or(1, |c| c as usize),
            ),
            _ => None,
        }
    };
    let mut out = BTreeMap::new();
    let list = claim
        .pointer("/spec/devices/requests")
        .and_then(Value::as_array);
    for req in list.into_iter().flatten() {
        let name = str_at(req, "/name").to_owned();
        if let Some(subs) = req.get("firstAvailable").and_then(Value::as_array) {
            let mut smallest: Option<usize> = None;
            let mut all_exact = true;
            for sub in subs {
                let c = count(sub);
                out.insert(format!("{name}/{}", str_at(sub, "/name")), c);
                match c {
                    Some(c) => smallest = Some(smallest.map_or(c, |s| s.min(c))),
                    None => all_exact = false,
                }
            }
            out.insert(name, smallest.filter(|_| all_exact));
            continue;
        }
        out.insert(name, count(req.get("exactly").unwrap_or(req)));
    }
    out
}

impl Explanation {
    /// The report for people: per request its selectors, then per node each device.
    pub fn to_text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let state = if self.allocated {
            "allocated"
        } else {
            "not allocated"
        };
        let _ = writeln!(s, "ResourceClaim {}: {state}", self.claim);
        for f in &self.findings {
            let _ = writeln!(s, "{}: {f}", f.severity.as_str());
        }
        for r in &self.requests {
            let _ = writeln!(s, "request {} (DeviceClass {}):", r.request, r.device_class);
            if !r.device_class_found {
                let _ = writeln!(
                    s,
                    "  DeviceClass {} does not exist: nothing can be allocated",
                    r.device_class
                );
            }
            for sel in &r.selectors {
                let _ = writeln!(s, "  {sel}: {}", sel.expression);
            }
            let _ = writeln!(
                s,
                "  {} of {} {} devices match, {} of them free",
                r.matching,
                r.nodes.iter().map(|n| n.devices.len()).sum::<usize>(),
                self.driver,
                r.available
            );
            for n in &r.nodes {
                let _ = writeln!(s, "  node {}:", n.node);
                for d in &n.devices {
                    let verdict = match (&d.rejected_by, &d.reason) {
                        _ if d.matches => "matches".to_owned(),
                        (Some(i), Some(reason)) => {
                            format!("rejected by {}: {reason}", r.selectors[*i])
                        }
                        (_, Some(reason)) => format!("rejected: {reason}"),
                        _ => "rejected".to_owned(),
                    };
                    let alloc = match &d.allocated_to {
                        Some(c) if c == "this claim" => ", allocated to this claim".to_owned(),
                        Some(c) => format!(", allocated to {c}"),
                        None => String::new(),
                    };
                    let _ = writeln!(s, "    {}: {verdict}{alloc}", d.device);
                }
            }
        }
        for c in &self.constraints {
            let needed = c.needed.map_or_else(String::new, |n| {
                format!(", {n} devices with one value needed")
            });
            let _ = writeln!(
                s,
                "constraint matchAttribute {} over [{}]{needed}:",
                c.attribute,
                c.requests.join(", ")
            );
            if c.nodes.is_empty() {
                let _ = writeln!(s, "  no device matches its requests");
            }
            for n in &c.nodes {
                let best = n.values.iter().map(ValueGroup::free).max().unwrap_or(0);
                let verdict = match c.needed {
                    Some(need) if best >= need => "fits".to_owned(),
                    Some(need) => {
                        format!("does not fit: at most {best} free with one value, {need} needed")
                    }
                    None => String::new(),
                };
                let _ = writeln!(s, "  node {}: {verdict}", n.node);
                for g in &n.values {
                    let taken = if g.taken.is_empty() {
                        String::new()
                    } else {
                        let t: Vec<String> =
                            g.taken.iter().map(|(d, c)| format!("{d} by {c}")).collect();
                        format!("; taken: {}", t.join(", "))
                    };
                    let _ = writeln!(
                        s,
                        "    {}: {} of {} free ({}){taken}",
                        g.value,
                        g.free(),
                        g.devices.len(),
                        g.devices.join(", ")
                    );
                }
                if !n.without_attribute.is_empty() {
                    let _ = writeln!(
                        s,
                        "    without the attribute (never chosen): {}",
                        n.without_attribute.join(", ")
                    );
                }
            }
        }
        s
    }
}
