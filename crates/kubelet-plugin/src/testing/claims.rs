//! Claims for tests: an allocated ResourceClaim in one call, and a claim source in memory.
//! Both live in [`crate::claims`], where `selftest` uses them too; tests keep naming them here.

pub use crate::claims::{MemoryClaims, allocated_claim};
