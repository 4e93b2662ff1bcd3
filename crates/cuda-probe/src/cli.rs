//! The command line of `gpu-cuda-probe`; every flag has an environment twin.

use clap::Parser;

/// `gpu-cuda-probe [--elements N] [--alloc-bytes BYTES] [--device I] [--libcuda PATH]`.
#[derive(Debug, Clone, PartialEq, Eq, Parser)]
#[command(
    name = "gpu-cuda-probe",
    about = "Check CUDA in this container: devices, a JIT-compiled PTX kernel, an allocation; prints one JSON object"
)]
pub struct Args {
    /// Elements of the saxpy kernel's vectors.
    #[arg(long, env = "GPU_CUDA_PROBE_ELEMENTS", default_value_t = 1 << 16,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 28)))]
    pub elements: u32,
    /// After the kernel, try one allocation of this many bytes and report its outcome.
    #[arg(long, env = "GPU_CUDA_PROBE_ALLOC_BYTES")]
    pub alloc_bytes: Option<u64>,
    /// CUDA ordinal of the device to run the kernel on.
    #[arg(long, env = "GPU_CUDA_PROBE_DEVICE", default_value_t = 0)]
    pub device: i32,
    /// The CUDA driver library to load: a file name the loader looks up, or a path.
    #[arg(long, env = "GPU_CUDA_PROBE_LIBCUDA", default_value = "libcuda.so.1")]
    pub libcuda: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("gpu-cuda-probe").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_and_flags() {
        let a = parse(&[]).expect("defaults");
        assert_eq!(
            a,
            Args {
                elements: 65536,
                alloc_bytes: None,
                device: 0,
                libcuda: "libcuda.so.1".into()
            }
        );
        let a = parse(&[
            "--elements",
            "1000",
            "--alloc-bytes",
            "1073741824",
            "--device",
            "2",
            "--libcuda",
            "/x/libcuda.so.1",
        ])
        .expect("flags");
        assert_eq!(a.elements, 1000);
        assert_eq!(a.alloc_bytes, Some(1 << 30));
        assert_eq!(a.device, 2);
        assert_eq!(a.libcuda, "/x/libcuda.so.1");
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(parse(&["--elements", "0"]).is_err());
        assert!(parse(&["--elements", "x"]).is_err());
        assert!(parse(&["--alloc-bytes", "-1"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
    }
}
