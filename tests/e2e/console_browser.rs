//! The console in a real browser: Debian's `chromium`, headless, driven
//! through `chromedriver` with fantoccini, against a gateway, a projector
//! and a notifier over PostgreSQL, Redis and the broker. The browser signs
//! in, creates a key with a grant through the form, watches the key's bar
//! reach 80 % and then 100 % as checks run through the API (the rendered
//! width of the bar's fill against its track, its colour class and its
//! label), flips the quota to monitor with its switch and resends a
//! webhook delivery with its button, finding every form control labelled,
//! every table with header cells and every bar's value in text on the way;
//! the screenshot of the key page is the one the README shows. Without the
//! session cookie every page sends the browser to the sign-in page (a GET)
//! or answers 401 (a POST), and a form posted without its CSRF token is
//! refused with 403. A second test runs
//! `tollgate dev` as the README does and follows its banner: the console
//! link, the admin token, the demo key's bar moving with a check.
//!
//! `scripts/test` installs `chromium` and `chromium-driver` with apt when
//! missing; without them the test is skipped (a failure under
//! `TOLLGATE_REQUIRE_SERVICES`, as a missing service is).

use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};
use testkit::webhooks::Receiver;

use crate::harness::*;

/// Where Debian's packages put the browser and its driver.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A `chromedriver` of this test's own, on a free port; killed when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    /// Ends the driver and every browser it started (its process group), so
    /// a test that fails mid-session leaves no chromium behind.
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    /// `None` (the test is skipped) when the browser is not installed.
    async fn start() -> Option<Driver> {
        if !std::path::Path::new(CHROMIUM).exists() || !std::path::Path::new(CHROMEDRIVER).exists() {
            let why = format!("{CHROMIUM} or {CHROMEDRIVER} not installed (apt-get install chromium chromium-driver)");
            if testkit::env::services_required() {
                panic!("{why}, and {} is set", testkit::env::REQUIRE_SERVICES);
            }
            eprintln!("skipped the browser test: {why}");
            return None;
        }
        // A driver that exited (its port taken between `free_port` and its
        // bind: another test's listener may answer there) is started again
        // on another port.
        let http = reqwest::Client::new();
        for _attempt in 0..3 {
            let port = free_port();
            let child = Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                // A group of its own, which its browsers join: see `Drop`.
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn chromedriver");
            let mut driver = Driver { child, url: format!("http://127.0.0.1:{port}") };
            for _ in 0..100 {
                if driver.child.try_wait().ok().flatten().is_some() {
                    break;
                }
                // Its own answer (WebDriver's status names `ready`), while it still runs.
                if let Ok(r) = http.get(format!("{}/status", driver.url)).send().await
                    && r.status().is_success()
                    && r.text().await.is_ok_and(|t| t.contains("\"ready\""))
                    && driver.child.try_wait().ok().flatten().is_none()
                {
                    return Some(driver);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        panic!("chromedriver did not start (three attempts)");
    }

    /// A headless browser session (root needs `--no-sandbox`).
    async fn browser(&self) -> Client {
        let caps = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1100,900", "--hide-scrollbars", "--lang=en-GB"],
            },
        });
        let Value::Object(caps) = caps else { unreachable!("an object") };
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a chromium session")
    }
}

/// The path of the page the browser is on.
async fn path(b: &Client) -> String {
    b.current_url().await.expect("current url").path().to_owned()
}

async fn find(b: &Client, css: &str) -> fantoccini::elements::Element {
    match b.wait().at_most(Duration::from_secs(10)).for_element(Locator::Css(css)).await {
        Ok(e) => e,
        Err(e) => panic!("{css} on {}: {e}", path(b).await),
    }
}

/// Clicks what `css` finds (a form's button, a link) and waits until the
/// browser shows the page it leads to: a new document, loaded. (The click
/// can return before the navigation it starts; what the next `find` meets
/// could be the old page's.)
async fn click_to(b: &Client, css: &str) {
    b.execute("document.documentElement.setAttribute('data-left', '1')", vec![]).await.expect("mark the page");
    find(b, css).await.click().await.unwrap_or_else(|e| panic!("click {css}: {e}"));
    for _ in 0..100 {
        // During the navigation a script may find no document to run in: not yet.
        let arrived = b
            .execute(
                "return document.readyState === 'complete' && !document.documentElement.hasAttribute('data-left')",
                vec![],
            )
            .await;
        if arrived.ok().and_then(|v| v.as_bool()) == Some(true) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{css}: no new page within 10 s");
}

async fn type_into(b: &Client, css: &str, text: &str) {
    let e = find(b, css).await;
    e.clear().await.expect("clear");
    e.send_keys(text).await.expect("type");
}

async fn attr(e: &fantoccini::elements::Element, name: &str) -> String {
    e.attr(name).await.expect("attribute").unwrap_or_default()
}

/// What the page in the browser lacks for a screen reader: form controls
/// without a label, tables without header cells, images of data (the
/// bars) not hidden from it while their value is in text.
async fn unlabelled(b: &Client) -> Vec<String> {
    let found = b
        .execute(
            "const out = [];
             for (const c of document.querySelectorAll('input:not([type=hidden]), select, textarea')) {
               if (c.labels.length === 0 && !c.getAttribute('aria-label')) out.push('control ' + (c.id || c.name));
             }
             for (const t of document.querySelectorAll('table')) {
               if (t.querySelectorAll('th').length === 0) out.push('table ' + t.id);
             }
             for (const s of document.querySelectorAll('svg.bar')) {
               if (s.getAttribute('aria-hidden') !== 'true') out.push('bar not hidden');
               if (!s.closest('.usage').querySelector('.pct')) out.push('bar without its value in text');
             }
             return out;",
            vec![],
        )
        .await
        .expect("inspect the page");
    serde_json::from_value(found).expect("a list")
}

/// One check admitted and settled through the API.
async fn call(env: &Env, pid: &str, kid: &str, secret: &str, n: usize) {
    let r = check(&env.http, env.gw(), secret, json!({})).await;
    let status = r.status().as_u16();
    let body: Value = r.json().await.expect("check body");
    assert_eq!(status, 200, "check {n}: {body}");
    let rid = body["reservation_id"].as_str().expect("reservation id");
    let (s, b) =
        post_events(&env.http, env.gw(), vec![call_event(&format!("browser-{n}"), pid, kid, Some(rid), 1)]).await;
    assert_eq!(s, 202, "settle {n}: {b}");
}

/// What the browser shows of one usage bar: (data-percent, data-level,
/// the label's text, the fill's rendered width over the track's, the
/// fill's computed colour).
async fn bar(b: &Client, quota: &str) -> (String, String, String, f64, String) {
    let css = format!(".usage[data-quota-id=\"{quota}\"]");
    let e = find(b, &css).await;
    let label = e.find(Locator::Css(".pct")).await.expect("the bar's label").text().await.expect("text");
    let measured = b
        .execute(
            "const u = document.querySelector(arguments[0]);
             const fill = u.querySelector('rect.fill').getBoundingClientRect().width;
             const track = u.querySelector('rect.track').getBoundingClientRect().width;
             return [fill / track, getComputedStyle(u.querySelector('rect.fill')).fill];",
            vec![json!(css)],
        )
        .await
        .expect("measure the bar");
    (
        attr(&e, "data-percent").await,
        attr(&e, "data-level").await,
        label,
        measured[0].as_f64().expect("a ratio"),
        measured[1].as_str().unwrap_or_default().to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_browser_signs_in_grants_shows_bars_switches_modes_and_resends() {
    let Some(mut env) = Env::new().await else { return };
    let Some(driver) = Driver::start().await else { return };
    env.extra_env.push(("TOLLGATE_WEBHOOK_ALLOW_PRIVATE".into(), "true".into()));
    env.start_gateway().await;
    env.start_projector();
    env.start_notifier_with(&[("TOLLGATE_NOTIFY_POLL", "50ms")]);
    let gw = env.gw().to_owned();
    let (s, p) = env.admin_post("/v1/projects", json!({"name": "Browser Co", "timezone": safe_timezone()})).await;
    assert_eq!(s, 201, "{p}");
    let pid = p["id"].as_str().expect("project id").to_owned();
    let receiver = Receiver::start(vec![]).await;
    let (wh, _) = env.webhook(&pid, &receiver.url("/hook")).await;

    let b = driver.browser().await;

    // Without a session, a page sends the browser to sign in.
    b.goto(&format!("{gw}/console/projects/{pid}")).await.expect("goto");
    assert_eq!(path(&b).await, "/console/sign-in");
    type_into(&b, "#token", "not the token").await;
    click_to(&b, "#sign-in button[type=submit]").await;
    assert!(find(&b, "#sign-in-error").await.text().await.expect("text").contains("not the admin token"));
    type_into(&b, "#token", ADMIN).await;
    click_to(&b, "#sign-in button[type=submit]").await;
    assert_eq!(path(&b).await, "/console");
    click_to(&b, &format!("a[href=\"/console/projects/{pid}\"]")).await;
    assert_eq!(path(&b).await, format!("/console/projects/{pid}"));

    // A key with grants, through the form; a bad value first (refused,
    // nothing made), then good ones.
    type_into(&b, "#f-name", "browser").await;
    type_into(&b, "#f-max_concurrent", "0").await;
    click_to(&b, "#new-key button[type=submit]").await;
    let refusal = find(&b, "#new-key-error").await;
    assert_eq!(attr(&refusal, "data-field").await, "grants.max_concurrent");
    assert_eq!(attr(&find(&b, "#f-max_concurrent").await, "aria-invalid").await, "true");
    find(&b, "#no-keys").await;
    type_into(&b, "#f-max_concurrent", "4").await;
    type_into(&b, "#f-max_rows", "500").await;
    click_to(&b, "#new-key button[type=submit]").await;
    let secret_el = find(&b, "#secret").await;
    assert_eq!(unlabelled(&b).await, Vec::<String>::new(), "the project page");
    let secret = secret_el.text().await.expect("the secret");
    let kid = attr(&secret_el, "data-key-id").await;
    let (s, k) = env.admin_get(&format!("/v1/api-keys/{kid}")).await;
    assert_eq!(s, 200, "{k}");
    assert_eq!((k["grants"]["max_concurrent"].as_u64(), k["grants"]["max_rows"].as_u64()), (Some(4), Some(500)), "{k}");

    // A quota of 10 calls a day on the key; 8 calls: the bar at 80 %.
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 10}))
        .await;
    for n in 0..8 {
        call(&env, &pid, &kid, &secret, n).await;
    }
    let key_page = format!("{gw}/console/projects/{pid}/keys/{kid}");
    b.goto(&key_page).await.expect("goto the key");
    let (pct, level, label, ratio, warn_colour) = bar(&b, &qid).await;
    assert_eq!((pct.as_str(), level.as_str(), label.as_str()), ("80", "warn", "80 %"));
    assert!((ratio - 0.8).abs() < 0.01, "the fill is 80 % of the track: {ratio}");
    assert_eq!(unlabelled(&b).await, Vec::<String>::new(), "the key page");
    let limits = find(&b, "#limits tr[data-limit=\"max_concurrent\"] td.granted").await;
    assert_eq!(limits.text().await.expect("text"), "4");

    // Two more: 100 %, another colour.
    for n in 8..10 {
        call(&env, &pid, &kid, &secret, n).await;
    }
    b.refresh().await.expect("reload");
    let (pct, level, label, ratio, full_colour) = bar(&b, &qid).await;
    assert_eq!((pct.as_str(), level.as_str(), label.as_str()), ("100", "full", "100 %"));
    assert!((ratio - 1.0).abs() < 0.01, "the fill is the whole track: {ratio}");
    assert_ne!(warn_colour, full_colour, "80 % and 100 % are told apart by colour as well as by text");
    let shot = b.screenshot().await.expect("a screenshot of the key page");
    assert_eq!(&shot[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-key.png");
    std::fs::write(&out, &shot).expect("write the screenshot");
    if std::env::var("TOLLGATE_UPDATE_SCREENSHOT").is_ok_and(|v| v == "1") {
        std::fs::write(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/console-key.png"), &shot).expect("the README's copy");
    }

    // The grant form on the key page: a changed grant shows as granted.
    type_into(&b, "#f-max_concurrent", "6").await;
    click_to(&b, "#grants button[type=submit]").await;
    let granted = find(&b, "#limits tr[data-limit=\"max_concurrent\"] td.granted").await;
    assert_eq!(granted.text().await.expect("text"), "6");

    // The quota to monitor with its switch.
    b.goto(&format!("{gw}/console/projects/{pid}/quotas")).await.expect("goto quotas");
    assert_eq!(unlabelled(&b).await, Vec::<String>::new(), "the quotas page");
    click_to(&b, &format!("#mode-{qid} button")).await;
    let row = find(&b, &format!("#quotas tr[data-quota-id=\"{qid}\"]")).await;
    assert_eq!(attr(&row, "data-mode").await, "monitor");
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(q["mode"], "monitor", "{q}");

    // A delivery resent with its button: the receiver gets it again, under the same id.
    let (s, t) = env.admin_post(&format!("/v1/webhooks/{wh}/test"), json!({})).await;
    assert_eq!(s, 202, "{t}");
    let message = t["message_id"].as_str().expect("message id").to_owned();
    env.eventually(20, "the test message delivered", || async { receiver.received().iter().any(|r| r.id == message) })
        .await;
    b.goto(&format!("{gw}/console/projects/{pid}/usage?group_by=api_key")).await.expect("goto usage");
    find(&b, "#usage-form").await;
    assert_eq!(unlabelled(&b).await, Vec::<String>::new(), "the usage page");
    let hook_page = format!("{gw}/console/projects/{pid}/webhooks/{wh}");
    b.goto(&hook_page).await.expect("goto the webhook");
    assert_eq!(unlabelled(&b).await, Vec::<String>::new(), "the webhook page");
    click_to(&b, &format!("#resend-{message} button")).await;
    assert_eq!(path(&b).await, format!("/console/projects/{pid}/webhooks/{wh}"));
    env.eventually(20, "the message delivered again", || async {
        receiver.received().iter().filter(|r| r.id == message).count() >= 2
    })
    .await;

    // The session cookie, as the browser holds it: without it every page
    // is refused; with it, a form without its CSRF token is.
    let session = b
        .get_all_cookies()
        .await
        .expect("cookies")
        .into_iter()
        .find(|c| c.name() == "tollgate_console")
        .map(|c| format!("{}={}", c.name(), c.value()))
        .expect("a session cookie");
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("client");
    let pages = [
        "/console".to_owned(),
        "/console/health".to_owned(),
        format!("/console/projects/{pid}"),
        format!("/console/projects/{pid}/keys/{kid}"),
        format!("/console/projects/{pid}/quotas"),
        format!("/console/projects/{pid}/quotas/{qid}"),
        format!("/console/projects/{pid}/usage"),
        format!("/console/projects/{pid}/breaches"),
        format!("/console/projects/{pid}/audit"),
        format!("/console/projects/{pid}/exceptions"),
        format!("/console/projects/{pid}/webhooks"),
        format!("/console/projects/{pid}/webhooks/{wh}"),
        format!("/console/projects/{pid}/exports"),
    ];
    for page in &pages {
        let r = http.get(format!("{gw}{page}")).send().await.expect("get");
        assert_eq!(r.status().as_u16(), 303, "{page} without the cookie");
        assert_eq!(r.headers()["location"], "/console/sign-in", "{page}");
        let r = http.get(format!("{gw}{page}")).header("cookie", &session).send().await.expect("get");
        assert_eq!(r.status().as_u16(), 200, "{page} with the cookie");
    }
    // The health page of a gateway over Kafka: every partition's lag read
    // from the log's ends against the projector's stored offsets, caught up
    // once the projector has folded everything.
    env.eventually(20, "every partition caught up on the health page", || async {
        let page = http.get(format!("{gw}/console/health")).header("cookie", &session).send().await;
        let Ok(page) = page else { return false };
        let body = page.text().await.unwrap_or_default();
        let lags: Vec<&str> = body
            .split(r#"<td class="num lag">"#)
            .skip(1)
            .filter_map(|rest| rest.split_once("</td>").map(|(v, _)| v))
            .collect();
        !lags.is_empty() && lags.iter().all(|v| *v == "0")
    })
    .await;
    let posts = [
        (format!("/console/projects/{pid}/keys"), "name=sneaky".to_owned()),
        (format!("/console/projects/{pid}/keys/{kid}/grants"), "max_concurrent=1".to_owned()),
        (format!("/console/projects/{pid}/quotas/{qid}/mode"), "mode=enforce".to_owned()),
        (format!("/console/projects/{pid}/webhooks/{wh}/deliveries/{message}/resend"), String::new()),
    ];
    for (form, body) in &posts {
        let post = |cookie: Option<&str>| {
            let mut r = http
                .post(format!("{gw}{form}"))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(body.clone());
            if let Some(c) = cookie {
                r = r.header("cookie", c);
            }
            r.send()
        };
        assert_eq!(post(None).await.expect("post").status().as_u16(), 401, "{form} without the cookie");
        assert_eq!(post(Some(&session)).await.expect("post").status().as_u16(), 403, "{form} without the CSRF token");
    }
    // Nothing those posts named changed.
    b.goto(&format!("{gw}/console/projects/{pid}")).await.expect("goto the project");
    let rows = b.find_all(Locator::Css("#keys tbody tr")).await.expect("the key rows");
    assert_eq!(rows.len(), 1, "no key made without a session or a CSRF token");
    let (_, k) = env.admin_get(&format!("/v1/api-keys/{kid}")).await;
    assert_eq!(k["grants"]["max_concurrent"], 6, "{k}");
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(q["mode"], "monitor", "{q}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(receiver.received().iter().filter(|r| r.id == message).count(), 2, "no third delivery");

    b.close().await.expect("close the browser");
}

/// A `tollgate dev` of this test's own; killed, and its data directory
/// removed, when dropped.
struct Dev {
    child: Child,
    dir: std::path::PathBuf,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What `tollgate dev`'s banner says.
#[derive(Default)]
struct Banner {
    console: String,
    admin: String,
    gateway: String,
    secret: String,
}

impl Dev {
    /// Starts `tollgate dev` on a free port, as the README does (no token
    /// given: it makes its own, with the demo project), and reads its
    /// banner. A child that exits before its banner (its port taken between
    /// `free_port` and its bind) is started again on another, up to three times.
    fn start(dir: &std::path::Path) -> (Dev, Banner) {
        for _ in 0..3 {
            let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
                .arg("dev")
                .env("TOLLGATE_LISTEN", format!("127.0.0.1:{}", free_port()))
                .env("TOLLGATE_DATA_DIR", dir)
                .env_remove("TOLLGATE_ADMIN_TOKEN")
                .env_remove("TOLLGATE_GATEWAY_TOKEN")
                .env_remove("TOLLGATE_NO_DEMO")
                .env("TOLLGATE_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn tollgate dev");
            match dev_banner(&mut child) {
                Some(banner) => return (Dev { child, dir: dir.to_owned() }, banner),
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
        panic!("tollgate dev exited three times before its banner (its ports taken?)");
    }
}

/// Reads `tollgate dev`'s banner from its stdout; `None` if it exited first.
fn dev_banner(child: &mut Child) -> Option<Banner> {
    let out = child.stdout.take().expect("stdout piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Read to the end, past the banner too: the child's stdout stays
        // open as it would on a terminal.
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut b = Banner::default();
    while [&b.console, &b.admin, &b.gateway, &b.secret].iter().any(|v| v.is_empty()) {
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => line,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("no banner within a minute"),
        };
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["console", url, ..] => b.console = (*url).to_owned(),
            ["admin", "token", token] => b.admin = (*token).to_owned(),
            ["gateway", "token", token] => b.gateway = (*token).to_owned(),
            ["demo", "key", _, "(secret", secret, ..] => b.secret = secret.trim_end_matches(';').to_owned(),
            _ => {}
        }
    }
    Some(b)
}

/// `tollgate dev` as a newcomer runs it: the banner's console link, signed
/// in with the banner's admin token, shows the demo project; its key's bar
/// moves with a check made with the banner's demo secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_browser_from_the_tollgate_dev_banner() {
    let Some(driver) = Driver::start().await else { return };
    let dir = std::env::temp_dir().join(format!("tg-e2e-console-dev-{}", testkit::unique_id()));
    let (_dev, Banner { console, admin, gateway, secret }) = Dev::start(&dir);
    assert!(console.ends_with("/console"), "{console}");
    let base = console.trim_end_matches("/console").to_owned();
    let http = reqwest::Client::new();
    for _ in 0..100 {
        if http.get(format!("{base}/healthz")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let b = driver.browser().await;
    b.goto(&console).await.expect("goto the console");
    assert_eq!(path(&b).await, "/console/sign-in");
    type_into(&b, "#token", &admin).await;
    click_to(&b, "#sign-in button[type=submit]").await;
    click_to(&b, "a[href^=\"/console/projects/\"]").await;
    let usage = find(&b, "#keys .usage").await;
    let quota = attr(&usage, "data-quota-id").await;
    let before: u64 = attr(&usage, "data-count").await.parse().expect("a count");

    // The banner's demo key, checked with the banner's gateway token.
    let r = http
        .post(format!("{base}/v1/check"))
        .bearer_auth(&gateway)
        .json(&json!({"api_key": secret}))
        .send()
        .await
        .expect("check");
    assert_eq!(r.status().as_u16(), 200, "{:?}", r.text().await);
    b.refresh().await.expect("reload");
    let after = find(&b, &format!("#keys .usage[data-quota-id=\"{quota}\"]")).await;
    assert_eq!(attr(&after, "data-count").await, (before + 1).to_string());
    b.close().await.expect("close the browser");
}
