//! The node plugin.

pub mod sharing;
