//! The node plugin.
