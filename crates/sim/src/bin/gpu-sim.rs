//! `gpu-sim`: creates and inspects simulated GPU hosts, injects GPU faults into them and
//! upgrades their driver in place.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args as ClapArgs, Parser, Subcommand};
use gpu_dra_sim::health::{Fault, RecoveryAction};
use gpu_dra_sim::profile::{self, Profile};
use gpu_dra_sim::setup::{self, Artefacts};
use gpu_dra_sim::state::StateFile;
use gpu_dra_sim::upgrade::{Upgrade, UpgradeStyle, upgrade_driver};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "gpu-sim",
    about = "Simulated NVIDIA GPU hosts for tests and demos"
)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a simulated host (library, tools, /dev, /proc, /sys, state) under --root.
    Setup {
        /// Built-in profile name or path to a profile JSON file.
        #[arg(long, env = "GPU_SIM_PROFILE")]
        profile: String,
        /// Directory to create the host in.
        #[arg(long, env = "GPU_SIM_ROOT")]
        root: PathBuf,
        /// Directory holding libgpu_dra_sim.so and libgpu_dra_sim_cuda.so (or deps/ holding
        /// them) and the tools; default: the directory of this executable.
        #[arg(long, env = "GPU_SIM_ARTEFACTS")]
        artefacts: Option<PathBuf>,
    },
    /// List the built-in profiles.
    Profiles,
    /// Print the state of a simulated host as JSON.
    State {
        /// The host's root directory.
        #[arg(long, env = "GPU_SIM_ROOT")]
        root: PathBuf,
    },
    /// Report an XID error on a GPU (an NVML XidCriticalError event) and set its recovery
    /// action.
    Xid {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        instance: Instance,
        /// Recovery action NVML reports afterwards; default: none for the application XIDs
        /// 13, 31, 43, 45, 68 and 109, reset for the others.
        #[arg(long, value_enum)]
        recovery: Option<RecoveryAction>,
        /// The XID number (48 double-bit ECC, 79 fallen off the bus, ...).
        xid: u64,
    },
    /// Report an uncorrectable ECC error on a GPU (an NVML DoubleBitEccError event): the
    /// volatile uncorrectable count grows by one and the recovery action becomes reset.
    Ecc {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        instance: Instance,
    },
    /// Make a GPU fall off the bus: an XID 79 event, then NVML answers GPU_IS_LOST for it and
    /// the recovery action becomes reboot.
    FallOffBus {
        #[command(flatten)]
        target: Target,
    },
    /// Reset a GPU's health as `nvidia-smi -r` does: not lost, recovery action none, volatile
    /// ECC counts cleared (MIG instances stay).
    Reset {
        #[command(flatten)]
        target: Target,
    },
    /// Upgrade the driver in place under a running host: the versioned files are swapped,
    /// the links repointed and the kernel module reloaded; NVML cannot be reached for the
    /// window (see the `upgrade` module of the simulator for what each style does).
    UpgradeDriver {
        /// The host's root directory (the driver root: `/run/nvidia/driver` of a node's
        /// tree for the GPU Operator's layout).
        #[arg(long, env = "GPU_SIM_ROOT")]
        root: PathBuf,
        /// The new driver version (`580.105.08`).
        #[arg(long, env = "GPU_SIM_DRIVER_VERSION")]
        version: String,
        /// `container`: the GPU Operator's driver container restarting (module unloaded, no
        /// library in the window); `package`: a package upgraded on the host, then the
        /// module reloaded (version mismatch in the window).
        #[arg(
            long,
            value_enum,
            default_value = "container",
            env = "GPU_SIM_UPGRADE_STYLE"
        )]
        style: UpgradeStyle,
        /// Seconds NVML cannot be reached.
        #[arg(long, default_value_t = 2.0, env = "GPU_SIM_UPGRADE_WINDOW")]
        window_seconds: f64,
        /// Directory holding libgpu_dra_sim.so, libgpu_dra_sim_cuda.so and the tools to
        /// install; default: the directory of this executable.
        #[arg(long, env = "GPU_SIM_ARTEFACTS")]
        artefacts: Option<PathBuf>,
    },
}

/// The build artefacts: `dir`, else those beside this executable.
fn artefacts(dir: Option<PathBuf>) -> anyhow::Result<Artefacts> {
    let dir = match dir {
        Some(d) => d,
        None => std::env::current_exe()
            .context("locating gpu-sim")?
            .parent()
            .map(PathBuf::from)
            .context("gpu-sim has no parent directory")?,
    };
    Ok(Artefacts::beside(&dir)?)
}

/// The GPU a fault command acts on.
#[derive(ClapArgs)]
struct Target {
    /// The host's root directory.
    #[arg(long, env = "GPU_SIM_ROOT")]
    root: PathBuf,
    /// The GPU: an index, a GPU UUID (GPU-...), a PCI bus ID or a board serial, as
    /// `nvidia-smi -i` takes it.
    #[arg(long, env = "GPU_SIM_GPU")]
    gpu: String,
}

/// The MIG device a fault hit; both IDs or neither.
#[derive(ClapArgs)]
struct Instance {
    /// GPU-instance ID of the MIG device the fault hit (needs --ci).
    #[arg(long, requires = "ci", env = "GPU_SIM_GI")]
    gi: Option<u32>,
    /// Compute-instance ID of the MIG device the fault hit (needs --gi).
    #[arg(long, requires = "gi", env = "GPU_SIM_CI")]
    ci: Option<u32>,
}

impl Instance {
    fn ids(&self) -> Option<(u32, u32)> {
        self.gi.zip(self.ci)
    }
}

/// Applies `fault` to the GPU `target` names, under the state file's lock.
fn inject(target: &Target, fault: &Fault) -> anyhow::Result<String> {
    let file = StateFile::under_root(&target.root);
    let line = file
        .update(|s| s.apply_fault(&target.gpu, fault))
        .with_context(|| format!("simulated host under {}", target.root.display()))??;
    Ok(line)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut out = std::io::stdout().lock();
    match args.command {
        Cmd::Setup {
            profile,
            root,
            artefacts,
        } => {
            let profile = Profile::load(&profile)?;
            let state = setup::setup(&root, &profile, &self::artefacts(artefacts)?)?;
            writeln!(
                out,
                "simulated host {:?} with {} GPU(s) ready under {}",
                state.profile.name,
                state.gpus.len(),
                root.display()
            )?;
        }
        Cmd::Profiles => {
            for name in profile::builtin_names() {
                let p = Profile::load(name)?;
                writeln!(out, "{name:<15} {}", p.description)?;
            }
        }
        Cmd::State { root } => {
            let state = StateFile::under_root(&root).load()?;
            writeln!(out, "{}", serde_json::to_string_pretty(&state)?)?;
        }
        Cmd::Xid {
            target,
            instance,
            recovery,
            xid,
        } => {
            let fault = Fault::Xid {
                xid,
                instance: instance.ids(),
                recovery,
            };
            writeln!(out, "{}", inject(&target, &fault)?)?;
        }
        Cmd::Ecc { target, instance } => {
            let fault = Fault::Ecc {
                instance: instance.ids(),
            };
            writeln!(out, "{}", inject(&target, &fault)?)?;
        }
        Cmd::FallOffBus { target } => {
            writeln!(out, "{}", inject(&target, &Fault::FallOffBus)?)?;
        }
        Cmd::Reset { target } => {
            writeln!(out, "{}", inject(&target, &Fault::Reset)?)?;
        }
        Cmd::UpgradeDriver {
            root,
            version,
            style,
            window_seconds,
            artefacts,
        } => {
            let window = Duration::try_from_secs_f64(window_seconds).map_err(|_| {
                anyhow::anyhow!(
                    "--window-seconds: {window_seconds} is not a duration: give 0 or more seconds"
                )
            })?;
            let upgrade = Upgrade {
                version,
                style,
                window,
            };
            let state = upgrade_driver(&root, &upgrade, &self::artefacts(artefacts)?)
                .with_context(|| format!("simulated host under {}", root.display()))?;
            writeln!(
                out,
                "driver {} loaded under {}",
                state.profile.driver_version,
                root.display()
            )?;
        }
    }
    Ok(())
}
