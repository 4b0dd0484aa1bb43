"""Benchmark redrive.py against a local server; prints one table per scenario.

usage: python bench_redrive.py [SCENARIO ...] [--ids N] [--latency MS]
                                [--concurrency N] [--limit R] [--faults MIX] [--minutes M]

Scenarios (all by default):
  clean          10,000 ids, 20 ms latency, concurrency 32; a bare 32-thread
                 requests loop runs beside redrive for comparison
  flaky          the same with 8% faults: 429 once, 503 twice, 500 for ever,
                 404 (2%), an empty body, a slow answer, a dropped connection
  rate-limited   3,000 ids; the server allows 100 requests a second and answers
                 429 with a Retry-After beyond that (an HTTP-date: the next
                 second's start, a window's end); concurrency 32, no --rate
  lone-429       10,000 ids on a server with no limit, 3% of them answering 429 +
                 Retry-After: 1 once (an item being rebuilt); concurrency 16,
                 against a clean run of the same ids
  resume         1,000,000 ids of which 999,990 are done already
  stop           1,000,000 ids, stopped by SIGTERM, by SIGHUP and by --max-time 5
                 soon after the first answers: how long from the stop to the exit
  nginx          nginx's own limit_req (a leaky bucket answering 429 with no
                 Retry-After) at 10, 50 and 100 r/s, with and without burst and
                 nodelay; every 50th id a real 404; skipped when nginx is absent.
                 For reference, the limiters with no burst again: 50 r/s with
                 --rate 45 and --rate 50, 100 r/s with --rate 95 given by hand,
                 and both against a bare client paced at 98% of the limit: what
                 knowing the limit gets
  fixed-window   a fixed window that starts at the first request: 100 per second
                 (3,000 ids), 600 per minute (900 ids) and 600 per 10 s (2,400
                 ids), each with a Retry-After to the window's end and with none;
                 for reference, 100 per second again with --rate 100 by hand,
                 and 600 per minute with --concurrency 16
  token-bucket   token buckets answering 429 + Retry-After: 1 when no token is
                 left: 100 r/s with a burst of 100 and of 10, 50 r/s burst 10,
                 10 r/s burst 5; N = 20 s x rate + burst
  limit-and-lone nginx's leaky-bucket arithmetic at 50 r/s, no burst, in front of
                 an application whose items being rebuilt (3%, then 8% of 1,000
                 ids) answer 429 + Retry-After: 1 once
  limit-change   4,500 ids against nginx's leaky-bucket arithmetic at 100 r/s
                 (burst 10, no Retry-After), halved from 10 s to 25 s: the 429s,
                 and the accepted requests second by second
  chaos          10,000 ids; every socket-level fault of the tests' FAULTS table
                 at 1% each (half of the retryable ones recover after one try),
                 every odd-but-usable answer of ODD_ANSWERS at 1%, and 1%
                 redirects whose body is a gzip bomb; concurrency 32
  fsync          5,000 ids, no latency: the cost of --fsync against the default
  declared       a server that declares its quota (60 per 2 s of the clock) in
                 each dialect's headers: GitHub's (refused with 429, and with
                 403), X's, the IETF drafts', Reddit's, OpenAI's, Anthropic's,
                 Discord's; 400 ids each, every 50th a real 404
  shards-on-one-key  two redrive processes (--shard 1/2, 2/2) at once on one
                 declared quota (GitHub's headers, 403 past it), 800 ids
  no-limit-throttles  10,000 ids on a server with no limit, 4% answering 429 +
                 Retry-After: 1 once and 1% 503 twice, against the same ids clean
  shards-parallel  docs/across-machines.md's GNU parallel line on this machine:
                 3,000 ids in three shards, then --cover; skipped without parallel
  nginx-slow     nginx's limit_req at the slow limits of public APIs: 1 r/s (90 ids),
                 2 and 5 r/s with no burst, 10 r/s burst 5 nodelay; no --rate
  nginx-twins    every row of the tests' limiter table that limit_req can make
                 (0.5 to 100 r/s, burst or none, queued or nodelay, 429 or 503),
                 against real nginx with the row's ids, beside the row's bounds
  server-twins   every token-bucket and fixed-window row of that table, against this
                 bench's server, beside the same row on the fake clock (--order) and its bounds
  model          the tests' limiter shapes at 2 to 500 r/s, two minutes of ideal each
                 (--minutes), and the penalty box, on the fake clock through redrive's own run loop;
                 --concurrency, --latency, --order and --spread apply
  next-run       the run after one that found the limit, in the same state dir (paces.json):
                 the model's shapes at 2 to 50 r/s on the fake clock, and nginx-slow's limits
  cold-start     3,000 ids on a server with no limit that refuses everything for its
                 first 2 or 5 s (503, or 429 + Retry-After: 5), then takes all,
                 against a clean run of the same ids
  refresh        a nightly sync of 10,000 ids with ETags: night 1 fetches all;
                 on night 2, 2% changed and 0.5% are gone: a plain rerun, then
                 --refresh; night 3's --refresh under GitHub's quota headers
                 (2,000 an hour, no 304 counted); planning a refresh of 200,000
                 done ids

--old REDRIVE_PY runs every scenario chosen with that redrive.py too, right
after this one's, so that the old code and the new are measured in one run.

--latency, --concurrency and --limit change those figures; --faults sets the
flaky mix as KIND=PERCENT pairs, e.g. --faults 500-forever=5,404=10 (kinds:
429-once 503-twice 500-forever 404 empty-once slow drop-once).

The chaos server is the tests' raw-socket RawServer (test_redrive.py, so pytest
must be installed), playing the same bytes as the tests, in its own process.

The server runs in its own process on 127.0.0.1, redrive runs as a real
subprocess (started by a small launcher process, so that its peak memory is
its own), and os.wait4 gives its CPU time and peak memory. A benchmark, not
a test: it prints figures and checks nothing that a slow machine could fail.
"""

import argparse
import base64
import copy
import email.utils
import functools
import json
import math
import multiprocessing
import os
import queue
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple, Optional

HERE = Path(__file__).resolve().parent
FLAKY_OPTIONS = ["--backoff", "0.1", "--max-backoff", "1", "--cooldown", "2"]
#: percent of ids of each fault kind in the flaky scenario: 8% in all
FAULTS = {"429-once": 1, "503-twice": 1, "500-forever": 1, "404": 2, "empty-once": 1, "slow": 1, "drop-once": 1}
SLOW = 0.3
#: requests each kind needs under redrive's default policy (5 tries, 2 passes)
NEEDED = {"ok": 1, "429-once": 2, "503-twice": 3, "500-forever": 10, "404": 1, "empty-once": 2,
          "slow": 1, "drop-once": 2}
#: the shortest wait after a kind's first request before its id settles, with FLAKY_OPTIONS
#: (backoffs at their shortest, half the nominal delay; the 500s also wait out the cool-down)
CHAIN = {"ok": 0.0, "404": 0.0, "slow": 0.0, "429-once": 0.05, "empty-once": 0.05, "drop-once": 0.05,
         "503-twice": 0.05 + 0.1, "500-forever": 2 * (0.05 + 0.1 + 0.2 + 0.4) + 2}


class Settings(NamedTuple):
    latency: float = 0.020  #: seconds the server takes per answer
    concurrency: int = 32
    limit: int = 100  #: requests a second the rate-limited server allows
    faults: tuple = ()  #: the flaky scenario's id -> kind table, 100 slots
    minutes: float = 2.0  #: model: each limiter row's ids take this long at its limit
    order: Optional[int] = None  #: model: the seed of the order the answers of a round trip come in (None: at once)
    spread: float = 0.0  #: model: sigma of the log of each answer's time over the latency (0: each takes the latency)


def at_least_two(text: str) -> float:
    """--minutes: two at least, so a window of a minute is passed more than once."""
    try:
        minutes = float(text)
    except ValueError:
        minutes = None
    if minutes is None or not minutes >= 2:
        raise argparse.ArgumentTypeError(f"{text!r}: write a number of minutes, 2 or more")
    return minutes


def fault_table(mix: dict) -> tuple:
    """100 slots (id number modulo 100) holding each kind's share, spread out."""
    slots = ["ok"] * 100
    kinds = [kind for kind, percent in mix.items() for _ in range(percent)]
    for j, kind in enumerate(kinds):
        slots[(7 + 37 * j) % 100] = kind  # 37 is prime to 100: every slot, in a scattered order
    return tuple(slots)


def kind_of(item: str, faults: tuple) -> str:
    return faults[int(item[1:]) % 100] if faults else "ok"


# ------------------------------------------------------------------ server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    wbufsize = -1  # headers and body leave in one write, flushed after each answer, as most servers do

    def do_GET(self):
        srv = self.server
        if self.path == "/_stats":
            return self.send(200, json.dumps(srv.stats()).encode())
        if self.path.startswith("/_night/"):
            srv.limit.night, srv.limit.quota = map(int, self.path.split("/")[2:4])
            return self.send(200, b"{}")
        item = self.path.rsplit("/", 1)[-1]
        if isinstance(srv.limit, Versions):
            return self.versioned(item)
        kind = kind_of(item, srv.faults)
        with srv.lock:
            srv.first_hit = srv.first_hit or time.time()
            srv.hits[item] += 1
            hit = srv.hits[item]
            if kind == "429-lone":
                srv.times.setdefault(item, []).append(time.monotonic())
            if item in srv.settled:
                srv.wasted += 1
            throttled = srv.over_limit()
            declared = srv.limit.headers() if isinstance(srv.limit, Declaring) else {}
        time.sleep(SLOW if kind == "slow" else srv.latency)
        if throttled is not None and declared:
            return self.send(srv.limit.status, srv.limit.body, declared)
        if throttled is not None:
            status = getattr(srv.limit, "status", 429)  # a Spell's 503, or a 429
            return self.send(status, b"slow down", {"Retry-After": throttled} if throttled else {})
        if kind == "429-lone" and hit == 1:  # this item only: being rebuilt, come back in a second
            return self.send(429, b"rebuilding", {"Retry-After": "1"})
        status, body = self.answer(kind, hit, item)
        if status is None:
            self.close_connection = True
            return
        if (status == 200 and body) or status == 404:
            with srv.lock:
                srv.settled.add(item)
                srv.accepted.append(time.monotonic())
        self.send(status, body, declared)

    def versioned(self, item):
        """An item as an API keeps it (see Versions): 304 to a matching If-None-Match."""
        srv, number, items = self.server, int(item[1:]), self.server.limit
        time.sleep(srv.latency)
        version = items.version(number)
        etag = f'"{number}-{version}"'
        fresh = version is not None and self.headers.get("If-None-Match") == etag
        with srv.lock:
            srv.hits[item] += 1
            declared = items.declared()
            if items.quota and not fresh:  # GitHub counts every request but a 304
                if items.used >= items.quota:
                    return self.send(403, b'{"message":"API rate limit exceeded"}', declared)
                items.used += 1
                declared["X-RateLimit-Remaining"] = str(items.quota - items.used)
        if version is None:
            return self.send(404, b"gone", declared)
        if fresh:
            return self.send(304, b"", {"ETag": etag, **declared})
        body = json.dumps({"id": item, "version": version, "text": "x" * items.size}).encode()
        with srv.lock:
            srv.body_bytes += len(body)
        self.send(200, body, {"ETag": etag, **declared})

    def answer(self, kind, hit, item):
        if kind == "429-once" and hit == 1:
            return 429, b"busy"
        if kind == "503-twice" and hit <= 2:
            return 503, b"busy"
        if kind == "503-four" and hit <= 4:  # one item under maintenance, as the demo's
            return 503, b"maintenance"
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


class Limiter:
    """A server-side rate limiter, started by the first request it sees."""

    start = None

    def refuse(self, now):
        """None (go on) or a 429's Retry-After ("" for none); the times of the 429s are kept."""
        if self.start is None:
            self.start, self.refused = now, []
        answer = self.check(now - self.start)
        if answer is not None:
            self.refused.append(now - self.start)
        return answer


class FixedWindow(Limiter):
    """`size` requests per window of `seconds`, then 429 until the window ends
    (with a Retry-After in seconds to its end, or none)."""

    def __init__(self, size, seconds, retry_after):
        self.size, self.seconds, self.retry_after = size, seconds, retry_after
        self.window, self.used = 0, 0

    def check(self, t):
        window = int(t // self.seconds)
        if window != self.window:
            self.window, self.used = window, 0
        self.used += 1
        if self.used <= self.size:
            return None
        return str(math.ceil((window + 1) * self.seconds - t)) if self.retry_after else ""


class Declaring(Limiter):
    """`size` requests per window of `seconds` of the wall clock (so a reset in
    whole epoch seconds is exact), the quota declared on every answer in the
    headers of `dialect`; past it `status` (429, or 403 with GitHub's body)."""

    def __init__(self, size, seconds, dialect, status=429):
        self.size, self.seconds, self.dialect, self.status = size, seconds, dialect, status
        self.body = b'{"message":"API rate limit exceeded"}' if status == 403 else b"slow down"
        self.window, self.used, self.first_wall = None, 0, None

    def check(self, t):
        self.first_wall = self.first_wall or time.time()
        window = int(time.time() // self.seconds)
        if window != self.window:
            self.window, self.used = window, 0
        self.used += 1
        return None if self.used <= self.size else ""

    def headers(self):
        """The quota as the last request left it, in the dialect's headers."""
        end = (self.window + 1) * self.seconds
        left, remaining = end - time.time(), max(0, self.size - self.used)
        return dialect_headers(self.dialect, self.size, self.seconds, remaining, left, end)


def dialect_headers(dialect, size, seconds, remaining, left, end):
    """A quota in the headers of one API family: `remaining` of `size`, renewed in `left` s, at epoch `end`."""
    whole = str(math.ceil(left))
    return {
        "github": {"X-RateLimit-Limit": str(size), "X-RateLimit-Remaining": str(remaining),
                   "X-RateLimit-Reset": str(math.ceil(end)), "X-RateLimit-Resource": "core"},
        "x": {"x-rate-limit-limit": str(size), "x-rate-limit-remaining": str(remaining),
              "x-rate-limit-reset": str(math.ceil(end))},
        "ietf": {"RateLimit-Limit": str(size), "RateLimit-Remaining": str(remaining), "RateLimit-Reset": whole},
        "structured": {"RateLimit-Policy": f'"default";q={size};w={seconds}',
                       "RateLimit": f'"default";r={remaining};t={whole}'},
        "reddit": {"X-Ratelimit-Used": str(size - remaining), "X-Ratelimit-Remaining": f"{remaining:.1f}",
                   "X-Ratelimit-Reset": whole},
        "openai": {"x-ratelimit-limit-requests": str(size), "x-ratelimit-remaining-requests": str(remaining),
                   "x-ratelimit-reset-requests": f"{max(0, int(left * 1000))}ms"},
        "anthropic": {"anthropic-ratelimit-requests-limit": str(size),
                      "anthropic-ratelimit-requests-remaining": str(remaining),
                      "anthropic-ratelimit-requests-reset":
                          time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(end)))},
        "discord": {"X-RateLimit-Limit": str(size), "X-RateLimit-Remaining": str(remaining),
                    "X-RateLimit-Reset": f"{end:.3f}", "X-RateLimit-Reset-After": f"{max(0.0, left):.3f}"},
    }[dialect]


class Spell(Limiter):
    """A host that refuses every request for its first `seconds` (a deploy, a cold start), with `status`
    and a Retry-After of `retry_after` (None: none), then takes everything."""

    def __init__(self, seconds, status=503, retry_after=None):
        self.seconds, self.status, self.retry_after = seconds, status, retry_after

    def check(self, t):
        return None if t >= self.seconds else "" if self.retry_after is None else str(self.retry_after)


class TokenBucket(Limiter):
    """A token bucket: `burst` tokens at first, `rate` more a second up to
    `burst`; a request with no token left gets 429 + Retry-After: 1 (in
    whole seconds, as most APIs send it: it says when to ask again, not
    where any window ends)."""

    def __init__(self, rate, burst):
        self.rate, self.burst, self.tokens, self.last = rate, burst, float(burst), 0.0

    def check(self, t):
        self.tokens, self.last = min(self.burst, self.tokens + (t - self.last) * self.rate), t
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        return "1"


class ChangingBucket(Limiter):
    """nginx's limit_req (a leaky bucket: `burst` requests of slack, 429 and
    no Retry-After past it) whose rate is `rate` but `rate` x `factor` from
    `low_from` to `low_until` seconds after the first request."""

    def __init__(self, rate, burst, factor, low_from, low_until):
        self.rate, self.burst, self.factor = rate, burst, factor
        self.low_from, self.low_until = low_from, low_until
        self.excess, self.last = 0.0, 0.0

    def rate_at(self, t):
        return self.rate * (self.factor if self.low_from <= t < self.low_until else 1.0)

    def time_to_allow(self, count):
        """Seconds from the first request until the limit has let `count` through, sent as it allows."""
        need = count - self.burst
        for start, end in ((0.0, self.low_from), (self.low_from, self.low_until), (self.low_until, math.inf)):
            rate = self.rate_at(start)
            if need <= rate * (end - start):
                return start + need / rate
            need -= rate * (end - start)
        return 0.0

    def check(self, t):
        """nginx's arithmetic (ngx_http_limit_req_lookup), in requests, not thousandths."""
        excess = max(0.0, self.excess - self.rate_at(t) * (t - self.last) + 1.0) if t else 0.0
        if excess > self.burst:
            return ""
        self.excess, self.last = excess, t
        return None


class Versions:
    """Items that change from night to night, each with its ETag: on night k
    (from 1), the items whose number is k modulo 50 get a new version (2% a
    night), and every 200th item is gone from night 2 on (0.5%)."""

    def __init__(self, size=2000):
        self.night, self.size = 1, size  #: size: bytes of text in each body
        self.quota, self.used, self.reset = 0, 0, 0  #: GitHub's quota, when declared: its size an hour, used

    def declared(self):
        """GitHub's headers for what is left of the hour (none when no quota is declared)."""
        if not self.quota:
            return {}
        if time.time() >= self.reset:
            self.used, self.reset = 0, int(time.time()) + 3600
        return {"X-RateLimit-Limit": str(self.quota), "X-RateLimit-Remaining": str(max(0, self.quota - self.used)),
                "X-RateLimit-Reset": str(self.reset), "X-RateLimit-Resource": "core"}

    def version(self, number):
        if self.night >= 2 and number % 200 == 199:
            return None
        return 1 + sum(1 for k in range(2, self.night + 1) if number % 50 == k % 50)


class BenchServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, latency, faults, limit):
        super().__init__(("127.0.0.1", 0), Handler)
        self.latency, self.faults, self.limit = latency, faults, limit
        self.lock = threading.Lock()
        self.hits, self.statuses, self.settled, self.wasted = Counter(), Counter(), set(), 0
        self.window, self.in_window = 0, 0
        self.times = {}  #: item -> monotonic times of its requests, for the 429-lone kind
        self.body_bytes = 0  #: bytes of the versioned items' bodies sent
        self.accepted = []  #: monotonic times of the answers that were not throttles
        self.first_hit = None  #: the wall time of the first request

    def over_limit(self):
        """None (go on) or the Retry-After of a 429 ("" for none): the
        scenario's limiter, or a fixed one-second window of `limit` requests
        whose Retry-After names the next second as an HTTP date."""
        if isinstance(self.limit, Limiter):
            return self.limit.refuse(time.monotonic())
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
            start = self.limit.start if isinstance(self.limit, Limiter) else 0.0
            refused = getattr(self.limit, "refused", [])
            return {"hits": dict(self.hits), "statuses": dict(self.statuses), "wasted": self.wasted,
                    "body_bytes": self.body_bytes,
                    "first_wall": getattr(self.limit, "first_wall", None), "first_hit": self.first_hit,
                    "times": self.times, "accepted": [t - start for t in self.accepted], "refused": refused}


def serve(port_queue, latency, faults, limit):
    server = BenchServer(latency, faults, limit)
    port_queue.put(server.server_address[1])
    server.serve_forever(0.05)


def start_server(latency, faults=(), limit=0):
    ports = multiprocessing.Queue()
    proc = multiprocessing.Process(target=serve, args=(ports, latency, faults, limit), daemon=True)
    proc.start()
    return proc, f"http://127.0.0.1:{ports.get(timeout=10)}"


def server_stats(base):
    import urllib.request
    with urllib.request.urlopen(base + "/_stats") as resp:
        return json.loads(resp.read())


# ------------------------------------------------------------- measuring


class Run(NamedTuple):
    wall: float  #: seconds
    cpu: float  #: user + system seconds
    rss: float  #: peak resident memory, MB
    code: int
    err: bytes


def measured(cmd, env=None) -> Run:
    """Run cmd as a subprocess of the launcher and measure it with os.wait4."""
    return launcher().run(cmd, env)


@functools.lru_cache(maxsize=None)
def launcher() -> "Launcher":
    return Launcher()


class Launcher:
    """Starts the measured commands from a small process of its own, begun
    before the bench grows. Linux gives a child the peak memory of the
    process it was forked from, so after the resume scenario (a million ids
    in the bench's memory) every redrive started by the bench itself
    reported 100 MB or more that was never its own."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__, "--launcher"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, cmd, env) -> Run:
        self.proc.stdin.write(json.dumps({"cmd": [str(part) for part in cmd], "env": env}) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        return Run(got["wall"], got["cpu"], got["rss"], got["code"], base64.b64decode(got["err"]))


def launcher_loop() -> int:
    """The launcher's side: a JSON job a line in, a JSON Run a line out."""
    for line in sys.stdin:
        job = json.loads(line)
        run = measured_here(job["cmd"], job["env"])
        print(json.dumps({**run._asdict(), "err": base64.b64encode(run.err).decode()}), flush=True)
    return 0


def measured_here(cmd, env=None) -> Run:
    """Run cmd as a subprocess of this process and measure it with os.wait4."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), err)


def sent_and_throttled(after, before=None):
    """Requests the server saw (since the `before` /_stats snapshot), and how many it answered 429."""
    before = before or {"hits": {}, "statuses": {}}
    sent = sum(after["hits"].values()) - sum(before["hits"].values())
    throttled = after["statuses"].get("429", 0) - before["statuses"].get("429", 0)
    return sent, throttled


def cpu_us(run, sent):
    """The client's CPU per request sent, in microseconds."""
    return run.cpu / max(sent, 1) * 1e6


def core_rows(run, ideal, ideal_how, target, sent, needed, throttled):
    """The rows every scenario prints, in the same order."""
    return [
        (f"ideal ({ideal_how})", f"{ideal:.2f} s"),
        ("wall", f"{run.wall:.2f} s, efficiency {ideal / run.wall:.2f} ({target})"),
        ("requests sent / minimum needed", f"{sent} / {needed}"),
        ("429s", f"{throttled} = {throttled / max(sent, 1):.1%} of requests"),
        ("client CPU per request", f"{cpu_us(run, sent):.0f} us ({run.cpu:.2f} s in all)"),
        ("peak memory", f"{run.rss:.0f} MB"),
    ]


def run_workers(worker, concurrency):
    """Start `concurrency` threads running `worker` and wait for them all."""
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


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

    run_workers(worker, concurrency)


def paced_loop(url, ids_file, rate, concurrency):
    """The paced baseline: threads with a session each take the next id and
    the next slot of one schedule 1 / rate apart, and wait for it; a 429 puts
    its id back for a later slot. It knows the limit and discovers nothing."""
    import requests
    todo = [line.strip() for line in open(ids_file, encoding="utf-8") if line.strip()][::-1]
    lock, schedule = threading.Lock(), [time.monotonic()]

    def worker():
        session = requests.Session()
        session.trust_env = False
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop()
                slot = schedule[0] = max(schedule[0] + 1 / rate, time.monotonic() - 0.5 / rate)
            time.sleep(max(0.0, slot - time.monotonic()))
            if session.get(url.format(id=item), timeout=30).status_code == 429:
                with lock:
                    todo.append(item)

    run_workers(worker, concurrency)


def write_ids(folder, count):
    path = folder / "ids.txt"
    path.write_text("".join(f"i{n}\n" for n in range(count)))
    return path


#: The redrive.py the scenarios run: this one, or the one --old names (see main).
REDRIVE = [HERE / "redrive.py"]


def redrive_cmd(ids, base, *options):
    return [sys.executable, str(REDRIVE[0]), str(ids), "--url", base + "/items/{id}", "-q", *options]


def table(title, rows):
    print(f"\n{title}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


# -------------------------------------------------------------- scenarios


def clean(folder, count, opt):
    proc, base = start_server(opt.latency)
    try:
        ids = write_ids(folder, count)
        bare = measured([sys.executable, __file__, "--bare", base, str(count), str(opt.concurrency)])
        before = server_stats(base)
        run = measured(redrive_cmd(ids, base, "--concurrency", str(opt.concurrency)))
        sent, throttled = sent_and_throttled(server_stats(base), before)
    finally:
        proc.terminate()
    ideal = count * opt.latency / opt.concurrency
    rows = core_rows(run, ideal, "N x latency / concurrency", "target 0.90, or 0.90 of the bare loop's",
                     sent, count, throttled)
    rows[2:2] = [
        ("bare requests loop: wall", f"{bare.wall:.2f} s, efficiency {ideal / bare.wall:.2f}, "
                                     f"CPU {bare.cpu / count * 1e6:.0f} us/request, peak {bare.rss:.0f} MB"),
        ("redrive against the bare loop", f"{bare.wall / run.wall:.2f} of its efficiency, "
                                          f"{run.cpu / max(sent, 1) / (bare.cpu / count):.2f} x its CPU per request "
                                          f"(target <= 1.3)"),
    ]
    table(f"clean: {count} ids, {opt.latency * 1000:g} ms latency, concurrency {opt.concurrency} (exit {run.code})",
          rows)
    show_error(run)


def flaky(folder, count, opt):
    proc, base = start_server(opt.latency, faults=opt.faults)
    try:
        ids = write_ids(folder, count)
        run = measured(redrive_cmd(ids, base, "--concurrency", str(opt.concurrency), *FLAKY_OPTIONS))
        stats = server_stats(base)
    finally:
        proc.terminate()
    kind = {f"i{n}": kind_of(f"i{n}", opt.faults) for n in range(count)}
    counted = Counter(kind.values())
    kinds = {k: counted[k] for k in NEEDED if k in counted}  # in a fixed order
    needed = sum(NEEDED[k] * n for k, n in kinds.items())
    work = sum((SLOW if k == "slow" else opt.latency) * NEEDED[k] * n for k, n in kinds.items()) / opt.concurrency
    # the last id of the slowest-settling kind cannot start before the work is nearly
    # done; then it waits out its backoffs (and cool-down) between its requests
    chain = max(CHAIN[k] + NEEDED[k] * opt.latency for k in kinds)
    sent, throttled = sent_and_throttled(stats)
    over = Counter()
    for item, hits in stats["hits"].items():
        over[kind[item]] += hits
    over = {k: over[k] - NEEDED[k] * m for k, m in kinds.items()}
    rows = core_rows(run, work + chain, f"work / concurrency + the last backoff chain: {work:.2f} + {chain:.2f}",
                     "target 0.85", sent, needed, throttled)
    rows[0:0] = [("options", " ".join(FLAKY_OPTIONS))]
    rows[4:4] = [
        ("wasted (a done or 404 id fetched again)", f"{stats['wasted']} (target 0)"),
        ("requests over the minimum, by kind", ", ".join(f"{k} {v:+d}" for k, v in over.items())),
    ]
    table(f"flaky: {count} ids, {sum(n for k, n in kinds.items() if k != 'ok') / count:.0%} faulty "
          f"({', '.join(f'{n} {k}' for k, n in kinds.items() if k != 'ok')}) (exit {run.code})", rows)
    show_error(run)


def rate_limited(folder, count, opt):
    limit = opt.limit
    proc, base = start_server(opt.latency, limit=limit)
    try:
        ids = write_ids(folder, count)
        run = measured(redrive_cmd(ids, base, "--concurrency", str(opt.concurrency)))
        stats = server_stats(base)
    finally:
        proc.terminate()
    sent, throttled = sent_and_throttled(stats)
    ideal = count / limit
    rows = core_rows(run, ideal, "N / limit", "target: wall <= 1.05 x ideal, efficiency >= 0.95",
                     sent, count, throttled)
    rows[3] = ("429s", f"{throttled} = {throttled / max(sent, 1):.1%} of requests (target <= 2%)")
    table(f"rate-limited: {count} ids, server allows {limit}/s, concurrency {opt.concurrency}, no --rate "
          f"(exit {run.code})", rows)
    show_error(run)


def resume_first_nights(folder, count, opt):
    """resume's first two nights alone (a state of an earlier release, then nothing changed), and no
    reader: the rows a list too long for the rest of the scenario (100,000,000 ids) can run."""
    resume(folder, count, opt, upto=2, readers=False)


def resume(folder, count, opt, left=10, upto=4, readers=True):
    """A state of `count` ids with all but `left` done, as an earlier release left it (no done.index):
    the resume that reads it, then the nights after: nothing changed, 10 ids appended, and 1% of the
    lines removed and 1% added in the middle. Wall and peak memory of each run, and of the readers of
    the state after them: --check, --export jsonl, --dry-run, --dry-run --refresh."""
    proc, base = start_server(0.0)
    rows = []
    try:
        ids = write_ids(folder, count)
        state = folder / "ids.redrive"
        state.mkdir()
        with open(state / "done.txt", "w") as done, open(state / "results.jsonl", "w") as results:
            for n in range(count - left):
                done.write(f"i{n}\n")
                results.write(f'{{"id":"i{n}","url":"u","status":200,"fetched_at":"t","body":{{}}}}\n')
        nights = [("state of an earlier release, no done.index", None, left),
                  ("the same command again, nothing changed", None, 0),
                  (f"{left} ids appended to the ids file", "append", left),
                  ("1% of the lines removed, 1% added, in the middle", "middle", count // 100)][:upto]
        for what, change, wanted in nights:
            if change == "append":
                with open(ids, "a") as fh:
                    fh.write("".join(f"new{n}\n" for n in range(left)))
            elif change == "middle":
                lines = ids.read_text().split("\n")
                middle, cut = len(lines) // 2, count // 100
                lines[middle - cut // 2:middle + cut // 2] = []
                lines[middle:middle] = [f"mid{n}" for n in range(cut)]
                ids.write_text("\n".join(lines))
            before = server_stats(base)
            run = measured(redrive_cmd(ids, base))
            sent, _ = sent_and_throttled(server_stats(base), before)
            rows.append((what, f"{run.wall:.2f} s, {run.rss:.0f} MB, {sent} requests of {wanted} (exit {run.code})"))
            show_error(run)
        for reader in (["--check"], ["--export", "jsonl"], ["--dry-run"], ["--dry-run", "--refresh"]) if readers else ():
            run = measured(redrive_cmd(ids, base, *reader) if "--dry-run" in reader else
                           [sys.executable, str(REDRIVE[0]), str(ids), *reader])
            rows.append((f"{' '.join(reader)} over the last state", f"{run.wall:.2f} s, {run.rss:.0f} MB "
                         f"(exit {run.code})"))
            show_error(run)
    finally:
        proc.terminate()
    table(f"resume: {count} ids, {count - left} already done: wall, peak memory, requests "
          f"(targets at 10,000,000 ids: <= 20 s and 150 MB unchanged or appended, <= 90 s and 200 MB changed)", rows)


def first_run(folder, count, opt):
    """A first run over a long list of new ids: with --max-time 10 (what a short cron window buys: the
    requests, the first one's delay, the peak memory), and stopped by SIGTERM, once while it indexes
    the list and once when its requests flow (the time from the signal to the exit)."""
    ids = write_ids(folder, count)
    rows = []
    proc, base = start_server(0.0)
    try:
        launched = time.time()
        run = measured(redrive_cmd(ids, base, "--max-time", "10"))
        stats = server_stats(base)
        first = f"{stats['first_hit'] - launched:.2f} s" if stats["first_hit"] else "none sent"
        rows += [("--max-time 10: wall", f"{run.wall:.2f} s (exit {run.code})"),
                 ("--max-time 10: first request after", f"{first} (target <= 5 s)"),
                 ("--max-time 10: requests sent", f"{sent_and_throttled(stats)[0]} (target: at least one)"),
                 ("--max-time 10: peak memory", f"{run.rss:.0f} MB (target <= 200 MB at 10,000,000 ids)")]
    finally:
        proc.terminate()
    for when in ("while it indexes the list", "when its requests flow"):
        shutil.rmtree(folder / "ids.redrive", ignore_errors=True)
        proc, base = start_server(0.0)
        try:
            child = subprocess.Popen(redrive_cmd(ids, base), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if when.startswith("while"):
                time.sleep(1.0)
            else:
                while not server_stats(base)["first_hit"] and child.poll() is None:
                    time.sleep(0.05)
            signalled = time.monotonic()
            child.send_signal(signal.SIGTERM)
            code = child.wait()
            rows.append((f"SIGTERM {when}: to exit", f"{time.monotonic() - signalled:.2f} s, exit {code} "
                         "(target <= 2 s)"))
        finally:
            proc.terminate()
    table(f"first run: {count} new ids", rows)


def lone_429(folder, count, opt):
    """A server with no limit at all where 3% of the ids answer 429 + Retry-After: 1 once."""
    ids = write_ids(folder, count)
    proc, base = start_server(opt.latency)
    try:
        clean_run = measured(redrive_cmd(ids, base, "--concurrency", "16", "--state-dir", str(folder / "clean")))
    finally:
        proc.terminate()
    proc, base = start_server(opt.latency, faults=fault_table({"429-lone": 3}))
    try:
        run = measured(redrive_cmd(ids, base, "--concurrency", "16"))
        stats = server_stats(base)
    finally:
        proc.terminate()
    sent, throttled = sent_and_throttled(stats)
    late = sorted(max(0.0, times[1] - times[0] - 1.0) for times in stats["times"].values() if len(times) > 1)
    rows = [
        ("clean run of the same ids (no 429)", f"{clean_run.wall:.2f} s"),
        ("wall", f"{run.wall:.2f} s = {run.wall / clean_run.wall:.2f} x the clean run (target <= 1.25)"),
        ("429s", f"{throttled} = {throttled / max(sent, 1):.1%} of {sent} requests"),
        ("asked again after its 1 s wait", f"median {late[len(late) // 2]:.2f} s late, at most {late[-1]:.2f} s "
                                           f"(target <= 2 s), {len(late)} of {throttled} ids" if late else "none"),
        ("client CPU per request", f"{cpu_us(run, sent):.0f} us"),
        ("peak memory", f"{run.rss:.0f} MB"),
    ]
    table(f"lone 429s: {count} ids, 3% answer 429 + Retry-After: 1 once, no rate limit, "
          f"{opt.latency * 1000:g} ms latency, concurrency 16 (exit {run.code})", rows)
    show_error(run)
    per_id_trouble(folder, opt)


def cold_start(folder, count, opt):
    """A server with no limit that refuses everything for its first seconds, then takes everything."""
    ids, rows = write_ids(folder, count), []
    proc, base = start_server(opt.latency)
    try:
        clean_run = measured(redrive_cmd(ids, base, "--concurrency", str(opt.concurrency),
                                         "--state-dir", str(folder / "clean")))
    finally:
        proc.terminate()
    rows.append(("clean run of the same ids", f"{clean_run.wall:.2f} s"))
    for seconds, status, retry_after in ((2, 503, None), (5, 503, None), (5, 429, 5)):
        here = folder / f"spell-{seconds}-{status}"
        here.mkdir()
        run, stats = limited_run(here, count, opt, Spell(seconds, status, retry_after))
        sent, _ = sent_and_throttled(stats)
        said = f" + Retry-After: {retry_after}" if retry_after else ""
        rows.append((f"{status}{said} to everything for the first {seconds} s",
                     f"{run.wall:.2f} s = the spell + {run.wall - seconds:.2f} s (the clean run: {clean_run.wall:.2f} s), "
                     f"{len(stats['refused'])} refused of {sent} requests, exit {run.code}"))
    table(f"a cold start: {count} ids, {opt.latency * 1000:g} ms latency, concurrency {opt.concurrency}", rows)


#: The demo's mix of one-item trouble on a server with no limit: 8% of ids answer 429 + Retry-After: 1
#: once, 8% 503 four times in a row (--backoff 0.1, so that the ids' own waits stay short), at the
#: demo's size and larger; each run stopped by --max-time TROUBLE_BUDGET.
TROUBLE, TROUBLE_SIZES, TROUBLE_BUDGET = {"429-lone": 8, "503-four": 8}, (50, 200), 60


def per_id_trouble(folder, opt):
    """The demo's mix: many ids in trouble of their own, the same ids refused again and again."""
    rows = []
    for size in TROUBLE_SIZES:
        run_dir = folder / f"trouble-{size}"
        run_dir.mkdir()
        few = write_ids(run_dir, size)
        options = ("--concurrency", "16", "--backoff", "0.1", "--max-time", str(TROUBLE_BUDGET))
        proc, base = start_server(opt.latency)
        try:
            clean = measured(redrive_cmd(few, base, *options, "--state-dir", str(run_dir / "clean")))
        finally:
            proc.terminate()
        proc, base = start_server(opt.latency, faults=fault_table(TROUBLE))
        try:
            run = measured(redrive_cmd(few, base, *options, "--state-dir", str(run_dir / "trouble")))
            stats = server_stats(base)
        finally:
            proc.terminate()
        done = (run_dir / "trouble" / "done.txt").read_text().count("\n")
        sent, throttled = sent_and_throttled(stats)
        rows.append((f"{size} ids (exit {run.code})",
                     f"wall {run.wall:.1f} s against {clean.wall:.2f} s for the same ids with no trouble; "
                     f"{done} of {size} done; {throttled} 429s and {stats['statuses'].get('503', 0)} 503s "
                     f"of {sent} requests"))
    table("one-item trouble (the demo's mix): " + ", ".join(f"{v}% {k}" for k, v in TROUBLE.items())
          + f", no rate limit, --backoff 0.1, --max-time {TROUBLE_BUDGET}, {opt.latency * 1000:g} ms latency, "
          f"concurrency 16", rows)


# ------------------------------------------------------- other limiters

#: (allowance, window in seconds, ids): a fixed window per second, per minute
#: (one window spent), and per 10 s (three spent: the allowance learned from the first).
WINDOWS = [(100, 1, 3000), (600, 60, 900), (600, 10, 2400)]

#: (allowance, seconds, ids, options given by hand), for reference: the per-second window with
#: Retry-After and its limit given (what a client that knows the limit gets on this machine), and
#: the per-minute one with half the concurrency: a window that runs out refuses all that is in
#: flight, so its first end costs --concurrency 429s, whatever comes after.
WINDOWS_KNOWN = [(100, 1, 3000, 100), (600, 60, 900, ("--concurrency", "16"))]


def fixed_window(folder, count, opt):
    """N requests per window, then 429 until it ends: with a Retry-After to its end, and with none."""
    rows = []
    for size, seconds, ids in WINDOWS:
        for retry_after in (True, False):
            run_dir = folder / f"window-{size}-{seconds}-{int(retry_after)}"
            run_dir.mkdir()
            rows.append(window_row(run_dir, size, seconds, retry_after, count or ids, opt))
    for size, seconds, ids, given in WINDOWS_KNOWN:
        run_dir = folder / f"window-{size}-{seconds}-1-given-{len(rows)}"
        run_dir.mkdir()
        rows.append(window_row(run_dir, size, seconds, True, count or ids, opt, given))
    table(f"fixed window: the window starts at the first request; ideal (ceil(N / allowance) - 1) x window, "
          f"the windows waited; {opt.latency * 1000:g} ms latency, concurrency {opt.concurrency}, "
          f"no --rate unless shown", rows)


def by_hand(given):
    """redrive's options and the row label's words for a --rate given by hand (None: discovered),
    or for options given by hand (a tuple)."""
    if isinstance(given, tuple):
        return list(given), f", {' '.join(given)} by hand"
    return (["--rate", str(given)], f", --rate {given} by hand") if given else ([], "")


def limited_run(folder, count, opt, limiter, *options, faults=()):
    """(Run, the server's /_stats) for redrive over `count` ids behind `limiter` (and `faults`)."""
    proc, base = start_server(opt.latency, faults=faults, limit=limiter)
    try:
        run = measured(redrive_cmd(write_ids(folder, count), base, "--concurrency", str(opt.concurrency), *options))
        return run, server_stats(base)
    finally:
        proc.terminate()


def window_row(folder, size, seconds, retry_after, count, opt, given=None):
    """(label, figures) for one window: wall against the windows waited, and the share of 429s;
    `given`: the --rate given by hand (None: discovered)."""
    hand, shown = by_hand(given)
    run, stats = limited_run(folder, count, opt, FixedWindow(size, seconds, retry_after), *hand)
    sent, throttled = sent_and_throttled(stats)
    ideal = (math.ceil(count / size) - 1) * seconds
    show_error(run)
    label = (f"{size} per {'second' if seconds == 1 else f'{seconds} s'}, "
             f"{'Retry-After' if retry_after else 'no Retry-After'}, {count} ids"
             f"{shown} (exit {run.code})")
    ratio = f" = {run.wall / ideal:.2f} x {ideal:g} s (target <= 1.15)" if ideal else " (no window to wait: N <= allowance)"
    first = sum(t < seconds for t in stats["refused"])  # the first window's end: all that was in flight
    return label, (f"wall {run.wall:.1f} s{ratio}, "
                   f"429s {throttled} = {throttled / max(sent, 1):.1%} of {sent} requests (target <= 3%; "
                   f"{first} in the first window, {throttled - first} after), "
                   f"CPU {cpu_us(run, sent):.0f} us/request, peak {run.rss:.0f} MB")


#: (rate, burst) of the token buckets: a burst of a second's worth, and small ones.
BUCKETS = [(100, 100), (100, 10), (50, 10), (10, 5)]


def token_bucket(folder, count, opt):
    """Token buckets answering 429 + Retry-After: 1, as many APIs limit; N = 20 s x rate + burst."""
    rows = []
    for rate, burst in BUCKETS:
        run_dir = folder / f"bucket-{rate}-{burst}"
        run_dir.mkdir()
        ids = count or 20 * rate + burst
        run, stats = limited_run(run_dir, ids, opt, TokenBucket(rate, burst))
        sent, throttled = sent_and_throttled(stats)
        ideal = (ids - burst) / rate
        show_error(run)
        first = sum(t < 1.0 for t in stats["refused"])  # the first burst's refusals: all that was in flight
        rows.append((f"{rate} r/s, burst {burst}, {ids} ids (exit {run.code})",
                     f"wall {run.wall:.1f} s = {run.wall / ideal:.2f} x {ideal:g} s, "
                     f"429s {throttled} = {throttled / max(sent, 1):.1%} of {sent} requests "
                     f"({first} in the first second, {throttled - first} after), "
                     f"CPU {cpu_us(run, sent):.0f} us/request, peak {run.rss:.0f} MB"))
    table(f"token bucket: 429 + Retry-After: 1 when no token is left; ideal (N - burst) / rate; "
          f"{opt.latency * 1000:g} ms latency, concurrency {opt.concurrency}, no --rate", rows)


#: (share of ids, in percent) answering 429 + Retry-After: 1 once, behind nginx's arithmetic at LONE_RATE r/s.
LONE_SHARES, LONE_RATE, LONE_IDS = (3, 8), 50, 1000


def limit_and_lone(folder, count, opt):
    """nginx's leaky-bucket arithmetic (no burst, 429 with no Retry-After) in front of an application
    whose items being rebuilt answer 429 + Retry-After: 1 once: a limit and ids' own throttles at once."""
    rows = []
    for share in LONE_SHARES:
        run_dir = folder / f"lone-{share}"
        run_dir.mkdir()
        ids = count or LONE_IDS
        limiter = ChangingBucket(LONE_RATE, 0, 1.0, 0.0, 0.0)
        run, stats = limited_run(run_dir, ids, opt, limiter, faults=fault_table({"429-lone": share}))
        sent, throttled = sent_and_throttled(stats)
        limits = len(stats["refused"])
        ideal = (ids + ids * share / 100) / LONE_RATE  # the limit counts the lone 429s' requests too
        show_error(run)
        rows.append((f"{share}% of {ids} ids rebuilt (exit {run.code})",
                     f"wall {run.wall:.1f} s = {run.wall / ideal:.2f} x {ideal:.1f} s, 429s {throttled} = "
                     f"{throttled / max(sent, 1):.1%} of {sent} requests ({limits} the limit's, "
                     f"{throttled - limits} the items'), CPU {cpu_us(run, sent):.0f} us/request, "
                     f"peak {run.rss:.0f} MB"))
    table(f"limit and lone 429s: nginx's arithmetic at {LONE_RATE} r/s, no burst (429, no Retry-After), "
          f"ids answering 429 + Retry-After: 1 once; ideal (N + those ids) / rate; "
          f"{opt.latency * 1000:g} ms latency, concurrency {opt.concurrency}, no --rate", rows)


#: The changing limit: nginx's arithmetic at RATE r/s, burst 10, halved from LOW[0] to LOW[1] s.
CHANGE_RATE, CHANGE_LOW = 100, (10.0, 25.0)


def limit_change(folder, count, opt):
    """A leaky bucket (no Retry-After) whose rate halves after 10 s and returns 15 s later."""
    low_from, low_until = CHANGE_LOW
    limiter = ChangingBucket(CHANGE_RATE, 10, 0.5, low_from, low_until)
    run, stats = limited_run(folder, count, opt, limiter)
    sent, throttled = sent_and_throttled(stats)
    per_second = Counter(int(t) for t in stats["accepted"])
    seconds = [per_second[n] for n in range(max(per_second) + 1)] if per_second else []
    back = next((n for n in range(int(low_until), len(seconds)) if seconds[n] >= 0.9 * CHANGE_RATE), None)
    allowed = sum(limiter.rate_at(n + 0.5) for n in range(len(seconds)))
    ideal = limiter.time_to_allow(count)
    rows = [
        ("ideal (N - burst over the limit's rates in turn)", f"{ideal:.1f} s"),
        ("accepted per second", " ".join(map(str, seconds))),
        ("429s", f"{throttled} = {throttled / max(sent, 1):.1%} of {sent} requests (target <= 5%)"),
        ("back to 90% of the limit", f"{back - low_until:.0f} s after it returned (target <= 15 s)"
                                     if back is not None else "never"),
        ("accepted / allowed over the run", f"{len(stats['accepted'])} / {allowed:.0f} = "
                                            f"{len(stats['accepted']) / max(allowed, 1):.2f}"),
        ("wall", f"{run.wall:.1f} s = {run.wall / ideal:.2f} x ideal"),
        ("client CPU per request", f"{cpu_us(run, sent):.0f} us"),
        ("peak memory", f"{run.rss:.0f} MB"),
    ]
    show_error(run)
    table(f"limit change: {count} ids; nginx's leaky bucket at {CHANGE_RATE} r/s (burst 10, no Retry-After), "
          f"{CHANGE_RATE // 2} r/s from {low_from:g} s to {low_until:g} s; concurrency {opt.concurrency}, "
          f"no --rate (exit {run.code})", rows)


# ------------------------------------------------------------------- stop


def stop(folder, count, opt):
    """A huge run stopped early: the time from the stop to the exit, and what report.json weighs."""
    proc, base = start_server(0.0)
    rows = []
    try:
        ids = write_ids(folder, count)
        for how in ("SIGTERM", "SIGHUP", "--max-time 5"):
            shutil.rmtree(folder / "ids.redrive", ignore_errors=True)
            rows.append(stopped_run(ids, base, folder / "ids.redrive", how))
    finally:
        proc.terminate()
    table(f"stop: {count} ids, no latency, concurrency 32, stopped once answers flow", rows)


def stopped_run(ids, base, state, how):
    """(label, figures) for one run stopped by a signal 0.5 s after its first done line, or by --max-time."""
    options = how.split() if how.startswith("--") else []
    started = time.monotonic()
    proc = subprocess.Popen(redrive_cmd(ids, base, "--concurrency", "32", *options),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (state / "done.txt").exists() or not (state / "done.txt").stat().st_size:
        time.sleep(0.01)
    first = time.monotonic()
    if options:
        stop_at = started + 5.0  # the budget starts after the ids are read: this overstates the delay a little
    else:
        time.sleep(0.5)
        stop_at = time.monotonic()
        proc.send_signal(getattr(__import__("signal"), how))
    _, status, usage = os.wait4(proc.pid, 0)
    ended = time.monotonic()
    report = state / "report.json"
    size = report.stat().st_size / 1e6 if report.exists() else 0.0
    # started by the bench itself, not the Launcher (it is signalled mid-run): a peak no higher
    # than the bench's own may be the bench's (see Launcher)
    peak, ours = usage.ru_maxrss / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    memory = f"peak memory {peak:.0f} MB" if peak > ours else f"peak memory at most {ours:.0f} MB (the bench's own)"
    return (f"{how} (exit {os.waitstatus_to_exitcode(status)})",
            f"start to first answer {first - started:.2f} s, stop to exit {ended - stop_at:.2f} s (target <= 2 s), "
            f"report.json {size:.2f} MB, {memory}")


# ------------------------------------------------------------------ nginx

#: (rate r/s, burst, nodelay): the limiters of issue 12's table, and 100 and 10 r/s with no burst (its
#: text asks for 10, 50 and 100 r/s with and without a burst).
NGINX_LIMITS = [(50, 0, False), (50, 10, False), (50, 10, True), (100, 20, True), (10, 5, True), (100, 0, False),
                (10, 0, False)]

#: (rate, burst, nodelay, --rate): the same limiter with its limit given by hand, for reference: what a
#: client that knows the limit gets on this machine (45: issue 12's own figure; 50: the limit exactly;
#: 95: the better of 90 and 95, tried by hand at 100 r/s).
NGINX_KNOWN = [(50, 0, False, 45), (50, 0, False, 50), (100, 0, False, 95)]

#: (rate, burst, nodelay, "bare"): the same limiter against paced_loop, a bare client told the limit,
#: for reference: what this machine's timing allows with no discovery at all (see PACED_SHARE).
NGINX_BARE = [(50, 0, False, "bare"), (100, 0, False, "bare")]

#: paced_loop sends at this share of the limit: at the limit exactly, the jitter of 32 threads on 2
#: cores brings sends a millisecond early and nginx with no burst refuses them (100 r/s: 12.7% of 429s
#: in one run, 1.16 x; at 98 r/s 2.2%, 1.06 x).
PACED_SHARE = 0.98

NGINX_CONF = """daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    log_format status '$msec $status';
    access_log {dir}/access.log status;
    client_body_temp_path {dir}/tmp; proxy_temp_path {dir}/tmp; fastcgi_temp_path {dir}/tmp;
    uwsgi_temp_path {dir}/tmp; scgi_temp_path {dir}/tmp;
    limit_req_zone $server_name zone=api:1m rate={rate};
    limit_req_status {status};
    server {{
        listen 127.0.0.1:{port};
        server_name bench;
        location /items/ {{
            limit_req zone=api{burst}{nodelay};
            {serve}
        }}
    }}
}}
"""


def nginx_binary():
    """nginx's path, on PATH or where Debian puts it (outside a user's PATH), or None."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


def nginx(folder, count, opt):
    """redrive against nginx's limit_req: static files, so the limit really runs before each answer."""
    binary = nginx_binary()
    if not binary:
        print("\nnginx: skipped: nginx is not installed (apt-get install nginx)")
        return
    rows = []
    for rate, burst, nodelay, *given in NGINX_LIMITS + NGINX_KNOWN + NGINX_BARE:
        ids = max(count, rate * 20 + burst) if count else rate * 20 + burst  # an ideal of at least 20 s
        rows.append(nginx_row(binary, folder, rate, burst, nodelay, ids, opt, *given))
    table(f"nginx {nginx_version(binary)} limit_req (429, no Retry-After), every 50th id a 404, "
          f"concurrency {opt.concurrency}, no --rate unless shown", rows)


def nginx_row(binary, folder, rate, burst, nodelay, count, opt, given=None, status=429, lone=0, runs=1):
    """(label, figures) for one limiter: wall against (N - burst) / rate, and the share of 429s;
    `given`: the --rate given by hand (None: discovered), or "bare": paced_loop told the limit;
    `lone`: nginx in front of the bench's server, `lone` % of whose ids answer 429 + Retry-After: 1 once;
    `runs`: so many runs in one state dir, each with `count` new ids, the figures the last one's."""
    run_dir = folder / f"nginx-{rate}-{burst}-{int(nodelay)}-{status}-{lone}{f'-rate-{given}' if given else ''}-{runs}"
    hand, shown = by_hand(given) if given != "bare" else ([], f", a bare client paced at {rate * PACED_SHARE:g} r/s")
    (run_dir / "www" / "items").mkdir(parents=True)
    (run_dir / "tmp").mkdir()
    for n in range(count * runs):
        if n % 50 != 49:
            (run_dir / "www" / "items" / f"i{n}").write_text(json.dumps({"id": f"i{n}", "title": "x" * 200}))
    port = free_port()
    conf = run_dir / "nginx.conf"
    backend, base = start_server(opt.latency, faults=fault_table({"429-lone": lone})) if lone else (None, None)
    serve = f"proxy_pass {base};" if lone else f"root {run_dir}/www; default_type application/json;"
    conf.write_text(NGINX_CONF.format(dir=run_dir, port=port, rate=nginx_rate(rate), burst=f" burst={burst}" if burst else "",
                                      nodelay=" nodelay" if nodelay else "", status=status, serve=serve))
    server = subprocess.Popen([binary, "-c", str(conf), "-p", str(run_dir), "-e", str(run_dir / "error.log")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        if server.poll() is not None:
            raise RuntimeError(f"nginx exited at start (code {server.returncode}); see {run_dir / 'error.log'}")
        ids = run_dir / "ids.txt"
        url = f"http://127.0.0.1:{port}/items/{{id}}"
        for done in range(runs):
            ids.write_text("".join(f"i{n}\n" for n in range(count * (done + 1))))  # the runs before: done
            time.sleep(2 / rate if done else 0.0)  # the limit's bucket drained, as between two runs
            last_started = time.time()
            if given == "bare":
                run = measured([sys.executable, __file__, "--paced", url, ids, rate * PACED_SHARE, opt.concurrency])
            else:
                run = measured([sys.executable, str(REDRIVE[0]), str(ids), "--url", url, "-q",
                                "--concurrency", str(opt.concurrency), *hand])
    finally:
        server.terminate()
        server.wait()
        if backend:
            backend.terminate()
    log = [row for row in (line.split() for line in (run_dir / "access.log").read_text().splitlines())
           if float(row[0]) >= last_started]
    statuses = Counter(row[-1] for row in log)
    sent, throttled = sum(statuses.values()), statuses[str(status)]
    started = min((float(row[0]) for row in log), default=0.0)
    early = sum(row[-1] == str(status) and float(row[0]) < started + 1.0 for row in log)  # finding the limit
    queued = burst and not nodelay  # nginx logs a queued request when it lets it go, not when it came
    spread = "n/a (queued)" if queued else f"{send_spread([float(row[0]) for row in log]) * 1000:.1f} ms"
    ideal = (count - burst) / rate
    label = (f"{rate} r/s, burst {burst}{' nodelay' if nodelay else ''}{', 503' if status == 503 else ''}, {count} ids"
             f"{f', {lone}% of them refused once by the application behind' if lone else ''}"
             f"{shown}{', the run after one over as many' if runs > 1 else ''} (exit {run.code})")
    show_error(run)
    return label, (f"wall {run.wall:.1f} s = {run.wall / ideal:.2f} x (N - burst) / rate (target <= 1.15), "
                   f"{status}s {throttled} = {throttled / max(sent, 1):.1%} of {sent} requests (target <= 3%; "
                   f"{early} in the first second, {throttled - early} after), "
                   f"send spread {spread}, "
                   f"CPU {cpu_us(run, sent):.0f} us/request, peak {run.rss:.0f} MB")


def nginx_rate(rate):
    """limit_req's rate: whole requests a second, or a minute (0.5 -> '30r/m')."""
    return f"{rate:g}r/s" if rate == int(rate) else f"{rate * 60:g}r/m"


def send_spread(arrivals):
    """How unevenly requests arrived: the 99th percentile of how far each gap
    between two arrivals is from the median of the ten around it (seconds, the
    first 50 left out). A limit with no burst refuses a gap short by its
    slack: at 100 r/s, a millisecond or two."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])][50:]
    devs = sorted(abs(gaps[i] - statistics.median(gaps[i - 5:i + 5])) for i in range(5, len(gaps) - 5))
    return devs[int(0.99 * len(devs))] if devs else 0.0


def nginx_version(binary):
    out = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr
    return out.strip().rpartition("/")[2] or "?"


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port, limit=10.0):
    import socket
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nginx did not listen on 127.0.0.1:{port} within {limit:g} s; see its error.log")


# ------------------------------------------------------------------ chaos

CHAOS_OPTIONS = ["--timeout", "0.3", "--max-bytes", "1000000", "--backoff", "0.1", "--max-backoff", "1",
                 "--cooldown", "2"]
CHAOS_BACKOFFS = 2 * (0.05 + 0.1 + 0.2 + 0.4) + 2  #: a hopeless retryable id's shortest waits: 2 passes, cool-down


def chaos_plan(faults, odd):
    """100 slots (id number modulo 100): each fault row once, each odd answer once, one redirect bomb.
    A slot is (kind, row): kind "fault" (hopeless, or recovering after one try on odd hundreds), "odd",
    "bomb-redirect" or "ok"."""
    kinds = [("fault", row) for row in range(len(faults))] + [("odd", row) for row in range(len(odd))]
    kinds.append(("bomb-redirect", 0))
    slots = [("ok", 0)] * 100
    for j, kind in enumerate(kinds):
        slots[(7 + 37 * j) % 100] = kind
    return slots


def chaos_expected(n, slots, faults):
    """What id i<n> must end as: ("done", None), or ("unavailable", reason); and its cost model:
    (requests, seconds of one attempt, the shortest chain of waits before it settles)."""
    kind, row = slots[n % 100]
    if kind != "fault":
        return ("done", None), (2 if kind == "bomb-redirect" else 1), 1.0, 0.0
    _, _, bucket, reason = faults[row]
    slow = 1.0 + (0.3 / CHAOS_LATENCY if "timeout" in reason else 0.0)  # an attempt, in latencies
    if reason == "too many redirects":
        return ("unavailable", reason), 31, 0.1, 0.0  # its hops answer at once (see chaos_serve)
    if bucket == "skip":
        return ("unavailable", reason), 1, slow, 0.0
    if (n // 100) % 2:
        return ("done", None), 2, (slow + 1) / 2, 0.05
    return ("unavailable", reason), 10, slow, CHAOS_BACKOFFS


CHAOS_LATENCY = 0.020


def chaos_serve(port_queue, count, latency):
    """The tests' RawServer, each id's script chosen by chaos_plan, every answer after `latency`."""
    import test_redrive as t
    slots = chaos_plan(t.FAULTS, t.ODD_ANSWERS)
    server = t.RawServer()
    bomb = t.zero_bomb(64 << 20, 31)

    def late(script):
        return lambda item, hit: [("sleep", latency), *(script(item, hit) if callable(script) else script)]

    for n in range(count):
        kind, row = slots[n % 100]
        if kind == "fault":
            script = t.FAULTS[row][1]
            scripts = [script, t.ok_answer] if (n // 100) % 2 and t.FAULTS[row][2] == "retryable" else [script]
            if t.FAULTS[row][3] == "too many redirects":  # 31 hops at 20 ms would outlast --timeout
                server.replies[f"i{n}"] = scripts
                continue
        elif kind == "odd":
            scripts = [[t.ODD_ANSWERS[row][0], "close"]]
        elif kind == "bomb-redirect":
            scripts = [[t.answer(302, bomb, [("Location", f"/items/i{n}-target"), ("Content-Encoding", "gzip")])]]
        else:
            scripts = [t.ok_answer]
        server.replies[f"i{n}"] = [late(s) for s in scripts]
    server.replies["_stats"] = [lambda item, hit: [t.answer(200, json.dumps({"hits": dict(server.hits)}).encode())]]
    port_queue.put(server.port)
    threading.Event().wait()


def chaos(folder, count, opt):
    sys.path.insert(0, str(HERE))
    import test_redrive as t
    ports = multiprocessing.Queue()
    proc = multiprocessing.Process(target=chaos_serve, args=(ports, count, CHAOS_LATENCY), daemon=True)
    proc.start()
    base = f"http://127.0.0.1:{ports.get(timeout=60)}"
    try:
        ids = write_ids(folder, count)
        run = measured(redrive_cmd(ids, base, "--concurrency", str(opt.concurrency), *CHAOS_OPTIONS))
        hits = server_stats(base)["hits"]
    finally:
        proc.terminate()
    slots = chaos_plan(t.FAULTS, t.ODD_ANSWERS)
    plans = [chaos_expected(n, slots, t.FAULTS) for n in range(count)]
    work = sum(requests * slow * CHAOS_LATENCY for _, requests, slow, _ in plans) / opt.concurrency
    chain = max(chain + requests * slow * CHAOS_LATENCY for _, requests, slow, chain in plans)
    ideal = max(work, chain)  # a lower bound: neither the work nor the longest chain of tries can be beaten
    wrong = chaos_wrong(folder / "ids.redrive", [expected for expected, *_ in plans])
    over = Counter()
    for n, (_, requests, _, _) in enumerate(plans):
        kind, row = slots[n % 100]
        name = t.FAULTS[row][0] if kind == "fault" else kind
        over[name] += hits.get(f"i{n}", 0) + hits.get(f"i{n}-target", 0) - requests
    over = {name: extra for name, extra in over.items() if extra}
    sent = sum(v for k, v in hits.items() if k != "_stats")
    rows = core_rows(run, ideal, f"max(work / concurrency, the longest chain of tries) = max({work:.2f}, {chain:.2f})",
                     f"wall = {run.wall / ideal:.2f} x ideal, target <= 2", sent, sum(requests for _, requests, _, _ in plans), 0)
    del rows[3]  # no throttles here
    rows[0:0] = [("options", " ".join(CHAOS_OPTIONS))]
    rows[3:3] = [("ids settled as expected", f"{count - len(wrong)} / {count}" +
                  (f"; wrong: {'; '.join(wrong[:5])}" if wrong else "")),
                 ("tracebacks", "yes" if b"Traceback" in run.err else "none"),
                 ("requests over the minimum, by kind", ", ".join(f"{k} {v:+d}" for k, v in over.items()) or "none")]
    table(f"chaos: {count} ids, {len(t.FAULTS)} socket-level faults, {len(t.ODD_ANSWERS)} odd answers and a "
          f"redirect bomb at 1% each, {CHAOS_LATENCY * 1000:g} ms latency, concurrency {opt.concurrency} "
          f"(exit {run.code})", rows)
    show_error(run)


def chaos_wrong(state, expected):
    """'i7: unavailable (reason) instead of done' for every id not settled as expected."""
    done = set((state / "done.txt").read_text().split())
    unavailable = {}
    for line in (state / "unavailable.jsonl").read_text().splitlines():
        record = json.loads(line)
        unavailable[record["id"]] = record["reason"]
    wrong = []
    for n, (want, reason) in enumerate(expected):
        item = f"i{n}"
        got = ("done", None) if item in done else ("unavailable", unavailable.get(item))
        if got != (want, reason):
            wrong.append(f"{item}: {got[0]} ({got[1]}) instead of {want} ({reason})")
    return wrong


def show_error(run):
    if run.code:
        print(run.err.decode(errors="replace")[-2000:])


def fsync(folder, count, opt):
    proc, base = start_server(0.0)
    rows = []
    try:
        ids = write_ids(folder, count)
        for options in ([], ["--fsync"]):
            shutil.rmtree(folder / "ids.redrive", ignore_errors=True)
            run = measured(redrive_cmd(ids, base, "--concurrency", "8", *options))
            rows.append((" ".join(["redrive"] + options) + f" (exit {run.code})",
                         f"{run.wall:.2f} s wall, {count / run.wall:.0f} ids/s, {run.wall / count * 1e3:.2f} ms/id"))
    finally:
        proc.terminate()
    table(f"fsync: {count} ids, no latency, concurrency 8, state on {fs_type(folder)}", rows)


#: The declared-quota server: 60 requests per 2 s window, 20 ms per answer, every 50th id a real 404.
DECLARED = (60, 2, 400)
DIALECTS = [("github", 429), ("github", 403), ("x", 429), ("ietf", 429), ("structured", 429), ("reddit", 429),
            ("openai", 429), ("anthropic", 429), ("discord", 429)]


def declared(folder, count, opt):
    """A server that declares its quota, in each dialect: the run should pace by it, not find it."""
    size, seconds, ids = DECLARED
    rows = []
    for dialect, status in DIALECTS:
        run_dir = folder / f"{dialect}-{status}"
        run_dir.mkdir()
        n = count or ids
        run, stats = limited_run(run_dir, n, opt, Declaring(size, seconds, dialect, status),
                                 faults=fault_table({"404": 2}))
        rows.append((f"{dialect} headers, refused with {status}, {n} ids (exit {run.code})",
                     quota_figures(run_dir, run, stats, n, size, seconds, status)))
        show_error(run)
    table(f"declared quota: {size} per {seconds} s of the clock, the quota in every answer's headers; ideal: "
          f"the rest of the first request's window, then {seconds} s for each further {size} ids; "
          f"{opt.latency * 1000:g} ms latency, concurrency {opt.concurrency}, no --rate", rows)


def declared_ideal(stats, n, size, seconds):
    """The window arithmetic from the first request on: what is left of its window, then a window for
    each further `size` ids."""
    first = stats["first_wall"]
    return ((first // seconds) + 1) * seconds - first + max(0, math.ceil(n / size) - 2) * seconds


def quota_figures(state_root, run, stats, n, size, seconds, status):
    """Wall against the window arithmetic, the refusals, and where the ids ended."""
    ideal = declared_ideal(stats, n, size, seconds)
    sent, refused = sum(stats["hits"].values()), stats["statuses"].get(str(status), 0)
    gone = sum(1 for item in range(n) if kind_of(f"i{item}", fault_table({"404": 2})) == "404")
    unavailable = sum(len(p.read_text().splitlines()) for p in state_root.rglob("unavailable.jsonl"))
    return (f"wall {run.wall:.1f} s = {run.wall / ideal:.2f} x {ideal:.1f} s (target <= 1.05), "
            f"refusals {refused} = {refused / max(sent, 1):.1%} of {sent} requests (target <= 1%), "
            f"unavailable {unavailable} (the server's 404s: {gone}), "
            f"CPU {cpu_us(run, sent):.0f} us/request")


def shards_on_one_key(folder, count, opt):
    """Two redrive processes, --shard 1/2 and 2/2, started together on one declared quota."""
    size, seconds, ids = DECLARED
    n = count or 2 * ids
    limiter = Declaring(size, seconds, "github", 403)
    proc, base = start_server(opt.latency, faults=fault_table({"404": 2}), limit=limiter)
    try:
        ids_file = write_ids(folder, n)
        cmds = [redrive_cmd(ids_file, base, "--concurrency", str(opt.concurrency), "--shard", f"{k}/2",
                            "--state-dir", str(folder / f"shard{k}")) for k in (1, 2)]
        started = time.monotonic()
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for cmd in cmds]
        codes = [p.wait() for p in procs]
        wall = time.monotonic() - started
        stats = server_stats(base)
    finally:
        proc.terminate()
    sent, refused = sum(stats["hits"].values()), stats["statuses"].get("403", 0)
    ideal = declared_ideal(stats, n, size, seconds)
    gone = sum(1 for item in range(n) if kind_of(f"i{item}", fault_table({"404": 2})) == "404")
    unavailable = sum(len(p.read_text().splitlines()) for p in folder.rglob("unavailable.jsonl"))
    done = sum(len(p.read_text().splitlines()) for p in folder.rglob("done.txt"))
    table(f"two shards on one key: {n} ids split by --shard 1/2 and 2/2, run at once against one quota of "
          f"{size} per {seconds} s (GitHub's headers, 403 past it), concurrency {opt.concurrency} each", [
              ("exit codes", " ".join(map(str, codes))),
              ("wall", f"{wall:.1f} s = {wall / ideal:.2f} x {ideal:.1f} s (target <= 1.05)"),
              ("refusals", f"{refused} = {refused / max(sent, 1):.1%} of {sent} requests (target <= 1%)"),
              ("done, unavailable", f"{done}, {unavailable} (the server's 404s: {gone})"),
          ])


def shards_parallel(folder, count, opt):
    """docs/across-machines.md's GNU parallel line, run on this machine (--sshlogin :): three shards against
    one local server, then --cover over their state dirs."""
    if shutil.which("parallel") is None:
        print("\nshards-parallel: skipped, GNU parallel is not installed (apt install parallel)")
        return
    n = count or 3000
    proc, base = start_server(opt.latency)
    try:
        ids = write_ids(folder, n)
        line = (f"cd {folder} && {sys.executable} {REDRIVE[0]} ids.txt --shard {{}}/3 -q --url '{base}/items/{{id}}' "
                f"--concurrency {opt.concurrency} --state-dir state-{{}}; c=$?; "
                "[ $c -eq 3 ] && { echo 'shard {}/3: key refused' >&2; exit 0; }; exit $c")
        started = time.monotonic()
        done = subprocess.run(["parallel", "--will-cite", "--sshlogin", ":", "--joblog", str(folder / "jobs.log"),
                               "--resume-failed", line, ":::", "1", "2", "3"], capture_output=True, text=True)
        wall = time.monotonic() - started
        stats = server_stats(base)
    finally:
        proc.terminate()
    covered = subprocess.run([sys.executable, str(REDRIVE[0]), str(ids), "--cover",
                              *(str(folder / f"state-{k}") for k in (1, 2, 3))], capture_output=True, text=True)
    sent = sum(stats["hits"].values())
    table(f"shards-parallel: {n} ids in three shards by GNU parallel on this machine, {opt.latency * 1000:g} ms "
          f"latency, concurrency {opt.concurrency} each", [
              ("parallel's exit", f"{done.returncode}"),
              ("wall", f"{wall:.1f} s against {n * opt.latency / (3 * opt.concurrency):.2f} s of work"),
              ("requests", f"{sent} for {n} ids, {max(stats['hits'].values())} at most for one id"),
              ("--cover", f"exit {covered.returncode}: {covered.stdout.strip().splitlines()[-1]}"),
          ])


def no_limit_throttles(folder, count, opt):
    """One-id throttles on a host with no limit: 4% of ids answer 429 + Retry-After: 1 once, 1% answer 503
    twice, against the same ids clean, in the same minutes."""
    n = count or 10_000
    rows = []
    clean_run = None
    for label, mix in (("clean", {}), ("4% 429 once + 1% 503 twice", {"429-lone": 4, "503-twice": 1})):
        run_dir = folder / ("clean" if not mix else "mix")
        run_dir.mkdir()
        run, stats = limited_run(run_dir, n, opt, 0, faults=fault_table(mix) if mix else ())
        clean_run = clean_run or run
        sent, refused = sent_and_throttled(stats)
        refused += stats["statuses"].get("503", 0)
        goal = "" if not mix else f", {run.wall / (clean_run.wall + 3):.2f} x (clean + 3 s) (target <= 1.1)"
        rows.append((f"{label} (exit {run.code})", f"wall {run.wall:.2f} s{goal}, refusals {refused} of {sent}"))
        show_error(run)
    table(f"one-id throttles on a host with no limit: {n} ids, {opt.latency * 1000:g} ms latency, "
          f"concurrency {opt.concurrency}", rows)


def refresh(folder, count, opt):
    """A nightly sync: night 1 fetches every id; on night 2, 2% of the items
    changed and 0.5% are gone. A plain rerun, then --refresh; on night 3 (2%
    more changed) --refresh against GitHub's quota headers, 2,000 an hour,
    counting no 304; and the cost of planning a refresh over a large state."""
    import urllib.request
    proc, base = start_server(opt.latency, limit=Versions())
    ids, results = write_ids(folder, count), folder / "ids.redrive" / "results.jsonl"
    runs, stats = [], []
    try:
        for night, quota, options in ((1, 0, ()), (2, 0, ()), (2, 0, ("--refresh",)),
                                      (3, 2000, ("--refresh", "--max-time", "120"))):
            urllib.request.urlopen(f"{base}/_night/{night}/{quota}").read()
            runs.append(measured(redrive_cmd(ids, base, "--concurrency", str(opt.concurrency), *options)))
            stats.append((server_stats(base), results.stat().st_size))
    finally:
        proc.terminate()
    seen = [(sum(s["hits"].values()), s["statuses"], s["body_bytes"], size) for s, size in stats]
    report = json.loads((folder / "ids.redrive" / "report.json").read_text())
    ideal = count * opt.latency / opt.concurrency
    rows = [("ideal, each id asked once", f"{ideal:.2f} s (N x latency / concurrency)")]
    for label, run, now, before in (("night 1, every id fetched", runs[0], seen[0], (0, {}, 0, 0)),
                                    ("night 2, plain rerun", runs[1], seen[1], seen[0]),
                                    ("night 2, --refresh", runs[2], seen[2], seen[1]),
                                    ("night 3, --refresh, GitHub's quota of 2,000 an hour, no 304 counted",
                                     runs[3], seen[3], seen[2])):
        rows.append((f"{label} (exit {run.code})",
                     f"wall {run.wall:.2f} s, {now[0] - before[0]} requests, {(now[2] - before[2]) / 1e6:.1f} MB of "
                     f"bodies, results.jsonl +{(now[3] - before[3]) / 1e6:.2f} MB, CPU {run.cpu:.2f} s"))
        show_error(run)
    rows.append(("night 3's refresh counted", ", ".join(f"{report['refresh'][k]} {k}" for k in
                                                       ("unchanged", "changed", "gone", "kept", "left"))
                 + f" of {report['refresh']['due']}; 304s: {seen[3][1].get('304', 0) - seen[2][1].get('304', 0)}; "
                 f"403s: {seen[3][1].get('403', 0)}; quota left: {(report['quota'] or {}).get('remaining')}"))
    rows.append(refresh_planning(folder, 200_000))
    table(f"refresh: {count} ids, 2,000-byte bodies, {opt.latency * 1000:g} ms latency, concurrency "
          f"{opt.concurrency}", rows)


def refresh_planning(folder, count):
    """(label, figures): --refresh --dry-run over `count` done ids with 1,000-byte bodies: reading the
    validators and the body digests of every result, with no request."""
    big = folder / "big"
    big.mkdir()
    ids = write_ids(big, count)
    (big / "ids.redrive").mkdir()
    with open(big / "ids.redrive" / "done.txt", "w") as done, open(big / "ids.redrive" / "results.jsonl", "w") as out:
        for n in range(count):
            done.write(f"i{n}\n")
            out.write(f'{{"id":"i{n}","url":"u","status":200,"fetched_at":"2026-01-01T00:00:00.000000Z",'
                      f'"etag":"\\"{n}-1\\"","body":{{"text":"{"x" * 1000}"}}}}\n')
    size = (big / "ids.redrive" / "results.jsonl").stat().st_size
    run = measured([sys.executable, str(REDRIVE[0]), str(ids), "--url", "http://127.0.0.1:9/{id}", "--refresh",
                    "--dry-run"])
    show_error(run)
    return (f"planning a refresh of {count:,} done ids (--dry-run, {size / 1e6:.0f} MB of results)",
            f"wall {run.wall:.2f} s, CPU {run.cpu:.2f} s, peak memory {run.rss:.0f} MB (exit {run.code})")


def fs_type(folder):
    try:
        out = subprocess.run(["df", "-T", str(folder)], capture_output=True, text=True).stdout.splitlines()[-1]
        return out.split()[1]
    except (OSError, IndexError):
        return "?"


#: (rate r/s, burst, nodelay, ids): slow limits, as public APIs set them (1 a second, 5, 10).
NGINX_SLOW = [(1, 0, False, 90), (2, 0, False, 240), (5, 0, False, 300), (10, 5, True, 600),
              (5, 5, False, 300), (2, 0, False, 240, 503)]  # a queued burst; 503 as the refusal (MusicBrainz)


def nginx_slow(folder, count, opt):
    """redrive against nginx's limit_req at the slow limits public APIs set, no --rate."""
    binary = nginx_binary()
    if not binary:
        print("\nnginx-slow: skipped: nginx is not installed (apt-get install nginx)")
        return
    rows = [nginx_row(binary, folder, rate, burst, nodelay, count or ids, opt, None, *status)
            for rate, burst, nodelay, ids, *status in NGINX_SLOW]
    table(f"nginx {nginx_version(binary)} limit_req at slow limits (429, no Retry-After), every 50th id a 404, "
          f"concurrency {opt.concurrency}, no --rate", rows)


def next_run(folder, count, opt):
    """A run after one that found the limit, in the same state dir (paces.json): the fake clock's shapes at 2 to 50 r/s
    (two minutes of ideal each run, through test_redrive.runs_in_one_state_dir), and nginx's slow limits."""
    rows = []
    if Path(REDRIVE[0]).resolve() == (HERE / "redrive.py").resolve():
        sys.path.insert(0, str(HERE))
        import test_redrive as t
        for name, make in model_shapes(t).items():
            for rate in (2, 5, 10, 50):
                ids = count or int(rate * 60 * opt.minutes) + 5
                first, second = t.runs_in_one_state_dir((make(rate), ids), (make(rate), ids))
                ideal = make(rate).ideal(ids)
                rows.append((f"{name}, {rate} r/s, {ids} ids a run", " -> ".join(
                    f"{r['end'] / ideal:.2f} x, refused {r['refused']} = {r['refused'] / r['requests']:.1%}"
                    f" ({r['early']} in the first 10 s)" for r in (first, second))))
        table("the fake clock: a first run, then the next in the same state dir, concurrency 32, 20 ms answers", rows)
        changes = {"a limit of 10 r/s, then 2": ((t.Leaky(10, 0), 1205), (t.Leaky(2, 0), 245), (t.Leaky(2, 0), 245)),
                   "a limit of 2 r/s, then 10": ((t.Leaky(2, 0), 245), (t.Leaky(10, 0), 1205), (t.Leaky(10, 0), 1205)),
                   "a limit of 2 r/s, then none": ((t.Leaky(2, 0), 245), *[(t.Lone(0), 2000)] * 3)}
        def shown(run, serve, ids):
            over = f" = {run['end'] / serve.ideal(ids):.2f} x" if hasattr(serve, "ideal") else ""
            return f"{run['end']:.1f} s{over}, refused {run['refused']}"
        rows = [(f"{name} (no slack), each run's ids", " -> ".join(
                    shown(run, serve, ids) for run, (serve, ids) in zip(t.runs_in_one_state_dir(*runs), runs)))
                for name, runs in changes.items()]
        table("the fake clock: a limit that changed between runs in one state dir (a clean run of 2,000 ids: "
              f"{t.drive(t.Lone(0), 2000)['end']:.1f} s)", rows)
    else:
        print(f"\nnext-run: the fake clock's half skipped for {REDRIVE[0]}: it drives this redrive.py's run loop")
    binary = nginx_binary()
    if not binary:
        print("\nnext-run: nginx skipped: nginx is not installed (apt-get install nginx)")
        return
    rows = [nginx_row(binary, folder, rate, burst, nodelay, count or ids, opt, None, *status, runs=2)
            for rate, burst, nodelay, ids, *status in NGINX_SLOW]
    table(f"nginx {nginx_version(binary)} limit_req at slow limits: the run after one that found the limit, "
          f"every 50th id a 404, concurrency {opt.concurrency}, no --rate", rows)


def nginx_twins(folder, count, opt):
    """Each row of the tests' limiter table that limit_req can make (a leaky bucket: burst or none,
    queued or nodelay, 429 or 503), against real nginx with the row's ids, beside the row's bounds."""
    binary = nginx_binary()
    if not binary:
        print("\nnginx-twins: skipped: nginx is not installed (apt-get install nginx)")
        return
    sys.path.insert(0, str(HERE))
    import test_redrive as t
    rows = []
    for name, (limiter, ids, _, most_time, most_refused) in t.LIMITERS.items():
        limit, lone = (limiter.limit, limiter.lone.share) if type(limiter) is t.Behind else (limiter, 0)
        if type(limit) is t.Leaky and not limit.halved:  # a limit that changes: limit-change, nginx's arithmetic
            label, figures = nginx_row(binary, folder, limit.rate, limit.burst, limit.burst and not limit.delay,
                                       count or ids, opt, None, limit.status, lone)
            rows.append((f"{name}: {label}", f"{figures}; the fake clock's bound: {most_time} x, {most_refused:.0%}"))
    table(f"nginx {nginx_version(binary)} limit_req, the twins of the tests' limiter table, every 50th id a 404, "
          f"concurrency {opt.concurrency}, no --rate", rows)


def server_twins(folder, count, opt):
    """Each token-bucket and fixed-window row of the tests' limiter table (429 as the refusal, nothing declared)
    against the bench's own server, beside the same row on the fake clock (test_redrive.drive; --order: the
    answers of one round trip in a seeded order) and its bounds: where the two part, a bound measures the clock,
    not the product."""
    sys.path.insert(0, str(HERE))
    import test_redrive as t
    same = Path(REDRIVE[0]).resolve() == (HERE / "redrive.py").resolve()
    rows = []
    for name, (limiter, ids, cap, most_time, most_refused) in t.LIMITERS.items():
        if type(limiter) is t.TokenBucket:
            served = TokenBucket(limiter.rate, limiter.burst)
        elif type(limiter) is t.Window and limiter.dialect is None and limiter.status == 429:
            served = FixedWindow(limiter.size, limiter.seconds, limiter.retry_after)
        else:
            continue
        n, run_dir = count or ids, folder / f"twin-{len(rows)}"
        run_dir.mkdir()
        run, stats = limited_run(run_dir, n, opt._replace(concurrency=cap), served)
        show_error(run)
        sent, throttled = sent_and_throttled(stats)
        ideal = limiter.ideal(n)
        over = (lambda took: f"{took / ideal:.2f} x") if ideal > 0 else (lambda took: f"{took:.1f} s (nothing to wait)")
        fake = t.drive(copy.deepcopy(limiter), n, cap=cap, latency=opt.latency, order=opt.order) if same else None
        shown = f"{over(fake['end'])}, {fake['refused'] / fake['requests']:.1%}" if fake else f"n/a for {REDRIVE[0]}"
        rows.append((f"{name}, {n} ids (exit {run.code})",
                     f"real {over(run.wall)}, {throttled / max(sent, 1):.1%} refused; fake clock {shown}; "
                     f"bounds {most_time} x, {most_refused:.0%}"))
    table(f"the limiter table's token buckets and windows, the bench's server against the fake clock, "
          f"{opt.latency * 1000:g} ms answers, each row's concurrency, no --rate", rows)


def model_shapes(t) -> dict:
    """The silent limiter shapes of the model, by name: rate -> a limiter of test_redrive (t)."""
    return {"leaky, no burst": lambda r: t.Leaky(r, 0), "leaky, no burst, 503": lambda r: t.Leaky(r, 0, status=503),
            "leaky, burst 5 nodelay": lambda r: t.Leaky(r, 5), "leaky, burst 5 queued": lambda r: t.Leaky(r, 5, delay=True),
            "token bucket, burst 5, Retry-After": lambda r: t.TokenBucket(r, 5),
            "window of 2 s, Retry-After": lambda r: t.Window(max(1, int(r * 2)), 2),
            "window of a minute, none": lambda r: t.Window(int(r * 60), 60, retry_after=False),
            "sliding log of 10 s": lambda r: t.SlidingLog(int(r * 10), 10)}


def model(folder, count, opt):
    """The limiter shapes of the tests' table, each for --minutes of its ideal or more, played on the fake clock
    through redrive's own run loop (test_redrive.drive) at --concurrency and --latency: time over ideal and
    refusals, and of those the ones sent before the first refusal came back, which no answer could have warned of
    (--order: the answers of one round trip in a seeded order; on the shared instant the first refusal comes back
    with the takes of its round, so that count means little). A rate over what so many in flight can carry
    (concurrency / latency) is out of reach, not run."""
    if Path(REDRIVE[0]).resolve() != (HERE / "redrive.py").resolve():
        print(f"\nmodel: skipped for {REDRIVE[0]}: the fake-clock harness drives this redrive.py's run loop")
        return
    sys.path.insert(0, str(HERE))
    import test_redrive as t
    rows, met, reached, reach, unwarned, warned = [], 0, 0, opt.concurrency / opt.latency, 0, 0
    for name, make in model_shapes(t).items():
        for rate in (2, 5, 10, 50, 100, 500):
            limiter = t.Varied(make(rate), opt.spread, opt.latency) if opt.spread else make(rate)
            ids = count or int(rate * 60 * opt.minutes) + 5
            if rate >= reach:
                rows.append((f"{name}, {rate} r/s, {ids} ids", f"out of reach: {opt.concurrency} in flight at "
                             f"{opt.latency * 1000:g} ms answers carry {reach:g} r/s at most"))
                continue
            run = t.drive(limiter, ids, until=max(7200, 10 * ids / rate), latency=opt.latency, cap=opt.concurrency,
                          order=opt.order)
            ideal = limiter.ideal(ids)
            wrong = sum(1 for _, _, status in run["ended"].values() if status not in (200, 404))
            early = sum(1 for sent in run["refusals"] if sent < 10)
            over, refused = run["end"] / ideal, run["refused"] / run["requests"]
            seen = (run["refused"] - run["blind"]) / run["requests"]  # refused once a refusal had told of the limit
            within = lambda share: round(over, 2) <= 1.10 and round(share, 3) <= 0.03  # noqa: E731 (both targets)
            reached, met, warned = reached + 1, met + within(refused), warned + within(seen)
            unwarned = unwarned + (run["blind"] > 0.03 * run["requests"])
            rows.append((f"{name}, {rate} r/s, {ids} ids",
                         f"{over:.2f} x ideal (target <= 1.10), refused {run['refused']} = "
                         f"{refused:.1%} of {run['requests']} (target <= 3%; {early} "
                         f"in the first 10 s, {run['blind']} before the first came back), "
                         f"{len(run['ended'])} ended, {wrong} not where the server put them"))
    rows.append(("rows within both targets", f"{met} of the {reached} in reach"))
    rows.append(("rows whose refusals before the first came back are over 3% alone", f"{unwarned}"))
    rows.append(("rows within both targets, those refused before the first came back left out",
                 f"{warned} of the {reached} in reach"))
    box = t.PenaltyBox(5, 20)
    run = t.drive(box, 300, until=7200, latency=opt.latency, cap=opt.concurrency, max_backoff=300.0, order=opt.order)
    rows.append(("penalty box 5 r/s, a 20 s block per excess, 300 ids, --max-backoff 300",
                 f"{box.blocks} blocks (target <= 2), {run['end'] / box.ideal(300):.2f} x ideal, "
                 f"{len(run['ended'])} ended"))
    burst = t.Burst(5000, 3600, 2000, at=0.1)
    run = t.drive(burst, 400, until=7200, latency=opt.latency, cap=opt.concurrency, order=opt.order)
    rows.append(("declared 5,000 an hour, another client spends 2,000 at once, 400 ids",
                 f"{run['end']:.1f} s, refused {run['refused']}, {len(run['ended'])} ended (before: stopped until the reset)"))
    run = t.drive(t.Liar(), 500, until=7200, latency=opt.latency, cap=opt.concurrency, order=opt.order)
    rows.append(("a declared 5 a minute that never renews, on a server that takes all, 500 ids",
                 f"{run['end']:.1f} s, refused {run['refused']}, {len(run['ended'])} ended"))
    order = "answers sharing an instant" if opt.order is None else f"answers of a round trip in order {opt.order}"
    order += f", each answer's time x e^N(0, {opt.spread:g}) (the limiter rows)" if opt.spread else ""
    table(f"the fake-clock model: limiter shapes through redrive's own run loop, concurrency {opt.concurrency}, "
          f"{opt.latency * 1000:g} ms answers, {order}", rows)


COARSE_ROWS = ["leaky 2/s, no burst", "leaky 5/s, no burst", "leaky 10/s, no burst", "leaky 50/s, no burst",
               "leaky 10/s, burst 5", "token bucket 50/s, burst 10, Retry-After",
               "declared, GitHub's headers, none counted", "window 100 a second, none"]
WINDOWS_TICK = 0.015625  #: Windows' system timer, and its time.monotonic before Python 3.13


def coarse_clock(folder, count, opt):
    """Rows of the tests' limiter table on the fake clock (test_redrive.drive, answers in order), with redrive's clock
    read to a fine resolution or to Windows' 15.6 ms tick, and the run loop's waits ending on the fine clock or at
    that tick: time over ideal and the share refused in each of the four."""
    if Path(REDRIVE[0]).resolve() != (HERE / "redrive.py").resolve():
        print(f"\ncoarse-clock: skipped for {REDRIVE[0]}: the fake-clock harness drives this redrive.py's run loop")
        return
    sys.path.insert(0, str(HERE))
    import test_redrive as t
    rows = []
    for row in COARSE_ROWS:
        limiter, ids, cap = t.LIMITERS[row][:3]
        cells = []
        for tick, wait_tick in ((0.0, 0.0), (WINDOWS_TICK, 0.0), (0.0, WINDOWS_TICK), (WINDOWS_TICK, WINDOWS_TICK)):
            served = copy.deepcopy(limiter)
            run = t.drive(served, count or ids, cap=cap, latency=opt.latency, order=1, tick=tick, wait_tick=wait_tick)
            cells.append(f"{run['end'] / served.ideal(count or ids):.2f} x, {run['refused'] / run['requests']:.1%}")
        rows.append((f"{row}, {count or ids} ids", " | ".join(cells)))
    table(f"a clock coarser than the gaps it paces, answers in order, {opt.latency * 1000:g} ms answers: "
          f"fine | clock read to {WINDOWS_TICK * 1000:g} ms | waits ending on it | both", rows)


SCENARIOS = {"clean": clean, "flaky": flaky, "rate-limited": rate_limited, "lone-429": lone_429,
             "resume": resume, "fsync": fsync, "stop": stop, "nginx": nginx,
             "fixed-window": fixed_window, "token-bucket": token_bucket, "limit-and-lone": limit_and_lone,
             "limit-change": limit_change, "chaos": chaos, "declared": declared,
             "shards-on-one-key": shards_on_one_key, "no-limit-throttles": no_limit_throttles,
             "shards-parallel": shards_parallel, "refresh": refresh, "nginx-slow": nginx_slow,
             "nginx-twins": nginx_twins, "server-twins": server_twins, "model": model, "first-run": first_run, "resume-first-nights": resume_first_nights,
             "next-run": next_run, "cold-start": cold_start, "coarse-clock": coarse_clock}
COUNTS = {"clean": 10_000, "flaky": 10_000, "rate-limited": 3_000, "lone-429": 10_000, "resume": 1_000_000, "fsync": 5_000,
          "stop": 1_000_000, "nginx": 0,
          "fixed-window": 0, "token-bucket": 0, "limit-and-lone": 0, "limit-change": 4_500, "chaos": 10_000,
          "declared": 0, "shards-on-one-key": 0, "no-limit-throttles": 10_000, "shards-parallel": 3_000,
          "refresh": 10_000, "nginx-slow": 0, "nginx-twins": 0, "server-twins": 0, "model": 0, "first-run": 2_000_000, "resume-first-nights": 1_000_000,
          "next-run": 0, "cold-start": 3_000, "coarse-clock": 0}


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--bare"]:
        base, count, concurrency = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        return bare_loop(base, count, concurrency)
    if argv is None and sys.argv[1:2] == ["--paced"]:
        url, ids_file, rate, concurrency = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
        return paced_loop(url, ids_file, rate, concurrency)
    if argv is None and sys.argv[1:2] == ["--launcher"]:
        return launcher_loop()
    args = build_parser().parse_args(argv)
    opt = Settings(args.latency / 1000, args.concurrency, args.limit, fault_table(args.faults), args.minutes, args.order,
                   args.spread)
    print(f"redrive benchmark: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    launcher()  # now, while this process is small (see Launcher)
    for name in args.scenarios or SCENARIOS:
        for code in [HERE / "redrive.py"] + ([args.old] if args.old else []):
            REDRIVE[0] = code
            if args.old:
                print(f"\n== {name}: {code}")
            with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as folder:
                SCENARIOS[name](Path(folder), args.ids or COUNTS[name], opt)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line (the docs' bench lines are parsed with it by the tests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", choices=[[]] + list(SCENARIOS), default=[], metavar="SCENARIO",
                        help="any of: " + " ".join(SCENARIOS) + " (default: all)")
    parser.add_argument("--ids", type=int, metavar="N", help="ids per scenario instead of the defaults")
    parser.add_argument("--latency", type=float, default=20, metavar="MS", help="server latency (default 20)")
    parser.add_argument("--minutes", type=at_least_two, default=2, metavar="M",
                        help="model: each limiter row's ids take M >= 2 minutes at its limit (default 2)")
    parser.add_argument("--concurrency", type=int, default=32, metavar="N", help="redrive's and the bare loop's (default 32)")
    parser.add_argument("--order", type=int, metavar="SEED",
                        help="model, server-twins: the answers of one round trip come in an order seeded SEED, as on Linux "
                             "(default: they share an instant, as on a clock that ticks every 15.6 ms)")
    parser.add_argument("--spread", type=float, default=0.0, metavar="SIGMA",
                        help="model: each answer takes the latency x e^N(0, SIGMA), a seeded draw, as a server's time "
                             "varies (default 0: each takes the latency)")
    parser.add_argument("--limit", type=int, default=100, metavar="R",
                        help="requests a second the rate-limited server allows (default 100)")
    parser.add_argument("--faults", type=fault_mix, default=FAULTS, metavar="MIX",
                        help="the flaky mix, KIND=PERCENT,... (default: %s)" % ",".join(f"{k}={v}" for k, v in FAULTS.items()))
    parser.add_argument("--old", type=Path, metavar="REDRIVE_PY",
                        help="an older redrive.py to run each scenario with too, right after this one's "
                             "(e.g. from 'git show REV:redrive.py > /tmp/old.py')")
    return parser


def fault_mix(text: str) -> dict:
    """'500-forever=5,404=10' -> {'500-forever': 5, '404': 10}: whole percents, 100 at most."""
    mix = {}
    for pair in text.split(","):
        kind, _, percent = pair.partition("=")
        if kind not in NEEDED or kind == "ok" or not percent.isdigit():
            raise argparse.ArgumentTypeError(f"{pair!r}: write KIND=PERCENT, KIND one of {' '.join(list(NEEDED)[1:])}")
        mix[kind] = int(percent)
    if sum(mix.values()) > 100:
        raise argparse.ArgumentTypeError("the percents add up to more than 100")
    return mix


if __name__ == "__main__":
    sys.exit(main())
