//! The nbody CUDA sample as `cuda-app` plays it: `/tmp/sample` of NVIDIA's
//! `nvcr.io/nvidia/k8s/cuda-sample:nbody-*` images, which other people's specs run as
//! `/tmp/sample --benchmark --numbodies=4226000`.
//!
//! The sample reads its flags the CUDA samples' way: one or two dashes, `name` or
//! `name=value`, flags it does not know ignored. These are its flags: `benchmark`,
//! `fullscreen`, `fp64`, `hostmem`, `numbodies=<N>`, `device=<d>`, `numdevices=<i>`,
//! `i=<iterations>`, and `cpu`, `compare`, `qatest`, `tipsy=<file>`, which this stand-in
//! refuses with a message (they need the CPU simulation or a model file, not simulated).
//! A command line with none of them is not the sample's: `cuda-app` runs as itself.
//!
//! Output follows the sample's: its usage lines and note, the mode lines
//! (`> Windowed mode`, `> Simulation data stored in video memory`,
//! `> Single precision floating point simulation`, `> 1 Devices used for simulation`), then
//! `GPU Device 0: "Ampere" with compute capability 8.0` and
//! `> Compute 8.0 CUDA device: [NVIDIA A100-SXM4-40GB]` for the device it runs on (a MIG
//! device is named `<GPU name> MIG <profile>`), `number of bodies = N` when given. In
//! benchmark mode it then computes for the time the run takes and prints
//! `N bodies, total time for I iterations: T ms`, the interactions per second and the
//! GFLOP/s (20 flops per interaction in single precision, 30 in double), and ends with 0.
//! Without `benchmark` it simulates until killed, as the windowed sample runs until closed.
//!
//! Time is the simulator's model, not a measurement: a whole GPU computes
//! [`INTERACTIONS_PER_SECOND`] body interactions per second in single precision (a quarter
//! in double), a MIG device its share of the GPU's compute slices, several devices the sum;
//! a run of I iterations over N bodies takes N²·I interactions. So the specs' 4,226,000
//! bodies keep a whole GPU busy for about three minutes, as the real sample keeps an A100
//! busy for minutes.

use std::fmt::Write as _;

/// Body interactions per second of a whole simulated GPU in single precision.
pub const INTERACTIONS_PER_SECOND: f64 = 1.0e12;

/// Flags of the sample this stand-in refuses, and why.
const NOT_SIMULATED: [&str; 4] = ["cpu", "compare", "qatest", "tipsy"];

/// Every flag of the sample.
const FLAGS: [&str; 12] = [
    "benchmark",
    "fullscreen",
    "fp64",
    "hostmem",
    "numbodies",
    "device",
    "numdevices",
    "i",
    "cpu",
    "compare",
    "qatest",
    "tipsy",
];

/// Bodies of a run that names no number (the sample's interactive default).
pub const DEFAULT_BODIES: u64 = 16384;

/// Iterations of a benchmark run that names none.
pub const DEFAULT_ITERATIONS: u64 = 10;

/// A command line of the sample that cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NbodyError {
    /// A flag needs a value that is not a number (or is zero where one is needed).
    #[error("nbody: -{flag}={value:?} is invalid: use a whole number of at least {min}")]
    BadValue {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
        /// The least valid value.
        min: u64,
    },
    /// A flag of the sample that the stand-in does not simulate.
    #[error(
        "nbody: -{0} is not simulated (runs without it: -benchmark, -numbodies=, -fp64, -hostmem, -fullscreen, -device=, -numdevices=, -i=)"
    )]
    NotSimulated(&'static str),
}

/// The sample's command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NbodyArgs {
    /// `-benchmark`: run a timed number of iterations and print the figures.
    pub benchmark: bool,
    /// `-fullscreen`.
    pub fullscreen: bool,
    /// `-fp64`: double precision.
    pub fp64: bool,
    /// `-hostmem`: simulation data in host memory.
    pub hostmem: bool,
    /// `-numbodies=<N>`.
    pub numbodies: Option<u64>,
    /// `-device=<d>`: the CUDA device to use.
    pub device: Option<u64>,
    /// `-numdevices=<i>`: how many devices to use.
    pub numdevices: Option<u64>,
    /// `-i=<iterations>`.
    pub iterations: Option<u64>,
}

impl NbodyArgs {
    /// Reads a command line (without the program name): `Ok(None)` when it has none of the
    /// sample's flags.
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Option<Self>, NbodyError> {
        let mut out = Self::default();
        let mut any = false;
        for arg in args {
            let arg = arg.as_ref();
            let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
                continue;
            };
            let (name, value) = match flag.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (flag, None),
            };
            let Some(&known) = FLAGS.iter().find(|f| **f == name) else {
                continue;
            };
            any = true;
            if let Some(&refused) = NOT_SIMULATED.iter().find(|f| **f == known) {
                return Err(NbodyError::NotSimulated(refused));
            }
            let number = |min: u64| -> Result<u64, NbodyError> {
                let v = value.unwrap_or("");
                v.parse::<u64>()
                    .ok()
                    .filter(|n| *n >= min)
                    .ok_or_else(|| NbodyError::BadValue {
                        flag: known,
                        value: v.to_string(),
                        min,
                    })
            };
            match known {
                "benchmark" => out.benchmark = true,
                "fullscreen" => out.fullscreen = true,
                "fp64" => out.fp64 = true,
                "hostmem" => out.hostmem = true,
                "numbodies" => out.numbodies = Some(number(1)?),
                "device" => out.device = Some(number(0)?),
                "numdevices" => out.numdevices = Some(number(1)?),
                _ => out.iterations = Some(number(1)?),
            }
        }
        Ok(any.then_some(out))
    }
}

/// A CUDA device as the sample sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaDevice {
    /// Name CUDA reports (`NVIDIA A100-SXM4-40GB`, `NVIDIA A100-SXM4-40GB MIG 1g.5gb`).
    pub name: String,
    /// Architecture name the samples print (`Ampere`).
    pub architecture: String,
    /// Compute capability (`8.0`).
    pub compute_capability: String,
    /// Share of a whole GPU's compute (1 for a GPU, slices/7 for a MIG device).
    pub share: f64,
}

/// The CUDA devices a process sees in `state`: its GPUs, or for a GPU in MIG mode its MIG
/// devices.
pub fn devices(state: &crate::state::State) -> Vec<CudaDevice> {
    let mut out = Vec::new();
    for (i, spec) in state.profile.gpus.iter().enumerate() {
        let device = |name: String, share: f64| CudaDevice {
            name,
            architecture: spec.architecture.clone(),
            compute_capability: spec.compute_capability.clone(),
            share,
        };
        if state.gpus[i].mig_current {
            for m in state.mig_devices(i) {
                let share = f64::from(m.ci.slice_count) / 7.0;
                out.push(device(format!("{} MIG {}", spec.name, m.name()), share));
            }
        } else {
            out.push(device(spec.name.clone(), 1.0));
        }
    }
    out
}

/// A run the sample can do: what it prints first, and the benchmark it then computes.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// Everything printed before the computation.
    pub header: String,
    /// The benchmark's figures (`None`: not a benchmark, runs until killed).
    pub benchmark: Option<Benchmark>,
}

/// A benchmark's size and simulated duration.
#[derive(Debug, Clone, PartialEq)]
pub struct Benchmark {
    /// Bodies.
    pub bodies: u64,
    /// Iterations.
    pub iterations: u64,
    /// Simulated duration, in milliseconds.
    pub millis: f64,
    /// Double precision.
    pub fp64: bool,
}

impl Benchmark {
    /// The lines the sample prints when the benchmark is done.
    pub fn report(&self) -> String {
        let interactions = (self.bodies as f64) * (self.bodies as f64) * (self.iterations as f64);
        let per_second = interactions * 1e-9 * 1000.0 / self.millis;
        let flops = if self.fp64 { 30 } else { 20 };
        let precision = if self.fp64 { "double" } else { "single" };
        format!(
            "{} bodies, total time for {} iterations: {:.3} ms\n= {per_second:.3} billion interactions per second\n= {:.3} {precision}-precision GFLOP/s at {flops} flops per interaction\n",
            self.bodies,
            self.iterations,
            self.millis,
            per_second * f64::from(flops),
        )
    }
}

const USAGE: &str = "Run \"nbody -benchmark [-numbodies=<numBodies>]\" to measure performance.
\t-fullscreen       (run n-body simulation in fullscreen mode)
\t-fp64             (use double precision floating point values for simulation)
\t-hostmem          (stores simulation data in host memory)
\t-benchmark        (run benchmark to measure performance) 
\t-numbodies=<N>    (number of bodies (>= 1) to run in simulation) 
\t-device=<d>       (where d=0,1,2.... for the CUDA device to use)
\t-numdevices=<i>   (where i=(number of CUDA devices > 0) to use for simulation)
\t-compare          (compares simulation results running once on the default GPU and once on the CPU)
\t-cpu              (run n-body simulation on the CPU)
\t-tipsy=<file.bin> (load a tipsy model file for simulation)

NOTE: The CUDA Samples are not meant for performance measurements. Results may vary when GPU Boost is enabled.

";

/// Plans a run on `devices`; `Err` is what the sample prints before it exits with 1.
pub fn plan(args: &NbodyArgs, devices: &[CudaDevice]) -> Result<Run, String> {
    let mut h = String::from(USAGE);
    let used = args.numdevices.unwrap_or(1);
    if devices.is_empty() {
        return Err(format!(
            "{h}gpuDeviceInit() CUDA error: no devices supporting CUDA.\n"
        ));
    }
    if used > devices.len() as u64 {
        return Err(format!(
            "{h}number of CUDA devices  = {}\nnumdevices = {used} is greater than the number of CUDA devices ({}). Exiting.\n",
            devices.len(),
            devices.len()
        ));
    }
    let first = args.device.unwrap_or(0);
    if first >= devices.len() as u64 {
        return Err(format!(
            "{h}gpuDeviceInit() Device {first} is not a valid GPU device (there are {} devices).\n",
            devices.len()
        ));
    }
    let mode = if args.fullscreen {
        "Fullscreen"
    } else {
        "Windowed"
    };
    let memory = if args.hostmem {
        "host memory"
    } else {
        "video memory"
    };
    let precision = if args.fp64 { "Double" } else { "Single" };
    let _ = write!(
        h,
        "> {mode} mode\n> Simulation data stored in {memory}\n> {precision} precision floating point simulation\n> {used} Devices used for simulation\n"
    );
    let chosen: Vec<&CudaDevice> = if used > 1 {
        devices.iter().take(used as usize).collect()
    } else {
        vec![&devices[first as usize]]
    };
    let d = chosen[0];
    let index = if used > 1 { 0 } else { first };
    let _ = write!(
        h,
        "GPU Device {index}: \"{}\" with compute capability {}\n\n> Compute {} CUDA device: [{}]\n",
        d.architecture, d.compute_capability, d.compute_capability, d.name
    );
    if let Some(n) = args.numbodies {
        let _ = writeln!(h, "number of bodies = {n}");
    }
    let benchmark = args.benchmark.then(|| {
        let bodies = args.numbodies.unwrap_or(DEFAULT_BODIES);
        let iterations = args.iterations.unwrap_or(DEFAULT_ITERATIONS);
        let share: f64 = chosen.iter().map(|d| d.share).sum();
        let rate = INTERACTIONS_PER_SECOND * share / if args.fp64 { 4.0 } else { 1.0 };
        let millis = (bodies as f64) * (bodies as f64) * (iterations as f64) / rate * 1000.0;
        Benchmark {
            bodies,
            iterations,
            millis,
            fp64: args.fp64,
        }
    });
    Ok(Run {
        header: h,
        benchmark,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a100(share: f64, name: &str) -> CudaDevice {
        CudaDevice {
            name: name.into(),
            architecture: "Ampere".into(),
            compute_capability: "8.0".into(),
            share,
        }
    }

    #[test]
    fn reads_the_specs_flags_with_one_or_two_dashes() {
        let got = NbodyArgs::parse(&["--benchmark", "--numbodies=4226000"])
            .unwrap()
            .unwrap();
        assert!(got.benchmark);
        assert_eq!(got.numbodies, Some(4226000));
        let got = NbodyArgs::parse(&["-benchmark", "-fp64", "-i=3", "-device=1", "-extra"])
            .unwrap()
            .unwrap();
        assert!(got.fp64 && got.benchmark);
        assert_eq!((got.iterations, got.device), (Some(3), Some(1)));
    }

    #[test]
    fn a_command_line_without_its_flags_is_not_the_samples() {
        assert_eq!(NbodyArgs::parse(&["--seconds", "5"]).unwrap(), None);
        assert_eq!(NbodyArgs::parse::<&str>(&[]).unwrap(), None);
    }

    #[test]
    fn bad_values_and_unsimulated_flags_are_refused_by_name() {
        let err = NbodyArgs::parse(&["-numbodies=0"]).unwrap_err();
        assert!(err.to_string().contains("-numbodies=\"0\""), "{err}");
        let err = NbodyArgs::parse(&["--benchmark", "--cpu"]).unwrap_err();
        assert_eq!(err, NbodyError::NotSimulated("cpu"));
    }

    #[test]
    fn benchmark_prints_the_samples_lines_for_the_device_it_runs_on() {
        let args = NbodyArgs::parse(&["--benchmark", "--numbodies=100000"])
            .unwrap()
            .unwrap();
        let run = plan(&args, &[a100(1.0, "NVIDIA A100-SXM4-40GB")]).unwrap();
        assert!(run.header.starts_with("Run \"nbody -benchmark"));
        assert!(run.header.contains(
            "> Windowed mode\n> Simulation data stored in video memory\n> Single precision floating point simulation\n> 1 Devices used for simulation\nGPU Device 0: \"Ampere\" with compute capability 8.0\n\n> Compute 8.0 CUDA device: [NVIDIA A100-SXM4-40GB]\nnumber of bodies = 100000\n"
        ), "{}", run.header);
        let b = run.benchmark.unwrap();
        // 1e10 interactions per iteration at 1e12 per second: 10 ms each.
        assert!((b.millis - 100.0).abs() < 1e-6, "{}", b.millis);
        assert_eq!(
            b.report(),
            "100000 bodies, total time for 10 iterations: 100.000 ms\n= 1000.000 billion interactions per second\n= 20000.000 single-precision GFLOP/s at 20 flops per interaction\n"
        );
    }

    #[test]
    fn a_mig_device_computes_its_share_and_fp64_a_quarter() {
        let args = NbodyArgs::parse(&["-benchmark", "-numbodies=100000", "-fp64"])
            .unwrap()
            .unwrap();
        let run = plan(
            &args,
            &[a100(1.0 / 7.0, "NVIDIA A100-SXM4-40GB MIG 1g.5gb")],
        )
        .unwrap();
        assert!(run.header.contains("[NVIDIA A100-SXM4-40GB MIG 1g.5gb]"));
        assert!(run.header.contains("> Double precision"));
        let b = run.benchmark.unwrap();
        assert!((b.millis - 2800.0).abs() < 1e-6, "{}", b.millis);
        assert!(b.report().contains("double-precision GFLOP/s at 30 flops"));
    }

    #[test]
    fn no_device_or_too_many_asked_fails_as_the_sample_does() {
        let args = NbodyArgs::parse(&["-benchmark"]).unwrap().unwrap();
        assert!(
            plan(&args, &[])
                .unwrap_err()
                .contains("no devices supporting CUDA")
        );
        let args = NbodyArgs::parse(&["-benchmark", "-numdevices=2"])
            .unwrap()
            .unwrap();
        let err = plan(&args, &[a100(1.0, "A100")]).unwrap_err();
        assert!(err.contains("numdevices = 2 is greater"), "{err}");
        let args = NbodyArgs::parse(&["-benchmark", "-device=3"])
            .unwrap()
            .unwrap();
        assert!(
            plan(&args, &[a100(1.0, "A100")])
                .unwrap_err()
                .contains("Device 3 is not a valid")
        );
    }

    #[test]
    fn without_benchmark_it_runs_until_killed() {
        let args = NbodyArgs::parse(&["-fullscreen"]).unwrap().unwrap();
        let run = plan(&args, &[a100(1.0, "A100")]).unwrap();
        assert!(run.header.contains("> Fullscreen mode"));
        assert_eq!(run.benchmark, None);
    }
}
