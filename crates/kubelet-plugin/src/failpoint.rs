//! Failpoints for fault-injection tests: named steps of prepare and unprepare where the
//! process can be made to fail, die or stop.
//!
//! Configured from `GPU_DRA_FAILPOINTS` (a hidden flag's env twin), e.g.
//! `prepare.after_cdi_write=kill,unprepare.start=error`. Actions: `error` (the step fails
//! with an error), `kill` (the process aborts at once, no cleanup, like SIGKILL), `pause`
//! (writes the step name to `<plugin-dir>/failpoint.reached` and stops there forever, so a
//! test can SIGKILL the process at exactly that step). Inert when unset: one `is_empty` check.

use std::collections::HashMap;
use std::path::PathBuf;

/// Every failpoint name, in the order the steps run.
pub const STEPS: &[&str] = &[
    "prepare.start",
    "prepare.after_plan",
    "prepare.after_checkpoint_started",
    "prepare.after_sharing",
    "prepare.after_cdi_write",
    "prepare.after_checkpoint_completed",
    "unprepare.start",
    "unprepare.after_sharing",
    "unprepare.after_cdi_remove",
    "unprepare.after_checkpoint",
];

/// Failpoints of dynamic MIG only, reached by claims of dynamic MIG devices (kept apart from
/// [`STEPS`], which every claim passes): `prepare.after_mig_create` is right after a MIG
/// instance was created, before its IDs are in the checkpoint.
pub const DYNAMIC_MIG_STEPS: &[&str] = &["prepare.after_mig_create"];

/// Failpoints of device metadata only (`--device-metadata`), reached by claims with files:
/// `prepare.after_metadata` is right after the files were written, before the CDI spec that
/// mounts them.
pub const METADATA_STEPS: &[&str] = &["prepare.after_metadata"];

/// What a failpoint does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Return an error from the step.
    Error,
    /// Abort the process.
    Kill,
    /// Record the step and stop forever.
    Pause,
}

/// The configured failpoints.
#[derive(Debug, Clone, Default)]
pub struct Failpoints {
    actions: HashMap<String, Action>,
    marker: Option<PathBuf>,
}

/// A failpoint configured with `error` fired.
#[derive(Debug, thiserror::Error)]
#[error("failpoint {0} fired")]
pub struct Fired(pub String);

impl Failpoints {
    /// Parses `name=action,...`; `marker` is where `pause` records the step.
    pub fn parse(spec: &str, marker: Option<PathBuf>) -> Result<Self, String> {
        let mut actions = HashMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, action) = item
                .split_once('=')
                .ok_or_else(|| format!("failpoint {item:?}: expected name=action"))?;
            if ![STEPS, DYNAMIC_MIG_STEPS, METADATA_STEPS]
                .iter()
                .any(|steps| steps.contains(&name))
            {
                return Err(format!(
                    "failpoint {name:?}: unknown; known: {}, {}, {}",
                    STEPS.join(", "),
                    DYNAMIC_MIG_STEPS.join(", "),
                    METADATA_STEPS.join(", ")
                ));
            }
            let action = match action {
                "error" => Action::Error,
                "kill" => Action::Kill,
                "pause" => Action::Pause,
                other => {
                    return Err(format!(
                        "failpoint {name}: action {other:?} is not error, kill or pause"
                    ));
                }
            };
            actions.insert(name.to_owned(), action);
        }
        Ok(Failpoints { actions, marker })
    }

    /// Runs the failpoint `name`.
    pub async fn hit(&self, name: &str) -> Result<(), Fired> {
        if self.actions.is_empty() {
            return Ok(());
        }
        match self.actions.get(name) {
            None => Ok(()),
            Some(Action::Error) => Err(Fired(name.to_owned())),
            Some(Action::Kill) => {
                tracing::warn!(failpoint = name, "failpoint: aborting");
                std::process::abort()
            }
            Some(Action::Pause) => {
                tracing::warn!(failpoint = name, "failpoint: pausing");
                if let Some(marker) = &self.marker {
                    let _ = std::fs::write(marker, name);
                }
                std::future::pending::<()>().await;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parse_and_fire() {
        let fp = Failpoints::parse("prepare.start=error", None).expect("parses");
        assert!(fp.hit("prepare.start").await.is_err());
        assert!(fp.hit("prepare.after_plan").await.is_ok());
        assert!(Failpoints::parse("nope=error", None).is_err());
        assert!(Failpoints::parse("prepare.after_mig_create=kill", None).is_ok());
        assert!(Failpoints::parse("prepare.start=explode", None).is_err());
        assert!(Failpoints::default().hit("prepare.start").await.is_ok());
    }
}
