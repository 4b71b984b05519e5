# shellcheck shell=bash
# Shared service helpers of scripts/test, scripts/bench and scripts/run.
# Source it (do not execute it); the caller sets `set -euo pipefail`.
#
# Services on 127.0.0.1:
#   PostgreSQL :5432 (user postgres, trust auth, database `test`)
#   Redis      :6379
#   tansu 0.6.0 (Kafka protocol, sqlite storage) :9092
# Services that already answer are used as they are; missing ones are started
# (and installed through apt-get, or cargo install for tansu, when absent).
# A tansu broker started here is stopped by `services_cleanup` (install it as
# the EXIT trap with `services_traps`); PostgreSQL and Redis are left running.
#
# What a caller uses:
#   ensure_postgres, ensure_redis, start_tansu [dir], ensure_services [dir]
#   start_redis_cluster     # three masters on 127.0.0.1:7001-7003 (scripts/test)
#   services_traps          # EXIT -> services_cleanup, INT -> 130, TERM -> 143
#   SERVICES_RC             # set it to the caller's result; cleanup exits with it
#   services_before_cleanup # optional function the caller defines; run first
#   SERVICES_OK_RCS         # exit codes that still count as success for
#                           # cleanup (default "0"; scripts/run adds 130 143)
#   log, die                # prefixed with [$SERVICES_TAG] (default scripts/<caller>)

PG_PORT=5432
REDIS_PORT=6379
KAFKA_PORT=9092
TANSU_VERSION=0.6.0
WAIT_SECS="${TOLLGATE_TEST_WAIT_SECS:-60}"
SERVICES_TAG="${SERVICES_TAG:-scripts/$(basename "$0")}"
SERVICES_RC=0
SERVICES_OK_RCS="${SERVICES_OK_RCS:-0}"

case ":$PATH:" in *":$HOME/.cargo/bin:"*) ;; *) export PATH="$PATH:$HOME/.cargo/bin" ;; esac

log() { printf '[%s] %s\n' "$SERVICES_TAG" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$SERVICES_TAG" "$*" >&2; exit 1; }

# Run as root, or through sudo when available.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root to run: $*"
    fi
}

port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

pg_answers() {
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -h 127.0.0.1 -p "$PG_PORT"
    else
        port_open "$PG_PORT"
    fi
}

redis_answers() {
    if command -v redis-cli >/dev/null 2>&1; then
        [ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
    else
        port_open "$REDIS_PORT"
    fi
}

# wait_for <description> <seconds> <command...>
wait_for() {
    local what="$1" secs="$2"
    shift 2
    local deadline=$((SECONDS + secs))
    until "$@"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            die "$what did not answer within ${secs}s"
        fi
        sleep 0.5
    done
}

APT_UPDATED=0
apt_install() {
    command -v apt-get >/dev/null 2>&1 || die "apt-get not available; install $* by hand"
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "apt-get update"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
        APT_UPDATED=1
    fi
    log "apt-get install $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

pg_cluster_version() {
    [ -d /etc/postgresql ] || return 1
    local v
    v="$(ls /etc/postgresql | sort -V | tail -n 1)"
    [ -n "$v" ] || return 1
    printf '%s' "$v"
}

# Make local and loopback connections trusted (fresh apt clusters use peer/scram).
pg_trust_loopback() {
    local ver="$1" hba
    hba="/etc/postgresql/$ver/main/pg_hba.conf"
    [ -f "$hba" ] || return 0
    if ! as_root grep -q '^host[[:space:]]\+all[[:space:]]\+all[[:space:]]\+127.0.0.1/32[[:space:]]\+trust' "$hba"; then
        log "configuring trust auth for loopback in $hba"
        as_root sed -i -E 's/^(local|host)([[:space:]].*[[:space:]])(peer|md5|scram-sha-256)[[:space:]]*$/\1\2trust/' "$hba"
    fi
}

ensure_postgres() {
    if pg_answers; then
        log "PostgreSQL answers on 127.0.0.1:$PG_PORT"
    else
        local ver fresh=0
        if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ver="$(pg_cluster_version)"; then
            log "PostgreSQL is not installed; installing"
            apt_install postgresql
            fresh=1
            ver="$(pg_cluster_version)" || die "no cluster under /etc/postgresql after install"
        fi
        if [ "$fresh" -eq 1 ]; then pg_trust_loopback "$ver"; fi
        if ! pg_answers; then
            log "starting PostgreSQL $ver/main"
            as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start \
                || as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main restart
        elif [ "$fresh" -eq 1 ]; then
            # apt may have started it before pg_hba.conf was changed
            as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main reload || true
        fi
        wait_for "PostgreSQL (pg_isready -h 127.0.0.1)" "$WAIT_SECS" pg_answers
        log "PostgreSQL is up"
    fi

    if command -v psql >/dev/null 2>&1; then
        local out
        if ! out="$(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -XtAc \
            "select 1 from pg_database where datname = 'test'" 2>&1)"; then
            die "cannot connect as postgres to 127.0.0.1:$PG_PORT (trust auth expected): $out"
        fi
        if [ "$out" != "1" ]; then
            log "creating database test"
            psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Xqc 'create database test'
        fi
    else
        log "psql not found; assuming database 'test' exists"
    fi
}

ensure_redis() {
    if redis_answers; then
        log "Redis answers on 127.0.0.1:$REDIS_PORT"
        return
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        log "Redis is not installed; installing"
        apt_install redis-server
    fi
    if ! redis_answers; then
        log "starting redis-server"
        as_root mkdir -p /var/lib/redis /var/log/redis
        as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" \
            --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
    fi
    wait_for "Redis (redis-cli -h 127.0.0.1 ping)" "$WAIT_SECS" redis_answers
    log "Redis is up"
}

TANSU=""
ensure_tansu_installed() {
    if command -v tansu >/dev/null 2>&1; then
        TANSU="$(command -v tansu)"
    elif [ -x "$HOME/.cargo/bin/tansu" ]; then
        TANSU="$HOME/.cargo/bin/tansu"
    else
        log "installing tansu $TANSU_VERSION (cargo install, features libsql)"
        cargo install --locked tansu --version "$TANSU_VERSION" --features libsql
        TANSU="$HOME/.cargo/bin/tansu"
    fi
    local v
    v="$("$TANSU" --version 2>/dev/null || true)"
    case "$v" in
        *"$TANSU_VERSION"*) ;;
        *) log "warning: expected tansu $TANSU_VERSION, found '$v' at $TANSU" ;;
    esac
}

TANSU_PID=""
TANSU_DIR=""
# 1 when TANSU_DIR was given by the caller (kept on exit, never removed).
TANSU_KEEP_DIR=0

tansu_log_tail() {
    if [ -n "$TANSU_DIR" ] && [ -f "$TANSU_DIR/tansu.log" ]; then
        log "last lines of $TANSU_DIR/tansu.log:"
        tail -n 50 "$TANSU_DIR/tansu.log" >&2 || true
    fi
}

# stop_pid <name> <pid>: TERM, up to 10 s, then KILL; reaps it.
stop_pid() {
    local name="$1" pid="$2" i
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name (pid $pid) did not stop on TERM; killing"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
    log "stopped $name (pid $pid)"
}

rc_is_ok() {
    local ok
    for ok in $SERVICES_OK_RCS; do
        [ "$1" -eq "$ok" ] && return 0
    done
    return 1
}

services_cleanup() {
    local rc=$?
    [ "$SERVICES_RC" -ne 0 ] && rc=$SERVICES_RC
    if declare -F services_before_cleanup >/dev/null; then
        services_before_cleanup || true
    fi
    if [ -n "$TANSU_PID" ]; then
        stop_pid tansu "$TANSU_PID"
    fi
    local p
    for p in $CLUSTER_PIDS; do
        stop_pid redis-cluster-node "$p"
    done
    if [ -n "$CLUSTER_DIR" ]; then
        rm -rf "$CLUSTER_DIR"
    fi
    if [ -n "$TANSU_DIR" ]; then
        if ! rc_is_ok "$rc"; then
            tansu_log_tail
            log "kept tansu working directory: $TANSU_DIR"
        elif [ "$TANSU_KEEP_DIR" -eq 0 ]; then
            rm -rf "$TANSU_DIR"
        fi
    fi
    exit "$rc"
}

services_traps() {
    trap services_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# start_tansu [dir]: starts tansu unless something listens on the Kafka port.
# Without dir it runs in a fresh temporary directory removed on success; with
# dir its data (tansu.db) is kept there across runs.
start_tansu() {
    if port_open "$KAFKA_PORT"; then
        log "something already listens on 127.0.0.1:$KAFKA_PORT; using it as the broker"
        return
    fi
    ensure_tansu_installed
    if [ "$#" -gt 0 ] && [ -n "$1" ]; then
        TANSU_DIR="$1"
        TANSU_KEEP_DIR=1
        mkdir -p "$TANSU_DIR"
    else
        TANSU_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tollgate-tansu.XXXXXX")"
    fi
    log "starting tansu on 127.0.0.1:$KAFKA_PORT (dir $TANSU_DIR)"
    (
        cd "$TANSU_DIR"
        exec env -u SCHEMA_REGISTRY -u CLUSTER_ID "$TANSU" broker \
            --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
            --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
            --storage-engine "sqlite://tansu.db" \
            >>"$TANSU_DIR/tansu.log" 2>&1 </dev/null
    ) &
    TANSU_PID=$!
    local deadline=$((SECONDS + 30))
    until port_open "$KAFKA_PORT"; do
        if ! kill -0 "$TANSU_PID" 2>/dev/null; then
            TANSU_PID=""
            die "tansu exited during start-up (log follows)"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            die "tansu did not open 127.0.0.1:$KAFKA_PORT within 30s"
        fi
        sleep 0.25
    done
    sleep 0.5
    kill -0 "$TANSU_PID" 2>/dev/null || { TANSU_PID=""; die "tansu exited right after start-up"; }
    log "tansu is up (pid $TANSU_PID)"
}

CLUSTER_PORTS="${TOLLGATE_TEST_CLUSTER_PORTS:-7001 7002 7003}"
CLUSTER_PIDS=""
CLUSTER_DIR=""

node_pong() { [ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" = PONG ]; }

cluster_ok() {
    local first
    first="${CLUSTER_PORTS%% *}"
    redis-cli -h 127.0.0.1 -p "$first" cluster info 2>/dev/null | grep -q '^cluster_state:ok'
}

# start_redis_cluster: a Redis Cluster of three masters (no replicas, no
# persistence) on 127.0.0.1:7001-7003, unless one answers there already;
# stopped by services_cleanup. Exports TOLLGATE_TEST_REDIS_CLUSTER.
start_redis_cluster() {
    local port nodes=() url=""
    for port in $CLUSTER_PORTS; do
        nodes+=("127.0.0.1:$port")
        url="${url:+$url,}127.0.0.1:$port"
    done
    export TOLLGATE_TEST_REDIS_CLUSTER="${TOLLGATE_TEST_REDIS_CLUSTER:-redis+cluster://$url}"
    if cluster_ok; then
        log "a Redis Cluster answers on ${nodes[*]}; using it"
        return
    fi
    for port in $CLUSTER_PORTS; do
        if port_open "$port"; then
            die "127.0.0.1:$port is taken by something that is no Redis Cluster (set TOLLGATE_TEST_CLUSTER_PORTS)"
        fi
    done
    CLUSTER_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tollgate-redis-cluster.XXXXXX")"
    log "starting a Redis Cluster of three masters on ${nodes[*]} (dir $CLUSTER_DIR)"
    for port in $CLUSTER_PORTS; do
        redis-server --bind 127.0.0.1 --port "$port" --cluster-enabled yes \
            --cluster-config-file "nodes-$port.conf" --cluster-node-timeout 5000 \
            --save "" --appendonly no --dir "$CLUSTER_DIR" \
            --logfile "$CLUSTER_DIR/redis-$port.log" </dev/null &
        CLUSTER_PIDS="$CLUSTER_PIDS $!"
    done
    for port in $CLUSTER_PORTS; do
        wait_for "cluster node 127.0.0.1:$port" "$WAIT_SECS" node_pong "$port"
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$CLUSTER_DIR/create.log" 2>&1 \
        || { cat "$CLUSTER_DIR/create.log" >&2; die "redis-cli --cluster create failed"; }
    wait_for "the Redis Cluster (cluster_state:ok)" "$WAIT_SECS" cluster_ok
    log "Redis Cluster is up"
}

# ensure_services [tansu dir]: PostgreSQL, Redis and the broker.
ensure_services() {
    command -v cargo >/dev/null 2>&1 || die "cargo not found (install the Rust toolchain)"
    ensure_postgres
    ensure_redis
    start_tansu "$@"
}

# Debian's chromium and its WebDriver (/usr/bin/chromium, /usr/bin/chromedriver),
# for the console's browser test.
ensure_browser() {
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
        return 0
    fi
    apt_install chromium chromium-driver
}

# The TOLLGATE_TEST_* variables the tests and the benchmark read.
export_test_env() {
    export TOLLGATE_TEST_KAFKA="${TOLLGATE_TEST_KAFKA:-127.0.0.1:$KAFKA_PORT}"
    export TOLLGATE_TEST_DATABASE_URL="${TOLLGATE_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:$PG_PORT/test}"
    export TOLLGATE_TEST_REDIS_URL="${TOLLGATE_TEST_REDIS_URL:-redis://127.0.0.1:$REDIS_PORT}"
}
