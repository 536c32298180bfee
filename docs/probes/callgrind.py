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


def settings(rounds, n):
    """`(CGDIR, ROUNDS, N)` from the environment: the dump directory (`/tmp/sq`), rounds
    per variant and operations per counted run (defaults `rounds` and `n`)."""
    return (os.environ.get("CGDIR", "/tmp/sq"), int(os.environ.get("ROUNDS", str(rounds))),
            int(os.environ.get("N", str(n))))


def connect(default_port):
    """A client of the server on localhost at port `PORT` (environment; `default_port`
    without it), and the server's pid for `zero` and `dump`."""
    from pymongo import MongoClient
    port = os.environ.get("PORT", str(default_port))
    client = MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true")
    return client, client.admin.command("serverStatus")["pid"]


def variants(client, pid, out, names, run, rounds, n, prefix):
    """kIr per operation of each variant in `names`, over `rounds` rounds in a shuffled order
    per round: `run(name)` sends `n` operations of the variant once to warm up, then once
    counted. Returns `{name: [kIr per op, one per round]}`, and prints it."""
    import random
    results = {name: [] for name in names}
    for r in range(rounds):
        for name in random.sample(list(names), len(names)):
            run(name)
            zero(client, pid)
            run(name)
            results[name].append(dump(out, pid, f"{prefix}{r}-{name}") / n / 1000)
    width = max(len(name) for name in names)
    for name, values in results.items():
        print(f"{name:{width}} kIr/op: " + " / ".join(f"{v:,.0f}" for v in values))
    return results
