//! A sharing executor for tests that need no driver tools: exclusive devices only.

use futures::future::BoxFuture;
use gpu_dra_core::checkpoint::Imported;
use gpu_dra_core::plan::{Plan, SharingGroup};
use serde_json::Value;

use crate::sharing::executor::strategy_name;
use crate::sharing::{Applied, SharingError, SharingExecutor};

/// A [`SharingExecutor`] that applies nothing: groups without sharing pass, a group with
/// sharing is refused, and releasing (also an imported claim's) succeeds with nothing to undo.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExclusiveOnly;

impl SharingExecutor for ExclusiveOnly {
    fn apply<'a>(
        &'a self,
        _plan: &'a Plan,
        group: &'a SharingGroup,
    ) -> BoxFuture<'a, Result<Applied, SharingError>> {
        let result = match &group.sharing {
            None => Ok(Applied::default()),
            Some(s) => Err(SharingError::InvalidRequest {
                field: "sharing.strategy".into(),
                message: format!(
                    "{}: this node's sharing executor (ExclusiveOnly) prepares devices for exclusive use only",
                    strategy_name(s)
                ),
            }),
        };
        Box::pin(async move { result })
    }

    fn release<'a>(
        &'a self,
        _claim_uid: &'a str,
        _state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), SharingError>> {
        Box::pin(async { Ok(()) })
    }

    fn release_imported<'a>(
        &'a self,
        _claim_uid: &'a str,
        _imported: &'a Imported,
    ) -> BoxFuture<'a, Result<(), SharingError>> {
        Box::pin(async { Ok(()) })
    }
}
