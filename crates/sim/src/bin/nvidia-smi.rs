//! `nvidia-smi` stand-in for the GPU simulator.
fn main() {}
