//! The node plugin.

pub mod discover;
pub mod publish;
