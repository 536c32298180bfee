#!/usr/bin/env python3
# Usage: python3 docs/probes/issue-14-s38-open-jobs-page-probe.py UI_URL SERVER_PID [SECONDS]
# Not part of the suite: session 38's probe of what one open jobs page costs the server
# (docs/ui.md, "Listings paced"). Fill a collection first with
# docs/probes/issue-14-s37-ui-scale-probe.py, then start `docwarden ui --uri … --db uiscale
# --read-only`. An open page fetches itself again after every burst of writes, at most
# every 0.7 s (ui/live.rs); this probe does the same for SECONDS (default 30) in two modes:
#   same:     the same filter each time (what an open page sends; paced since session 38)
#   distinct: a new filter each time (`limit` varies), so no listing is reused: what
#             every fetch cost before session 38
# and prints, per mode, the fetches, their median and worst latency, and the server's
# CPU seconds over the run (utime + stime of SERVER_PID from /proc) as a share of one core.
import os, statistics, sys, time, urllib.request

url, pid = sys.argv[1].rstrip("/"), int(sys.argv[2])
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
tick = os.sysconf("SC_CLK_TCK")


def cpu():
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick


def run(mode):
    took, n, c0, t0 = [], 0, cpu(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        n += 1
        path = "/jobs" if mode == "same" else f"/jobs?limit={100 + n}"
        s = time.monotonic()
        with urllib.request.urlopen(url + path, timeout=600) as r:
            r.read()
        took.append(time.monotonic() - s)
        # The next fetch follows the next burst: at most every 0.7 s.
        time.sleep(max(0.0, 0.7 - took[-1]))
    wall, used = time.monotonic() - t0, cpu() - c0
    print(f"{mode:8s} fetches {n:4d}  median {1000 * statistics.median(took):8.1f} ms  "
          f"worst {1000 * max(took):8.1f} ms  server CPU {used:6.1f} s over {wall:5.1f} s "
          f"= {100 * used / wall:5.1f} % of a core", flush=True)


for mode in ("same", "distinct", "same"):
    run(mode)
