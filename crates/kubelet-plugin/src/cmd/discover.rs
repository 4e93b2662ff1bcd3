//! `gpu-kubelet-plugin discover`: prints the inventory and the ResourceSlices this node would
//! publish, without a cluster. The tool users run on a node to see what the scheduler will see.
//!
//! Reads the environment only through clap (every flag has an env twin, shared with `run`).

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use gpu_dra_core::slices::{self, SliceParams};
use gpu_dra_device::{GpuInventory, Inventory};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde::Serialize;

use crate::host::HostArgs;

/// Output format of `discover`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// YAML (default).
    Yaml,
    /// JSON.
    Json,
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
    use std::path::PathBuf;

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
}
