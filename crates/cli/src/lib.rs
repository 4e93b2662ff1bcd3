//! `gpu-dra`, the operator CLI: checks claim files offline with the same validation the
//! admission webhook and the node plugin use (`gpu_dra_api`), and explains which devices a
//! claim in a cluster can get.
//!
//! `gpu-dra validate [--driver-name NAME] [--strict] FILE...` reads multi-document YAML or JSON
//! (a JSON stream, a JSON array, or `kind: List` / `*List` objects with `items`), checks every
//! ResourceClaim, ResourceClaimTemplate and DeviceClass in it (opaque configs with
//! `gpu_dra_api`, CEL selectors with the `gpu_dra_selectors` lint), skips other kinds silently,
//! and prints one line per problem followed by a summary line per file. Selector findings are
//! warnings; `--strict` counts them as problems, for CI pipelines.
//!
//! `gpu-dra explain [-o json] NAMESPACE/NAME` reads the claim, the DeviceClasses, the
//! ResourceSlices and all claims from the cluster (kubeconfig found as kubectl finds it:
//! `KUBECONFIG`, `~/.kube/config`, in-cluster) and prints, per request and node, which devices
//! match and why the others do not (see [`explain`]).
//!
//! `gpu-dra usage [--node N] [-o json] [--idle-threshold 1h] [--metrics-url URL]...` shows per
//! node and GPU which claims hold a whole GPU, a MIG partition or a memory share, which GPUs
//! are free, and from the node plugins' metrics what each claim uses (memory allocated and
//! used, SM utilisation, processes, idle time, claims near their memory limit), with a cluster
//! summary (see [`usage`]; [`metrics_text`] reads the metrics' text format).
//!
//! `gpu-dra advise [NAMESPACE/NAME] [-n NS] [--margin 20] [-o text|json|yaml]...` advises, per
//! claim, the smallest offering on its GPU model that fits its observed peak memory and SM
//! p95 plus a margin, or why the whole GPU stays, and the GPUs the cluster would need (see
//! [`advise`]); `-o yaml` prints the changed ResourceClaimTemplates.
//!
//! `gpu-dra check [-n NAMESPACE] [-o json] [--cluster-feature-gates G,...]` runs named checks
//! of the cluster the driver runs in (Kubernetes version, DRA features served, DeviceClasses,
//! the webhook and its certificate, a ready plugin on every GPU node, slices, device taints,
//! MPS daemons, claims stuck in prepare), each passed or failed with its fix (see [`check`]);
//! with `--workload [--node N]` also a one-GPU claim and pod run to completion that must see
//! exactly its GPU (then removed); exit 1 when one failed.
//!
//! Exit codes: 0 all valid (or explained); 1 something is invalid (including malformed
//! YAML/JSON, reported with file, line and column); 2 usage errors (bad flags, unreadable
//! files, an unreachable cluster or a missing claim).

pub mod advise;
pub mod check;
pub mod explain;
pub mod metrics_text;
pub mod usage;

use std::io::{Read, Write};
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use gpu_dra_api::objects;
use gpu_dra_selectors::Severity;
use serde_json::Value;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "gpu-dra",
    version,
    about = "Operator tools for the GPU DRA driver"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check the GPU device configs and CEL selectors in ResourceClaims,
    /// ResourceClaimTemplates and DeviceClasses.
    Validate(ValidateArgs),
    /// Show which devices of the cluster a ResourceClaim's requests can get, and why not.
    Explain(explain::ExplainArgs),
    /// Show, per node and GPU, which claims hold a whole GPU, a MIG partition or a memory
    /// share (from the cluster's ResourceSlices and ResourceClaims), and what each uses
    /// (from the node plugins' metrics), with a cluster summary.
    Usage(usage::UsageArgs),
    /// Check the cluster the driver runs in: Kubernetes version and DRA features, DeviceClasses,
    /// the webhook and its certificate, node plugins and their slices, device taints, MPS
    /// daemons and claims stuck in prepare; each check passed or failed with its fix.
    Check(check::CheckArgs),
    /// Advise, per claim, the smallest offering on its GPU model that fits what it was seen
    /// to use plus a margin (a MIG profile, a memory share, MPS, time-slicing, or keep the
    /// whole GPU, with the reason and the evidence), and the GPUs the cluster would need.
    Advise(advise::AdviseArgs),
}

/// `gpu-dra validate` arguments.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// Driver whose opaque configs are checked; configs for other drivers are ignored.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Treat selector warnings (names our devices do not publish, wrong types) as problems
    /// and exit 1.
    #[arg(long, env = "VALIDATE_STRICT")]
    pub strict: bool,
    /// YAML or JSON files to check; `-` reads standard input.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

/// How a run ended; maps to the process exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Everything checked is valid (exit 0).
    Valid,
    /// Something is invalid (exit 1).
    Invalid,
    /// The command could not do its job: an unreadable file (exit 2).
    Usage,
}

impl Outcome {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Self::Valid => 0,
            Self::Invalid => 1,
            Self::Usage => 2,
        }
    }
}

/// Errors of the CLI library.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Writing the report failed (closed pipe, full disk).
    #[error("cannot write output: {0}")]
    Output(#[from] std::io::Error),
    /// Talking to the cluster failed (no kubeconfig, unreachable, forbidden, not found).
    #[error("{what}: {source}")]
    Cluster {
        /// What was being done.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The async runtime for the cluster calls could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// JSON output could not be encoded.
    #[error("cannot encode JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// YAML output could not be encoded.
    #[error("cannot encode YAML: {0}")]
    Yaml(String),
}

/// A document that could not be parsed, with its position.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{line}:{column}: invalid {format}: {message}")]
pub struct ParseError {
    /// 1-based line.
    pub line: u64,
    /// 1-based column.
    pub column: u64,
    /// `YAML` or `JSON`.
    pub format: &'static str,
    /// What the parser said.
    pub message: String,
}

/// Runs the CLI: reads files (or `stdin` for `-`), writes the report to `out` and problems
/// with the invocation to `err`.
pub fn run(
    cli: &Cli,
    stdin: &mut dyn Read,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    match &cli.command {
        Command::Validate(args) => validate(args, stdin, out, err),
        Command::Explain(args) => explain::run(args, out),
        Command::Usage(args) => usage::run(args, out),
        Command::Check(args) => check::run(args, out),
        Command::Advise(args) => advise::run(args, out),
    }
}

fn validate(
    args: &ValidateArgs,
    stdin: &mut dyn Read,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let mut outcome = Outcome::Valid;
    for path in &args.files {
        let (name, text) = if path.as_os_str() == "-" {
            let mut text = String::new();
            match stdin.read_to_string(&mut text) {
                Ok(_) => ("<stdin>".to_owned(), text),
                Err(e) => {
                    writeln!(err, "gpu-dra: cannot read standard input: {e}")?;
                    outcome = outcome.max(Outcome::Usage);
                    continue;
                }
            }
        } else {
            match std::fs::read_to_string(path) {
                Ok(text) => (path.display().to_string(), text),
                Err(e) => {
                    writeln!(err, "gpu-dra: cannot read {}: {e}", path.display())?;
                    outcome = outcome.max(Outcome::Usage);
                    continue;
                }
            }
        };
        outcome = outcome.max(validate_text(
            &name,
            &text,
            &args.driver_name,
            args.strict,
            out,
        )?);
    }
    Ok(outcome)
}

/// Checks the objects in one file's text and writes its problems and summary line. With
/// `strict`, selector warnings count as problems.
pub fn validate_text(
    name: &str,
    text: &str,
    driver: &str,
    strict: bool,
    out: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let docs = match parse_documents(text) {
        Ok(docs) => docs,
        Err(e) => {
            writeln!(out, "{name}:{e}")?;
            writeln!(out, "{name}: invalid (not parsed)")?;
            return Ok(Outcome::Invalid);
        }
    };
    let mut checked = 0usize;
    let mut problems = 0usize;
    let mut warnings = 0usize;
    for obj in expand_lists(docs) {
        if objects::object_kind(&obj).is_none() {
            continue;
        }
        checked += 1;
        let report = objects::check_object(&obj, driver);
        let label = objects::object_label(&obj);
        for e in report.errors.iter().chain(&report.unknown_requests) {
            writeln!(out, "{label}: {e}")?;
            problems += 1;
        }
        for w in &report.warnings {
            writeln!(out, "{label}: warning: {w}")?;
            warnings += 1;
        }
        for f in gpu_dra_selectors::lint_object(&obj, driver) {
            let counts_as_problem = strict && f.severity == Severity::Warning;
            let word = if counts_as_problem {
                "error"
            } else {
                f.severity.as_str()
            };
            writeln!(out, "{label}: {word}: {f}")?;
            if counts_as_problem {
                problems += 1;
            } else if f.severity == Severity::Warning {
                warnings += 1;
            }
        }
    }
    let objects = plural(checked, "object");
    let warned = if warnings > 0 {
        format!(", {}", plural(warnings, "warning"))
    } else {
        String::new()
    };
    if problems == 0 {
        writeln!(out, "{name}: ok ({objects} checked{warned})")?;
        Ok(Outcome::Valid)
    } else {
        writeln!(
            out,
            "{name}: invalid ({}, {objects} checked{warned})",
            plural(problems, "problem")
        )?;
        Ok(Outcome::Invalid)
    }
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// Parses all documents of a file: JSON (a stream of values) when it starts with `{` or `[`,
/// multi-document YAML otherwise, as kubectl decides. There is deliberately no YAML fallback
/// for JSON-looking input: YAML would read `{"b": }` as `b: null` and hide the mistake.
/// Empty documents are dropped.
pub fn parse_documents(text: &str) -> Result<Vec<Value>, ParseError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        let mut docs = Vec::new();
        for item in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
            match item {
                Ok(Value::Array(items)) => docs.extend(items),
                Ok(v) => docs.push(v),
                Err(e) => {
                    return Err(ParseError {
                        line: e.line() as u64,
                        column: e.column() as u64,
                        format: "JSON",
                        message: strip_position(&e.to_string()),
                    });
                }
            }
        }
        return Ok(docs);
    }
    gpu_dra_api::yaml::from_multiple(text).map_err(|e| ParseError {
        line: e.line,
        column: e.column,
        format: "YAML",
        message: e.message,
    })
}

/// serde_json appends " at line L column C"; the position is printed separately.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

/// Replaces `kind: List` (and `ResourceClaimList` etc.) objects by their items.
fn expand_lists(docs: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(docs.len());
    for doc in docs {
        let is_list = doc
            .get("kind")
            .and_then(Value::as_str)
            .is_some_and(|k| k.ends_with("List"));
        match doc.get("items") {
            Some(Value::Array(items)) if is_list => out.extend(items.iter().cloned()),
            _ => out.push(doc),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> (Outcome, String) {
        let mut out = Vec::new();
        let outcome = validate_text("f.yaml", text, "gpu.nvidia.com", false, &mut out).unwrap();
        (outcome, String::from_utf8(out).unwrap())
    }

    const CLAIM: &str = "\
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: x
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
    config:
    - requests: [gpu]
      opaque:
        driver: gpu.nvidia.com
        parameters:
          apiVersion: resource.nvidia.com/v1beta1
          kind: GpuConfig
          sharing:
            strategy: STRATEGY
";

    #[test]
    fn valid_claim_is_ok() {
        let (o, out) = check(&CLAIM.replace("STRATEGY", "TimeSlicing"));
        assert_eq!(o, Outcome::Valid);
        assert_eq!(out, "f.yaml: ok (1 object checked)\n");
    }

    #[test]
    fn invalid_claim_names_object_path_and_fix() {
        let (o, out) = check(&CLAIM.replace("STRATEGY", "Time-Slicing"));
        assert_eq!(o, Outcome::Invalid);
        assert_eq!(
            out,
            "ResourceClaim default/x: spec.devices.config[0].opaque.parameters.sharing.strategy: \
             unknown strategy \"Time-Slicing\"; did you mean \"TimeSlicing\"? valid: \
             \"TimeSlicing\" or \"MPS\"\n\
             f.yaml: invalid (1 problem, 1 object checked)\n"
        );
    }

    #[test]
    fn other_kinds_and_empty_documents_are_skipped() {
        let text = format!(
            "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\n---\n---\n{}",
            CLAIM.replace("STRATEGY", "MPS")
        );
        let (o, out) = check(&text);
        assert_eq!(o, Outcome::Valid);
        assert_eq!(out, "f.yaml: ok (1 object checked)\n");
    }

    #[test]
    fn malformed_yaml_reports_line_and_column() {
        let (o, out) = check("kind: ResourceClaim\nspec: [unclosed\n");
        assert_eq!(o, Outcome::Invalid);
        assert!(out.starts_with("f.yaml:2:7: invalid YAML: "), "{out}");
        assert!(out.ends_with("f.yaml: invalid (not parsed)\n"), "{out}");
    }

    #[test]
    fn malformed_json_reports_line_and_column() {
        let err = parse_documents("{\"a\": 1,\n \"b\": }").unwrap_err();
        assert_eq!((err.line, err.column, err.format), (2, 7, "JSON"));
        assert!(!err.message.contains(" at line "), "{err}");
    }

    #[test]
    fn json_streams_arrays_and_lists_are_expanded() {
        let docs = parse_documents("{\"a\": 1} {\"b\": 2}\n[{\"c\": 3}]").unwrap();
        assert_eq!(docs.len(), 3);
        let docs = expand_lists(
            parse_documents("kind: List\nitems:\n- kind: A\n- kind: B\n---\nkind: C\n").unwrap(),
        );
        assert_eq!(docs.len(), 3);
    }

    const INDEX_CLAIM: &str = "\
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: first-gpu}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
        selectors:
        - cel: {expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}
";

    #[test]
    fn selector_warnings_are_printed_and_fail_only_with_strict() {
        let (o, out) = check(INDEX_CLAIM);
        assert_eq!(o, Outcome::Valid, "{out}");
        assert!(
            out.starts_with(
                "ResourceClaim default/first-gpu: warning: \
                 spec.devices.requests[0].exactly.selectors[0].cel.expression: \
                 `device.attributes['gpu.nvidia.com'].index`: attribute \"index\" is not published"
            ),
            "{out}"
        );
        assert!(
            out.ends_with("f.yaml: ok (1 object checked, 1 warning)\n"),
            "{out}"
        );

        let mut strict = Vec::new();
        let o = validate_text("f.yaml", INDEX_CLAIM, "gpu.nvidia.com", true, &mut strict).unwrap();
        let strict = String::from_utf8(strict).unwrap();
        assert_eq!(o, Outcome::Invalid);
        assert!(
            strict.starts_with("ResourceClaim default/first-gpu: error: spec.devices"),
            "{strict}"
        );
        assert!(
            strict.ends_with("f.yaml: invalid (1 problem, 1 object checked)\n"),
            "{strict}"
        );
    }

    #[test]
    fn exit_codes() {
        assert_eq!(Outcome::Valid.code(), 0);
        assert_eq!(Outcome::Invalid.code(), 1);
        assert_eq!(Outcome::Usage.code(), 2);
        assert!(Outcome::Usage > Outcome::Invalid && Outcome::Invalid > Outcome::Valid);
    }
}
