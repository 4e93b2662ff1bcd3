//! `nvidia-cuda-mps-control` stand-in.
