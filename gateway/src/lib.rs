//! # gateway — Tollgate's HTTP service
//!
//! The hot path (`/v1/check`, `/v1/events`), the admin API (projects, API
//! keys, roles, quotas one by one or a project's whole set declaratively,
//! the audit log, prices and exceptions, usage reports by model, actor,
//! agent or key), `/healthz` and `/openapi.json`; the web [`console`] at
//! `/console`; and the tower
//! [`TollgateLayer`] that gives a Rust service the same admission and
//! metering in-process.
//!
//! Layers, outside in: [`routes`] (handlers: extract, convert, one call,
//! map) and [`layer`] are the ways in; [`dto`] holds the typed request and
//! response bodies, read with the field path of any error; [`service`] is
//! every operation, over the ports in [`AppState`], returning a
//! [`service::Error`] that [`ApiError`] maps to the API's answer. The rules
//! themselves are `meter`'s.

pub mod auth;
pub mod console;
pub mod dto;
#[cfg(feature = "embedded")]
pub mod embedded;
pub mod error;
pub mod heavy;
pub mod layer;
#[cfg(feature = "parquet")]
pub mod parquet;
pub mod routes;
pub mod seeding;
pub mod service;
pub mod state;
pub mod telemetry;

pub use error::{ApiError, ApiResult};
pub use layer::TollgateLayer;
pub use routes::{ApiDoc, app};
pub use state::{AppState, Settings, ViewDownPolicy};
