//! # One Redis server, or a Redis Cluster
//!
//! [`RedisConn`] is the connection [`crate::RedisView`] and
//! [`crate::RedisPermits`] share: a self-reconnecting multiplexed connection
//! to one server (`redis://host:port/db`, also `rediss://`), or a cluster
//! connection (`redis+cluster://host1:port1,host2:port2,…`: any reachable
//! node of the cluster; the client learns the slot map from it, follows
//! `MOVED`/`ASK`, and refreshes the map when it changes).
//!
//! On a cluster a script runs on the master of the slot of its keys: every
//! script Tollgate sends names keys of one hash slot (a project's keys carry
//! the tag `{<project>}`, the permits' keys the tag `{permits}`), and the
//! keys a script derives at run time carry the same tag, so every script is
//! atomic there as on one server. What is not one script — the `SCAN`s of
//! [`crate::RedisView::forget_all`] and of a project's keys — is sent to
//! each master ([`RedisConn::scan`]).

use std::time::Duration;

use meter::{PortError, PortResult};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, Value};
use tracing::Instrument;

use crate::redis_view::classify;

/// The URL scheme that names a Redis Cluster by some of its nodes.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

/// How long connecting, and each answer, may take before the call fails
/// (transient): a frozen Redis must not hold a check for long.
const TIMEOUT: Duration = Duration::from_secs(1);

/// A connection to one Redis server or to a Redis Cluster; cheap to clone
/// (clones share the connection).
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Which masters a [`RedisConn::scan`] asks.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ScanScope<'a> {
    /// Every master (on one server: that server).
    All,
    /// The master of the slot of this key (on one server: that server).
    SlotOf(&'a str),
}

impl RedisConn {
    /// Connects to `url`: `redis://…` (one server) or `redis+cluster://h:p,…`.
    pub async fn connect(url: &str) -> PortResult<RedisConn> {
        match cluster_nodes(url)? {
            None => {
                let client = redis::Client::open(url).map_err(|e| PortError::Permanent(format!("redis url: {e}")))?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(TIMEOUT))
                    .set_response_timeout(Some(TIMEOUT))
                    .set_number_of_retries(3);
                let conn = ConnectionManager::new_with_config(client, config)
                    .instrument(tracing::debug_span!("datastore", op = "connect"))
                    .await
                    .map_err(|e| classify("connect", &e))?;
                Ok(RedisConn::Single(conn))
            }
            Some(nodes) => {
                let client = ClusterClient::builder(nodes)
                    .connection_timeout(TIMEOUT)
                    .response_timeout(TIMEOUT)
                    .retries(3)
                    .build()
                    .map_err(|e| PortError::Permanent(format!("redis cluster url: {e}")))?;
                let conn = client
                    .get_async_connection()
                    .instrument(tracing::debug_span!("datastore", op = "connect"))
                    .await
                    .map_err(|e| classify("connect", &e))?;
                Ok(RedisConn::Cluster(conn))
            }
        }
    }

    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }

    /// Every key matching `pattern` on the masters `scope` names (a `SCAN`
    /// per master; not atomic, never on the hot path). A key may appear
    /// twice (a `SCAN` may repeat one); callers dedup when it matters.
    pub(crate) async fn scan(&self, op: &'static str, pattern: &str, scope: ScanScope<'_>) -> PortResult<Vec<String>> {
        let mut keys = Vec::new();
        self.scan_each(op, pattern, scope, async |batch| {
            keys.extend(batch);
            Ok(())
        })
        .await?;
        Ok(keys)
    }

    /// [`RedisConn::scan`], handing each batch to `each` as it comes, so
    /// that nothing holds every key at once. Keys may be deleted meanwhile:
    /// a `SCAN` still returns every key that stays throughout.
    pub(crate) async fn scan_each(
        &self,
        op: &'static str,
        pattern: &str,
        scope: ScanScope<'_>,
        mut each: impl AsyncFnMut(Vec<String>) -> PortResult<()>,
    ) -> PortResult<()> {
        let span = tracing::debug_span!("datastore", op);
        // One server: one pass, no routing. A cluster: one pass per master.
        let routes: Vec<Option<SingleNodeRoutingInfo>> = match (self, scope) {
            (RedisConn::Single(_), _) => vec![None],
            (RedisConn::Cluster(_), ScanScope::SlotOf(key)) => {
                vec![Some(SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master)))]
            }
            (RedisConn::Cluster(c), ScanScope::All) => masters(&mut c.clone())
                .instrument(span.clone())
                .await?
                .into_iter()
                .map(|(host, port)| Some(SingleNodeRoutingInfo::ByAddress { host, port }))
                .collect(),
        };
        for route in routes {
            let mut cursor: u64 = 0;
            loop {
                let answer = match (self, &route) {
                    (RedisConn::Cluster(c), Some(r)) => {
                        c.clone().route_command(scan_cmd(cursor, pattern), RoutingInfo::SingleNode(r.clone())).await
                    }
                    _ => scan_cmd(cursor, pattern).query_async::<Value>(&mut self.clone()).await,
                };
                let v = answer.map_err(|e| classify(op, &e))?;
                let (next, batch): (u64, Vec<String>) = redis::from_redis_value(v)
                    .map_err(|e| PortError::Permanent(format!("redis {op}: SCAN answered {e}")))?;
                each(batch).instrument(span.clone()).await?;
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }
}

fn scan_cmd(cursor: u64, pattern: &str) -> Cmd {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
    cmd
}

/// The nodes of a `redis+cluster://h1:p1,h2:p2` URL as `redis://` URLs, or
/// `None` for any other URL.
fn cluster_nodes(url: &str) -> PortResult<Option<Vec<String>>> {
    let Some(rest) = url.strip_prefix(CLUSTER_SCHEME) else { return Ok(None) };
    let rest = rest.trim_end_matches('/');
    let nodes: Vec<String> =
        rest.split(',').map(str::trim).filter(|n| !n.is_empty()).map(|n| format!("redis://{n}")).collect();
    if nodes.is_empty() {
        return Err(PortError::Permanent(format!(
            "redis cluster url {url:?} names no node ({CLUSTER_SCHEME}host:port,host:port,…)"
        )));
    }
    Ok(Some(nodes))
}

/// The cluster's masters that serve slots, as `(host, port)`, from
/// `CLUSTER NODES` (one line per node: `id host:port@bus[,name] flags …`).
async fn masters(c: &mut ClusterConnection) -> PortResult<Vec<(String, u16)>> {
    let v = c
        .route_command(
            redis::cmd("CLUSTER").arg("NODES").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await
        .map_err(|e| classify("cluster nodes", &e))?;
    let text: String =
        redis::from_redis_value(v).map_err(|e| PortError::Permanent(format!("redis CLUSTER NODES answered {e}")))?;
    parse_masters(&text)
}

fn parse_masters(text: &str) -> PortResult<Vec<(String, u16)>> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let (Some(addr), Some(flags)) = (parts.get(1), parts.get(2)) else {
            return Err(PortError::Permanent(format!("redis CLUSTER NODES: unreadable line {line:?}")));
        };
        let flags: Vec<&str> = flags.split(',').collect();
        // A master with no slots holds no keys; a failed one cannot be asked.
        if !flags.contains(&"master") || flags.contains(&"fail") || flags.contains(&"noaddr") || parts.len() < 9 {
            continue;
        }
        let hostport = addr.split(['@', ',']).next().unwrap_or_default();
        let Some((host, port)) = hostport.rsplit_once(':') else {
            return Err(PortError::Permanent(format!("redis CLUSTER NODES: unreadable address {addr:?}")));
        };
        let port = port
            .parse::<u16>()
            .map_err(|_| PortError::Permanent(format!("redis CLUSTER NODES: unreadable port in {addr:?}")))?;
        out.push((host.to_owned(), port));
    }
    Ok(out)
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_names_its_nodes() {
        assert_eq!(cluster_nodes("redis://127.0.0.1:6379/0").expect("a url"), None);
        assert_eq!(
            cluster_nodes("redis+cluster://127.0.0.1:7001, 127.0.0.1:7002/").expect("a url"),
            Some(vec!["redis://127.0.0.1:7001".to_owned(), "redis://127.0.0.1:7002".to_owned()])
        );
        assert!(cluster_nodes("redis+cluster://").is_err());
        assert!(cluster_nodes("redis+cluster://,,").is_err());
    }

    #[test]
    fn masters_with_slots_are_read_from_cluster_nodes() {
        let text = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002,node-b master - 0 1 2 connected 5461-10922
c3 127.0.0.1:7003@17003 master,fail - 0 1 3 connected 10923-16383
d4 127.0.0.1:7004@17004 slave a1 0 1 1 connected
e5 127.0.0.1:7005@17005 master - 0 1 5 connected
";
        assert_eq!(
            parse_masters(text).expect("readable"),
            vec![("127.0.0.1".to_owned(), 7001), ("127.0.0.1".to_owned(), 7002)]
        );
        assert!(parse_masters("x").is_err());
    }
}
