//! # store — the adapters
//!
//! Each port `meter` declares has its implementations here, named by
//! technology and role: [`KafkaLog`] and [`KafkaReader`] for the log,
//! [`RedisView`] for the view, [`PgStore`] and [`SqliteStore`] for the
//! store (one [`SqlStore`] over either database, see [`sql`]), and
//! [`RedisPermits`], [`PgPermits`] and [`MemoryPermits`] for the
//! concurrency permits. Transient
//! versus permanent is decided once, where a driver error is converted.
//! Both logs publish through one bounded retry queue ([`outbox`]), so a log
//! outage delays facts instead of losing them.

//!
//! Each backend is a cargo feature (`kafka`, `redis`, `postgres`,
//! `embedded`; all on by default), so a service that embeds Tollgate over the
//! embedded backends compiles none of the others' clients. The in-memory
//! view needs no feature.

#[cfg(feature = "kafka")]
pub mod kafka;
pub mod memory_permits;
pub mod memory_view;
#[cfg(any(feature = "kafka", feature = "embedded"))]
pub mod outbox;
#[cfg(feature = "postgres")]
pub mod pg;
#[cfg(feature = "postgres")]
pub mod pg_permits;
#[cfg(feature = "redis")]
pub mod redis_conn;
#[cfg(feature = "redis")]
pub mod redis_permits;
#[cfg(feature = "redis")]
pub mod redis_view;
#[cfg(any(feature = "postgres", feature = "embedded"))]
pub mod sql;
#[cfg(feature = "embedded")]
pub mod sqlite_log;
#[cfg(feature = "embedded")]
pub mod sqlite_store;

#[cfg(feature = "kafka")]
pub use kafka::{KafkaAuditLog, KafkaConfig, KafkaLog, KafkaReader, KafkaTail, ProducerState, Retention};
pub use memory_permits::MemoryPermits;
pub use memory_view::MemoryView;
#[cfg(any(feature = "kafka", feature = "embedded"))]
pub use outbox::PublishOptions;
#[cfg(feature = "postgres")]
pub use pg::PgStore;
#[cfg(feature = "postgres")]
pub use pg_permits::PgPermits;
#[cfg(feature = "redis")]
pub use redis_conn::RedisConn;
#[cfg(feature = "redis")]
pub use redis_permits::RedisPermits;
#[cfg(feature = "redis")]
pub use redis_view::RedisView;
#[cfg(any(feature = "postgres", feature = "embedded"))]
pub use sql::SqlStore;
#[cfg(feature = "embedded")]
pub use sqlite_log::{SqliteLog, SqliteLogReader};
#[cfg(feature = "embedded")]
pub use sqlite_store::SqliteStore;
