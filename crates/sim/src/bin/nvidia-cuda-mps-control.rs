//! `nvidia-cuda-mps-control` stand-in for the GPU simulator.
fn main() {}
