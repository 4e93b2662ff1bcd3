//! `gpu-dra check`: named checks of the cluster the driver runs in, each passed, warned or
//! failed with the fix, in the manner of `linkerd check`.
//!
//! The cluster is read once ([`facts::gather`]) into plain data; every check is a pure function
//! of it ([`checks`]), so each is tested on fixtures with its subject broken. [`gates`] holds
//! the table of Kubernetes releases and the DRA feature gates they turn on by default;
//! [`cert`] judges the webhook's certificate as the API server does.
//!
//! Exit status: 0 when no check failed (warnings allowed), 1 when one failed, 2 when the
//! cluster could not be reached or the flags are wrong.

pub mod cert;
pub mod checks;
pub mod facts;
pub use gpu_dra_core::feature_gates as gates;

use std::io::Write;

use clap::Args;
use serde::Serialize;

use self::checks::{CheckResult, Status};
use crate::explain::Format;
use crate::{CliError, Outcome};

/// `gpu-dra check` arguments.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Namespace of the driver's release (its node plugin DaemonSet, webhook, MPS daemons).
    #[arg(short, long, env = "GPU_DRA_NAMESPACE", default_value = "gpu-dra")]
    pub namespace: String,
    /// Driver name.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Output format.
    #[arg(short, long, env = "OUTPUT_FORMAT", value_enum, default_value_t = Format::Text)]
    pub output: Format,
    /// Kubernetes feature gates this cluster turned on although its version has them off by
    /// default (comma-separated, e.g. DRAConsumableCapacity,DRAPartitionableDevices); used
    /// where the dry-run write cannot tell (ResourceHealthStatus) or is not made.
    #[arg(long, env = "CLUSTER_FEATURE_GATES", value_delimiter = ',', value_parser = parse_gate)]
    pub cluster_feature_gates: Vec<String>,
    /// Name of the DeviceClass for whole GPUs (the chart's deviceClasses.gpu.name).
    #[arg(long, env = "GPU_DEVICE_CLASS", default_value = "gpu.nvidia.com")]
    pub gpu_class: String,
    /// Name of the DeviceClass for MIG devices (the chart's deviceClasses.mig.name).
    #[arg(long, env = "MIG_DEVICE_CLASS", default_value = "mig.nvidia.com")]
    pub mig_class: String,
    /// Do not make the dry-run ResourceSlice write that tells which DRA features the API
    /// server keeps (it needs `create` on resourceslices; nothing is stored).
    #[arg(long, env = "CHECK_NO_PROBE")]
    pub no_probe: bool,
}

/// A gate name `--cluster-feature-gates` knows.
fn parse_gate(s: &str) -> Result<String, String> {
    let s = s.trim();
    match gates::gate(s) {
        Some(g) => Ok(g.name.to_owned()),
        None => Err(format!(
            "unknown feature gate {s:?}; valid: {}",
            gates::GATES
                .iter()
                .map(|g| g.name)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// The JSON report.
#[derive(Debug, Serialize)]
pub struct Report<'a> {
    /// Every check's result.
    pub checks: &'a [CheckResult],
    /// `passed`, `warning` or `failed`: the worst of them.
    pub status: Status,
}

/// Runs `gpu-dra check`.
pub fn run(args: &CheckArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let opts = facts::GatherOptions {
        driver: args.driver_name.clone(),
        namespace: args.namespace.clone(),
        declared_gates: args.cluster_feature_gates.clone(),
        expected_classes: vec![
            (args.gpu_class.clone(), "gpu".into()),
            (args.mig_class.clone(), "mig".into()),
        ],
        probe: !args.no_probe,
    };
    let facts = runtime.block_on(async {
        let client = crate::explain::cluster_client().await?;
        facts::gather(&client, &opts).await
    })?;
    let results = checks::all(&facts);
    let worst = results
        .iter()
        .map(|r| r.status)
        .max()
        .unwrap_or(Status::Passed);
    match args.output {
        Format::Text => write!(out, "{}", to_text(&results))?,
        Format::Json => {
            serde_json::to_writer_pretty(
                &mut *out,
                &Report {
                    checks: &results,
                    status: worst,
                },
            )?;
            writeln!(out)?;
        }
    }
    Ok(if worst == Status::Failed {
        Outcome::Invalid
    } else {
        Outcome::Valid
    })
}

/// One line per check (`√`, `‼` or `×`, its title), its findings indented under it, the fix
/// of each that did not pass, and a status line.
pub fn to_text(results: &[CheckResult]) -> String {
    let mut text = String::new();
    for r in results {
        let mark = match r.status {
            Status::Passed => "√",
            Status::Warning => "‼",
            Status::Failed => "×",
        };
        text.push_str(&format!("{mark} {} [{}]\n", r.title, r.name));
        for line in &r.detail {
            text.push_str(&format!("    {line}\n"));
        }
        if let Some(fix) = &r.fix {
            text.push_str(&format!("    fix: {fix}\n"));
        }
    }
    let failed = results
        .iter()
        .filter(|r| r.status == Status::Failed)
        .count();
    let warned = results
        .iter()
        .filter(|r| r.status == Status::Warning)
        .count();
    text.push_str(&format!(
        "\nStatus check results are {} ({} checks: {failed} failed, {warned} warnings)\n",
        if failed > 0 { "×" } else { "√" },
        results.len()
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_output_names_each_check_its_findings_and_fix() {
        let results = vec![
            CheckResult {
                name: "api-server",
                title: "Kubernetes version supported",
                status: Status::Passed,
                detail: vec!["API server v1.37.1".into()],
                fix: None,
            },
            CheckResult {
                name: "plugin-pods",
                title: "node plugins",
                status: Status::Failed,
                detail: vec!["node node-b: no plugin pod".into()],
                fix: Some("start it".into()),
            },
        ];
        assert_eq!(
            to_text(&results),
            "√ Kubernetes version supported [api-server]\n    API server v1.37.1\n\
             × node plugins [plugin-pods]\n    node node-b: no plugin pod\n    fix: start it\n\
             \nStatus check results are × (2 checks: 1 failed, 0 warnings)\n"
        );
    }

    #[test]
    fn unknown_feature_gates_are_refused_with_the_valid_ones() {
        assert_eq!(parse_gate(" DRADeviceTaints").unwrap(), "DRADeviceTaints");
        let err = parse_gate("DRAConsumable").unwrap_err();
        assert!(
            err.contains("unknown feature gate \"DRAConsumable\""),
            "{err}"
        );
        assert!(err.contains("DRAConsumableCapacity"), "{err}");
    }
}
