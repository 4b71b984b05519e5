//! Permits in this process's memory: [`MemoryPermits`] runs the reference
//! model ([`meter::PermitModel`]) behind a mutex. What `tollgate dev` (one
//! process) and a service embedding the Layer use; across processes the
//! slots are not shared, so a deployment of several gateways takes Redis or
//! PostgreSQL (`TOLLGATE_PERMITS`).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{Claimed, Permit, PermitClaim, PermitId, PermitModel, Permits, PortResult};

/// Permits in memory; cheap to clone (clones share the slots).
#[derive(Debug, Clone, Default)]
pub struct MemoryPermits {
    model: Arc<Mutex<PermitModel>>,
}

impl MemoryPermits {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut PermitModel) -> T) -> T {
        // A poisoned lock holds a model no panic left half-changed: each
        // operation changes it in one step.
        let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut m)
    }
}

#[async_trait]
impl Permits for MemoryPermits {
    async fn claim(&self, claim: &PermitClaim, at: DateTime<Utc>) -> PortResult<Claimed> {
        Ok(self.with(|m| m.claim(claim, at)))
    }

    async fn renew(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<Option<Permit>> {
        Ok(self.with(|m| m.renew(id, at)))
    }

    async fn release(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<bool> {
        Ok(self.with(|m| m.release(id, at)))
    }
}
