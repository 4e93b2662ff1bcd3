//! Gives the simulated NVML library the real one's SONAME, `libnvidia-ml.so.1`: NVIDIA's
//! container toolkit reads it to decide which links a container gets.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
}
