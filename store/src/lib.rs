//! # store — the adapters
//!
//! Each port `meter` declares has its implementations here, named by
//! technology and role: [`KafkaLog`] and [`KafkaReader`] for the log,
//! [`RedisView`] for the view, [`PgStore`] and [`SqliteStore`] for the
//! store (one [`SqlStore`] over either database, see [`sql`]). Transient
//! versus permanent is decided once, where a driver error is converted.

pub mod kafka;
pub mod memory_view;
pub mod pg;
pub mod redis_view;
pub mod sql;
pub mod sqlite_log;
pub mod sqlite_store;

pub use kafka::{KafkaConfig, KafkaLog, KafkaReader};
pub use memory_view::MemoryView;
pub use pg::PgStore;
pub use redis_view::RedisView;
pub use sql::SqlStore;
pub use sqlite_log::{SqliteLog, SqliteLogReader};
pub use sqlite_store::SqliteStore;
