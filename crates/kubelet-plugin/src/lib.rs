//! The node plugin: kubelet registration and DRA gRPC, prepare/unprepare with CDI specs and
//! a crash-safe checkpoint, metrics and health endpoints.

pub mod authority;
