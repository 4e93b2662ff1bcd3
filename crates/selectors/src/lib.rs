//! CEL device selectors of ResourceClaims, ResourceClaimTemplates and DeviceClasses, checked
//! before they strand a pod.
//!
//! Two things, both pure (no I/O: the webhook and the CLI fetch and print):
//! - [`lint`]: a static check of each selector aimed at our DeviceClasses (or our driver)
//!   against the schema of what the renderer publishes (`gpu_dra_core::slices::ATTRIBUTES` and
//!   `CAPACITIES`, which the renderer itself is checked against): unknown names, wrong types,
//!   foreign domains, MIG-only names in the GPU class and the reverse, parse errors. The `cel`
//!   crate has no type checker, so [`lint`] infers types only for the shapes selectors use and
//!   says nothing when unsure: a finding is a likely mistake, never a refusal.
//! - [`explain`]: evaluates a claim's selectors against published devices the way the
//!   scheduler's CEL environment does (`device.driver`, `device.attributes[domain][name]`,
//!   `device.capacity[domain][name]` as quantities, `quantity()`, `semver()`; a missing
//!   attribute is a "no such key" error) and says for each device why it does or does not match.
//!
//! Behind them: `values` (the `quantity()` and `semver()` types of the Kubernetes CEL library)
//! and `unparse` (a parsed expression printed back, for messages that quote part of it).

pub mod explain;
pub mod lint;
mod unparse;
mod values;

pub use explain::{Explanation, explain};
pub use lint::{Finding, ObjectFinding, Severity, Target, lint_expression, lint_object};
