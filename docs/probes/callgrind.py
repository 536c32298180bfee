"""Callgrind's counters of a server run under valgrind, shared by the probes here.

Zero the counters before the operations a variant measures, dump them after, and read the
instructions the server executed in between from the dump file (callgrind's Ir). A label
may hold letters, digits, `_`, `-` and `=` only: callgrind_control cuts it at `$` and
dumps nothing for one with parentheses.
"""
import glob, os, subprocess, time


def zero(client, pid):
    """Zero the counters of the server `pid`, then wait for a live connection of `client`:
    the signal may close one that was waiting in a read."""
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    for _ in range(5):
        try:
            client.admin.command("ping")
            return
        except Exception:
            time.sleep(0.5)


def dump(out, pid, label):
    """Dump the counters of the server `pid` as `label` into `out` (the directory of
    `--callgrind-out-file`) and return the instructions counted since the last zero."""
    started = time.time()
    subprocess.run(["callgrind_control", "-d", label, str(pid)], check=True, capture_output=True)
    while True:  # the dump file of this label, once written in full
        time.sleep(0.2)
        for f in glob.glob(f"{out}/cg.out.{pid}.*"):
            if os.path.getmtime(f) < started - 1:
                continue
            text = open(f, "rb").read().decode("utf-8", "replace")
            if f"Trigger: dump {label}\n" in text:
                total = next((int(l.split()[1]) for l in text.splitlines()
                              if l.startswith(("summary:", "totals:"))), None)
                if total is not None:
                    return total
