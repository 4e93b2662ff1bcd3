//! Operator CLI.
