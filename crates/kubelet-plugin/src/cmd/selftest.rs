//! `gpu-kubelet-plugin selftest`: the flags, and the report printed as text or JSON. The
//! self-test itself is [`crate::selftest`].
//!
//! Run by hand (or by the self-test bundle's script), so its flags have no env twins besides
//! the host's, which it shares with `run`.

use std::path::PathBuf;
use std::time::Duration;

use crate::host::HostArgs;
use crate::selftest::container::Runtime;
use crate::selftest::{Kind, Options};

/// Output format of `selftest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// One line per check, then a summary line.
    Text,
    /// `{"checks": [{"name", "status", "detail"}], "passed", "failed", "skipped"}`.
    Json,
}

/// Flags of `selftest`.
#[derive(Debug, Clone, clap::Args)]
pub struct SelftestArgs {
    /// The host under test.
    #[command(flatten)]
    pub host: HostArgs,
    /// The root file system of the test containers: the CUDA probe and the C library it
    /// loads `libcuda.so.1` with (the self-test bundle's `rootfs`).
    #[arg(long)]
    pub rootfs: PathBuf,
    /// The CUDA probe's path inside `--rootfs`.
    #[arg(long, default_value = "/usr/local/bin/gpu-cuda-probe")]
    pub probe: String,
    /// The OCI runtime that starts the containers.
    #[arg(long, default_value = "runc")]
    pub runtime: PathBuf,
    /// NVIDIA's `nvidia-cdi-hook` on this host, named by the specs' hooks (the `libcuda.so.1`
    /// link and the loader cache in the container); empty: specs carry no hooks.
    #[arg(long, default_value = "", value_parser = super::path_or_empty())]
    pub nvidia_cdi_hook_path: PathBuf,
    /// Where the self-test writes its checkpoint, CDI specs, MPS pipes and container bundles
    /// (emptied first; default: a folder under the system's temporary folder).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Change no GPU setting: time-slicing is skipped, MPS runs without setting the compute
    /// mode (MIG is never changed).
    #[arg(long)]
    pub leave_settings: bool,
    /// The claim kinds to try (comma-separated); kinds this host cannot offer are skipped.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "whole-gpu,mig,mps,time-slicing"
    )]
    pub kinds: Vec<Kind>,
    /// `defaultActiveThreadPercentage` of the MPS claim.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub mps_thread_percentage: u32,
    /// `defaultPinnedDeviceMemoryLimit` of the MPS claim, in MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(64..))]
    pub mps_memory_limit_mib: u64,
    /// A read-only bind mount added to every test container beyond its spec, `HOST:CONTAINER`
    /// (repeatable). For simulated hosts, whose state folder stands for the kernel driver
    /// that every process of a real host reaches; a real host needs none.
    #[arg(long = "container-mount", value_parser = parse_mount)]
    pub container_mounts: Vec<(PathBuf, String)>,
    /// How long one test container may run, in seconds.
    #[arg(long, default_value_t = 60)]
    pub container_timeout_seconds: u64,
    /// Node (pool) name of the test claims; default: this host's name.
    #[arg(long)]
    pub node_name: Option<String>,
    /// Driver name of the test claims.
    #[arg(long, default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Report format.
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: OutputFormat,
    /// Also write the report as JSON to this file (whatever `--output` prints).
    #[arg(long)]
    pub json_report: Option<PathBuf>,
    /// Log filter for the lines on stderr (the report goes to stdout).
    #[arg(long, default_value = "warn")]
    pub log_level: String,
}

fn parse_mount(s: &str) -> Result<(PathBuf, String), String> {
    match s.split_once(':') {
        Some((host, container)) if !host.is_empty() && container.starts_with('/') => {
            Ok((PathBuf::from(host), container.to_string()))
        }
        _ => Err(format!(
            "{s:?}: want HOST:CONTAINER with an absolute container path"
        )),
    }
}

/// Runs the self-test and prints its report; `Ok(true)` when a check failed.
pub async fn run(args: SelftestArgs) -> anyhow::Result<bool> {
    let work_dir = args.work_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("gpu-dra-selftest-{}", std::process::id()))
    });
    let work_dir = std::path::absolute(&work_dir)?;
    let rootfs = std::path::absolute(&args.rootfs)?;
    anyhow::ensure!(
        rootfs.join(args.probe.trim_start_matches('/')).is_file(),
        "--rootfs {}: no CUDA probe at {} in it",
        rootfs.display(),
        args.probe
    );
    let hook = Some(args.nvidia_cdi_hook_path.clone())
        .filter(|p| !p.as_os_str().is_empty())
        .map(std::path::absolute)
        .transpose()?;
    let options = Options {
        host: args.host.clone(),
        node_name: args
            .node_name
            .clone()
            .unwrap_or_else(super::discover::hostname),
        driver_name: args.driver_name.clone(),
        runtime: Runtime {
            runc: args.runtime.clone(),
            state_root: work_dir.join("runc"),
            rootfs,
            extra_mounts: args.container_mounts.clone(),
            timeout: Duration::from_secs(args.container_timeout_seconds.max(1)),
        },
        work_dir: work_dir.clone(),
        probe: args.probe.clone(),
        hook,
        leave_settings: args.leave_settings,
        kinds: args.kinds.clone(),
        mps_percentage: args.mps_thread_percentage,
        mps_memory_limit_mib: args.mps_memory_limit_mib,
        tool_timeout: Duration::from_secs(10),
    };
    let report = crate::selftest::run(&options).await;
    let mut out = std::io::stdout().lock();
    use std::io::Write;
    match args.output {
        OutputFormat::Text => out.write_all(report.text().as_bytes())?,
        OutputFormat::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report.json())?)?,
    }
    if let Some(path) = &args.json_report {
        std::fs::write(path, serde_json::to_string_pretty(&report.json())? + "\n")
            .map_err(|e| anyhow::anyhow!("--json-report {}: {e}", path.display()))?;
    }
    // The work folder holds nothing of value once the claims are unprepared.
    let _ = std::fs::remove_dir_all(&work_dir);
    Ok(report.failed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_parse_or_say_what_is_wanted() {
        assert_eq!(
            parse_mount("/sim/etc/gpu-sim:/etc/gpu-sim").expect("valid"),
            (
                PathBuf::from("/sim/etc/gpu-sim"),
                "/etc/gpu-sim".to_string()
            )
        );
        assert!(
            parse_mount("/a")
                .expect_err("no colon")
                .contains("HOST:CONTAINER")
        );
        assert!(parse_mount("/a:relative").is_err());
    }
}
