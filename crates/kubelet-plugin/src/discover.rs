//! `gpu-kubelet-plugin discover`: prints the inventory and the ResourceSlices this node would
//! publish, without a cluster. The tool users run on a node to see what the scheduler will see.
//!
//! Reads the environment only through clap (every flag has an env twin, shared with `run`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use gpu_dra_core::slices::{self, SliceParams};
use gpu_dra_device::{GpuInventory, Inventory};
use gpu_dra_nvml::{self as nvml, NvmlInventory, NvmlOptions};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde::Serialize;

/// Output format of `discover`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// YAML (default).
    Yaml,
    /// JSON.
    Json,
}

/// Where the driver, device nodes and sysfs of the host are: flags shared by `run` and
/// `discover`, so both read one host the same way.
#[derive(Debug, Clone, clap::Args)]
pub struct HostArgs {
    /// Root of the NVIDIA driver installation (libraries, binaries, firmware) on the host,
    /// as the container runtime sees it (NVIDIA's chart value `nvidiaDriverRoot`): `/` for a
    /// driver installed on the host, `/run/nvidia/driver` for the GPU Operator's. CDI specs
    /// name paths under it.
    #[arg(
        long = "nvidia-driver-root",
        visible_alias = "driver-root",
        env = "NVIDIA_DRIVER_ROOT",
        default_value = "/"
    )]
    pub driver_root: PathBuf,
    /// Where that root is found by this process, when it differs: the chart mounts a driver
    /// installed on the host at `/driver-root` in the plugin's container. Default: the
    /// `--nvidia-driver-root` path itself.
    #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
    pub container_driver_root: Option<PathBuf>,
    /// Root under which dev/nvidia* and proc/driver/nvidia/capabilities live.
    #[arg(long, env = "NVIDIA_DEV_ROOT", default_value = "/")]
    pub dev_root: PathBuf,
    /// Root of sysfs (PCIe root and NUMA node).
    #[arg(long, env = "SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// Explicit NVML library; default: first libnvidia-ml.so.1 under the driver root's lib dirs.
    #[arg(long, env = "NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
}

impl HostArgs {
    /// The driver root as this process reads it (see `container_driver_root`).
    pub fn driver_root_here(&self) -> &Path {
        self.container_driver_root
            .as_deref()
            .unwrap_or(&self.driver_root)
    }

    /// The driver root on the host and where this process reads it.
    pub fn driver_roots(&self) -> DriverRoots {
        DriverRoots {
            host: self.driver_root.clone(),
            here: self.driver_root_here().to_path_buf(),
        }
    }

    /// The NVML backend for this host and the library it loads.
    pub fn nvml_inventory(&self) -> anyhow::Result<(PathBuf, NvmlInventory)> {
        let lib_path = nvml_library(self.driver_root_here(), self.nvml_lib.as_deref())?;
        let backend = NvmlInventory::new(NvmlOptions {
            lib_path: lib_path.clone(),
            sysfs_root: self.sysfs_root.clone(),
        });
        Ok((lib_path, backend))
    }
}

/// The driver root by its two names: the host's path, which CDI specs name, and the path
/// under which this process reads the same files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRoots {
    /// On the host, as the container runtime resolves spec paths.
    pub host: PathBuf,
    /// In this process's filesystem.
    pub here: PathBuf,
}

impl DriverRoots {
    /// One root seen at the same path by the host and this process.
    pub fn same(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        DriverRoots {
            host: root.clone(),
            here: root,
        }
    }
}

/// Flags of `discover`.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoverArgs {
    /// The host to discover (`--dev-root` is accepted so `discover` takes the same environment
    /// as `run`; discovery does not read it).
    #[command(flatten)]
    pub host: HostArgs,
    /// Node name used for the pool and slice names; default: this host's name.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Driver name.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Output format.
    #[arg(long, env = "DISCOVER_OUTPUT", value_enum, default_value = "yaml")]
    pub output: OutputFormat,
}

/// What `discover` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DiscoverReport {
    /// The node name used.
    pub node_name: String,
    /// The NVML library used.
    pub nvml_library: String,
    /// The discovered inventory.
    pub inventory: Inventory,
    /// The slices that would be published (generation 1).
    pub resource_slices: Vec<ResourceSlice>,
    /// Attributes left out because of API limits.
    pub warnings: Vec<String>,
}

/// The NVML library to load: `explicit` if given (it must exist), else the first
/// `libnvidia-ml.so.1` under the driver root's library directories.
pub fn nvml_library(driver_root: &Path, explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        anyhow::ensure!(
            path.exists(),
            "NVML library {} (--nvml-lib / NVML_LIB) does not exist",
            path.display()
        );
        return Ok(path.to_path_buf());
    }
    nvml::find_library(driver_root).with_context(|| {
        format!(
            "no {} under {} in any of {}; set --nvidia-driver-root (NVIDIA_DRIVER_ROOT) to where the driver is installed (and --container-driver-root to where this process sees it, if elsewhere), or --nvml-lib (NVML_LIB)",
            nvml::LIBRARY_NAME,
            driver_root.display(),
            nvml::LIBRARY_DIRS.join(", ")
        )
    })
}

/// This host's name, lower-cased (node names are lower case), or `localhost` if unknown.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Builds the report for `args` using `inventory` as the backend.
pub fn report(
    args: &DiscoverArgs,
    library: &Path,
    inventory: &dyn GpuInventory,
) -> anyhow::Result<DiscoverReport> {
    let node_name = args.node_name.clone().unwrap_or_else(hostname);
    let inventory = inventory
        .discover()
        .context("discovering GPUs through NVML")?;
    let rendered = slices::render_slices(
        &inventory,
        &SliceParams {
            node_name: &node_name,
            driver_name: &args.driver_name,
            generation: 1,
        },
    );
    Ok(DiscoverReport {
        node_name,
        nvml_library: library.display().to_string(),
        inventory,
        resource_slices: rendered.slices,
        warnings: rendered.warnings.iter().map(ToString::to_string).collect(),
    })
}

/// Serialises a report in the chosen format.
pub fn render(report: &DiscoverReport, format: OutputFormat) -> anyhow::Result<String> {
    Ok(match format {
        OutputFormat::Json => {
            let mut s = serde_json::to_string_pretty(report)?;
            s.push('\n');
            s
        }
        OutputFormat::Yaml => serde_saphyr::to_string(report).context("rendering YAML")?,
    })
}

/// Runs `discover`: NVML discovery, rendering, printing to stdout.
pub fn run(args: DiscoverArgs) -> anyhow::Result<()> {
    let (library, backend) = args.host.nvml_inventory()?;
    let report = report(&args, &library, &backend)?;
    let text = render(&report, args.output)?;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use gpu_dra_device::fixture::FixtureInventory;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: DiscoverArgs,
    }

    fn inv() -> Inventory {
        gpu_dra_device::testing::t4_inventory(1)
    }

    #[test]
    fn flags_parse_with_defaults() {
        let cli = Cli::try_parse_from(["x", "--node-name", "n1", "--output", "json"]).unwrap();
        assert_eq!(cli.args.driver_name, "gpu.nvidia.com");
        assert_eq!(cli.args.host.sysfs_root, PathBuf::from("/sys"));
        assert_eq!(cli.args.output, OutputFormat::Json);
        assert!(Cli::try_parse_from(["x", "--output", "xml"]).is_err());
    }

    #[test]
    fn report_renders_as_json_and_yaml() {
        let cli = Cli::try_parse_from(["x", "--node-name", "n1"]).unwrap();
        let fixture = FixtureInventory::new(inv());
        let r = report(&cli.args, Path::new("lib"), &fixture).unwrap();
        assert_eq!(r.resource_slices.len(), 1);
        let json: serde_json::Value =
            serde_json::from_str(&render(&r, OutputFormat::Json).unwrap()).unwrap();
        assert_eq!(json["nodeName"], "n1");
        assert_eq!(
            json["resourceSlices"][0]["metadata"]["name"],
            "n1-gpu-nvidia-com-0"
        );
        assert_eq!(
            json["resourceSlices"][0]["spec"]["devices"][0]["attributes"]["architecture"]["string"],
            "Turing"
        );
        let yaml = render(&r, OutputFormat::Yaml).unwrap();
        assert!(yaml.contains("n1-gpu-nvidia-com-0"), "{yaml}");
        assert!(yaml.contains("productName"), "{yaml}");
    }

    #[test]
    fn library_lookup_errors_say_what_to_set() {
        let dir = tempfile::tempdir().unwrap();
        let err = nvml_library(dir.path(), None).unwrap_err().to_string();
        assert!(
            err.contains("NVIDIA_DRIVER_ROOT") && err.contains("usr/lib64"),
            "{err}"
        );
        let missing = dir.path().join("nope.so");
        let err = nvml_library(dir.path(), Some(&missing))
            .unwrap_err()
            .to_string();
        assert!(err.contains("NVML_LIB"), "{err}");
        std::fs::create_dir_all(dir.path().join("usr/lib")).unwrap();
        std::fs::write(dir.path().join("usr/lib/libnvidia-ml.so.1"), "").unwrap();
        assert_eq!(
            nvml_library(dir.path(), None).unwrap(),
            dir.path().join("usr/lib/libnvidia-ml.so.1")
        );
    }
}
