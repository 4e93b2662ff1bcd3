//! `gpu-sim`: creates and inspects simulated GPU hosts.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use gpu_dra_sim::profile::{self, Profile};
use gpu_dra_sim::setup::{self, Artefacts};
use gpu_dra_sim::state::StateFile;

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
        /// Directory holding libgpu_dra_sim.so (or deps/libgpu_dra_sim.so) and the tools;
        /// default: the directory of this executable.
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
            let dir = match artefacts {
                Some(d) => d,
                None => std::env::current_exe()
                    .context("locating gpu-sim")?
                    .parent()
                    .map(PathBuf::from)
                    .context("gpu-sim has no parent directory")?,
            };
            let artefacts = Artefacts::beside(&dir)?;
            let state = setup::setup(&root, &profile, &artefacts)?;
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
    }
    Ok(())
}
