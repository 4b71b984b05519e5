//! `tollgate apply -f quotas.yaml`: makes a project's quotas match a file.
//!
//! It talks to the store directly — PostgreSQL at `TOLLGATE_DATABASE_URL`,
//! or with `--data-dir` the SQLite file of `tollgate dev` — and runs the same
//! planning and the same one-transaction apply as `PUT
//! /v1/projects/{id}/quotas`: every entry is validated as the REST route
//! validates it, an attempt to change an immutable field fails the whole
//! apply naming it, and applying the same file twice changes nothing.
//! Gateways see the change within their configuration cache TTL.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Args;
use gateway::dto::quotas::{PlanView, QuotaDocumentBody};
use gateway::service::quotas::{self, Document};
use gateway::state::{Stores, SystemClock};
use meter::{Principal, ProjectId, Quota, QuotaPlan, Store};
use store::{PgStore, SqliteStore};

use crate::DbArgs;

#[derive(Args)]
pub struct ApplyArgs {
    /// The file of desired quotas (YAML, or JSON); `-` reads standard input.
    #[arg(short = 'f', long = "file", env = "TOLLGATE_APPLY_FILE")]
    file: PathBuf,
    #[command(flatten)]
    db: DbArgs,
    /// Apply to the embedded store of `tollgate dev` in this directory
    /// instead of PostgreSQL.
    #[arg(long, env = "TOLLGATE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The project, when the file does not name one (`project_id`).
    #[arg(long, env = "TOLLGATE_PROJECT_ID")]
    project_id: Option<String>,
    /// Print the plan and change nothing.
    #[arg(long, env = "TOLLGATE_DRY_RUN")]
    dry_run: bool,
    /// Print the result as JSON (the body `PUT /v1/projects/{id}/quotas` answers).
    #[arg(long, env = "TOLLGATE_JSON")]
    json: bool,
}

fn read(file: &PathBuf) -> anyhow::Result<String> {
    if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading standard input")?;
        return Ok(s);
    }
    std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
}

async fn open_store(args: &ApplyArgs) -> anyhow::Result<Arc<dyn Store>> {
    match &args.data_dir {
        Some(dir) => {
            let path = dir.join("tollgate.db");
            if !path.exists() {
                bail!("{} does not exist: no `tollgate dev` data in {}", path.display(), dir.display());
            }
            let store = SqliteStore::open(&path).await.with_context(|| format!("opening {}", path.display()))?;
            store.migrate().await.context("migrating the embedded store")?;
            Ok(Arc::new(store))
        }
        None => {
            let store = PgStore::connect(&args.db.database_url).await.context("connecting to PostgreSQL")?;
            store.migrate().await.context("migrating PostgreSQL")?;
            Ok(Arc::new(store))
        }
    }
}

fn describe(q: &Quota) -> String {
    let s = &q.spec;
    let subject = match &s.scope_ref {
        Some(r) => format!("{} {r}", s.scope),
        None => s.scope.to_string(),
    };
    format!(
        "{} {}/{} for {subject}, limit {} ({})",
        q.id,
        s.metric,
        s.window,
        meter::quota::limit_json(s.metric, s.limit),
        s.mode.as_str()
    )
}

fn print_plan(plan: &QuotaPlan, dry_run: bool) {
    for q in &plan.deletes {
        println!("  - delete {}", describe(q));
    }
    for u in &plan.updates {
        let (b, a) = (&u.before.spec, &u.after.spec);
        let mut what = Vec::new();
        if b.limit != a.limit {
            what.push(format!(
                "limit {} -> {}",
                meter::quota::limit_json(b.metric, b.limit),
                meter::quota::limit_json(a.metric, a.limit)
            ));
        }
        if b.mode != a.mode {
            what.push(format!("mode {} -> {}", b.mode.as_str(), a.mode.as_str()));
        }
        println!("  ~ update {} {}/{}: {}", u.before.id, b.metric, b.window, what.join(", "));
    }
    for c in &plan.creates {
        println!("  + create {}", describe(&c.quota));
    }
    let counts = format!(
        "{} created, {} updated, {} deleted, {} unchanged",
        plan.creates.len(),
        plan.updates.len(),
        plan.deletes.len(),
        plan.unchanged
    );
    if dry_run {
        println!("dry run for project {} (nothing changed): {counts}", plan.project_id);
    } else {
        println!("applied to project {}: {counts}", plan.project_id);
    }
}

pub async fn run(args: ApplyArgs) -> anyhow::Result<()> {
    let text = read(&args.file)?;
    // YAML is a superset of JSON, so one parser reads both.
    let value: serde_json::Value =
        serde_norway::from_str(&text).with_context(|| format!("{} is not valid YAML", args.file.display()))?;
    let doc = gateway::dto::from_value::<QuotaDocumentBody>(value)
        .and_then(Document::try_from)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let project = match (&doc.project_id, &args.project_id) {
        (Some(f), Some(a)) if f != a => bail!("project_id: the file names {f}, --project-id {a}"),
        (Some(p), _) | (None, Some(p)) => p.clone(),
        (None, None) => bail!("project_id: the file names no project; add `project_id:` or pass --project-id"),
    };
    let project = ProjectId::parse(project.clone()).map_err(|e| anyhow::anyhow!("project_id: {e}"))?;
    let stores = Stores::of(open_store(&args).await?);
    let plan =
        quotas::apply(&stores, &SystemClock, &project, &doc.quotas, &Principal::new("admin", "cli"), args.dry_run)
            .await
            .map_err(|e| anyhow::anyhow!("{e} (nothing was changed)"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&PlanView::of(&plan, args.dry_run))?);
    } else {
        print_plan(&plan, args.dry_run);
    }
    Ok(())
}
