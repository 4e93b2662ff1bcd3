//! Logging for the driver's services: the flags (`--log-format`, `--log-level` and their env
//! twins `LOG_FORMAT`, `LOG_LEVEL`, which the chart sets for every component) and the one
//! subscriber set-up.
//!
//! Invariant: a filter that does not parse is an error at start-up, in every binary. Falling
//! back to a default would hide a typo in the chart's `logLevel` until someone needs the logs.

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (for the cluster's log pipeline).
    Json,
}

/// Logging flags, flattened into each binary's command line.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter, in tracing EnvFilter syntax (e.g. `info,gpu_dra_kubelet_plugin=debug`).
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// `--log-level` is not a valid tracing filter.
    #[error(
        "--log-level {level:?} is not a valid tracing filter ({source}); \
         write e.g. \"info\" or \"info,gpu_dra_kubelet_plugin=debug\""
    )]
    Filter {
        /// The filter as given.
        level: String,
        /// What the parser said.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// A global subscriber was already installed in this process.
    #[error("installing the log subscriber: {0}")]
    Install(String),
}

/// The filter for `level`, or the error naming it.
pub fn filter(level: &str) -> Result<EnvFilter, TelemetryError> {
    EnvFilter::try_new(level).map_err(|source| TelemetryError::Filter {
        level: level.to_owned(),
        source,
    })
}

/// Installs the global subscriber: lines to stderr in the chosen format, colours only on a
/// terminal.
pub fn init(args: &LogArgs) -> Result<(), TelemetryError> {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter(&args.log_level)?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = match args.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|e| TelemetryError::Install(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_filter_is_an_error_that_names_it() {
        let err = filter("info,=bad[").expect_err("not a filter");
        let text = err.to_string();
        assert!(text.contains("\"info,=bad[\""), "{text}");
        assert!(text.contains("not a valid tracing filter"), "{text}");
        let err = init(&LogArgs {
            log_format: LogFormat::Json,
            log_level: "info,=bad[".into(),
        })
        .expect_err("init refuses it too");
        assert!(matches!(err, TelemetryError::Filter { .. }), "{err}");
    }

    #[test]
    fn good_filters_parse() {
        for level in ["info", "warn,gpu_dra_webhook=debug", "debug"] {
            filter(level).expect(level);
        }
    }
}
