#!/usr/bin/env bash
# Make sure the machine's PostgreSQL answers on 127.0.0.1:5432 (database `test`, trust
# auth). This machine kind starts it before a session; if it has stopped, start it the
# way the machine does. Fails loudly (never skips) when it cannot be reached.
set -euo pipefail
ready() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -q -h 127.0.0.1 -p 5432
  else
    (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null
  fi
}
if ready; then exit 0; fi
if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do ready && exit 0; sleep 1; done
fi
echo "PostgreSQL is not reachable on 127.0.0.1:5432; the postgres tests need it." >&2
exit 1
