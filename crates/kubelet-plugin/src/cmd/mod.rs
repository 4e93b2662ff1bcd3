//! The subcommands of `gpu-kubelet-plugin`, one module each: [`run`] (the node plugin),
//! [`discover`], [`health`], [`cleanup`], [`uninstall`] and [`selftest`]; and their one command line
//! ([`Cli`]), which `main` parses and the chart's test reads the env twins from.
//!
//! Invariants: every flag of `run`, `discover`, `cleanup` and `uninstall` has an env twin (the
//! chart configures the plugin through the environment; `health` is run by hand), and the
//! environment is read only through clap. The one exception is [`FORMER_ENV`]: flags renamed to say their unit keep
//! their former env names working for users who set those by hand. Clap gives a flag one env
//! name, so [`try_parse_from`] binds a renamed flag to its former name when, and only when,
//! the new one is unset and the former one set; the former flag names are plain clap aliases.
//! Alternatives rejected: a hidden flag per former env name (it needs a flag name of its own,
//! and a value given on the command line under the former flag name would lose to the new env
//! name set by the chart); reading the former names after parsing (a second place that reads
//! the environment, with its own precedence rules).

pub mod cleanup;
pub mod discover;
pub mod health;
pub mod run;
pub mod selftest;
pub mod uninstall;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::builder::TypedValueParser;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use gpu_dra_telemetry::{LogArgs, LogFormat};

/// The command line of `gpu-kubelet-plugin`.
#[derive(Debug, Parser)]
#[command(
    name = "gpu-kubelet-plugin",
    version,
    about = "DRA kubelet plugin for NVIDIA GPUs"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the kubelet: registration, prepare/unprepare, metrics.
    Run(Box<run::RunArgs>),
    /// Print the GPU inventory and the ResourceSlices this node would publish.
    Discover(discover::DiscoverArgs),
    /// Put this node back as it was before the driver (no plugin may run): GPU compute modes
    /// and time-slices to their defaults, MPS daemons stopped, our files removed.
    Cleanup(Box<cleanup::CleanupArgs>),
    /// Watch this node's GPU health through NVML for a while and print what the plugin would
    /// report (events, probes, then each device's taints and health).
    Health(health::HealthArgs),
    /// The chart's pre-delete hook: stop the node plugins, then run `cleanup` on every node.
    Uninstall(Box<uninstall::UninstallArgs>),
    /// Prove the node path on this host without Kubernetes: discovery, then a claim of each
    /// kind the host offers prepared by the plugin, a container started from its CDI spec
    /// that checks what it sees (nvidia-smi, a CUDA kernel, MPS limits), unprepared; the host
    /// left as it was. One line per check; exit status 1 when one failed.
    Selftest(Box<selftest::SelftestArgs>),
}

/// Env names of flags renamed to say their unit: `(new, former)`. The former name is read
/// when the new one is unset (see the module documentation); the chart sets the new ones.
pub const FORMER_ENV: &[(&str, &str)] = &[
    ("HEALTH_PROBE_INTERVAL_SECONDS", "HEALTH_PROBE_INTERVAL"),
    ("HEALTH_HOLD_SECONDS", "HEALTH_HOLD"),
    ("REDISCOVER_INTERVAL_SECONDS", "REDISCOVER_INTERVAL"),
    ("CLEANUP_INTERVAL_SECONDS", "CLEANUP_INTERVAL"),
];

/// The command line as derived, each flag with its own env twin: what tests check the chart
/// against. [`try_parse_from`] parses with it.
pub fn command() -> clap::Command {
    Cli::command()
}

/// Parses `args` and the process's environment, honouring [`FORMER_ENV`].
pub fn try_parse_from<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut cmd = with_former_env(command(), |name| std::env::var_os(name).is_some());
    let mut matches = cmd.try_get_matches_from_mut(args)?;
    Cli::from_arg_matches_mut(&mut matches).map_err(|e| e.format(&mut cmd))
}

/// Parses the process's arguments and environment; on an error prints clap's message and
/// exits.
pub fn parse() -> Cli {
    try_parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
}

/// Binds each renamed flag to its former env name where only that one is set (`is_set`).
fn with_former_env(cmd: clap::Command, is_set: impl Fn(&str) -> bool) -> clap::Command {
    cmd.mut_subcommands(|sub| {
        sub.mut_args(|arg| {
            let former = arg.get_env().and_then(|env| {
                FORMER_ENV
                    .iter()
                    .find(|(new, former)| env == *new && !is_set(new) && is_set(former))
                    .map(|(_, former)| *former)
            });
            match former {
                // Named as the value too, so that clap's message for a bad value names the
                // variable it came from.
                Some(former) => arg.env(former).value_name(former),
                None => arg,
            }
        })
    })
}

/// A path flag whose help gives the empty value a meaning ("empty: no hooks"): clap's own
/// path parser refuses an empty value, this one keeps it as the empty path.
pub fn path_or_empty() -> impl TypedValueParser<Value = PathBuf> {
    clap::builder::OsStringValueParser::new().map(PathBuf::from)
}

/// Worker threads of `cleanup` and `uninstall`: each runs once per node or cluster and waits
/// on one thing at a time.
const ONE_SHOT_WORKERS: usize = 2;

/// The async runtime with `workers` worker threads, at most one per CPU this process may use
/// (tokio's own default is one per CPU, however many: see `run --worker-threads`).
fn runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads(
            workers,
            std::thread::available_parallelism().ok(),
        ))
        .enable_all()
        .build()
}

/// `asked` capped at the CPUs this process may use (`cpus`, from the affinity mask and the
/// cgroup's quota; unknown: `asked`), at least one.
fn worker_threads(asked: usize, cpus: Option<std::num::NonZeroUsize>) -> usize {
    cpus.map_or(asked, |c| asked.min(c.get())).max(1)
}

/// Runs a parsed command line: sets up logging (JSON or text as the flags say for the
/// services, text for the tools run by hand) and hands over to the subcommand.
pub fn execute(cli: Cli) -> anyhow::Result<()> {
    let by_hand = |level: &str| LogArgs {
        log_format: LogFormat::Text,
        log_level: level.into(),
    };
    match cli.command {
        Command::Run(args) => {
            gpu_dra_telemetry::init(&args.log)?;
            runtime(usize::from(args.worker_threads))?.block_on(run::run(*args))
        }
        Command::Cleanup(args) => {
            gpu_dra_telemetry::init(&args.log)?;
            runtime(ONE_SHOT_WORKERS)?.block_on(cleanup::run(*args))
        }
        Command::Uninstall(args) => {
            gpu_dra_telemetry::init(&args.log)?;
            runtime(ONE_SHOT_WORKERS)?.block_on(uninstall::run(*args))
        }
        Command::Health(args) => {
            gpu_dra_telemetry::init(&by_hand("info"))?;
            health::run(args, &mut std::io::stdout().lock())
        }
        Command::Discover(args) => {
            gpu_dra_telemetry::init(&by_hand("warn"))?;
            discover::run(args)
        }
        Command::Selftest(args) => {
            gpu_dra_telemetry::init(&by_hand(&args.log_level))?;
            let failed = runtime(ONE_SHOT_WORKERS)?.block_on(selftest::run(*args))?;
            if failed {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every env name any flag reads, and the former ones.
    fn every_env_name() -> Vec<String> {
        let cmd = command();
        let mut names: Vec<String> = cmd
            .get_subcommands()
            .flat_map(|s| s.get_arguments())
            .filter_map(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned())
            .chain(FORMER_ENV.iter().map(|(_, former)| (*former).to_owned()))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Runs the ignored test `name` of this module in a child process of this test binary,
    /// with exactly the env twins in `env` set (clap reads the process's environment, which a
    /// test cannot change in its own process); fails unless it ran and passed.
    fn in_child_with_env(name: &str, env: &[(&str, &str)]) {
        let module = module_path!()
            .split_once("::")
            .map_or(module_path!(), |(_, m)| m);
        let test = format!("{module}::{name}");
        let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"));
        child.args([&test, "--exact", "--ignored", "--test-threads=1"]);
        for name in every_env_name() {
            child.env_remove(name);
        }
        child.envs(env.iter().copied());
        let out = child.output().expect("test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("test result: ok. 1 passed"),
            "{test} with {env:?}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `run`'s flags from `args` (and the environment) after `--node-name n`.
    pub(super) fn run_args(args: &[&str]) -> run::RunArgs {
        let line = ["gpu-kubelet-plugin", "run", "--node-name", "n"]
            .iter()
            .chain(args);
        match try_parse_from(line).expect("parses") {
            Cli {
                command: Command::Run(args),
            } => *args,
            _ => panic!("not run"),
        }
    }

    fn env_of(sub: &str, id: &str, is_set: impl Fn(&str) -> bool) -> Option<String> {
        with_former_env(command(), is_set)
            .find_subcommand(sub)
            .and_then(|s| s.get_arguments().find(|a| a.get_id() == id))
            .and_then(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned())
    }

    #[test]
    fn worker_threads_are_the_flag_capped_at_the_cpus() {
        let cpus = |n| std::num::NonZeroUsize::new(n);
        assert_eq!(worker_threads(4, cpus(128)), 4);
        assert_eq!(worker_threads(4, cpus(2)), 2);
        assert_eq!(worker_threads(4, None), 4);
        assert_eq!(worker_threads(0, cpus(8)), 1);
        assert_eq!(run_args(&[]).worker_threads, 4);
        assert_eq!(run_args(&["--worker-threads=16"]).worker_threads, 16);
        for bad in ["0", "-1", "many", "1025"] {
            let line = ["gpu-kubelet-plugin", "run", "--node-name", "n"];
            let flag = format!("--worker-threads={bad}");
            let err = try_parse_from(line.iter().copied().chain([flag.as_str()]))
                .expect_err(bad)
                .to_string();
            assert!(err.contains("--worker-threads"), "{bad}: {err}");
        }
    }

    /// The runtime `run` builds has the capped number of workers.
    #[test]
    fn the_runtime_has_the_workers_asked_for() {
        let rt = runtime(1).expect("runtime");
        assert_eq!(rt.metrics().num_workers(), 1);
        let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
        assert_eq!(
            runtime(1024).expect("runtime").metrics().num_workers(),
            cpus
        );
    }

    #[test]
    fn every_flag_of_the_services_and_discover_has_an_env_twin() {
        let cmd = command();
        // `health` is an operator's tool run by hand in a shell; the others run in pods the
        // chart configures through the environment (discover shares run's environment).
        for name in ["run", "discover", "cleanup", "uninstall"] {
            let sub = cmd.find_subcommand(name).expect("subcommand");
            let without: Vec<&str> = sub
                .get_arguments()
                .filter(|a| a.get_env().is_none())
                .map(|a| a.get_id().as_str())
                .collect();
            assert!(without.is_empty(), "{name}: no env twin: {without:?}");
        }
    }

    #[test]
    fn a_former_env_name_is_read_only_when_the_new_one_is_unset() {
        let id = "health_hold_seconds";
        let new = Some("HEALTH_HOLD_SECONDS".to_owned());
        assert_eq!(env_of("run", id, |_| false), new);
        assert_eq!(
            env_of("run", id, |n| n == "HEALTH_HOLD"),
            Some("HEALTH_HOLD".to_owned())
        );
        assert_eq!(
            env_of("run", id, |n| n == "HEALTH_HOLD"
                || n == "HEALTH_HOLD_SECONDS"),
            new
        );
        // Other flags keep their env twin whatever is set.
        assert_eq!(
            env_of("run", "node_name", |_| true),
            Some("NODE_NAME".to_owned())
        );
    }

    #[test]
    fn every_former_env_name_belongs_to_a_run_flag() {
        let run = command();
        let run = run.find_subcommand("run").expect("run");
        for (new, former) in FORMER_ENV {
            assert!(
                run.get_arguments()
                    .any(|a| a.get_env().is_some_and(|e| e == *new)),
                "{new} is no flag's env twin"
            );
            assert!(
                run.get_arguments()
                    .all(|a| a.get_env().is_none_or(|e| e != *former)),
                "{former} is still a flag's env twin"
            );
        }
    }

    #[test]
    fn renamed_flags_read_their_former_env_names() {
        in_child_with_env(
            "child_former_env_names",
            &[
                ("HEALTH_PROBE_INTERVAL", "1"),
                ("HEALTH_HOLD", "2"),
                ("REDISCOVER_INTERVAL", "3"),
                ("CLEANUP_INTERVAL", "4"),
                ("CLEANUP_INTERVAL_SECONDS", "40"),
            ],
        );
    }

    #[test]
    #[ignore = "run by renamed_flags_read_their_former_env_names with its environment"]
    fn child_former_env_names() {
        let a = run_args(&[]);
        assert_eq!(a.health_probe_interval_seconds, 1);
        assert_eq!(a.health_hold_seconds, 2);
        assert_eq!(a.rediscover_interval_seconds, 3);
        // The new name wins over the former one.
        assert_eq!(a.cleanup_interval_seconds, 40);
        // A flag on the command line, under either name, wins over both env names.
        assert_eq!(run_args(&["--health-hold=20"]).health_hold_seconds, 20);
        assert_eq!(
            run_args(&["--cleanup-interval-seconds=400"]).cleanup_interval_seconds,
            400
        );
    }

    #[test]
    fn an_empty_cdi_hook_source_env_means_no_hooks() {
        in_child_with_env("child_empty_cdi_hook_source", &[("CDI_HOOK_SOURCE", "")]);
    }

    #[test]
    #[ignore = "run by an_empty_cdi_hook_source_env_means_no_hooks with its environment"]
    fn child_empty_cdi_hook_source() {
        assert_eq!(run_args(&[]).cdi_hook_source(), None);
    }

    /// A flag whose help gives the empty value a meaning must accept it, from the command line
    /// as from its env twin (clap parses both with the flag's value parser).
    #[test]
    fn every_flag_whose_help_names_an_empty_value_accepts_one() {
        let cmd = command();
        let mut checked = Vec::new();
        for sub in cmd.get_subcommands() {
            let required: Vec<String> = sub
                .get_arguments()
                .filter(|a| a.is_required_set())
                .filter_map(|a| a.get_long())
                .map(|l| format!("--{l}=x"))
                .collect();
            for arg in sub.get_arguments() {
                let help = arg.get_long_help().or(arg.get_help());
                let says_empty =
                    help.is_some_and(|h| h.to_string().to_lowercase().contains("empty"));
                let Some(long) = arg.get_long().filter(|_| says_empty) else {
                    continue;
                };
                let line = ["gpu-kubelet-plugin".to_owned(), sub.get_name().to_owned()]
                    .into_iter()
                    .chain(required.iter().cloned())
                    .chain([format!("--{long}=")]);
                if let Err(e) = try_parse_from(line) {
                    panic!("{} --{long}=: {e}", sub.get_name());
                }
                checked.push(format!("{} --{long}", sub.get_name()));
            }
        }
        assert!(
            checked.contains(&"run --cdi-hook-source".to_owned())
                && checked.contains(&"run --http-address".to_owned()),
            "{checked:?}"
        );
    }
}
