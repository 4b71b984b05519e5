//! The time, injected: nothing in `meter` reads a clock, and everything
//! outside it that needs "now" asks a [`Clock`], so tests can set it.

use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

/// The time, injected.
pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

/// A clock tests set by hand. Clones share the time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    pub fn new(at: DateTime<Utc>) -> Self {
        ManualClock(Arc::new(Mutex::new(at)))
    }
    pub fn set(&self, at: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }
    pub fn advance(&self, by: chrono::Duration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *t += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
