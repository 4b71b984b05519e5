//! `tollgate dev`: gateway, projector (with the audit relay and folder) and
//! notifier in one process, with no external service. The store and the log
//! live in two SQLite files under the data directory (`tollgate.db` and
//! `tollgate-log.db`), the view in memory; the fold, the verdict and the API are the
//! same code as the distributed deployment. State survives a restart: the
//! view is re-seeded from the store and the projector resumes from its
//! stored offsets.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use gateway::embedded::Embedded;
use gateway::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
use gateway::state::{SystemClock, random_token};
use gateway::{AppState, Settings};
use meter::{Clock, Metric, Principal, WindowKind};
use serde_json::json;
use tracing::info;

#[derive(Args)]
pub struct DevArgs {
    /// Where the SQLite file and the dev tokens are kept.
    #[arg(long, env = "TOLLGATE_DATA_DIR", default_value = ".tollgate")]
    data_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// Bearer token of the admin API (generated and kept in the data directory if unset).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Bearer token of the hot path (generated and kept in the data directory if unset).
    #[arg(long, env = "TOLLGATE_GATEWAY_TOKEN", hide_env_values = true)]
    gateway_token: Option<String>,
    /// Do not create the demo project, key and quota on the first start.
    #[arg(long, env = "TOLLGATE_NO_DEMO")]
    no_demo: bool,
    /// How long an admitted call holds its reservation if never settled
    /// (more than zero, at most an hour).
    #[arg(long, env = "TOLLGATE_LEASE", default_value = "60s", value_parser = crate::parse_lease)]
    lease: Duration,
    /// How long quota and key configuration is cached.
    #[arg(long, env = "TOLLGATE_CONFIG_TTL", default_value = "1s", value_parser = humantime::parse_duration)]
    config_ttl: Duration,
    /// Deliver webhooks to private and loopback addresses (a receiver on
    /// this machine); on by default in `dev`.
    #[arg(long, env = "TOLLGATE_WEBHOOK_ALLOW_PRIVATE", default_value_t = true, action = clap::ArgAction::Set)]
    webhook_allow_private: bool,
    /// How long one webhook delivery attempt may take.
    #[arg(long, env = "TOLLGATE_WEBHOOK_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    webhook_timeout: Duration,
    /// Permits are kept in this process's memory under `dev`.
    #[command(flatten)]
    permit: crate::PermitArgs,
}

/// Tokens kept across restarts so curl lines keep working.
fn tokens(dir: &Path, admin: Option<String>, gateway: Option<String>) -> anyhow::Result<(String, String)> {
    let path = dir.join("tokens.json");
    let saved: serde_json::Value =
        std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_else(|| json!({}));
    let admin = admin
        .or_else(|| saved["admin"].as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("adm_{}", random_token(32)));
    let gateway = gateway
        .or_else(|| saved["gateway"].as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("gw_{}", random_token(32)));
    std::fs::write(&path, serde_json::to_vec_pretty(&json!({"admin": admin, "gateway": gateway}))?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok((admin, gateway))
}

/// The demo project, key and quota, created once; returns (project, key id, secret).
async fn demo(state: &AppState, dir: &Path) -> anyhow::Result<(String, String, String)> {
    let path = dir.join("demo.json");
    if let Some(v) = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        && let (Some(p), Some(k), Some(s)) = (v["project_id"].as_str(), v["api_key_id"].as_str(), v["secret"].as_str())
    {
        return Ok((p.to_owned(), k.to_owned(), s.to_owned()));
    }
    let starter = Starter {
        project: NewProject { name: "demo".into(), timezone: chrono_tz::Tz::UTC },
        key: NewApiKey { name: "demo key".into(), ..NewApiKey::default() },
        quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Rolling1m, limit: 5 }),
    };
    let made = provisioning::provision(state, starter, &Principal::new("admin", "dev"))
        .await
        .map_err(|e| anyhow::anyhow!("creating the demo project: {e}"))?;
    let quota_id = made.quota.as_ref().map(|q| q.id.to_string());
    let v =
        json!({"project_id": made.project.id, "api_key_id": made.key.id, "secret": made.secret, "quota_id": quota_id});
    std::fs::write(&path, serde_json::to_vec_pretty(&v)?)?;
    Ok((made.project.id.to_string(), made.key.id.to_string(), made.secret))
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating {}", args.data_dir.display()))?;
    let (admin, gateway_token) = tokens(&args.data_dir, args.admin_token, args.gateway_token)?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let mut settings = Settings::new(admin.clone(), gateway_token.clone());
    settings.lease = args.lease;
    settings.config_ttl = args.config_ttl;
    settings.instance = "dev".into();
    settings.webhook_allow_private = args.webhook_allow_private;
    args.permit.apply(&mut settings, gateway::state::DEFAULT_POOL_SIZE)?;
    let db = args.data_dir.join("tollgate.db");
    let embedded =
        Embedded::open(&db, settings, clock.clone()).await.with_context(|| format!("opening {}", db.display()))?;
    let state = embedded.state.clone();
    // The notifier, beside the gateway and the projector, on the same file.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let notifier_config = projector::notify::NotifierConfig {
        allow_private: args.webhook_allow_private,
        timeout: args.webhook_timeout,
        lease: chrono::Duration::from_std(args.webhook_timeout + Duration::from_secs(45))
            .context("--webhook-timeout")?,
        ..projector::notify::NotifierConfig::default()
    };
    let scheduler = gateway::service::export_schedules::Scheduler::new(
        state.stores.tenants.clone(),
        state.stores.exports.clone(),
        state.stores.schedules.clone(),
        clock.clone(),
        state.settings.exports.clone(),
        notifier_config.claimant.clone(),
    );
    let notifier =
        crate::notify::spawn(state.stores.webhooks.clone(), clock.clone(), notifier_config, Some(scheduler), stopped);
    let demo = if args.no_demo { None } else { Some(demo(&state, &args.data_dir).await?) };

    let listener =
        tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let url = format!("http://{}", listener.local_addr()?);
    print_banner(&url, &admin, &gateway_token, &args.data_dir, demo.as_ref());
    info!(%url, "tollgate dev listening");
    axum::serve(listener, gateway::app(state)).with_graceful_shutdown(crate::shutdown_signal()).await?;
    let _ = stop.send(true);
    notifier.await.context("notifier task")??;
    embedded.shutdown().await.context("projector")?;
    Ok(())
}

/// Writes the banner to stdout in one write, and goes on if stdout is
/// gone: `println!` panics on a closed stdout (`tollgate dev | head -3`
/// once `head` has exited), and the banner is not worth the server.
fn print_banner(url: &str, admin: &str, gateway: &str, dir: &Path, demo: Option<&(String, String, String)>) {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let mut b = String::new();
    // Writing into a String cannot fail.
    let _ = writeln!(b, "tollgate dev — gateway, projector and notifier in one process, state in {}", dir.display());
    let _ = writeln!(b);
    let _ = writeln!(b, "  URL            {url}");
    let _ = writeln!(b, "  console        {url}/console  (sign in with the admin token)");
    let _ = writeln!(b, "  admin token    {admin}");
    let _ = writeln!(b, "  gateway token  {gateway}");
    if let Some((project, key, secret)) = demo {
        let _ = writeln!(b, "  demo project   {project}");
        let _ = writeln!(b, "  demo key       {key}  (secret {secret}; quota: 5 calls per minute)");
        let _ = writeln!(b);
        let _ = writeln!(b, "Try:");
        let _ = writeln!(b, "  curl -s -X POST {url}/v1/check -H 'authorization: Bearer {gateway}' \\");
        let _ = writeln!(b, "       -H 'content-type: application/json' -d '{{\"api_key\":\"{secret}\"}}'");
        let _ = writeln!(b, "  curl -s {url}/v1/quotas?project_id={project} -H 'authorization: Bearer {admin}'");
        let _ = writeln!(b, "  tollgate export --data-dir {} --project {project} --out usage.csv", dir.display());
    }
    let _ = writeln!(b, "  curl -s {url}/openapi.json");
    let _ = writeln!(b);
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(b.as_bytes()).and_then(|()| out.flush()) {
        tracing::warn!(error = %e, "could not print the banner; serving anyway");
    }
}
