//! Checks of the repository as a whole rather than of one crate.
//!
//! The tests under `tests/` read files outside any crate: `chart.rs` renders the Helm chart
//! in `deploy/` and checks what it produces, `examples.rs` runs every manifest in `examples/`
//! through the API validation, the webhook and the operator CLI. They live here so that each
//! crate's own tests test only that crate and no crate depends on another just for a test.
//!
//! This library is intentionally empty: cargo needs a target, the tests need no shared code.
