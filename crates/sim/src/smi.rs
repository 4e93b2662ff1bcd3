//! `nvidia-smi` stand-in.
