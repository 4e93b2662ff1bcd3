//! `gpu-dra check`: named checks of the cluster the driver runs in, each passed, warned or
//! failed with the fix, in the manner of `linkerd check`.
//!
//! The cluster is read once ([`facts::gather`]) into plain data; every check is a pure function
//! of it ([`checks`]), so each is tested on fixtures with its subject broken. [`gates`] holds
//! the table of Kubernetes releases and the DRA feature gates they turn on by default;
//! [`cert`] judges the webhook's certificate as the API server does.
//!
//! With `--workload`, one more check runs last ([`workload`]): a one-GPU claim and a pod that
//! lists the GPUs it sees, in a namespace the check creates and deletes.
//!
//! `--only` keeps the report (and so the exit status) to the checks it names: a script that
//! watches one thing, or a cluster where other checks are known to fail, is not answered by
//! the others. The cluster is read in full all the same, but for the webhook: not read when no
//! webhook check is named, its `/readyz` through the API server (which can take seconds to
//! time out) asked only for `webhook-reachable`.
//!
//! Exit status: 0 when no check failed (warnings allowed), 1 when one failed, 2 when the
//! cluster could not be reached or the flags are wrong.

pub mod cert;
pub mod checks;
pub mod facts;
pub mod workload;
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
    /// Report only these checks (comma-separated names, e.g. webhook-certificate,stuck-claims);
    /// the exit status then counts only them. A failed resource-api is reported whatever
    /// this says (the checks after it did not run); `--workload` adds the workload check. The
    /// webhook is read only when a webhook check is named, its /readyz asked only for
    /// webhook-reachable.
    #[arg(long, env = "CHECK_ONLY", value_delimiter = ',', value_parser = parse_check_name)]
    pub only: Vec<String>,
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
    /// Also run a workload: a claim for one device of `--gpu-class` and a pod using it that
    /// runs `--workload-command`, in a namespace the check creates and deletes; passes when
    /// the pod lists exactly the GPU its claim was allocated.
    #[arg(long, env = "CHECK_WORKLOAD")]
    pub workload: bool,
    /// Node the workload runs on (by a node selector); any node with a free GPU when unset.
    #[arg(long, env = "CHECK_NODE", requires = "workload")]
    pub node: Option<String>,
    /// Image of the workload's pod; default: the image of the chart's node plugin DaemonSet,
    /// which its nodes can pull.
    #[arg(long, env = "CHECK_WORKLOAD_IMAGE", requires = "workload")]
    pub workload_image: Option<String>,
    /// The workload's command, split into words as a shell does and run without one (the
    /// driver's image has none): its output must be `nvidia-smi -L`'s. In an image with a
    /// shell: `sh -c '...'`.
    #[arg(long, env = "CHECK_WORKLOAD_COMMAND", default_value = workload::DEFAULT_COMMAND,
        value_parser = parse_command)]
    pub workload_command: WorkloadCommand,
    /// How long the workload's pod may take to complete: `90s`, `2m`.
    #[arg(long, env = "CHECK_WORKLOAD_TIMEOUT", default_value = "120s", value_parser = parse_timeout)]
    pub workload_timeout: u64,
}

/// The words of `--workload-command`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadCommand(pub Vec<String>);

fn parse_command(s: &str) -> Result<WorkloadCommand, String> {
    workload::split_command(s).map(WorkloadCommand)
}

/// A timeout in seconds, at least one.
fn parse_timeout(s: &str) -> Result<u64, String> {
    match crate::usage::parse_duration(s)? {
        0 => Err(format!("{s:?}: the timeout must be at least 1s")),
        n => Ok(n),
    }
}

/// A check name `--only` knows.
fn parse_check_name(s: &str) -> Result<String, String> {
    let s = s.trim();
    match checks::NAMES.iter().find(|n| **n == s) {
        Some(n) => Ok((*n).to_owned()),
        None => Err(format!(
            "unknown check {s:?}; valid: {} (the workload check runs with --workload)",
            checks::NAMES.join(", ")
        )),
    }
}

/// The results `only` names (all when it is empty), and a failed `resource-api` in any case:
/// without it the checks after it did not run, and the report would not say why.
pub fn select(results: Vec<CheckResult>, only: &[String]) -> Vec<CheckResult> {
    if only.is_empty() {
        return results;
    }
    results
        .into_iter()
        .filter(|r| {
            only.iter().any(|n| n == r.name)
                || (r.name == "resource-api" && r.status == Status::Failed)
        })
        .collect()
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
    let wanted = |check: &str| args.only.is_empty() || args.only.iter().any(|n| n == check);
    let opts = facts::GatherOptions {
        driver: args.driver_name.clone(),
        namespace: args.namespace.clone(),
        declared_gates: args.cluster_feature_gates.clone(),
        expected_classes: vec![
            (args.gpu_class.clone(), "gpu".into()),
            (args.mig_class.clone(), "mig".into()),
        ],
        probe: !args.no_probe,
        webhook: wanted("webhook-reachable") || wanted("webhook-certificate"),
        webhook_readyz: wanted("webhook-reachable"),
    };
    let (facts, client) = runtime.block_on(async {
        let client = crate::explain::cluster_client().await?;
        let facts = facts::gather(&client, &opts).await?;
        Ok::<_, CliError>((facts, client))
    })?;
    let mut results = select(checks::all(&facts), &args.only);
    if args.workload {
        results.push(run_workload(args, &facts, &client, &runtime));
    }
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

/// The workload check, or why it could not run.
fn run_workload(
    args: &CheckArgs,
    facts: &facts::Facts,
    client: &kube::Client,
    runtime: &tokio::runtime::Runtime,
) -> CheckResult {
    let not_run = |why: String, fix: &str| CheckResult {
        name: workload::NAME,
        title: workload::TITLE,
        status: Status::Failed,
        detail: vec![format!("not run: {why}")],
        fix: Some(fix.to_owned()),
    };
    if !facts.resource_versions.iter().any(|v| v == "v1") {
        return not_run(
            "the API server serves no resource.k8s.io/v1".into(),
            "see the resource-api check",
        );
    }
    let image = match (&args.workload_image, &facts.plugin) {
        (Some(image), _) => image.clone(),
        (None, Some(plugin)) if !plugin.image.is_empty() => plugin.image.clone(),
        _ => {
            return not_run(
                format!(
                    "no node plugin DaemonSet in namespace {} to take the image from",
                    args.namespace
                ),
                "pass --workload-image, or --namespace of the driver's release",
            );
        }
    };
    let opts = workload::WorkloadOptions {
        driver: args.driver_name.clone(),
        gpu_class: args.gpu_class.clone(),
        node: args.node.clone(),
        image,
        command: args.workload_command.0.clone(),
        timeout: std::time::Duration::from_secs(args.workload_timeout),
    };
    runtime.block_on(workload::run(client, &opts))
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

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        check: CheckArgs,
    }

    fn parse(args: &[&str]) -> Result<CheckArgs, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("check").chain(args.iter().copied())).map(|c| c.check)
    }

    #[test]
    fn workload_flags_are_read_and_checked() {
        let a = parse(&[]).expect("defaults");
        assert!(!a.workload);
        assert_eq!(a.workload_command.0, ["nvidia-smi", "-L"]);
        assert_eq!(a.workload_timeout, 120);
        let a = parse(&[
            "--workload",
            "--node",
            "n1",
            "--workload-image",
            "busybox",
            "--workload-command",
            "sh -c 'nvidia-smi -L'",
            "--workload-timeout",
            "2m",
        ])
        .expect("flags");
        assert_eq!(a.node.as_deref(), Some("n1"));
        assert_eq!(a.workload_image.as_deref(), Some("busybox"));
        assert_eq!(a.workload_command.0, ["sh", "-c", "nvidia-smi -L"]);
        assert_eq!(a.workload_timeout, 120);
        let err = parse(&["--workload", "--workload-timeout", "0s"]).unwrap_err();
        assert!(err.to_string().contains("at least 1s"), "{err}");
        let err = parse(&["--workload", "--workload-command", "sh -c 'x"]).unwrap_err();
        assert!(err.to_string().contains("single quote"), "{err}");
        // --node means nothing without --workload.
        assert!(parse(&["--node", "n1"]).is_err());
    }

    #[test]
    fn only_keeps_the_named_checks_and_a_failed_resource_api() {
        let result = |name: &'static str, status| CheckResult {
            name,
            title: "t",
            status,
            detail: Vec::new(),
            fix: None,
        };
        let results = vec![
            result("resource-api", Status::Passed),
            result("plugin-pods", Status::Failed),
            result("stuck-claims", Status::Passed),
        ];
        assert_eq!(select(results.clone(), &[]), results);
        let only = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
        let kept = select(results.clone(), &only(&["stuck-claims"]));
        assert_eq!(kept, vec![results[2].clone()]);
        // Nothing after a failed resource-api ran: it stays, saying why.
        let failed = vec![result("resource-api", Status::Failed)];
        assert_eq!(select(failed.clone(), &only(&["stuck-claims"])), failed);

        let a = parse(&["--only", "stuck-claims, webhook-certificate"]).expect("names");
        assert_eq!(a.only, ["stuck-claims", "webhook-certificate"]);
        let err = parse(&["--only", "stuck"]).unwrap_err().to_string();
        assert!(err.contains("unknown check \"stuck\""), "{err}");
        assert!(err.contains("dra-features"), "{err}");
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
