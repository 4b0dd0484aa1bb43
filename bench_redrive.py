"""Benchmark redrive.py against a local server; prints one table per scenario.

usage: python bench_redrive.py [SCENARIO ...] [--ids N]

Scenarios (all by default):
  clean          10,000 ids, 20 ms latency, concurrency 32; a bare 32-thread
                 requests loop runs beside redrive for comparison
  flaky          the same with about 8% faults: 429 once, 503 twice, 500 for
                 ever, 404, an empty body, a slow answer, a dropped connection
  rate-limited   3,000 ids; the server allows 100 requests a second and answers
                 429 with a Retry-After beyond that; concurrency 32, no --rate
  resume         1,000,000 ids of which 999,990 are done already
  fsync          5,000 ids, no latency: the cost of --fsync against the default

The server runs in its own process on 127.0.0.1, redrive runs as a real
subprocess, and os.wait4 gives its CPU time and peak memory. A benchmark, not
a test: it prints figures and checks nothing that a slow machine could fail.
"""

import argparse
import email.utils
import json
import math
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
LATENCY = 0.020
CONCURRENCY = 32
FLAKY_OPTIONS = ["--backoff", "0.1", "--max-backoff", "1", "--cooldown", "2"]

#: fault kind by id number modulo 100: about 8% of ids misbehave
FAULTS = {7: "429-once", 19: "503-twice", 31: "500-forever", 43: "404", 55: "empty-once",
          67: "slow", 79: "drop-once", 91: "404"}
SLOW = 0.3
#: requests each kind needs under redrive's default policy (5 tries, 2 passes)
NEEDED = {"ok": 1, "429-once": 2, "503-twice": 3, "500-forever": 10, "404": 1, "empty-once": 2,
          "slow": 1, "drop-once": 2}


def kind_of(item: str, flaky: bool) -> str:
    return FAULTS.get(int(item[1:]) % 100, "ok") if flaky else "ok"


# ------------------------------------------------------------------ server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    wbufsize = -1  # headers and body leave in one write, flushed after each answer, as most servers do

    def do_GET(self):
        srv = self.server
        if self.path == "/_stats":
            return self.send(200, json.dumps(srv.stats()).encode())
        item = self.path.rsplit("/", 1)[-1]
        kind = kind_of(item, srv.flaky)
        with srv.lock:
            srv.hits[item] += 1
            hit = srv.hits[item]
            if item in srv.settled:
                srv.wasted += 1
            throttled = srv.over_limit()
        time.sleep(SLOW if kind == "slow" else srv.latency)
        if throttled:
            return self.send(429, b"slow down", {"Retry-After": throttled})
        status, body = self.answer(kind, hit, item)
        if status is None:
            self.close_connection = True
            return
        if (status == 200 and body) or status == 404:
            with srv.lock:
                srv.settled.add(item)
        self.send(status, body)

    def answer(self, kind, hit, item):
        if kind == "429-once" and hit == 1:
            return 429, b"busy"
        if kind == "503-twice" and hit <= 2:
            return 503, b"busy"
        if kind == "500-forever":
            return 500, b"oops"
        if kind == "404":
            return 404, b"gone"
        if kind == "empty-once" and hit == 1:
            return 200, b""
        if kind == "drop-once" and hit == 1:
            return None, b""
        return 200, json.dumps({"id": item, "title": "x" * 200}).encode()

    def send(self, status, body, headers=None):
        with self.server.lock:
            self.server.statuses[status] += 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class BenchServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, latency, flaky, limit):
        super().__init__(("127.0.0.1", 0), Handler)
        self.latency, self.flaky, self.limit = latency, flaky, limit
        self.lock = threading.Lock()
        self.hits, self.statuses, self.settled, self.wasted = Counter(), Counter(), set(), 0
        self.window, self.in_window = 0, 0

    def over_limit(self):
        """A fixed one-second window: `limit` requests, then 429 until the next
        second, whose start the Retry-After names as an HTTP date."""
        if not self.limit:
            return None
        now = time.time()
        if int(now) != self.window:
            self.window, self.in_window = int(now), 0
        self.in_window += 1
        if self.in_window <= self.limit:
            return None
        return email.utils.formatdate(self.window + 1, usegmt=True)

    def handle_error(self, request, client_address):
        pass

    def stats(self):
        with self.lock:
            return {"hits": dict(self.hits), "statuses": dict(self.statuses), "wasted": self.wasted}


def serve(port_queue, latency, flaky, limit):
    server = BenchServer(latency, flaky, limit)
    port_queue.put(server.server_address[1])
    server.serve_forever(0.05)


def start_server(latency=LATENCY, flaky=False, limit=0):
    ports = multiprocessing.Queue()
    proc = multiprocessing.Process(target=serve, args=(ports, latency, flaky, limit), daemon=True)
    proc.start()
    return proc, f"http://127.0.0.1:{ports.get(timeout=10)}"


def server_stats(base):
    import urllib.request
    with urllib.request.urlopen(base + "/_stats") as resp:
        return json.loads(resp.read())


# ------------------------------------------------------------- measuring


def measured(cmd, env=None):
    """Run cmd; (wall seconds, CPU seconds, peak RSS in MB, exit code, stderr)."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), err


def bare_loop(base, count, concurrency):
    """The baseline: threads with a requests.Session(trust_env=False) each."""
    import requests
    work = queue.SimpleQueue()
    for n in range(count):
        work.put(f"{base}/items/i{n}")

    def worker():
        session = requests.Session()
        session.trust_env = False
        while True:
            try:
                url = work.get_nowait()
            except queue.Empty:
                return
            session.get(url, timeout=30).content

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def write_ids(folder, count):
    path = folder / "ids.txt"
    path.write_text("".join(f"i{n}\n" for n in range(count)))
    return path


def redrive_cmd(ids, base, *options):
    return [sys.executable, str(HERE / "redrive.py"), str(ids), "--url", base + "/items/{id}", "-q", *options]


def table(title, rows):
    print(f"\n{title}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


# -------------------------------------------------------------- scenarios


def clean(folder, count):
    proc, base = start_server()
    try:
        ids = write_ids(folder, count)
        ideal = count * LATENCY / CONCURRENCY
        b_wall, b_cpu, b_rss, _, _ = measured([sys.executable, __file__, "--bare", base, str(count), str(CONCURRENCY)])
        r_wall, r_cpu, r_rss, code, err = measured(redrive_cmd(ids, base, "--concurrency", str(CONCURRENCY)))
        sent = sum(server_stats(base)["hits"].values()) - count
    finally:
        proc.terminate()
    table(f"clean: {count} ids, {LATENCY * 1000:.0f} ms latency, concurrency {CONCURRENCY} (exit {code})", [
        ("ideal (N x latency / concurrency)", f"{ideal:.2f} s"),
        ("bare requests loop: wall", f"{b_wall:.2f} s, efficiency {ideal / b_wall:.2f}, "
                                     f"CPU {b_cpu / count * 1e6:.0f} us/request, peak {b_rss:.0f} MB"),
        ("redrive: wall", f"{r_wall:.2f} s, efficiency {ideal / r_wall:.2f} "
                          f"({b_wall / r_wall:.2f} of the bare loop's)"),
        ("redrive: requests sent / needed", f"{sent} / {count}"),
        ("redrive: CPU per request", f"{r_cpu / sent * 1e6:.0f} us ({r_cpu / sent / (b_cpu / count):.2f} x bare)"),
        ("redrive: peak memory", f"{r_rss:.0f} MB"),
    ])
    if code:
        print(err.decode()[-2000:])


def flaky(folder, count):
    proc, base = start_server(flaky=True)
    try:
        ids = write_ids(folder, count)
        kinds = Counter(kind_of(f"i{n}", True) for n in range(count))
        needed = sum(NEEDED[k] * n for k, n in kinds.items())
        work = sum((SLOW if k == "slow" else LATENCY) * NEEDED[k] * n for k, n in kinds.items()) / CONCURRENCY
        # the last 500-for-ever id cannot start before the work is nearly done; then it
        # waits out 2 passes of 4 backoffs (at their shortest, d/2) and one cool-down
        chain = 2 * sum(0.1 * 2 ** i / 2 for i in range(4)) + 2 + 10 * LATENCY
        ideal = work + chain
        wall, cpu, rss, code, err = measured(redrive_cmd(ids, base, "--concurrency", str(CONCURRENCY),
                                                         *FLAKY_OPTIONS))
        stats = server_stats(base)
    finally:
        proc.terminate()
    sent = sum(stats["hits"].values())
    over = {k: sum(stats["hits"].get(f"i{n}", 0) for n in range(count) if kind_of(f"i{n}", True) == k) - NEEDED[k] * m
            for k, m in kinds.items()}
    table(f"flaky: {count} ids, {sum(n for k, n in kinds.items() if k != 'ok') / count:.0%} faulty "
          f"({', '.join(f'{n} {k}' for k, n in kinds.items() if k != 'ok')}) (exit {code})", [
        ("options", " ".join(FLAKY_OPTIONS)),
        ("ideal (work / concurrency + the last backoff chain)", f"{work:.2f} + {chain:.2f} = {ideal:.2f} s"),
        ("wall", f"{wall:.2f} s, efficiency {ideal / wall:.2f}"),
        ("requests sent / minimum needed", f"{sent} / {needed}"),
        ("wasted (a done or 404 id fetched again)", f"{stats['wasted']}"),
        ("requests over the minimum, by kind", ", ".join(f"{k} {v:+d}" for k, v in over.items())),
        ("CPU per request", f"{cpu / sent * 1e6:.0f} us"),
        ("peak memory", f"{rss:.0f} MB"),
    ])
    if code:
        print(err.decode()[-2000:])


def rate_limited(folder, count, limit=100):
    proc, base = start_server(limit=limit)
    try:
        ids = write_ids(folder, count)
        wall, cpu, rss, code, err = measured(redrive_cmd(ids, base, "--concurrency", str(CONCURRENCY)))
        stats = server_stats(base)
    finally:
        proc.terminate()
    sent = sum(stats["hits"].values())
    throttled = stats["statuses"].get("429", 0)
    ideal = count / limit
    table(f"rate-limited: {count} ids, server allows {limit}/s, concurrency {CONCURRENCY}, no --rate (exit {code})", [
        ("ideal (N / limit)", f"{ideal:.2f} s"),
        ("wall", f"{wall:.2f} s = {wall / ideal:.3f} x ideal (target <= 1.15)"),
        ("requests sent / needed", f"{sent} / {count}"),
        ("429s", f"{throttled} = {throttled / sent:.1%} of requests (target <= 5%)"),
        ("CPU per request", f"{cpu / sent * 1e6:.0f} us"),
    ])


def resume(folder, count=1_000_000, left=10):
    proc, base = start_server(latency=0.0)
    try:
        ids = write_ids(folder, count)
        state = folder / "ids.redrive"
        state.mkdir()
        with open(state / "done.txt", "w") as done, open(state / "results.jsonl", "w") as results:
            for n in range(count - left):
                done.write(f"i{n}\n")
                results.write(f'{{"id":"i{n}","url":"u","status":200,"fetched_at":"t","body":{{}}}}\n')
        wall, cpu, rss, code, err = measured(redrive_cmd(ids, base))
        sent = sum(server_stats(base)["hits"].values())
    finally:
        proc.terminate()
    table(f"resume: {count} ids, {count - left} already done (exit {code})", [
        ("wall", f"{wall:.2f} s (target < 3 s)"),
        ("peak memory", f"{rss:.0f} MB (target < 250 MB)"),
        ("requests sent", f"{sent}"),
    ])


def fsync(folder, count=5000):
    proc, base = start_server(latency=0.0)
    rows = []
    try:
        ids = write_ids(folder, count)
        for options in ([], ["--fsync"]):
            shutil.rmtree(folder / "ids.redrive", ignore_errors=True)
            wall, cpu, _, code, _ = measured(redrive_cmd(ids, base, "--concurrency", "8", *options))
            rows.append((" ".join(["redrive"] + options) + " (exit %d)" % code,
                         f"{wall:.2f} s wall, {count / wall:.0f} ids/s, {wall / count * 1e3:.2f} ms/id"))
    finally:
        proc.terminate()
    table(f"fsync: {count} ids, no latency, concurrency 8, state on {fs_type(folder)}", rows)


def fs_type(folder):
    try:
        out = subprocess.run(["df", "-T", str(folder)], capture_output=True, text=True).stdout.splitlines()[-1]
        return out.split()[1]
    except (OSError, IndexError):
        return "?"


SCENARIOS = {"clean": clean, "flaky": flaky, "rate-limited": rate_limited, "resume": resume, "fsync": fsync}
COUNTS = {"clean": 10_000, "flaky": 10_000, "rate-limited": 3_000}


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--bare"]:
        base, count, concurrency = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        return bare_loop(base, count, concurrency)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", choices=[[]] + list(SCENARIOS), default=[])
    parser.add_argument("--ids", type=int, help="ids per scenario instead of the defaults")
    args = parser.parse_args(argv)
    print(f"redrive benchmark: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    for name in args.scenarios or SCENARIOS:
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as folder:
            count = args.ids or COUNTS.get(name)
            SCENARIOS[name](Path(folder), *([count] if count else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
