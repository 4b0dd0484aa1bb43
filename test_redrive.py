"""Tests for redrive.py: a real HTTP server on 127.0.0.1, real files, real
subprocesses and signals; the clock, the sleep and the randomness injected."""

import base64
import bisect
import copy
import html
import importlib
import csv
import email.utils
import errno
import gzip
import heapq
import io
import itertools
import json
import math
import os
import queue
import random
import re
import select
import shutil
import signal
import socket
import ssl
import struct
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, unquote, urlsplit

import pytest
import requests

import redrive
from redrive import Bucket, Config, Effects, ExitCode, Outcome

HERE = Path(__file__).resolve().parent
SECRET = "s3cr3t-key-value-0042"
SECRET_NUMBER = "73519284660391"  #: a key that is a number


# ------------------------------------------------------------ test server


class Handler(BaseHTTPRequestHandler):
    """Plays the scripted replies of each id, one per request; the last repeats."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall between headers and body

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.bodies.append(body)
        self.do_GET()

    do_PUT = do_PATCH = do_DELETE = do_POST

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        server = self.server
        path = self.path.split("?", 1)[0]
        item = unquote(path.split("/items/", 1)[-1]) if "/items/" in path else path
        with server.lock:
            server.hits[item] += 1
            server.paths.append(self.path)
            server.seen_headers.append(dict(self.headers))
            steps = server.replies.get(item, [200])
            step = steps[min(server.hits[item], len(steps)) - 1]
            if item in server.versions:
                step = ("sleep", server.delay, self.version(*server.versions[item]))
            server.inflight += 1
            server.max_inflight = max(server.max_inflight, server.inflight)
            server.events.append("start")
        self.in_flight = True
        try:
            self.play(step, item)
        finally:
            self.answering()

    def answering(self):
        """The request ends where its answer starts to leave: the client can
        see nothing sooner, so a loaded server thread that writes and is then
        put aside cannot count the client's next request as an overlap."""
        with self.server.lock:
            if self.in_flight:
                self.in_flight = False
                self.server.inflight -= 1
                self.server.events.append("end")

    def version(self, etag, body, modified=None):
        """An item as an API keeps it: its ETag and Last-Modified (either may
        be None), and its body, or a status once it is gone; a 304 when the
        request's validators match (RFC 9110 13.1)."""
        if isinstance(body, int):
            return body
        headers = {"Content-Type": "application/json", **({"ETag": etag} if etag else {}),
                   **({"Last-Modified": modified} if modified else {})}
        match = self.headers.get("If-None-Match")
        if match is not None:
            fresh = etag is not None and etag.removeprefix("W/") in [m.strip().removeprefix("W/") for m in match.split(",")]
        else:
            fresh = modified is not None and self.headers.get("If-Modified-Since") == modified
        return (304, b"", headers) if fresh else (200, body, headers)

    def play(self, step, item):
        if callable(step):
            step = step()
        if step == "drop":
            self.close_connection = True
            return
        if isinstance(step, tuple) and step[0] == "drip":
            self.drip(*step[1:])
            return
        if isinstance(step, tuple) and step[0] == "sleep":
            time.sleep(step[1])
            step = step[2]
        if isinstance(step, int):
            body = json.dumps({"id": item}).encode() if 200 <= step < 300 else b"nope"
            step = (step, body, {"Content-Type": "application/json"})
        status, body, headers = step
        self.answering()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def drip(self, size, interval):
        """A 200 whose body arrives one byte at a time."""
        self.answering()
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        try:
            for _ in range(size):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(interval)
        except OSError:
            pass  # the client gave up, as it should

    def log_message(self, *args):
        pass


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client killed mid-request is what some tests do on purpose


def start_server(port=0, tls=None):
    """A scripted server on 127.0.0.1; with tls (an ssl.SSLContext) it speaks https."""
    server = QuietServer(("127.0.0.1", port), Handler)
    if tls:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    server.replies, server.hits, server.paths, server.seen_headers = {}, Counter(), [], []
    server.versions, server.delay = {}, 0.0  #: item -> (etag, body or a status, last-modified): Handler.version
    server.bodies, server.inflight, server.max_inflight, server.events = [], 0, 0, []
    server.lock = threading.Lock()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    server.base = f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    server.template = server.base + "/items/{id}"
    return server, thread


@pytest.fixture
def server():
    srv, thread = start_server()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


class RawServer:
    """An HTTP/1.1 server on a raw socket: each id's replies are scripts of
    bytes and socket actions, so it can cut, reset, stall, drip, mis-frame and
    mis-encode an answer byte for byte. A script is a list of steps: bytes to
    send, "close", "reset" (an RST), ("sleep", s), ("drip", bytes, s a byte),
    ("set", a threading.Event, set when the steps before it are sent) or
    ("await",): on once the next request has come; or a callable (item, hit) -> such a list. The last script of an id repeats."""

    def __init__(self, tls=None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.tls = tls  #: an ssl.SSLContext: each connection is TLS
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.template = self.base + "/items/{id}"
        self.replies, self.hits, self.requests = {}, Counter(), []
        self.early = False  #: answer an error before reading the request's body, keeping the connection
        self.lock = threading.Lock()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.sock.fileno() == -1:
                    return  # closed: the test is over
                time.sleep(0.01)  # a connection reset while it waited (ECONNABORTED), or no fd left: go on accepting
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write sent at once, as real servers do
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn):
        buffer = b""
        try:
            conn = self.tls.wrap_socket(conn, server_side=True) if self.tls else conn
            with conn:
                while True:
                    while b"\r\n\r\n" not in buffer:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buffer += data
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                    script = self.script_for(head.decode("latin-1"))
                    answered = script and isinstance(script[0], bytes) and script[0][9:10] != b"2"
                    if self.early and length and answered:  # an error before the body: its bytes stay unread
                        length = None
                    while length and len(buffer) < int(length.group(1)):
                        buffer += conn.recv(65536)
                    buffer = buffer[int(length.group(1)):] if length else buffer
                    if not self.play(conn, script):
                        return
        except OSError:
            pass  # the client gave up, as it should

    def script_for(self, head):
        if not re.match(r"[A-Z]+ /\S* HTTP/1\.[01]\r\n", head):  # not a request line: what a server says to that
            with self.lock:
                self.requests.append(head)
            return [answer(501, b"not a request")]
        path = head.split(" ", 2)[1]
        item = unquote(path.split("?")[0].rsplit("/", 1)[-1])
        with self.lock:
            self.hits[item] += 1
            self.requests.append(head)
            scripts = self.replies.get(item, [ok_answer])
            script = scripts[min(self.hits[item], len(scripts)) - 1]
        return script(item, self.hits[item]) if callable(script) else script

    def play(self, conn, script):
        """Send a script; False when it ended the connection."""
        for step in script:
            if isinstance(step, bytes):
                conn.sendall(step)
            elif step == "close":
                return False
            elif step == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            elif step[0] == "sleep":
                time.sleep(step[1])
            elif step[0] == "drip":
                for byte in step[1]:
                    conn.sendall(bytes([byte]))
                    time.sleep(step[2])
            elif step[0] == "set":
                step[1].set()
            elif step[0] == "await":
                select.select([conn], [], [], 10)
        return True

    def close(self):
        self.sock.close()


def answer(status=200, body=b"", headers=(), length=True):
    """The bytes of one answer; a Content-Length unless told otherwise or chunked."""
    reason = {200: "OK", 302: "Found", 404: "Not Found"}.get(status, "Whatever")
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{name}: {value}" for name, value in headers)]
    if length and not any(name.lower() in ("content-length", "transfer-encoding") for name, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def ok_answer(item, hit):
    return [answer(200, json.dumps({"id": item}).encode(), [("Content-Type", "application/json")])]


def gzipped(data):
    return gzip.compress(data, compresslevel=9)


def zero_bomb(size, wbits):
    """size zero bytes, compressed (gzip: wbits 31; zlib deflate: 15): about size / 1000 on the wire."""
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    block = bytes(1 << 20)
    return b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()


@pytest.fixture
def raw_server():
    srv = RawServer()
    yield srv
    srv.close()


@pytest.fixture
def raw_tls_server(tmp_path, monkeypatch):
    """The raw-socket server over TLS, its throwaway CA trusted through REQUESTS_CA_BUNDLE."""
    import trustme
    ca, context = trustme.CA(), ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    srv = RawServer(tls=context)
    yield srv
    srv.close()


# ---------------------------------------------------------------- helpers


class FakeTime:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self, rand=0.5):
        self.now, self.sleeps, self.rand = 1000.0, [], rand
        self.fsyncs = []  #: the names of the files fsynced, in order

    def clock(self):
        return self.now

    def wallclock(self):
        return 1_700_000_000.0 + self.now

    def sleep(self, seconds):
        self.sleeps.append(round(seconds, 6))
        self.now += seconds

    def fsync(self, fd):
        self.fsyncs.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        os.fsync(fd)

    def effects(self):
        return Effects(clock=self.clock, wallclock=self.wallclock, sleep=self.sleep, rand=lambda: self.rand,
                       fsync=self.fsync)


class FastForward(FakeTime):
    """Real time, but a sleep skips ahead at once: for runs with real latency."""

    def __init__(self):
        super().__init__()
        self.skipped = 0.0

    def clock(self):
        return time.monotonic() + self.skipped

    def wallclock(self):
        return time.time() + self.skipped

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.skipped += seconds


def write_ids(tmp_path, ids, name="ids.txt"):
    path = tmp_path / name
    path.write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")
    return path


def run_cli(argv, fake=None, environ=None):
    """main(argv) in-process: (exit code, stderr text, fake time)."""
    fake = fake or FakeTime()
    err = io.StringIO()
    code = redrive.main([str(a) for a in argv], fx=fake.effects(), err=err, environ=environ or {})
    return code, err.getvalue(), fake


def crawl(server, tmp_path, ids, *extra, fake=None, environ=None):
    ids_file = write_ids(tmp_path, ids)
    argv = [ids_file, "--url", server.template, "--concurrency", "1", *extra]
    return run_cli(argv, fake, environ)


def state(tmp_path, name, stem="ids"):
    path = tmp_path / f"{stem}.redrive" / name
    if not path.exists():
        return []
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return path.read_text(encoding="utf-8").splitlines()


def all_output(tmp_path):
    """Every byte redrive wrote into the tmp dir, as text."""
    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in tmp_path.rglob("*") if p.is_file())


def summary_count(err, label):
    """The number on the summary line that starts with label."""
    [number] = re.findall(rf"^  {label} +(\d+)", err, re.M)
    return int(number)


def redrive_cmd(*args):
    return [sys.executable, str(HERE / "redrive.py"), *map(str, args)]


# --------------------------------------------------------- pure functions


@pytest.mark.parametrize("status, bucket", [
    (200, Bucket.OK), (204, Bucket.OK), (401, Bucket.FATAL), (402, Bucket.FATAL),
    (408, Bucket.RETRYABLE), (429, Bucket.RETRYABLE), (500, Bucket.RETRYABLE), (503, Bucket.RETRYABLE),
    (599, Bucket.RETRYABLE), (501, Bucket.SKIP), (505, Bucket.SKIP), (404, Bucket.SKIP),
    (400, Bucket.SKIP), (410, Bucket.SKIP), (403, Bucket.SKIP), (418, Bucket.SKIP), (301, Bucket.SKIP),
])
def test_classify_status_default_buckets(status, bucket):
    assert redrive.classify_status(status, Config(Path("i"), Path("s"))) is bucket


@pytest.mark.parametrize("attempt, rand, expected", [
    (1, 0.0, 0.5), (1, 1.0, 1.0), (2, 0.5, 1.5), (3, 0.5, 3.0), (10, 1.0, 60.0), (10, 0.0, 30.0),
])
def test_backoff_delay_doubles_with_equal_jitter_and_cap(attempt, rand, expected):
    assert redrive.backoff_delay(attempt, 1.0, 60.0, lambda: rand) == expected


R, S, OKB = Bucket.RETRYABLE, Bucket.SKIP, Bucket.OK
OVER = "503, asked to wait 120 s (over --max-backoff 60 s)"


@pytest.mark.parametrize("row, out, tries, pass_no, stopping, move, wait, error", [
    ("a success", dict(bucket=OKB, status=200), 1, 1, False, "DONE", 0.0, None),
    ("a fatal answer", dict(bucket=Bucket.FATAL, status=401), 1, 1, False, "HALT", 0.0, None),
    ("a 404", dict(bucket=S, status=404, error="404"), 1, 1, False, "UNAVAILABLE", 0.0, "404"),
    ("a 404 while stopping", dict(bucket=S, status=404, error="404"), 1, 1, True, "UNAVAILABLE", 0.0, "404"),
    ("a 500, first try", dict(bucket=R, status=500), 1, 1, False, "RETRY", 0.75, None),
    ("a 500, second try", dict(bucket=R, status=500), 2, 1, False, "RETRY", 1.5, None),
    ("a 500 in pass 2", dict(bucket=R, status=500), 1, 2, False, "RETRY", 0.75, None),
    ("a Retry-After", dict(bucket=R, status=503, retry_after=7.0), 1, 1, False, "RETRY", 7.0, None),
    ("a Retry-After of 0 (or a date past)", dict(bucket=R, status=429, retry_after=0.0), 1, 1, False, "RETRY", 0.75,
     None),
    ("a Retry-After under the backoff", dict(bucket=R, status=503, retry_after=0.5), 2, 1, False, "RETRY", 1.5, None),
    ("a plain 429, the id's own", dict(bucket=R, status=429), 1, 1, False, "RETRY", 0.75, None),
    ("a plain 503, the id's own", dict(bucket=R, status=503), 1, 1, False, "RETRY", 0.75, None),
    ("tries spent, pass 1", dict(bucket=R, status=500, error="500"), 5, 1, False, "FAIL", 30.0, "500"),
    ("tries spent, longer Retry-After", dict(bucket=R, status=503, retry_after=45.0), 5, 1, False,
     "FAIL", 45.0, None),
    ("tries spent, last pass", dict(bucket=R, status=500, error="500"), 5, 2, False, "GIVE_UP", 0.0, "500"),
    ("Retry-After past --max-backoff", dict(bucket=R, status=503, error="503", retry_after=120.0), 1, 1,
     False, "FAIL", 120.0, OVER),
    ("the same in the last pass", dict(bucket=R, status=503, error="503", retry_after=120.0), 1, 2,
     False, "GIVE_UP", 0.0, OVER),
    ("a 500 while stopping", dict(bucket=R, status=500), 1, 1, True, "LEAVE", 0.0, None),
])
def test_next_step_decides_each_outcome(row, out, tries, pass_no, stopping, move, wait, error):
    cfg = Config(Path("i"), Path("s"))
    step = redrive.next_step(Outcome(**out), tries, pass_no, cfg, stopping, lambda: 0.5)
    assert (step.move, step.wait) == (redrive.Move[move], wait), row
    if error is not None:
        assert step.outcome.error == error, row


@pytest.mark.parametrize("method, unsafe_ok, out, move, bucket", [
    ("POST", False, dict(bucket=R, status=500, error="500"), "UNAVAILABLE", S),  # it may have been done
    ("POST", False, dict(bucket=R, status=503, error="503"), "RETRY", None),  # 503: not processed
    ("POST", False, dict(bucket=R, error="refused", unreached=True), "RETRY", None),  # never sent
    ("POST", True, dict(bucket=R, status=500, error="500"), "RETRY", None),  # --retry-unsafe
    ("PUT", False, dict(bucket=R, status=500, error="500"), "RETRY", None),  # idempotent
])
def test_next_step_never_repeats_a_post_that_may_have_been_processed(method, unsafe_ok, out, move, bucket):
    cfg = Config(Path("i"), Path("s"), request=redrive.Request(method=method), retry_unsafe=unsafe_ok)
    step = redrive.next_step(Outcome(**out), 1, 1, cfg, False, lambda: 0.5)
    assert step.move is redrive.Move[move]
    if bucket is not None:
        assert step.outcome.bucket is bucket and step.outcome.error == "may have been processed (500)"


Cause = redrive.Cause


@pytest.mark.parametrize("cause, action", [
    (Cause.TIMEOUT, "still timing out after 2 passes: raise --timeout, or rerun later with --retry-unavailable"),
    (Cause.UNREACHED, "host not reachable (it broke) after 2 passes: check the URL's host, "
                      "or rerun with --retry-unavailable once it is back"),
    (Cause.TRANSPORT, "still it broke after 2 passes: check the item upstream, or rerun with --retry-unavailable"),
])
def test_recommend_switches_on_the_cause_not_on_the_words(cause, action):
    assert redrive.recommend(Bucket.RETRYABLE, None, cause, "it broke", 2) == action


@pytest.mark.parametrize("record, cause", [
    ({"reason": "timeout after 30 s", "status": None}, Cause.TIMEOUT),
    ({"reason": "connection refused", "status": None}, Cause.UNREACHED),
    ({"reason": "connect timeout after 5 s", "status": None}, Cause.UNREACHED),
    ({"reason": "redirect target: connection refused", "status": None}, Cause.TRANSPORT),
    ({"error": "invalid JSON", "status": 200}, Cause.BAD_BODY),
    ({"reason": "body over 100 bytes", "status": 200}, Cause.TOO_LARGE),
    ({"reason": "may have been processed (500 Internal Server Error)", "status": 500},
     Cause.MAY_HAVE_BEEN_PROCESSED),
    ({"reason": redrive.DOT_SEGMENT, "status": None}, Cause.DOT_SEGMENT),
    ({"reason": "503 Service Unavailable", "status": 503}, Cause.STATUS),
    ({"reason": "timeout after 30 s", "status": None, "cause": "status"}, Cause.STATUS),  # the field wins
])
def test_a_record_from_before_causes_were_kept_reads_its_cause_from_its_words(record, cause):
    assert redrive.record_cause(record) is cause


def test_the_request_shape_and_its_options_come_from_the_request_fields():
    dests = {action.dest for action in redrive.build_parser()._actions}
    assert set(redrive.REQUEST_OPTIONS) <= dests  # every option a rerun takes back is a real one
    assert list(redrive.request_shape(redrive.Request())) == ["method", "url", "data", "headers", "expect_json", "require",
                                               "require_field"]  # run.json's order, as before the dataclass
    request = redrive.Request(method="POST", url_spec="https://x.test/{id}?${Q}", url="https://x.test/{id}?k=abc",
                              headers=(("X-Key", "s3cret"),), header_specs=(("X-Key", "${KEY}"),), require=("ok",))
    shape = redrive.request_shape(request)
    assert shape["url"] == "https://x.test/{id}?${Q}" and shape["headers"] == ["x-key"] and shape["require"] == ["ok"]
    assert "s3cret" not in json.dumps(shape) and "abc" not in json.dumps(shape)
    assert redrive.request_shape(redrive.Request(demo=True))["url"] == "--demo"


def test_one_host_identity_gives_the_gate_the_origin_and_the_name_in_messages():
    assert redrive.host_of("http://USER:pw@Api.Example:80/{id}", "a") == redrive.host_of("http://api.example/x", "")
    assert redrive.host_of("https://api.example/{id}", "a") != redrive.host_of("http://api.example/{id}", "a")
    assert redrive.origin_of("https://api.example/x") == ("https", "api.example", 443)
    assert redrive.shown_host("https://u:p@Api.Example:8443/x") == "api.example:8443"  # no credentials shown
    assert redrive.shown_host("https://api.example/x") == "api.example"  # the port only when given
    assert redrive.shown_host("http://api.example:bad/x") == "api.example"


NOW = 1_700_000_000.0


@pytest.mark.parametrize("last, move, wait", [
    ({"pass": 1, "at": redrive.iso(NOW - 10)}, "FAIL", 20.0),  # 10 s into a 30 s cool-down
    ({"pass": 1, "at": redrive.iso(NOW - 10), "retry_after": 60.0}, "FAIL", 50.0),  # a longer Retry-After
    ({"pass": 1, "at": redrive.iso(NOW - 3600)}, "FAIL", 0.0),  # due long ago: at once
    ({"pass": 2, "at": redrive.iso(NOW - 10)}, "GIVE_UP", 0.0),  # it failed its last pass
])
def test_resume_step_takes_an_earlier_runs_failure_on_from_where_it_stopped(last, move, wait):
    step = redrive.resume_step(last, Config(Path("i"), Path("s")), NOW)
    assert (step.move, step.wait) == (redrive.Move[move], pytest.approx(wait))


@pytest.mark.parametrize("value, expected", [
    ("7", 7.0), (" 120 ", 120.0), ("0", 0.0), (None, None), ("", None), ("soon", None), ("-3", None),
    ("2.0", 2.0), ("0.5", 0.5), ("1e3", None), ("1.", None), (".5", None), ("1.5.2", None), ("nan", None),
    ("inf", None), ("1_000", None), ("\u0661", None), ("9" * 400, redrive.MAX_RETRY_AFTER),
    (email.utils.formatdate(NOW + 42, usegmt=True), 42.0),
    (email.utils.formatdate(NOW - 42, usegmt=True), 0.0),
])
def test_parse_retry_after_both_forms(value, expected):
    assert redrive.parse_retry_after(value, NOW) == expected


@pytest.mark.parametrize("url, expected", [
    ("https://a.example/x?id=1&api_key=abc", "https://a.example/x?id=1&api_key=REDACTED"),
    ("https://a.example/x?token=t&sig=s&q=ok", "https://a.example/x?token=REDACTED&sig=REDACTED&q=ok"),
    ("https://user:pw@a.example/x", "https://user:REDACTED@a.example/x"),
    ("https://a.example/x?page=2", "https://a.example/x?page=2"),
])
def test_redact_url_hides_key_like_parameters(url, expected):
    assert redrive.redact_url(url) == expected


@pytest.mark.parametrize("text, expected", [
    ("429", {429}), ("429, 503", {429, 503}), ("500-503", {500, 501, 502, 503}),
])
def test_parse_codes(text, expected):
    assert redrive.parse_codes(text) == frozenset(expected)


@pytest.mark.parametrize("text", ["", "abc", "99", "600", "503-500"])
def test_parse_codes_rejects_junk(text):
    with pytest.raises(ValueError):
        redrive.parse_codes(text)


def test_a_code_given_to_one_option_leaves_the_default_of_another():
    fatal, retry, skip = redrive.resolve_buckets(None, None, redrive.parse_codes("503"))
    assert 503 in skip and 503 not in retry and 500 in retry and fatal == redrive.FATAL_STATUSES


def test_template_percent_encodes_the_id():
    assert redrive.build_url("https://a.example/i/{id}?x=1", "a/b?c=d&e") == \
        "https://a.example/i/a%2Fb%3Fc%3Dd%26e?x=1"


# ------------------------------------------------------------------ buckets


def test_success_stores_result_then_done(server, tmp_path):
    code, err, _ = crawl(server, tmp_path, ["a1", "b2"])
    assert code == ExitCode.OK
    results = state(tmp_path, "results.jsonl")
    assert [r["id"] for r in results] == ["a1", "b2"]
    assert set(results[0]) == {"id", "url", "status", "fetched_at", "body"}
    assert results[0]["body"] == {"id": "a1"} and results[0]["status"] == 200
    assert results[0]["url"] == server.base + "/items/a1"
    assert state(tmp_path, "done.txt") == ["a1", "b2"]
    assert summary_count(err, "done") == 2


def test_text_body_is_stored_as_text(server, tmp_path):
    server.replies["t"] = [(200, "héllo".encode(), {"Content-Type": "text/plain; charset=utf-8"})]
    assert crawl(server, tmp_path, ["t"])[0] == ExitCode.OK
    assert state(tmp_path, "results.jsonl")[0]["body"] == "héllo"


def test_404_is_unavailable_and_never_retried(server, tmp_path):
    server.replies["gone"] = [404]
    code, err, fake = crawl(server, tmp_path, ["gone", "ok"])
    assert code == ExitCode.OK
    assert server.hits["gone"] == 1 and fake.sleeps == []
    [record] = state(tmp_path, "unavailable.jsonl")
    assert record["id"] == "gone" and record["status"] == 404 and record["bucket"] == "skip"
    assert record["reason"] == "404 Not Found"
    assert record["action"] == "not found (404): check it or drop it from the input list"
    assert record["cause"] == "status"
    assert state(tmp_path, "failed.jsonl") == []
    assert "1 x 404 Not Found: not found (404): check it or drop it from the input list\n      gone\n" in err
    assert crawl(server, tmp_path, ["gone", "ok"])[0] == ExitCode.OK
    assert server.hits["gone"] == 1


def test_unknown_status_fails_closed_as_skip(server, tmp_path):
    server.replies["tea"] = [418]
    assert crawl(server, tmp_path, ["tea"])[0] == ExitCode.OK
    assert server.hits["tea"] == 1
    assert state(tmp_path, "unavailable.jsonl")[0]["reason"] == "418 I'm a Teapot"


def test_401_halts_at_once_and_marks_nothing_failed(server, tmp_path):
    server.replies["b"] = [(401, b'{"error": "bad key"}', {"Content-Type": "application/json"})]
    code, err, _ = crawl(server, tmp_path, ["a", "b", "c", "d"])
    assert code == ExitCode.FATAL
    assert server.hits == Counter({"a": 1, "b": 1})
    assert state(tmp_path, "done.txt") == ["a"]
    assert state(tmp_path, "failed.jsonl") == [] and state(tmp_path, "unavailable.jsonl") == []
    assert "401 Unauthorized" in err and "bad key" in err and "rerun" in err
    server.replies["b"] = [200]
    code, _, _ = crawl(server, tmp_path, ["a", "b", "c", "d"])
    assert code == ExitCode.OK
    assert server.hits == Counter({"a": 1, "b": 2, "c": 1, "d": 1})


def test_a_401_in_a_list_of_urls_names_skip_401_as_the_way_on(server, tmp_path):
    server.replies["b"] = [401]
    ids = write_ids(tmp_path, [f"{server.base}/items/a", f"{server.base}/items/b"])
    code, err, _ = run_cli([ids, "--concurrency", "1"])
    assert code == ExitCode.FATAL and "--skip 401" in err
    code, err, _ = run_cli([ids, "--skip", "401"])
    assert code == ExitCode.OK and [r["status"] for r in state(tmp_path, "unavailable.jsonl")] == [401]


def test_402_is_fatal_and_fatal_codes_are_configurable(server, tmp_path):
    server.replies["a"] = [402]
    assert crawl(server, tmp_path, ["a", "b"])[0] == ExitCode.FATAL
    assert server.hits["b"] == 0
    server.replies["b"] = [403]
    assert crawl(server, tmp_path, ["b"], "--fatal", "403", "--state-dir", tmp_path / "s2")[0] == ExitCode.FATAL


def test_503_twice_then_ok_backs_off_exactly(server, tmp_path):
    server.replies["f"] = [503, 503, 200]
    code, _, fake = crawl(server, tmp_path, ["f"])
    assert code == ExitCode.OK
    assert fake.sleeps == [0.75, 1.5]
    assert server.hits["f"] == 3
    assert state(tmp_path, "failed.jsonl") == []


def test_backoff_settings_shape_the_waits(server, tmp_path):
    server.replies["f"] = [500, 500, 500, 200]
    code, _, fake = crawl(server, tmp_path, ["f"], "--backoff", "0.5", "--max-backoff", "1.5", fake=FakeTime(rand=1.0))
    assert code == ExitCode.OK
    assert fake.sleeps == [0.5, 1.0, 1.5]


def test_retry_after_seconds_is_honoured(server, tmp_path):
    server.replies["t"] = [(429, b"", {"Retry-After": "7"}), 200]
    code, _, fake = crawl(server, tmp_path, ["t"])
    assert code == ExitCode.OK and fake.sleeps == [7.0]


def test_retry_after_http_date_is_honoured(server, tmp_path):
    fake = FakeTime()
    when = email.utils.formatdate(fake.wallclock() + 9, usegmt=True)
    server.replies["t"] = [(503, b"", {"Retry-After": when}), 200]
    code, _, fake = crawl(server, tmp_path, ["t"], fake=fake)
    assert code == ExitCode.OK and fake.sleeps == [9.0]


def test_an_id_waiting_out_its_backoff_does_not_hold_a_worker(server, tmp_path):
    server.replies["a"] = [500, 200]
    code, _, fake = crawl(server, tmp_path, ["a", "b", "c"], "--backoff", "4")
    assert code == ExitCode.OK
    assert server.paths == ["/items/a", "/items/b", "/items/c", "/items/a"]
    assert fake.sleeps == [3.0]
    fetched = {r["id"]: r["fetched_at"] for r in state(tmp_path, "results.jsonl")}
    assert fetched["b"] == fetched["c"] == redrive.iso(FakeTime().wallclock())


def test_a_lone_throttle_is_that_ids_alone_and_the_host_goes_on(server, tmp_path):
    server.replies["a"] = [(429, b"", {"Retry-After": "5"}), 200]
    code, _, fake = crawl(server, tmp_path, ["a", "b", "c"])
    assert code == ExitCode.OK and fake.sleeps == [5.0]
    fetched = {r["id"]: r["fetched_at"] for r in state(tmp_path, "results.jsonl")}
    assert fetched["b"] == fetched["c"] == redrive.iso(FakeTime().wallclock())
    assert fetched["a"] == redrive.iso(FakeTime().wallclock() + 5)


def test_throttles_over_the_share_rule_are_the_hosts_cost_the_id_no_try_and_pause_it_once_it_refuses_all(server,
                                                                                                   tmp_path):
    for item in "abcdef":
        server.replies[item] = [(429, b"", {"Retry-After": "5"}), 200]
    code, _, fake = crawl(server, tmp_path, list("abcdefg"), "--concurrency", "1", "--tries", "1", "--passes", "1")
    assert code == ExitCode.OK
    # a new host's background is one refusal in 50 answers until measured: four in a row are still the ids' own
    assert [r["id"] for r in state(tmp_path, "unavailable.jsonl")] == list("abcd")
    assert server.hits == Counter({"a": 1, "b": 1, "c": 1, "d": 1, "e": 2, "f": 2, "g": 1})  # e, f: no try spent
    fetched = {r["id"]: r["fetched_at"] for r in state(tmp_path, "results.jsonl")}
    # e, the host's, waits its own Retry-After; f, refused after the cut with nothing taken since, pauses the
    # whole host for its Retry-After: g goes after the pause
    start = FakeTime().wallclock()
    assert fetched["e"] >= redrive.iso(start + 5) and fetched["g"] >= redrive.iso(start + 5)


def test_a_new_hosts_refusals_are_the_ids_own_until_they_are_more_than_one_in_ten(server, tmp_path):
    for item in "abcde":
        server.replies[item] = [429, 200]
    code, _, _ = crawl(server, tmp_path, list("abcde"), "--tries", "1", "--passes", "1", "--concurrency", "1")
    assert code == ExitCode.OK  # every id settled
    assert [r["id"] for r in state(tmp_path, "unavailable.jsonl")] == list("abcd")  # their own: a try each
    assert state(tmp_path, "done.txt") == ["e"] and server.hits["e"] == 2  # the host's "too fast": no try spent


def test_one_id_refused_again_and_again_is_its_own_trouble_and_the_host_goes_on_at_full_speed(server, tmp_path):
    server.replies["a"] = [503, 503, 503, 503, 200]  # one item under maintenance: four 503s in a row, then back
    code, _, fake = crawl(server, tmp_path, list("abcde"), "--concurrency", "1", "--backoff", "0")
    assert code == ExitCode.OK and state(tmp_path, "done.txt") == list("abcde")
    # a spent four tries of its own; taken as the host's, it would have paced the others
    assert server.paths == ["/items/a"] * 5 + ["/items/b", "/items/c", "/items/d", "/items/e"]
    assert fake.sleeps == []


def test_an_id_the_host_turned_away_goes_behind_the_others_so_it_never_holds_the_host(server, tmp_path):
    for item in "abcd":
        server.replies[item] = [503, 200]
    server.replies["e"] = [503] * 5 + [200]  # the fifth 503 in a row, the host's; then its own trouble
    code, _, fake = crawl(server, tmp_path, list("abcdefgh"), "--backoff", "0", "--tries", "5", "--passes", "1",
                          "--concurrency", "1")
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == list("abcdefgh")
    # turned away, e went behind f, g and h, which the host took: a host that takes them refuses not everything,
    # and e's later 503s are its own (a try each); put first again, e would have been the host's only probe
    assert server.hits["e"] == 6 and server.paths.index("/items/h") < len(server.paths) - 5
    assert fake.sleeps == [] or max(fake.sleeps) < 1.0


def test_a_retry_whose_time_has_come_goes_before_untried_ids(server, tmp_path):
    server.replies["a"] = [500, 200]
    code, _, _ = crawl(server, tmp_path, ["a", "b", "c", "d"], "--concurrency", "1", "--backoff", "0")
    assert code == ExitCode.OK and server.paths == ["/items/a", "/items/a", "/items/b", "/items/c", "/items/d"]


def test_rate_spaces_requests_evenly_across_workers(server, tmp_path):
    code, _, fake = crawl(server, tmp_path, ["a", "b", "c", "d", "e"], "--rate", "4", "--concurrency", "4")
    assert code == ExitCode.OK and fake.sleeps == [0.25] * 4
    fetched = [r["fetched_at"] for r in state(tmp_path, "results.jsonl")]
    assert fetched == [redrive.iso(FakeTime().wallclock() + 0.25 * n) for n in range(5)]


def test_a_new_host_gets_a_few_requests_first_then_the_full_concurrency(server, tmp_path):
    ids = [f"s{n}" for n in range(150)]  # the first few reused connections also wait for a stray answer
    for item in ids:
        server.replies[item] = [("sleep", 0.05, 200)]
    code, _, _ = crawl(server, tmp_path, ids, "--concurrency", "12", fake=FastForward())
    assert code == ExitCode.OK
    assert server.events.index("end") == redrive.START_LIMIT  # 4 starts, then the first answer
    assert server.max_inflight == 12


def test_per_host_caps_requests_in_flight_per_host(server, tmp_path):
    other, thread = start_server()
    try:
        ids = [f"{srv.base}/items/{n}" for n in range(6) for srv in (server, other)]
        for srv in (server, other):
            srv.replies.update({str(n): [("sleep", 0.05, 200)] for n in range(6)})
        ids_file = write_ids(tmp_path, ids)
        code, _, _ = run_cli([ids_file, "--concurrency", "4", "--per-host", "1"], fake=None)
        assert code == ExitCode.OK
        assert server.max_inflight == 1 and other.max_inflight == 1
        assert sum(server.hits.values()) == sum(other.hits.values()) == 6
    finally:
        other.shutdown()
        other.server_close()
        thread.join()


def test_retry_after_over_max_backoff_ends_the_pass_instead_of_sleeping(server, tmp_path):
    server.replies["t"] = [(429, b"", {"Retry-After": "120"}), 200]
    code, _, fake = crawl(server, tmp_path, ["t"], "--max-backoff", "60", "--cooldown", "30")
    assert code == ExitCode.OK
    [failed] = state(tmp_path, "failed.jsonl")
    assert failed["pass"] == 1 and failed["status"] == 429 and failed["tries"] == 1
    assert failed["retry_after"] == 120.0 and "120 s" in failed["error"]
    assert fake.sleeps == [120.0]  # the next pass waits what the server asked, not the 30 s cool-down
    assert server.hits["t"] == 2


def test_tries_cap_then_pass_two_redrives_only_failures(server, tmp_path):
    server.replies["flaky"] = [500, 500, 200]
    code, err, fake = crawl(server, tmp_path, ["ok1", "flaky", "ok2"], "--tries", "2", "--cooldown", "30")
    assert code == ExitCode.OK
    assert server.hits == Counter({"ok1": 1, "flaky": 3, "ok2": 1})
    [failed] = state(tmp_path, "failed.jsonl")
    assert failed == {"id": "flaky", "pass": 1, "bucket": "retryable", "status": 500, "cause": "status",
                      "error": "500 Internal Server Error", "tries": 2, "at": failed["at"], "due": failed["due"]}
    assert redrive.parse_iso(failed["due"]) - redrive.parse_iso(failed["at"]) == 30.0  # the cool-down
    assert fake.sleeps == [0.75, 30.0]
    assert state(tmp_path, "done.txt") == ["ok1", "ok2", "flaky"]
    assert "pass 2: re-driving" in err and "pass 2: 1 done" in err


def test_still_failing_after_the_last_pass_is_unavailable_with_reason_and_action(server, tmp_path):
    server.replies["bad"] = [500]
    code, err, fake = crawl(server, tmp_path, ["bad"], "--tries", "2", "--passes", "3", "--cooldown", "5")
    assert code == ExitCode.OK
    assert server.hits["bad"] == 6
    assert [f["pass"] for f in state(tmp_path, "failed.jsonl")] == [1, 2, 3]
    [record] = state(tmp_path, "unavailable.jsonl")
    assert record["reason"] == "500 Internal Server Error" and record["bucket"] == "retryable"
    assert record["action"] == "still 500 after 3 passes: check the item upstream, or rerun with --retry-unavailable"
    assert fake.sleeps == [0.75, 5.0, 0.75, 5.0, 0.75]
    assert crawl(server, tmp_path, ["bad"])[0] == ExitCode.OK
    assert server.hits["bad"] == 6


def test_empty_and_invalid_json_bodies_are_retried(server, tmp_path):
    server.replies["e"] = [(200, b"", {}), (200, b"  ", {}), 200]
    server.replies["j"] = [(200, b'{"trunc', {"Content-Type": "application/json"}), 200]
    code, _, _ = crawl(server, tmp_path, ["e", "j"])
    assert code == ExitCode.OK
    assert server.hits["e"] == 3 and server.hits["j"] == 2
    server.replies["z"] = [(200, b"", {})]
    crawl(server, tmp_path, ["z"], "--tries", "1", "--passes", "1")
    assert state(tmp_path, "unavailable.jsonl")[0]["reason"] == "empty body"
    [failed] = state(tmp_path, "failed.jsonl")
    assert failed["cause"] == state(tmp_path, "unavailable.jsonl")[0]["cause"] == "bad body"


@pytest.mark.parametrize("raw, headers, extra", [
    (b'\xef\xbb\xbf{"a":1}', {"Content-Type": "application/json"}, ()),  # IIS and .NET send it
    (b'\xef\xbb\xbf {"a":1}\n', {"Content-Type": "text/plain"}, ("--expect-json",)),
    (b'\xff\xfe' + '{"a":1}'.encode("utf-16-le"), {"Content-Type": "application/json; charset=utf-16"}, ()),
], ids=["UTF-8 BOM", "UTF-8 BOM, --expect-json", "UTF-16 BOM"])
def test_json_that_starts_with_a_byte_order_mark_is_json(server, tmp_path, raw, headers, extra):
    server.replies["b"] = [(200, raw, headers)]
    code, err, _ = crawl(server, tmp_path, ["b"], *extra)
    assert code == ExitCode.OK, err
    [result] = state(tmp_path, "results.jsonl")
    assert result["body"] == {"a": 1} and server.hits["b"] == 1


def test_204_and_head_answers_are_done_with_no_body(server, tmp_path):
    server.replies["n"] = [(204, b"", {})]
    code, err, _ = crawl(server, tmp_path, ["n"], "--method", "POST")
    assert code == ExitCode.OK, err
    assert [(r["id"], r["status"], r["body"]) for r in state(tmp_path, "results.jsonl")] == [("n", 204, None)]
    code, err, _ = crawl(server, tmp_path, ["h"], "--method", "HEAD", "--allow-config-change")
    assert code == ExitCode.OK, err
    assert state(tmp_path, "results.jsonl")[-1]["body"] is None and server.hits["h"] == 1


def test_an_empty_204_still_fails_a_body_check(server, tmp_path):
    server.replies["n"] = [(204, b"", {})]
    code, _, _ = crawl(server, tmp_path, ["n"], "--require-field", "id", "--tries", "1", "--passes", "1")
    assert state(tmp_path, "unavailable.jsonl")[0]["reason"] == "empty body"


def test_dropped_connection_is_retryable(server, tmp_path):
    server.replies["d"] = ["drop", 200]
    code, _, fake = crawl(server, tmp_path, ["d"])
    assert code == ExitCode.OK and server.hits["d"] == 2 and fake.sleeps == [0.75]


def test_a_refused_url_in_a_url_list_is_retryable_then_unavailable(tmp_path):
    ids = write_ids(tmp_path, ["http://127.0.0.1:9/x"])  # ids on many hosts: the URL's own problem
    code, err, fake = run_cli([ids, "--tries", "2", "--cooldown", "1"])
    assert code == ExitCode.OK
    assert [f["error"] for f in state(tmp_path, "failed.jsonl")] == ["connection refused"] * 2
    assert state(tmp_path, "unavailable.jsonl")[0]["status"] is None


def closed_port():
    """A local port nothing listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_api_stops_the_run_with_69_and_marks_nothing(tmp_path):
    ids = write_ids(tmp_path, [f"n{i}" for i in range(20)])
    url = f"http://127.0.0.1:{closed_port()}/items/{{id}}"
    code, err, fake = run_cli([ids, "--url", url, "--concurrency", "1", "--tries", "2", "--passes", "2"])
    assert code == ExitCode.UNREACHABLE == 69
    assert fake.sleeps == [0.75, 1.5, 3.0, 6.0]  # 4 probes (tries x passes), backing off
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["requests"] == redrive.DOWN_AFTER + 4
    assert report["counts"]["pending"] == 20 and report["unreachable"]["reason"] == "connection refused"
    assert state(tmp_path, "failed.jsonl") == [] and state(tmp_path, "unavailable.jsonl") == []
    assert "unreachable (connection refused)" in err and "nothing was marked failed" in err


def test_max_time_while_the_api_is_down_says_so(tmp_path):
    ids = write_ids(tmp_path, [f"n{i}" for i in range(8)])
    url = f"http://127.0.0.1:{closed_port()}/items/{{id}}"
    code, err, fake = run_cli([ids, "--url", url, "--concurrency", "1", "--max-time", "3"])
    assert code == ExitCode.INCOMPLETE
    assert "--max-time 3 s reached" in err and "unreachable (connection refused) since" in err
    assert state(tmp_path, "failed.jsonl") == []


def test_an_unreachable_api_is_exit_69_in_a_real_process(tmp_path):
    ids = write_ids(tmp_path, [f"n{i}" for i in range(10)])
    url = f"http://127.0.0.1:{closed_port()}/items/{{id}}"
    cmd = redrive_cmd(ids, "--url", url, "--backoff", "0.01", "--max-backoff", "0.02", "--tries", "1", "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 69 and "Traceback" not in proc.stderr
    assert "unreachable (connection refused)" in proc.stderr and "10 x pending" in proc.stderr


class ServerComesBack(FakeTime):
    """Fake time; the server starts listening on `port` at the n-th sleep."""

    def __init__(self, port, at_sleep):
        super().__init__()
        self.port, self.at_sleep, self.server = port, at_sleep, None

    def sleep(self, seconds):
        super().sleep(seconds)
        if len(self.sleeps) == self.at_sleep:
            self.server, self.thread = start_server(self.port)


def test_an_api_that_comes_back_resumes_the_run_and_no_try_was_spent(tmp_path):
    port = closed_port()
    ids = write_ids(tmp_path, [f"n{i}" for i in range(12)])
    fake = ServerComesBack(port, at_sleep=2)
    try:
        code, err, _ = run_cli([ids, "--url", f"http://127.0.0.1:{port}/items/{{id}}", "--concurrency", "1",
                                "--tries", "2"], fake=fake)
        assert code == ExitCode.OK, err
        assert fake.sleeps == [0.75, 1.5]
        assert "answers again" in err
        assert sorted(state(tmp_path, "done.txt")) == sorted(f"n{i}" for i in range(12))
        assert state(tmp_path, "failed.jsonl") == []  # requests that never reached the host spent no try
        assert set(fake.server.hits.values()) == {1}
    finally:
        fake.server.shutdown()
        fake.server.server_close()
        fake.thread.join()


def test_unreachable_hosts_of_url_ids_are_that_urls_problem(tmp_path):
    dead = f"http://127.0.0.1:{closed_port()}"
    ids = write_ids(tmp_path, [f"{dead}/items/{i}" for i in range(8)])
    code, err, _ = run_cli([ids, "--tries", "1", "--passes", "1"])
    assert code == ExitCode.OK
    assert len(state(tmp_path, "unavailable.jsonl")) == 8
    assert "host not reachable (connection refused)" in err


def test_never_connected_tells_a_dead_host_from_a_failing_answer(server):
    import requests
    server.replies["d"] = ["drop"]
    server.replies["s"] = [("sleep", 0.5, 200)]
    failures = {}
    for name, url in [("refused", f"http://127.0.0.1:{closed_port()}/"), ("dropped", server.base + "/items/d"),
                      ("read timeout", server.base + "/items/s")]:
        with pytest.raises(requests.RequestException) as caught:
            requests.get(url, timeout=0.2)
        failures[name] = redrive.never_connected(caught.value)
    assert failures == {"refused": True, "dropped": False, "read timeout": False}


@pytest.fixture
def tls_server(tmp_path):
    """An https server whose certificate comes from a throwaway CA; .ca_file is that CA."""
    import trustme
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    srv, thread = start_server(tls=context)
    srv.ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(srv.ca_file))
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


def test_https_with_the_ca_bundle_named_in_the_environment(tls_server, tmp_path, monkeypatch):
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_server.ca_file))
    code, err, _ = crawl(tls_server, tmp_path, ["a", "b"])
    assert code == ExitCode.OK, err
    assert state(tmp_path, "done.txt") == ["a", "b"] and tls_server.hits == Counter({"a": 1, "b": 1})


def test_an_untrusted_certificate_is_a_tls_error_and_never_retried(tls_server, tmp_path, monkeypatch):
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    code, err, fake = crawl(tls_server, tmp_path, ["a"])
    assert code == ExitCode.OK
    [record] = state(tmp_path, "unavailable.jsonl")
    assert record["reason"] == "TLS error (certificate or handshake)" and record["tries"] == 1
    assert fake.sleeps == [] and not tls_server.hits  # no request ever got through


def test_timeout_is_retryable_and_named(server, tmp_path):
    server.replies["slow"] = [("sleep", 3.0, 200), 200]
    code, _, _ = crawl(server, tmp_path, ["slow"], "--timeout", "1", "--tries", "1", "--cooldown", "0")
    assert code == ExitCode.OK
    assert state(tmp_path, "failed.jsonl")[0]["error"] == "timeout after 1 s"
    assert server.hits["slow"] == 2


def test_custom_retry_and_skip_sets(server, tmp_path):
    server.replies["a"] = [403, 200]
    server.replies["b"] = [503]
    code, _, _ = crawl(server, tmp_path, ["a", "b"], "--retry", "403", "--skip", "503")
    assert code == ExitCode.OK
    assert server.hits == Counter({"a": 2, "b": 1})


# ------------------------------------------------------------ resume, runs


def test_resume_skips_ids_in_done_file(server, tmp_path):
    assert crawl(server, tmp_path, ["a", "b"])[0] == ExitCode.OK
    code, err, _ = crawl(server, tmp_path, ["a", "b", "c"])
    assert code == ExitCode.OK
    assert server.hits == Counter({"a": 1, "b": 1, "c": 1})
    assert "3 ids, 1 to fetch" in err


def test_a_run_keeps_only_the_ids_still_to_do_and_counts_the_rest_done(server, tmp_path):
    assert crawl(server, tmp_path, ["a", "b", "c"])[0] == ExitCode.OK
    with open(tmp_path / "ids.redrive" / "done.txt", "a") as fh:
        fh.write("stranger\n")  # done by an older list: not in this one
    code, err, _ = crawl(server, tmp_path, ["a", "b", "c", "d", "c", "e"])
    assert code == ExitCode.OK and "6 ids" not in err and "5 ids, 2 to fetch" in err
    assert server.hits == Counter({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["counts"] == {"input": 5, "duplicates": 1, "done": 5, "unavailable": 0, "failed": 0, "pending": 0}


def test_cooldown_counts_from_the_failure_across_runs(server, tmp_path):
    server.replies["f"] = [500, 200]
    fake = FakeTime()
    code, err, fake = crawl(server, tmp_path, ["f"], "--tries", "1", "--cooldown", "30", "--max-time", "10", fake=fake)
    assert code == ExitCode.INCOMPLETE and "--max-time" in err
    assert server.hits["f"] == 1
    assert fake.sleeps == []  # pass two is due after --max-time: the run ends now, it does not wait 10 s
    assert "nothing is due before 2023-11-14T22:30:30.000000Z" in err  # the failure's time + 30 s
    later = FakeTime()
    later.now += 12  # the rerun starts 12 s after the failure: 18 s of cool-down remain
    code, _, later = crawl(server, tmp_path, ["f"], "--tries", "1", "--cooldown", "30", fake=later)
    assert code == ExitCode.OK
    assert later.sleeps == [18.0] and server.hits["f"] == 2


def test_retry_unavailable_brings_ids_back_for_one_run(server, tmp_path):
    server.replies["g"] = [404, 200]
    assert crawl(server, tmp_path, ["g"])[0] == ExitCode.OK
    assert crawl(server, tmp_path, ["g"])[0] == ExitCode.OK and server.hits["g"] == 1
    assert crawl(server, tmp_path, ["g"], "--retry-unavailable")[0] == ExitCode.OK
    assert server.hits["g"] == 2 and state(tmp_path, "done.txt") == ["g"]


def test_retry_unavailable_with_classes_asks_again_only_those_and_keeps_one_line_per_id(server, tmp_path):
    gone, broken = [f"g{n}" for n in range(20)], ["e500", "e503", "slow"]
    server.replies.update({item: [404] for item in gone})
    server.replies.update({"e500": [500, 500, 200], "e503": [503, 503, 200], "slow": [("sleep", 2.5, 200)] * 2 + [200]})
    ids = gone + broken
    code, _, _ = crawl(server, tmp_path, ids, "--tries", "1", "--passes", "1", "--timeout", "1", "--no-guard")
    assert code == ExitCode.OK and len(state(tmp_path, "unavailable.jsonl")) == 23
    server.hits.clear()
    code, err, _ = crawl(server, tmp_path, ids, "--retry-unavailable", "5xx,timeout", "--tries", "1", "--passes", "1")
    assert code == ExitCode.OK, err
    assert set(server.hits) == set(broken)  # the 404s are not paid for again
    records, done = state(tmp_path, "unavailable.jsonl"), state(tmp_path, "done.txt")
    assert done and len(records) == len({r["id"] for r in records})  # one line per id, the last one
    assert {r["id"] for r in records} == set(ids) - set(done)  # an id that came back is unavailable no more
    code, err, _ = crawl(server, tmp_path, ids, "--retry-unavailable", "500")
    assert code == ExitCode.OK and "e500" in state(tmp_path, "done.txt") and server.hits["g0"] == 0
    code, err, _ = crawl(server, tmp_path, ids, "--retry-unavailable", "5xz")
    assert code == ExitCode.USAGE and "'5xz' is no class" in err and err.count("\n") == 1


def test_failed_id_resumes_at_the_pass_it_reached(server, tmp_path):
    server.replies["f"] = [500]
    fake = FakeTime()
    code, _, _ = crawl(server, tmp_path, ["f"], "--tries", "1", "--passes", "3", "--cooldown", "50",
                       "--max-time", "1", fake=fake)
    assert code == ExitCode.INCOMPLETE
    assert [f["pass"] for f in state(tmp_path, "failed.jsonl")] == [1]
    code, _, _ = crawl(server, tmp_path, ["f"], "--tries", "1", "--passes", "3", "--cooldown", "50", fake=fake)
    assert code == ExitCode.OK
    assert [f["pass"] for f in state(tmp_path, "failed.jsonl")] == [1, 2, 3]
    assert server.hits["f"] == 3


def test_max_time_starts_no_new_request_and_exits_1(server, tmp_path):
    server.replies["f"] = [500, 200]
    code, err, fake = crawl(server, tmp_path, ["f", "g"], "--max-time", "0.5")
    assert code == ExitCode.INCOMPLETE
    assert server.hits == Counter({"f": 1, "g": 1})
    assert summary_count(err, "pending") == 1
    assert crawl(server, tmp_path, ["f", "g"])[0] == ExitCode.OK
    assert server.hits == Counter({"f": 2, "g": 1})


class SlowStart(FakeTime):
    """A clock on which the run's set-up takes `setup` seconds: it moves on
    once the run has read it first, before anything is sent."""

    def __init__(self, setup):
        super().__init__()
        self.setup, self.reads = setup, 0

    def clock(self):
        self.reads += 1
        if self.reads == 2:
            self.now += self.setup
        return self.now


@pytest.mark.parametrize("setup, sent", [(5.0, 0), (0.0, 3)])
def test_max_time_counts_from_the_start_of_the_run_reading_the_state_included(server, tmp_path, setup, sent):
    code, err, _ = crawl(server, tmp_path, ["a", "b", "c"], "--max-time", "4", fake=SlowStart(setup))
    assert sum(server.hits.values()) == sent and summary_count(err, "pending") == 3 - sent
    assert code == (ExitCode.INCOMPLETE if sent < 3 else ExitCode.OK)
    assert crawl(server, tmp_path, ["a", "b", "c"])[0] == ExitCode.OK and sum(server.hits.values()) == 3


def test_a_list_longer_than_what_a_run_holds_is_asked_in_file_order_once_each(monkeypatch):
    monkeypatch.setattr(redrive, "LOOKAHEAD", 16)  # the run holds 16 untried ids; the file has 30 times that
    asked = []

    def serve(item, n, now):
        asked.append(item)
        return (404, {}, b"") if item % 7 == 0 else (200, {}, b'{"ok":1}')
    run = drive(serve, 500, cap=8)
    assert asked == list(range(500)) and len(run["ended"]) == 500


def test_hosts_further_on_in_a_list_of_urls_are_asked_while_the_first_host_is_shut(server, tmp_path, monkeypatch):
    monkeypatch.setattr(redrive, "LOOKAHEAD", 20)  # the shut host's ids alone fill what the run holds
    spent = (200, b'{"ok":1}', {"RateLimit-Limit": "1", "RateLimit-Remaining": "0", "RateLimit-Reset": "30"})
    server.replies.update({f"a{n}": [spent] for n in range(30)})  # one request each 30 s
    port = server.server_address[1]
    ids = [f"http://127.0.0.1:{port}/items/a{n}" for n in range(30)] + \
          [f"http://localhost:{port}/items/b{n}" for n in range(10)]
    assert run_cli([write_ids(tmp_path, ids), "--concurrency", "4"])[0] == ExitCode.OK
    fetched = {r["id"].rsplit("/", 1)[1]: r["fetched_at"] for r in state(tmp_path, "results.jsonl")}
    shut = sorted({t for i, t in fetched.items() if i.startswith("a")})
    assert len(fetched) == 40 and len(shut) > 20  # its quota let through one request a window
    assert max(t for i, t in fetched.items() if i.startswith("b")) < shut[1]  # before the first window renewed


def test_exhausted_record_without_unavailable_line_is_settled_on_start(server, tmp_path):
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / "failed.jsonl").write_text(json.dumps(
        {"id": "x", "pass": 2, "bucket": "retryable", "status": 503, "error": "503 Service Unavailable",
         "tries": 5, "at": "2026-01-01T00:00:00.000000Z"}) + "\n")
    assert crawl(server, tmp_path, ["x"])[0] == ExitCode.OK
    assert server.hits["x"] == 0
    assert state(tmp_path, "unavailable.jsonl")[0]["reason"] == "503 Service Unavailable"


def test_torn_last_line_is_cut_with_a_warning(server, tmp_path):
    crawl(server, tmp_path, ["a"])
    with open(tmp_path / "ids.redrive" / "results.jsonl", "ab") as fh:
        fh.write(b'{"id":"b","url":"htt')
    code, err, _ = crawl(server, tmp_path, ["a", "b"])
    assert code == ExitCode.OK and "torn last line" in err
    assert [r["id"] for r in state(tmp_path, "results.jsonl")] == ["a", "b"]


def test_times_in_the_future_left_by_a_clock_that_was_ahead_count_as_now_with_a_warning(server, tmp_path):
    server.replies["gone"] = [404]
    crawl(server, tmp_path, ["gone", "ok"])
    ahead = redrive.iso(FakeTime().wallclock() + 3 * 365 * 86400)
    run_json = tmp_path / "ids.redrive" / "run.json"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "verdicts_since": ahead}))
    failed = {"id": "late", "pass": 1, "bucket": "retryable", "status": 500, "cause": "status", "error": "500",
              "tries": 5, "at": ahead, "due": ahead}
    with open(tmp_path / "ids.redrive" / "failed.jsonl", "a") as fh:
        fh.write(json.dumps(failed) + "\n")
    code, err, fake = crawl(server, tmp_path, ["gone", "ok", "late"])
    # before: "nothing is due before 2029", exit 1 on every rerun, and the 404 asked again on each
    assert code == ExitCode.OK and "in the future" in err
    assert server.hits["gone"] == 1 and server.hits["late"] == 1 and "late" in state(tmp_path, "done.txt")
    assert fake.sleeps == [30.0]  # its cool-down, counted from now


def test_result_whose_done_line_was_lost_is_completed_not_fetched(server, tmp_path):
    crawl(server, tmp_path, ["a", "b"])
    done = tmp_path / "ids.redrive" / "done.txt"
    done.write_text("a\n")
    code, err, _ = crawl(server, tmp_path, ["a", "b"])
    assert code == ExitCode.OK and server.hits["b"] == 1
    assert state(tmp_path, "done.txt") == ["a", "b"] and "whose result was stored" in err


def test_duplicate_ids_are_processed_once_and_counted(server, tmp_path):
    code, err, _ = crawl(server, tmp_path, ["a", "b", "a", "a"])
    assert code == ExitCode.OK and server.hits == Counter({"a": 1, "b": 1})
    assert "2 ids (2 duplicate lines ignored)" in err


def test_ids_file_tolerates_bom_crlf_comments_and_blanks(server, tmp_path):
    path = tmp_path / "ids.txt"
    path.write_bytes(b"\xef\xbb\xbf# products\r\n  a1  \r\n\r\n#b\r\nc3\r\n")
    code, _, _ = run_cli([path, "--url", server.template])
    assert code == ExitCode.OK and server.hits == Counter({"a1": 1, "c3": 1})


@pytest.mark.parametrize("raw", [b"a1\rb2\rc3\r", b"a1\rb2\r\nc3"], ids=["CR alone", "CR and CRLF mixed"])
def test_line_endings_cr_alone_ends_a_line_so_the_file_is_three_ids(server, tmp_path, raw):
    path = tmp_path / "ids.txt"
    path.write_bytes(raw)
    code, err, _ = run_cli([path, "--url", server.template])
    assert code == ExitCode.OK, err
    assert server.hits == Counter({"a1": 1, "b2": 1, "c3": 1})


@pytest.mark.parametrize("sep", ["\u2028", "\x85", "\x0b", "\x1e"], ids=["U+2028", "NEL", "VT", "RS"])
def test_line_endings_any_other_line_break_inside_an_id_is_one_line_naming_it_and_exit_2(server, tmp_path, sep):
    path = tmp_path / "ids.txt"
    path.write_text(f"a1\nb2{sep}c3\n", encoding="utf-8")
    code, err, _ = run_cli([path, "--url", server.template])
    assert code == ExitCode.USAGE and "line 2" in err and "line break" in err and err.count("\n") == 1
    assert not server.hits


def test_an_id_of_a_megabyte_is_cut_in_every_line_and_report_and_kept_whole_in_the_ledgers(server, tmp_path):
    huge = "h" * 1_000_000 + "-end"
    server.replies[huge] = [404]
    code, err, _ = crawl(server, tmp_path, [huge, "ok"], "--url", server.base + "/items?q={id}")
    assert code == ExitCode.OK and "(1000004 characters)" in err and "-end" in err
    assert max(map(len, err.splitlines())) < 1000
    report = (tmp_path / "ids.redrive" / "report.json").read_text()
    assert len(report) < 20_000 and "(1000004 characters)" in report
    assert [r["id"] for r in state(tmp_path, "unavailable.jsonl")] == [huge]  # the ledger keeps it whole


def past_python_start(pid):
    """Is the process running redrive's own lines (Linux: its socket module is loaded, which redrive
    imports after its first handler)? The interpreter's own start is Python's, out of redrive's reach."""
    try:
        return "_socket" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True  # gone, or no /proc: send it now


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2, 0.4])
def test_a_ctrl_c_at_any_moment_of_the_start_exits_130_with_one_line_and_no_traceback(tmp_path, delay):
    ids = write_ids(tmp_path, ["a", "b"])
    proc = subprocess.Popen([sys.executable, str(HERE / "redrive.py"), str(ids), "--url",
                             "http://127.0.0.1:9/{id}", "--timeout", "5"], stderr=subprocess.PIPE, text=True)
    while not past_python_start(proc.pid):
        time.sleep(0.001)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # the first Ctrl+C lost: a failure, and no process left behind
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize("url", ["http://a b/{id}", "https://%zz/{id}", "http://.../{id}",
                                 "http://" + "a" * 300 + ".example/{id}", "http://[::1]]/{id}",
                                 "http://exa$mple.com/{id}"],
                         ids=["a space", "a percent", "dots only", "a 300-character label", "a stray ']'", "a '$'"])
def test_local_fault_a_url_whose_host_cannot_be_valid_is_one_line_exit_2_before_any_request(tmp_path, url):
    code, err, _ = run_cli([write_ids(tmp_path, ["a", "b"]), "--url", url])
    assert code == ExitCode.USAGE and err.count("\n") == 1 and "--url" in err
    assert not (tmp_path / "ids.redrive" / "unavailable.jsonl").exists()


def test_id_cannot_change_the_path_or_query(server, tmp_path):
    code, _, _ = crawl(server, tmp_path, ["a/../b?x=1&y"])
    assert code == ExitCode.OK
    assert server.paths == ["/items/a%2F..%2Fb%3Fx%3D1%26y"]
    assert state(tmp_path, "done.txt") == ["a/../b?x=1&y"]


def test_full_url_ids_are_used_as_they_are(server, tmp_path):
    ids = write_ids(tmp_path, [server.base + "/items/p?q=1", server.base + "/items/r"])
    code, _, _ = run_cli([ids])
    assert code == ExitCode.OK and sorted(server.paths) == ["/items/p?q=1", "/items/r"]


def test_redirect_keeps_the_input_id_and_notes_final_url(server, tmp_path):
    server.replies["old"] = [(301, b"", {"Location": "/items/new"})]
    code, _, _ = crawl(server, tmp_path, ["old"])
    assert code == ExitCode.OK
    [result] = state(tmp_path, "results.jsonl")
    assert result["id"] == "old" and result["final_url"] == server.base + "/items/new"
    assert state(tmp_path, "done.txt") == ["old"]


def test_a_cookie_the_api_sets_is_sent_back_on_later_requests(server, tmp_path):
    server.replies["a"] = [(200, b'{"id": "a"}', {"Set-Cookie": "sid=abc123; Path=/"})]
    code, _, _ = crawl(server, tmp_path, ["a", "b"])
    assert code == ExitCode.OK
    assert "Cookie" not in server.seen_headers[0]
    assert server.seen_headers[1].get("Cookie") == "sid=abc123"


def test_netrc_credentials_are_sent_to_their_host_and_recorded_nowhere(server, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login robot password {SECRET}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    code, _, _ = crawl(server, tmp_path, ["a", "b"])
    assert code == ExitCode.OK
    expected = "Basic " + base64.b64encode(f"robot:{SECRET}".encode()).decode()
    assert [h.get("Authorization") for h in server.seen_headers] == [expected, expected]
    assert SECRET not in "".join(p.read_text() for p in (tmp_path / "ids.redrive").iterdir() if p.is_file())


def test_a_netrc_password_echoed_back_by_the_server_is_never_shown(server, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login robot password {SECRET}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    basic = base64.b64encode(f"robot:{SECRET}".encode()).decode()
    server.replies["a"] = [(401, f"bad credentials: Basic {basic} ({SECRET})".encode(), {})]
    code, err, _ = crawl(server, tmp_path, ["a"])
    assert code == ExitCode.FATAL and "bad credentials" in err
    assert SECRET not in err and basic not in err
    assert SECRET not in (tmp_path / "ids.redrive" / "report.json").read_text()


@pytest.mark.parametrize("url, data", [
    ("http://{host}/items/{{id}}", '{"id":"{id}","api_key":"' + SECRET + '"}'),
    ("http://" + SECRET + "@{host}/items/{{id}}", None),
    ("http://{host}/items/{{id}}?x=1;api%5Fkey=" + SECRET, None),
    ("http://{host}/items/{{id}}?pwd=" + SECRET, None),
    ("http://me@mail.example:p@" + SECRET + "@{host}/items/{{id}}", None),  # urllib3 splits at the last '@'
    ("http://me%40mail.example:p%40" + SECRET + "@{host}/items/{{id}}", None),
    ("http://{host}/items/{{id}}?appid=" + SECRET, None),  # OpenWeatherMap
    ("http://{host}/items/{{id}}?ak=" + SECRET + "&lang=en", None),  # Baidu
    ("http://{host}/items/{{id}}?license=" + SECRET, None),
    ("http://{host}/items/{{id}}?" + SECRET, None),  # a bare token as the query
    ("http://{host}/items/{{id}}", '{"id":"{id}","n":' + SECRET_NUMBER + '}'),
    ("http://{host}/items/{{id}}", '{"id":"{id}","list":["' + SECRET + '"]}'),
    ("http://{host}/items/{{id}}", '<req><id>{id}</id><k>' + SECRET + '</k></req>'),
    ("http://{host}/items/{{id}}", '{"query":"{ item(id: \\"{id}\\", key: \\"' + SECRET + '\\") { name } }"}'),
    ("http://{host}/items/{{id}}", '{"id":"{id}","t\\u006fken":"' + SECRET + '"}'),
    ("http://{host}/items/{{id}}", 'id={id}&sig=' + SECRET),
], ids=["a key in --data", "a token as userinfo", "a percent-encoded name after ';'", "a short name",
        "userinfo with '@' in the login and the password", "userinfo percent-encoded", "appid", "ak",
        "license", "a bare query token", "a number in --data", "an array in --data", "XML --data",
        "a GraphQL argument", "an escaped JSON name", "a form field"])
def test_class_secrets_are_kept_only_when_known_not_to_be_ones(server, tmp_path, url, data):
    host = urlsplit(server.base).netloc
    extra = ["--data", data, "--method", "POST"] if data else []
    ids_file = write_ids(tmp_path, ["a", "b"])
    code, err, _ = run_cli([ids_file, "--url", url.format(host=host), "-v", *extra])
    assert code == ExitCode.OK, err
    for secret in (SECRET, SECRET_NUMBER):
        assert secret not in err and secret not in all_output(tmp_path)
    with open(ids_file, "a") as fh:
        fh.write("c\n")
    code, err, _ = run_cli([ids_file, "--url", url.format(host=host), *extra])  # the same request: no change
    assert code == ExitCode.OK and "changed" not in err, err
    code, err, _ = run_cli([ids_file])  # a bare rerun: what run.json could not keep is asked for again
    assert code == ExitCode.USAGE and "again" in err and SECRET not in err


def test_quiet_speaks_once_when_ids_went_unavailable_then_is_silent_again(server, tmp_path):
    server.replies["bad"] = [500]
    ids = ["a", "bad"]
    code, err, _ = crawl(server, tmp_path, ids, "-q", "--tries", "1")
    assert code == ExitCode.OK
    assert "1 x 500 Internal Server Error: still 500 after 2 passes" in err and "\n      bad\n" in err
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["new_unavailable"] == 1 and report["unresolved"][0]["new"] is True
    code, err, _ = crawl(server, tmp_path, [*ids, "c"], "-q")
    assert code == ExitCode.OK and err == ""  # nothing new for a person: cron mails nothing
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["new_unavailable"] == 0 and report["unresolved"][0]["new"] is False


def test_the_cron_mail_names_what_this_run_changed_and_counts_the_older_residue(server, tmp_path):
    old = [f"old{n}" for n in range(36)]
    server.replies.update({item: [404] for item in old})
    crawl(server, tmp_path, ["a", *old], "-q", "--no-guard")  # a row of 36 404s: the guard would halt it
    new = [f"new{n}" for n in range(100)]
    gone = new[:30:3] + new[40:70:3]  # 20 new 404s, in no row the guard would halt
    server.replies.update({item: [404] for item in gone})
    server.replies["new99"] = [404]
    code, err, _ = crawl(server, tmp_path, ["a", *old, *new], "-q")
    assert code == ExitCode.OK
    assert "  21 x 404 Not Found: not found (404): check them or drop them from the input list" in err
    assert f"      {', '.join(gone)} and 1 more\n" in err  # every new id up to 20 a reason
    assert f"      all of them: redrive.py {tmp_path / 'ids.txt'} --export gone\n" in err
    assert f"(state in {tmp_path / 'ids.redrive'})" in err
    assert "and 36 ids unavailable from earlier runs: see unavailable.jsonl" in err and "old0" not in err
    code, err, _ = crawl(server, tmp_path, ["a", *old, *new], "-q", "--retry-unavailable", "404", "--no-guard")
    assert code == ExitCode.OK and err == ""  # the same 404s again: no news, no mail
    server.replies["z"] = [401]  # the wrong key: the mail says so, and carries no old residue
    code, err, _ = crawl(server, tmp_path, ["a", *old, *new, "z", "y"], "-q", "--concurrency", "1")
    assert code == ExitCode.FATAL and "halted: 401" in err and "old0" not in err and "new0" not in err


def test_quiet_prints_nothing_on_success_and_the_summary_on_failure(server, tmp_path):
    code, err, _ = crawl(server, tmp_path, ["a"], "-q")
    assert code == ExitCode.OK and err == ""
    server.replies["b"] = [401]
    code, err, _ = crawl(server, tmp_path, ["a", "b"], "-q")
    assert code == ExitCode.FATAL and "401 Unauthorized" in err


def test_summary_names_a_few_ids_of_each_reason_and_the_ones_to_act_on_first(server, tmp_path):
    ids = [f"g{n}" for n in range(23)] + ["down1", "down2"]
    for item in ids:
        server.replies[item] = [503] if item.startswith("down") else [404]
    code, err, _ = crawl(server, tmp_path, ids, "--no-guard", "--tries", "1", "--cooldown", "0")
    assert code == ExitCode.OK
    lines = err.splitlines()
    residue = lines[lines.index("what is missing, and what to do:") + 1:]
    # the ids a person can act on (a 503 that may pass) before the 23 identical definitive answers
    assert residue[0].startswith("  2 x 503 Service Unavailable") and residue[1] == "      down1, down2"
    assert residue[2].startswith("  23 x 404 Not Found") and residue[3] == "      g0, g1, g2 and 20 more"
    assert len(residue) == 4


def test_demo_runs_the_normal_path_to_a_settled_end(tmp_path):
    ids = tmp_path / "sample_ids.txt"
    ids.write_bytes((HERE / "sample_ids.txt").read_bytes())
    code, err, _ = run_cli([ids, "--demo"], fake=FastForward())
    assert code == ExitCode.OK, err
    assert "pass 2: " in err and "404 Not Found" in err and "500 Internal Server Error" in err
    unavailable = state(tmp_path, "unavailable.jsonl", stem="sample_ids")
    assert len(unavailable) == 7
    assert len(state(tmp_path, "done.txt", stem="sample_ids")) == 43


@pytest.mark.parametrize("stop_after", [0.3, 1.5, 3.0])
def test_a_demo_stopped_and_resumed_ends_as_one_that_ran_through(tmp_path, stop_after):
    ids = tmp_path / "sample_ids.txt"
    ids.write_bytes((HERE / "sample_ids.txt").read_bytes())
    code, err, _ = run_cli([ids, "--demo", "--max-time", stop_after], fake=FastForward())
    assert code == ExitCode.INCOMPLETE, err
    code, err, _ = run_cli([ids], fake=FastForward())  # the restarted demo server knows what was asked
    assert code == ExitCode.OK, err
    assert len(state(tmp_path, "unavailable.jsonl", stem="sample_ids")) == 7  # 8 or 9 when it forgot
    assert len(state(tmp_path, "done.txt", stem="sample_ids")) == 43


# ----------------------------------------------------------------- refresh


def version(item, number):
    return json.dumps({"id": item, "v": number}).encode()


def asked(server):
    """Each request the server received: (id, If-None-Match, If-Modified-Since)."""
    return [(unquote(path.split("?")[0].split("/items/")[-1]), headers.get("If-None-Match"),
             headers.get("If-Modified-Since")) for path, headers in zip(server.paths, server.seen_headers)]


def latest(tmp_path, name="results.jsonl"):
    return {r["id"]: r for r in state(tmp_path, name)}


def test_a_refresh_asks_with_the_stored_validators_and_stores_only_what_changed(server, tmp_path):
    dated = "Tue, 01 Dec 2026 10:00:00 GMT"
    server.versions.update({"same": ('"s1"', version("same", 1)), "new": ('W/"n1"', version("new", 1)),
                            "gone": ('"g1"', version("gone", 1)), "dated": (None, version("dated", 1), dated)})
    ids, fake = ["same", "new", "gone", "dated"], FakeTime()
    assert crawl(server, tmp_path, ids, fake=fake)[0] == ExitCode.OK
    assert {i: (r.get("etag"), r.get("last_modified")) for i, r in latest(tmp_path).items()} == {
        "same": ('"s1"', None), "new": ('W/"n1"', None), "gone": ('"g1"', None), "dated": (None, dated)}
    server.versions.update({"new": ('W/"n2"', version("new", 2)), "gone": ('"g1"', 404)})
    server.paths.clear(), server.seen_headers.clear()
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, ids, "--refresh", fake=fake)
    assert code == ExitCode.OK, err
    assert sorted(asked(server)) == [("dated", None, dated), ("gone", '"g1"', None), ("new", 'W/"n1"', None),
                                     ("same", '"s1"', None)]
    results = state(tmp_path, "results.jsonl")
    assert len(results) == 5 and results[-1]["id"] == "new" and results[-1]["body"] == {"id": "new", "v": 2}
    assert results[-1]["etag"] == 'W/"n2"' and state(tmp_path, "done.txt") == ids  # no id listed twice
    assert {i: (r["result"], r["status"]) for i, r in latest(tmp_path, "refreshed.jsonl").items()} == {
        "same": ("unchanged", 304), "new": ("changed", 200), "gone": ("gone", 404), "dated": ("unchanged", 304)}
    [gone] = state(tmp_path, "unavailable.jsonl")
    assert gone["id"] == "gone" and gone["reason"] == "removed upstream since its last fetch (404 Not Found)"
    assert "refresh: 4 of 4 ids fetched before" in err and "2 unchanged, 1 changed, 1 gone, 0 kept" in err
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert (report["counts"]["done"], report["counts"]["unavailable"]) == (3, 1)
    assert {k: report["refresh"][k] for k in ("due", "unchanged", "changed", "gone", "kept", "left")} == {
        "due": 4, "unchanged": 2, "changed": 1, "gone": 1, "kept": 0, "left": 0}
    assert "refresh" not in json.loads((tmp_path / "ids.redrive" / "run.json").read_text())  # it is over
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--check"], out=out) == ExitCode.OK
    assert summary_count(out.getvalue(), "done") == 3 and summary_count(out.getvalue(), "unavailable") == 1
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--export", "jsonl"], out=out) == ExitCode.OK
    assert [json.loads(line)["body"] for line in out.getvalue().splitlines()] == [
        {"id": "same", "v": 1}, {"id": "new", "v": 2}, {"id": "dated", "v": 1}]  # the last line wins; gone is out
    server.paths.clear(), server.seen_headers.clear()
    fake.now += 60
    assert crawl(server, tmp_path, ids, "--refresh-older-than", "1h", fake=fake)[0] == ExitCode.OK
    assert asked(server) == []  # a 304 moved each fetch time on
    fake.now += 7200
    out = io.StringIO()
    redrive.main([str(tmp_path / "ids.txt"), "--refresh-older-than", "1h", "--dry-run"], out=out,
                 fx=fake.effects())
    assert "3 done to refresh" in out.getvalue() and 'GET ' + server.base + '/items/new, If-None-Match: W/"n2"' in \
        out.getvalue()
    assert crawl(server, tmp_path, ids, "--refresh-older-than", "1h", fake=fake)[0] == ExitCode.OK
    assert sorted(asked(server)) == [("dated", None, dated), ("new", 'W/"n2"', None), ("same", '"s1"', None)]


def test_a_server_that_ignores_validators_costs_a_body_but_no_result_line_unless_the_body_changed(server, tmp_path):
    server.replies.update({"a": [200], "b": [200, (200, b'{"id": "b", "v": 2}', {"Content-Type": "application/json"})]})
    fake = FakeTime()
    assert crawl(server, tmp_path, ["a", "b"], fake=fake)[0] == ExitCode.OK
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, ["a", "b"], "--refresh", fake=fake)
    assert code == ExitCode.OK, err
    assert [i for i, match, since in asked(server)] == ["a", "b", "a", "b"] and \
        all(match is since is None for _, match, since in asked(server))  # no validator to send
    assert [r["id"] for r in state(tmp_path, "results.jsonl")] == ["a", "b", "b"]
    assert {i: r["result"] for i, r in latest(tmp_path, "refreshed.jsonl").items()} == {"a": "unchanged",
                                                                                        "b": "changed"}


def test_the_same_body_under_a_new_etag_is_unchanged_and_the_next_refresh_sends_the_new_etag(server, tmp_path):
    server.versions["a"], fake = ('"a1"', version("a", 1)), FakeTime()
    crawl(server, tmp_path, ["a"], fake=fake)
    server.versions["a"] = ('"a2"', version("a", 1))  # re-encoded upstream: a new ETag, the same bytes
    seen = []
    for _ in range(3):
        fake.now += 60
        assert crawl(server, tmp_path, ["a"], "--refresh", fake=fake)[0] == ExitCode.OK
        seen += [(r["result"], r["status"], r.get("etag")) for r in state(tmp_path, "refreshed.jsonl")]
    assert [match for _, match, _ in asked(server)] == [None, '"a1"', '"a2"', '"a2"']  # the new one, each time after
    assert len(state(tmp_path, "results.jsonl")) == 1  # no new line for the same body
    assert seen == [("unchanged", 200, '"a2"'), ("unchanged", 304, '"a2"'), ("unchanged", 304, '"a2"')]
    server.versions["a"] = ('"a2"', version("a", 1), "Tue, 01 Dec 2026 10:00:00 GMT")  # a Last-Modified too
    fake.now += 60
    crawl(server, tmp_path, ["a"], "--refresh", fake=fake)
    assert latest(tmp_path, "refreshed.jsonl")["a"]["last_modified"] == "Tue, 01 Dec 2026 10:00:00 GMT"
    fake.now += 60
    crawl(server, tmp_path, ["a"], "--refresh", fake=fake)
    assert asked(server)[-1] == ("a", '"a2"', "Tue, 01 Dec 2026 10:00:00 GMT")  # both kept, neither dropped


def test_a_validator_too_long_or_not_printable_is_neither_kept_nor_sent_back(server, tmp_path):
    server.versions.update({"long": ('"' + "x" * 600 + '"', version("long", 1)),
                            "odd": ('"a\tb"', version("odd", 1), "Tue, 01 Dec 2026 10:00:00 GMT\x7f")})
    fake = FakeTime()
    assert crawl(server, tmp_path, ["long", "odd"], fake=fake)[0] == ExitCode.OK
    assert all("etag" not in r and "last_modified" not in r for r in state(tmp_path, "results.jsonl"))
    fake.now += 60
    assert crawl(server, tmp_path, ["long", "odd"], "--refresh", fake=fake)[0] == ExitCode.OK
    assert [(match, since) for _, match, since in asked(server)][2:] == [(None, None), (None, None)]


def test_a_304_to_a_request_that_sent_no_validator_is_retried_then_unavailable_never_done(server, tmp_path):
    server.replies["x"] = [304]
    code, err, _ = crawl(server, tmp_path, ["x"], "--tries", "2", "--passes", "1")
    assert code == ExitCode.OK and server.hits["x"] == 2 and state(tmp_path, "done.txt") == []
    [record] = state(tmp_path, "unavailable.jsonl")
    assert record["reason"] == "304 Not Modified to a request that sent no validator (a server bug)"


def test_a_refresh_that_fails_keeps_the_last_result_says_so_even_with_q_and_is_over(server, tmp_path):
    server.versions["k"], fake = ('"k1"', version("k", 1)), FakeTime()
    assert crawl(server, tmp_path, ["k", "m"], fake=fake)[0] == ExitCode.OK
    del server.versions["k"]
    server.replies.update({"k": [500], "m": [304]})  # m: a 304 though no validator was kept for it
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, ["k", "m"], "--refresh", "--tries", "2", "--cooldown", "0", "-q",
                         fake=fake)
    assert code == ExitCode.OK
    assert "1 x not refreshed, 500 Internal Server Error: the last result is kept" in err
    assert "1 x not refreshed, 304 Not Modified to a request that sent no validator (a server bug)" in err
    assert {r["result"] for r in state(tmp_path, "refreshed.jsonl")} == {"kept"}
    assert state(tmp_path, "unavailable.jsonl") == [] and [f["pass"] for f in state(tmp_path, "failed.jsonl")
                                                         if f["id"] == "k"] == [2]  # a refresh over keeps the last
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--export", "jsonl"], out=out) == ExitCode.OK
    assert [json.loads(line)["body"] for line in out.getvalue().splitlines()] == [{"id": "k", "v": 1}, {"id": "m"}]
    server.hits.clear()
    assert crawl(server, tmp_path, ["k", "m"], fake=fake)[0] == ExitCode.OK and not server.hits  # it is over


@pytest.mark.parametrize("status", [404, 403], ids=["404 (GitHub's answer to a revoked token)", "403"])
def test_local_fault_a_refresh_whose_answers_all_fail_alike_halts_and_settles_nothing_gone(server, tmp_path, status):
    ids, fake = [f"r{n:02}" for n in range(40)], FakeTime()
    assert crawl(server, tmp_path, ids, fake=fake)[0] == ExitCode.OK
    server.replies.update({item: [status] for item in ids})  # the token was revoked: every id answers alike
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, ids, "--refresh", fake=fake)
    assert code == ExitCode.FATAL and "halted: the first" in err and "is the key still valid" in err
    assert state(tmp_path, "unavailable.jsonl") == [] and sorted(state(tmp_path, "done.txt")) == ids
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--export", "jsonl"], out=out) == ExitCode.OK
    assert len(out.getvalue().splitlines()) == 40  # every result still exported


def test_local_fault_a_refresh_that_finds_a_few_ids_gone_among_answers_settles_them(server, tmp_path):
    ids, fake = [f"r{n:02}" for n in range(40)], FakeTime()
    assert crawl(server, tmp_path, ids, fake=fake)[0] == ExitCode.OK
    server.replies.update({item: [404] for item in ids[:3]})  # three really gone, first in the list
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, ids, "--refresh", fake=fake)
    assert code == ExitCode.OK, err
    assert sorted(r["id"] for r in state(tmp_path, "unavailable.jsonl")) == ids[:3]


def test_a_refresh_killed_midway_goes_on_in_a_plain_rerun_and_asks_no_refreshed_id_again(server, tmp_path):
    ids = [f"r{n}" for n in range(240)]
    server.versions.update({i: (f'"{i}-1"', version(i, 1)) for i in ids})
    ids_file, sdir = write_ids(tmp_path, ids), tmp_path / "ids.redrive"
    cmd = redrive_cmd(ids_file, "--url", server.template, "--concurrency", "4")
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    server.versions.update({i: (f'"{i}-2"', version(i, 2)) for i in ids[::2]})  # half of them changed
    server.delay, final = 0.005, {i: 2 if n % 2 == 0 else 1 for n, i in enumerate(ids)}
    server.hits.clear()
    proc = subprocess.Popen(cmd + ["--refresh"], stderr=subprocess.PIPE, text=True)
    wait_for_lines(sdir / "refreshed.jsonl", 40, proc)
    proc.kill()
    proc.communicate(timeout=10)
    assert json.loads((sdir / "run.json").read_text())["refresh"]["before"]  # the cut-off is kept
    check = subprocess.run(redrive_cmd(ids_file, "--check"), capture_output=True, text=True, timeout=30)
    assert check.returncode == 1 and "is unfinished: rerun to go on with it" in check.stdout
    settled = latest(tmp_path, "refreshed.jsonl")
    assert 40 <= len(settled) < len(ids)
    results = latest(tmp_path)
    assert all(results[i]["body"]["v"] == final[i] for i in settled)  # refreshed...
    assert all(results[i]["body"]["v"] in (1, final[i]) for i in ids)  # ...or as it was
    server.hits.clear()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "continuing the refresh that was cut short" in proc.stderr
    assert not set(settled) & set(server.hits) and max(server.hits.values()) == 1
    assert all(latest(tmp_path)[i]["body"]["v"] == final[i] for i in ids)
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids) and "refresh" not in json.loads((sdir / "run.json").read_text())
    lines = state(tmp_path, "refreshed.jsonl")
    assert len(lines) == len({r["id"] for r in lines})  # one line per id once a run ends
    assert subprocess.run(redrive_cmd(ids_file, "--check", "-q"), capture_output=True, timeout=30).returncode == 0


def test_a_refresh_longer_than_what_a_run_holds_asks_each_done_id_once_in_file_order(server, tmp_path, monkeypatch):
    monkeypatch.setattr(redrive, "LOOKAHEAD", 8)  # the run holds 8 ids at a time; the refresh has 60 and 5 new
    ids, fake = [f"r{n}" for n in range(60)], FakeTime()
    server.versions.update({i: (f'"{i}-1"', version(i, 1)) for i in ids})
    assert crawl(server, tmp_path, ids, fake=fake)[0] == ExitCode.OK
    server.versions.update({i: (f'"{i}-2"', version(i, 2)) for i in ids[::10]} | {i: ('"x"', 410) for i in ids[5::20]})
    server.paths.clear(), server.seen_headers.clear()
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, [*ids, *(f"new{n}" for n in range(5))], "--refresh", fake=fake)
    assert code == ExitCode.OK and "65 ids, 5 to fetch, 60 to refresh" in err
    assert asked(server) == [(f"new{n}", None, None) for n in range(5)] + [(i, f'"{i}-1"', None) for i in ids]
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert {k: report["refresh"][k] for k in ("due", "unchanged", "changed", "gone", "left")} == {
        "due": 60, "unchanged": 51, "changed": 6, "gone": 3, "left": 0}
    assert [r["id"] for r in report["unresolved"]] == ids[5::20]  # in file order
    assert report["counts"] | {"input": 0} == {"input": 0, "duplicates": 0, "done": 62, "unavailable": 3, "failed": 0,
                                               "pending": 0}


def test_an_id_gone_upstream_comes_back_with_retry_unavailable_done_again_listed_once(server, tmp_path):
    server.versions["g"], fake = ('"g1"', version("g", 1)), FakeTime()
    crawl(server, tmp_path, ["g", "h"], fake=fake)
    server.versions["g"] = ('"g1"', 410)
    fake.now += 60
    assert crawl(server, tmp_path, ["g", "h"], "--refresh", fake=fake)[0] == ExitCode.OK
    server.paths.clear(), server.seen_headers.clear()
    code, err, _ = crawl(server, tmp_path, ["g", "h"], fake=fake)
    assert code == ExitCode.OK and asked(server) == [] and summary_count(err, "unavailable") == 1
    server.versions["g"] = ('"g2"', version("g", 2))
    fake.now += 60
    code, err, _ = crawl(server, tmp_path, ["g", "h"], "--retry-unavailable", "410", fake=fake)
    assert code == ExitCode.OK and asked(server) == [("g", None, None)]  # not done: a whole fetch
    assert state(tmp_path, "done.txt") == ["g", "h"] and state(tmp_path, "unavailable.jsonl") == []
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--check"], out=out) == ExitCode.OK
    assert summary_count(out.getvalue(), "done") == 2 and summary_count(out.getvalue(), "unavailable") == 0


def test_a_kill_after_a_refreshs_new_result_line_leaves_it_refreshed_and_lists_no_id_twice(server, tmp_path):
    assert crawl(server, tmp_path, ["a", "b"])[0] == ExitCode.OK
    results = tmp_path / "ids.redrive" / "results.jsonl"
    first = json.loads(results.read_text().splitlines()[0])
    newer = {**first, "fetched_at": "2031-01-01T00:00:00.000000Z", "body": {"id": "a", "v": 2}}
    with open(results, "a") as fh:  # a refresh's new result for a, and the kill before its refreshed line
        fh.write(json.dumps(newer) + "\n")
    code, err, _ = crawl(server, tmp_path, ["a", "b"])
    assert code == ExitCode.OK and "added" not in err and state(tmp_path, "done.txt") == ["a", "b"]
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--export", "jsonl"], out=out) == ExitCode.OK
    assert json.loads(out.getvalue().splitlines()[0])["body"] == {"id": "a", "v": 2}


@pytest.mark.parametrize("text, seconds", [("30s", 30), ("12h", 43200), ("7d", 604800), ("1.5m", 90), ("2H", 7200)])
def test_duration_spec_reads_a_number_and_its_unit(text, seconds):
    assert redrive.duration_spec(text) == seconds


@pytest.mark.parametrize("extra, problem", [
    (["--refresh-older-than", "12x"], "give a DURATION as a number and s, m, h or d (30s, 12h, 7d), not '12x'"),
    (["--refresh-older-than", "0s"], "not '0s'"),
    (["--refresh-older-than", "12"], "not '12'"),
    (["--refresh", "--refresh-older-than", "1h"], "not allowed with argument --refresh"),
    (["--refresh", "--method", "POST"], "only GET and HEAD take as 'answer if changed'"),
])
def test_a_bad_refresh_option_is_one_line_and_exit_2(server, tmp_path, extra, problem):
    code, err, _ = crawl(server, tmp_path, ["a"], *extra)
    assert code == ExitCode.USAGE and problem in err and err.count("\n") == 1 and not server.hits


# ----------------------------------------------------------------- secrets


def test_header_values_come_from_the_environment_and_never_reach_output(server, tmp_path):
    server.replies["a"] = [(401, f"key {SECRET} is revoked".encode(), {})]
    code, err, _ = crawl(server, tmp_path, ["b", "a"], "-H", "X-API-Key: ${API_KEY}",
                         environ={"API_KEY": SECRET})
    assert code == ExitCode.FATAL
    assert all(h.get("X-API-Key") == SECRET for h in server.seen_headers)
    assert SECRET not in err and "key *** is revoked" in err
    assert SECRET not in all_output(tmp_path)


def test_key_like_query_parameters_are_redacted_in_state_and_output(server, tmp_path):
    ids = write_ids(tmp_path, ["a", "b"])
    server.replies["b"] = [404]
    code, err, _ = run_cli([ids, "--url", server.template + "?api_key=" + SECRET])
    assert code == ExitCode.OK
    assert state(tmp_path, "results.jsonl")[0]["url"].endswith("?api_key=REDACTED")
    assert SECRET not in err and SECRET not in all_output(tmp_path)


def test_user_headers_are_dropped_on_a_cross_origin_redirect(server, tmp_path):
    other, thread = start_server()
    try:
        server.replies["r"] = [(302, b"", {"Location": other.base + "/items/r"})]
        code, _, _ = crawl(server, tmp_path, ["r"], "-H", "X-API-Key: " + SECRET)
        assert code == ExitCode.OK
        assert server.seen_headers[0].get("X-API-Key") == SECRET
        assert other.hits["r"] == 1 and "X-API-Key" not in other.seen_headers[0]
    finally:
        other.shutdown()
        other.server_close()
        thread.join()


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize("setup, args, message", [
    (None, ["missing.txt"], "no such file"),
    ("dir", ["adir"], "a directory; give a text file"),
    ("fifo", ["ids.txt"], "not a regular file (a pipe or a device)"),
    ("fifo", ["ids.txt", "--check"], "not a regular file (a pipe or a device)"),
    (None, ["/dev/stdin"], "no state dir can go beside it; give --state-dir DIR"),
    (b"a\nb\n\xff\xfe\n", ["ids.txt"], "line 3: not valid UTF-8"),
    (b"# only comments\n\n   \n", ["ids.txt"], "no ids in it"),
    (b"a\n", ["ids.txt", "--url", "https://x.example/items"], "has no {id}"),
    (b"a\n", ["ids.txt", "--url", "ftp://x.example/{id}"], "not an http(s) URL"),
    (b"https://x.example/1\nftp://x.example/2\n", ["ids.txt"], "line 2: 'ftp://x.example/2' is not an http(s) URL"),
    (b"a\n", ["ids.txt", "--url", "http://x/{id}", "-H", "X-Key: ${NOPE}"], "environment variable NOPE is not set"),
    (b"a\n", ["ids.txt", "--url", "http://x/{id}", "-H", "no colon"], "write it as -H 'Name: value'"),
    (b"a\n", ["ids.txt", "--concurrency", "0"], "a whole number from 1 to 512, not '0'"),
    (b"a\n", ["ids.txt", "--concurrency", "30000"], "a whole number from 1 to 512, not '30000'"),
    (b"a\n", ["ids.txt", "--timeout", "-1"], "number of seconds"),
    (b"a\n", ["ids.txt", "--timeout", "1e10"], "a number of seconds above 0 to 86,400, not '1e10'"),
    (b"a\n", ["ids.txt", "--max-time", "1e300"], "a number of seconds above 0 to 2,678,400"),
    (b"a\n", ["ids.txt", "--rate", "1e-300"], "requests per second from 0.001 to 1,000,000"),
    (b"a\n", ["ids.txt", "--max-bytes", "1e99"], "a number of bytes from 1 to"),
    (b"a\n", ["ids.txt", "--tries", "99999"], "a whole number from 1 to 1000"),
    (b"a\n", ["ids.txt", "--url", "http://127.0.0.1:{id}/x"], "never in the port"),
    (b"http://h:99999/\n", ["ids.txt"], "line 1: 'http://h:99999/' is not a valid URL (a port"),
    (b"http://[::1/x\n", ["ids.txt"], "line 1: 'http://[::1/x' is not a valid URL"),
    (b"a\n", ["ids.txt", "--url", "http://x/{id}", "-H", "X-K: price in \u20ac"], "only Latin-1"),
    (b"a\n", ["ids.txt", "--retry", "abc"], "HTTP statuses"),
    (b"a\n", ["ids.txt", "--retry", "503", "--skip", "503"], "both --retry and --skip"),
    (b"a\n", ["ids.txt", "--bogus"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, setup, args, message):
    monkeypatch.chdir(tmp_path)
    if setup == "dir":
        (tmp_path / "adir").mkdir()
    elif setup == "fifo":
        os.mkfifo(tmp_path / "ids.txt")  # no writer: opening it would block for ever
    elif setup is not None:
        (tmp_path / "ids.txt").write_bytes(setup)
    err = io.StringIO()
    code = redrive.main(args, err=err, environ={})
    assert code == ExitCode.USAGE
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("redrive: error: ") and message in lines[0], lines


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    (tmp_path / "ids.txt").write_bytes(b"\xff\n")
    proc = subprocess.run(redrive_cmd(tmp_path / "ids.txt"), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "UTF-8" in proc.stderr


@pytest.mark.parametrize("where", ["ids.txt", "ids.redrive/done.txt", "ids.redrive/results.jsonl", "nowhere/r.json",
                                   "ids.redrive"])
def test_a_report_path_that_is_input_or_state_or_unwritable_is_refused_before_any_request(server, tmp_path, where):
    crawl(server, tmp_path, ["a", "b"])  # a state dir with ids done
    before = {p.name: p.read_bytes() for p in (tmp_path / "ids.redrive").iterdir()}
    server.hits.clear()
    code, err, _ = crawl(server, tmp_path, ["a", "b", "c"], "--report", tmp_path / where)
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1 and "--report" in err
    assert sum(server.hits.values()) == 0  # refused before the run was paid for
    assert (tmp_path / "ids.redrive" / "done.txt").read_bytes() == before["done.txt"]
    assert (tmp_path / "ids.redrive" / "results.jsonl").read_bytes() == before["results.jsonl"]
    assert (tmp_path / "ids.txt").read_text().split() == ["a", "b", "c"]  # the input list as given


def test_a_path_with_a_byte_that_is_not_utf8_runs_and_reports_like_any_other(server, tmp_path):
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/odd\xff"))
    folder.mkdir()
    code, err, _ = crawl(server, folder, ["a", "b"])
    assert code == ExitCode.OK, err
    report = json.loads((folder / "ids.redrive" / "report.json").read_text(encoding="utf-8"))
    assert report["counts"]["done"] == 2 and report["state_dir"].endswith("odd\ufffd/ids.redrive")
    assert not list((folder / "ids.redrive").glob("*.tmp"))


def test_a_typo_in_an_ipv6_url_is_one_line_and_exit_2(tmp_path):
    code, err, _ = run_cli([write_ids(tmp_path, ["a"]), "--url", "http://[::1/x/{id}?token=" + SECRET])
    assert code == ExitCode.USAGE and len(err.strip().splitlines()) == 1 and "[" in err and SECRET not in err
    assert not list(tmp_path.rglob("crash*"))


@pytest.mark.parametrize("name, value, shown", [
    ("REQUESTS_CA_BUNDLE", "/nonexistent/ca.pem", "REQUESTS_CA_BUNDLE='/nonexistent/ca.pem'"),
    ("HTTPS_PROXY", "http://robot:" + SECRET + "@[bad", "robot:REDACTED@[bad"),
    ("HTTPS_PROXY", "socks5://127.0.0.1:1080", "PySocks"),
    ("HTTPS_PROXY", "::::", "'::::'"),
])
def test_a_local_setting_that_cannot_work_halts_before_anything_is_sent_or_marked(tls_server, tmp_path, monkeypatch,
                                                                                 name, value, shown):
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setenv(name, value)
    code, err, _ = crawl(tls_server, tmp_path, ["a", "b"])
    assert code == ExitCode.FATAL and shown in err and SECRET not in err
    assert sum(tls_server.hits.values()) == 0 and not (tmp_path / "ids.redrive" / "unavailable.jsonl").exists()


@pytest.mark.parametrize("make", ["empty file", "garbage PEM", "text file", "folder with no certificate"])
def test_local_fault_a_ca_bundle_that_loads_no_certificate_halts_naming_it(tls_server, tmp_path, monkeypatch, make):
    bundle = tmp_path / "bundle"
    if make == "folder with no certificate":
        bundle.mkdir()
        (bundle / "readme.txt").write_text("not a certificate")
    else:
        bundle.write_text({"empty file": "", "text file": "hello\n",
                           "garbage PEM": "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"}[make])
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    code, err, _ = crawl(tls_server, tmp_path, ["a", "b"])
    assert code == ExitCode.FATAL and "REQUESTS_CA_BUNDLE=" in err and "certificate" in err, err
    assert sum(tls_server.hits.values()) == 0 and not (tmp_path / "ids.redrive" / "unavailable.jsonl").exists()


def test_local_fault_a_407_from_the_proxy_halts_and_names_the_proxy(server, tmp_path):
    server.replies["b"] = [(407, b"Proxy Authentication Required", {"Proxy-Authenticate": 'Basic realm="p"'})]
    code, err, _ = crawl(server, tmp_path, ["a", "b", "c"], "--concurrency", "1")
    assert code == ExitCode.FATAL and "the proxy asks for credentials" in err and "--skip" not in err
    assert state(tmp_path, "unavailable.jsonl") == [] and state(tmp_path, "failed.jsonl") == []


def test_local_fault_a_proxy_given_without_its_scheme_is_used_as_requests_uses_it(server, tmp_path, monkeypatch):
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setenv("http_proxy", urlsplit(server.base).netloc)  # host:port, no http://
    ids = write_ids(tmp_path, ["a", "b"])
    code, err, _ = run_cli([ids, "--url", "http://origin.invalid/items/{id}"])
    assert code == ExitCode.OK, err
    assert server.hits == Counter({"a": 1, "b": 1})  # through the proxy: origin.invalid resolves nowhere


def test_unwritable_state_dir_is_exit_2(tmp_path):
    if os.geteuid() == 0:
        target = Path("/proc/redrive-cannot-be-here")
    else:
        target = tmp_path / "ro"
        target.mkdir(mode=0o500)
    ids = write_ids(tmp_path, ["a"])
    code, err, _ = run_cli([ids, "--url", "http://127.0.0.1:9/{id}", "--state-dir", target])
    assert code == ExitCode.USAGE and "state dir" in err and err.count("\n") == 1


def test_foreign_line_in_a_state_file_is_exit_2_and_left_alone(server, tmp_path):
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / "failed.jsonl").write_text("hello world\n")
    code, err, _ = crawl(server, tmp_path, ["a"])
    assert code == ExitCode.USAGE and "failed.jsonl line 1: not a redrive record" in err
    assert (sdir / "failed.jsonl").read_text() == "hello world\n" and server.hits["a"] == 0


def test_help_and_version(capsys):
    assert redrive.main(["--version"]) == 0
    assert redrive.__version__ in capsys.readouterr().out
    assert redrive.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--retry-unavailable" in out
    codes = out.split("exit codes:\n")[1].splitlines()
    assert [int(line.split()[0]) for line in codes] == [int(code) for code in ExitCode]  # one line each, the last
    usage = next(line for line in redrive.__doc__.splitlines() if line.startswith("usage: "))
    assert out.startswith(usage.replace("python3 ", "", 1) + "\n")  # the docstring's usage line, not a copy
    assert redrive.__doc__.splitlines()[0] in out
    told = redrive.__doc__.split("Exit codes:")[1]  # the docstring's own list names every code, and no other
    assert sorted(map(int, re.findall(r"\b(\d{1,3}) ", told))) == sorted(int(code) for code in ExitCode)


def test_the_readmes_options_table_names_every_option_and_no_other():
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Options"):readme.index("## Buckets")]
    documented = set(re.findall(r"^\| `(?:-\w`, `)?(--[\w-]+)", table, re.M))
    options = {o for action in redrive.build_parser()._actions for o in action.option_strings if o.startswith("--")}
    assert documented == options - {"--help"}


def test_the_pacing_figures_the_usage_and_readme_quote_are_the_codes_own():
    # a figure quoted in prose drifts when its constant is tuned: the usage once said 0.7 for a cut of 0.85
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    told = readme[readme.index("Where nothing is declared, redrive finds the limit"):]
    cut = re.findall(r"rate (?:drops )?to (0\.\d+) of what it took", redrive.__doc__ + told)
    assert cut and {float(c) for c in cut} == {redrive.BETA}
    assert f"gets {redrive.START_LIMIT} requests in flight" in told
    assert f"after {redrive.CUBIC_C:g} requests' time" in told


def test_dry_run_needs_no_variable_set_and_shows_its_name_not_a_value(server, tmp_path):
    ids = write_ids(tmp_path, ["a", "b"])
    out, err = io.StringIO(), io.StringIO()
    code = redrive.main([str(ids), "--dry-run", "--url", server.template + "?key=${API_KEY}",
                         "-H", "Authorization: Bearer ${TOKEN}"], err=err, out=out, environ={})
    assert code == ExitCode.OK, err.getvalue()
    assert "/items/a?key=" in out.getvalue() and not server.hits and not (tmp_path / "ids.redrive").exists()
    code, err, _ = run_cli([ids, "--url", server.template + "?key=${API_KEY}"])  # a real run still asks for it
    assert code == ExitCode.USAGE and "API_KEY is not set" in err


def test_dry_run_sends_nothing_writes_nothing_and_says_what_a_run_would_ask(server, tmp_path):
    server.replies["gone"] = [404]
    run_cli([write_ids(tmp_path, ["a", "gone"]), "--url", server.template + "?api_key=" + SECRET])
    before = {p.name: p.read_bytes() for p in (tmp_path / "ids.redrive").iterdir()}
    server.hits.clear()
    ids = ["a", "gone", *[f"n{k}" for k in range(7)]]
    out = io.StringIO()
    code = redrive.main([str(write_ids(tmp_path, ids)), "--dry-run", "--url", server.template + "?api_key=" + SECRET],
                        fx=FakeTime().effects(), err=io.StringIO(), out=out, environ={})
    text = out.getvalue()
    assert code == ExitCode.OK and sum(server.hits.values()) == 0
    assert "9 ids: 1 done, 1 unavailable, 0 failed earlier, 7 new" in text
    assert text.count("  GET ") == 5 and "/items/n0?api_key=REDACTED" in text and SECRET not in text
    assert {p.name: p.read_bytes() for p in (tmp_path / "ids.redrive").iterdir()} == before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code = redrive.main([str(write_ids(fresh, ids)), "--dry-run", "--url", server.template, "--shard", "1/2"],
                        fx=FakeTime().effects(), err=io.StringIO(), out=out, environ={})
    assert code == ExitCode.OK and "(shard 1/2 of 9)" in out.getvalue() and not (fresh / "ids.redrive").exists()
    demo = tmp_path / "demo"
    demo.mkdir()
    ids = write_ids(demo, ["x1", "x2"])
    redrive.main([str(ids), "--demo", "--max-time", "0.001"], fx=FakeTime().effects(), err=io.StringIO(), environ={})
    out = io.StringIO()  # a bare dry run over the demo's state dir: the demo, as run.json keeps it
    assert redrive.main([str(ids), "--dry-run"], err=io.StringIO(), out=out, environ={}) == ExitCode.OK
    assert re.search(r"2 ids: \d done", out.getvalue()) and "(the demo's server)" in out.getvalue()


def test_verbose_says_a_line_for_each_request_with_what_was_decided_and_no_secret(server, tmp_path):
    server.replies.update({"slow": [500, 200], "gone": [404]})
    code, err, _ = crawl(server, tmp_path, ["a", "slow", "gone"], "-v", "-H", "X-Key: ${KEY}",
                         environ={"KEY": SECRET})
    assert code == ExitCode.OK and SECRET not in err
    lines = [line for line in err.splitlines() if re.match(r"redrive: \d\d:\d\d:\d\d\.\d{3} '", line)]
    assert len(lines) == sum(server.hits.values()) == 4
    said = {line.split("'")[1]: line for line in lines if "'a'" in line or "'gone'" in line}
    assert said["a"].endswith(": done") and " 200 " in said["a"] and re.search(r" \d+ B: done$", said["a"])
    assert said["gone"].endswith(": unavailable") and "404 Not Found" in said["gone"]
    assert any("'slow' 500 Internal Server Error" in line and ": retry in " in line for line in lines)


def test_export_gives_the_latest_result_of_every_done_id_in_input_order(server, tmp_path):
    server.replies.update({"b": [(200, b'{"name":"B","tags":["x","y"]}', {"Content-Type": "application/json"})],
                           "gone": [404], "bin": [(200, b"\xff\x00", {"Content-Type": "application/octet-stream"})]})
    crawl(server, tmp_path, ["gone", "bin", "b", "a"])
    results = tmp_path / "ids.redrive" / "results.jsonl"
    first_a = next(line for line in results.read_text().splitlines() if '"id":"a"' in line)
    with open(results, "a") as fh:  # a later result of a: the last line of an id wins
        fh.write(first_a.replace('"body":{"id":"a"}', '"body":{"id":"a","v":2}') + "\n")
    ids = write_ids(tmp_path, ["a", "gone", "b", "bin", "never"])  # the input order, not the order fetched
    sent = sum(server.hits.values())
    out = io.StringIO()
    assert redrive.main([str(ids), "--export", "jsonl"], out=out, err=io.StringIO(), environ={}) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["id"] for r in lines] == ["a", "b", "bin"] and lines[0]["body"] == {"id": "a", "v": 2}
    out = io.StringIO()
    assert redrive.main([str(ids), "--export", "csv", "--fields", "id,body.name,body.tags.1,body.tags"], out=out,
                        err=io.StringIO(), environ={}) == 0
    assert out.getvalue().splitlines() == ["id,body.name,body.tags.1,body.tags", "a,,,", "b,B,y,\"[\"\"x\"\", \"\"y\"\"]\"",
                                           "bin,,,"]
    folder = tmp_path / "bodies"
    assert redrive.main([str(ids), "--export", "files", "--out", str(folder)], err=io.StringIO(), environ={}) == 0
    assert json.loads((folder / "b").read_text()) == {"name": "B", "tags": ["x", "y"]}
    assert (folder / "bin").read_bytes() == b"\xff\x00" and sorted(p.name for p in folder.iterdir() if not p.name.startswith(".redrive-")) == ["a", "b", "bin"]
    assert sum(server.hits.values()) == sent  # no request
    err = io.StringIO()
    assert redrive.main([str(ids), "--export", "files"], err=err, environ={}) == ExitCode.USAGE
    assert "--out" in err.getvalue() and err.getvalue().count("\n") == 1


def test_export_csv_cells_that_start_like_a_formula_are_neutralised_and_jsonl_keeps_them_raw(server, tmp_path):
    body = b'{"name":"=HYPERLINK(\\"http://x\\")","note":"@SUM(A1)","t":"\\tx","n":-5,"s":"-5","ok":"plain"}'
    server.replies["=1+2"] = [(200, body, {"Content-Type": "application/json"})]
    ids = write_ids(tmp_path, ["=1+2"])
    crawl(server, tmp_path, ["=1+2"])
    out = io.StringIO()
    fields = "id,body.name,body.note,body.t,body.n,body.s,body.ok"
    assert redrive.main([str(ids), "--export", "csv", "--fields", fields], out=out, err=io.StringIO(), environ={}) == 0
    row = next(csv.reader(io.StringIO(out.getvalue().splitlines()[1])))
    assert row == ["'=1+2", "'=HYPERLINK(\"http://x\")", "'@SUM(A1)", "'\tx", "-5", "'-5", "plain"]
    out = io.StringIO()
    assert redrive.main([str(ids), "--export", "jsonl"], out=out, err=io.StringIO(), environ={}) == 0
    assert json.loads(out.getvalue())["body"]["name"] == '=HYPERLINK("http://x")'


def test_the_readmes_export_lines_run_as_written_and_give_only_what_is_live(server, tmp_path):
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Getting results out", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    if "| jq" in block and not shutil.which("jq"):
        pytest.skip("jq is not installed: the README's jq line cannot run here")
    price = {"p1": 10, "p2": 20, "p3": 30}
    for item, value in price.items():
        server.replies[item] = [(200, json.dumps({"name": item, "price": value}).encode(),
                                 {"Content-Type": "application/json", "ETag": f'"{value}"'}),
                                (200, json.dumps({"name": item, "price": value + 1}).encode(),
                                 {"Content-Type": "application/json", "ETag": f'"{value + 1}"'})]
    server.replies["p3"] = server.replies["p3"][:1] + [(404, b"", {})]
    ids = write_ids(tmp_path, list(price), name="products.txt")
    for extra in ((), ("--refresh",)):  # night 1, then a refresh: p1 and p2 changed, p3 gone
        code, err, _ = run_cli([ids, "--url", server.template, *extra], fake=FastForward())  # real time: a later night
        assert code == ExitCode.OK, err
    script = block.replace(".venv/bin/python redrive.py", f"{sys.executable} {HERE / 'redrive.py'}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    live = [json.loads(line) for line in (tmp_path / "latest.jsonl").read_text().splitlines()]
    assert [(r["id"], r["body"]["price"]) for r in live] == [("p1", 11), ("p2", 21)]
    assert (tmp_path / "products.csv").read_text().splitlines()[1:] == ["p1,p1,11", "p2,p2,21"]
    assert sorted(p.name for p in (tmp_path / "bodies").iterdir() if not p.name.startswith(".")) == ["p1", "p2"]
    assert done.stdout.splitlines() == ['"p1",11', '"p2",21']  # the jq line: stale and gone rows left out
    assert [json.loads(line)["id"] for line in (tmp_path / "gone.jsonl").read_text().splitlines()] == ["p3"]


def test_file_written_where_it_belongs_export_files_replaces_a_planted_link_and_never_writes_through_it(
        server, tmp_path):
    crawl(server, tmp_path, ["a", "b"])
    outside, folder = tmp_path / "outside.txt", tmp_path / "bodies"
    outside.write_text("precious")
    folder.mkdir()
    (folder / "a").symlink_to(outside)  # planted before the export
    (folder / "b").symlink_to(tmp_path / "nowhere")  # dangling: open() would create its target
    code = redrive.main([str(tmp_path / "ids.txt"), "--export", "files", "--out", str(folder)], err=io.StringIO(),
                        environ={})
    assert code == ExitCode.OK and outside.read_text() == "precious" and not (tmp_path / "nowhere").exists()
    assert not (folder / "a").is_symlink() and json.loads((folder / "a").read_text()) == {"id": "a"}


def test_export_files_mirrors_what_is_live_removing_what_an_earlier_export_wrote_for_ids_gone(server, tmp_path):
    ids, folder = ["p1", "p2", "p3"], tmp_path / "bodies"
    for item in ids:
        server.replies[item] = [(200, b'{"v":1}', {"Content-Type": "application/json", "ETag": '"1"'}), 304]
    server.replies["p3"] = server.replies["p3"][:1] + [404]
    assert run_cli([write_ids(tmp_path, ids), "--url", server.template], fake=FastForward())[0] == ExitCode.OK
    export = [str(tmp_path / "ids.txt"), "--export", "files", "--out", str(folder)]
    assert redrive.main(export, err=io.StringIO(), environ={}) == ExitCode.OK
    (folder / "mine.txt").write_text("the user's own file")
    assert run_cli([tmp_path / "ids.txt", "--url", server.template, "--refresh"], fake=FastForward())[0] == 0
    err = io.StringIO()
    assert redrive.main(export, err=err, environ={}) == ExitCode.OK
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == ["mine.txt", "p1", "p2"]  # p3 gone
    assert "mine.txt" in err.getvalue() and (folder / "mine.txt").read_text() == "the user's own file"


def test_file_written_where_it_belongs_a_folder_named_like_an_id_stops_no_export(server, tmp_path):
    crawl(server, tmp_path, ["a", "b"])
    folder = tmp_path / "bodies"
    (folder / "a").mkdir(parents=True)  # someone's folder where a's file would go
    code = redrive.main([str(tmp_path / "ids.txt"), "--export", "files", "--out", str(folder)], err=io.StringIO(),
                        environ={})
    assert code == ExitCode.OK and (folder / "a").is_dir() and json.loads((folder / "b").read_text()) == {"id": "b"}
    [moved] = map(json.loads, (folder / ".redrive-names.jsonl").read_text().splitlines())
    assert moved["id"] == "a" and json.loads((folder / moved["file"]).read_text()) == {"id": "a"}


def test_file_written_where_it_belongs_ids_no_file_system_can_name_get_a_stable_name_listed_in_the_folder(
        server, tmp_path):
    ids = ["x" * 300, "ABC", "abc", "CON", "nul.txt", "ok"]
    crawl(server, tmp_path, ids)
    folder = tmp_path / "bodies"
    for _ in range(2):  # stable: the same names again
        code = redrive.main([str(tmp_path / "ids.txt"), "--export", "files", "--out", str(folder)],
                            err=io.StringIO(), environ={})
        assert code == ExitCode.OK
    names = {r["id"]: r["file"] for r in map(json.loads, (folder / ".redrive-names.jsonl").read_text().splitlines())}
    assert sorted(names) == ["CON", "abc", "nul.txt", "x" * 300]  # 'ABC' came first and keeps its own name
    for item, name in [*names.items(), ("ABC", "ABC"), ("ok", "ok")]:
        assert json.loads((folder / name).read_text()) == {"id": item}
    files = [n for n in os.listdir(folder) if n != ".redrive-files"]
    assert len({n.lower() for n in files}) == len(files) == 7


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_file_written_where_it_belongs_a_report_path_that_is_no_regular_file_is_refused(server, tmp_path, kind):
    target = tmp_path / "kept.txt"
    target.write_text("kept")
    report = tmp_path / "report-here"
    report.symlink_to(target) if kind == "symlink" else os.mkfifo(report)
    code, err, _ = crawl(server, tmp_path, ["a"], "--report", str(report))
    assert code == ExitCode.USAGE and "not a regular file" in err and err.count("\n") == 1
    assert target.read_text() == "kept" and not server.hits


@pytest.mark.parametrize("fields, said", [("id,refreshed_at", "'refreshed_at'"), ("id,stauts", "'stauts'"),
                                          ("id,url.host", "'url.host'")])
def test_export_an_unknown_field_is_exit_2_naming_the_known_ones(server, tmp_path, fields, said):
    crawl(server, tmp_path, ["a"])
    err = io.StringIO()
    code = redrive.main([str(tmp_path / "ids.txt"), "--export", "csv", "--fields", fields], out=io.StringIO(),
                        err=err, environ={})
    assert code == ExitCode.USAGE and said in err.getvalue() and "fetched_at" in err.getvalue()
    assert err.getvalue().count("\n") == 1


def test_export_a_body_path_no_row_has_is_a_warning_and_the_rest_is_written(server, tmp_path):
    server.replies["a"] = [(200, b'{"price":3}', {"Content-Type": "application/json"})]
    crawl(server, tmp_path, ["a"])
    out, err = io.StringIO(), io.StringIO()
    code = redrive.main([str(tmp_path / "ids.txt"), "--export", "csv", "--fields", "id,body.price,body.prize"],
                        out=out, err=err, environ={})
    assert code == ExitCode.OK and out.getvalue().splitlines() == ["id,body.price,body.prize", "a,3,"]
    assert "body.prize" in err.getvalue() and "body.price" not in err.getvalue()


def test_export_of_a_state_larger_than_a_part_joins_on_disk_in_input_order_and_writes_nothing(tmp_path):
    ids = [f"id{n:07d}" for n in range(120_000)]  # with the results, several parts of the join
    order = ids[::-1]  # fetched in another order than the input's
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / "done.txt").write_text("".join(f"{i}\n" for i in order if not i.endswith("7")))
    line = '{{"id":"{0}","url":"http://h/{0}","status":200,"fetched_at":"2026-12-01T00:00:00.000000Z","body":{1}}}\n'
    with open(sdir / "results.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(line.format(i, '{"v":1,"name":"café"}') for i in order if not i.endswith("7"))
        fh.writelines(line.format(i, '{"v":2}') for i in order[::1000])  # later lines of the same ids win
    ids_file = write_ids(tmp_path, ids)
    before = sorted(p.name for p in sdir.iterdir())
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--export", "jsonl"], out=out, err=io.StringIO(), environ={}) == 0
    exported = [json.loads(line) for line in out.getvalue().splitlines()]
    again = set(order[::1000])
    assert [r["id"] for r in exported] == [i for i in ids if not i.endswith("7")]
    assert all(r["body"] == ({"v": 2} if r["id"] in again else {"v": 1, "name": "café"}) for r in exported)
    assert sorted(p.name for p in sdir.iterdir()) == before  # no index, no scratch: a reader writes nothing


def test_export_names_the_real_line_of_a_bad_results_line(server, tmp_path):
    crawl(server, tmp_path, ["a", "b", "c"])
    results = tmp_path / "ids.redrive" / "results.jsonl"
    lines = results.read_text().splitlines()
    lines[1] = '{"id": 7}'
    results.write_text("\n".join(lines) + "\n")
    err = io.StringIO()
    code = redrive.main([str(tmp_path / "ids.txt"), "--export", "jsonl"], out=io.StringIO(), err=err, environ={})
    assert code == ExitCode.USAGE and "line 2" in err.getvalue() and "line 0" not in err.getvalue()


def test_a_mistyped_option_gets_the_closest_one_suggested(tmp_path):
    code, err, _ = run_cli([write_ids(tmp_path, ["a"]), "--concurency", "8"])
    assert code == ExitCode.USAGE and "did you mean --concurrency?" in err and err.count("\n") == 1


@pytest.mark.parametrize("typed, said", [("--dry-run", None), ("--verbose", None), ("--max-tim", "--max-time"),
                                          ("--ur", "--url"), ("--dem", "--demo")])
def test_an_option_is_never_guessed_from_a_prefix_and_only_a_near_typo_gets_a_suggestion(tmp_path, typed, said):
    code, err, _ = run_cli([write_ids(tmp_path, ["a"]), typed, "5"])
    assert code == ExitCode.USAGE and err.count("\n") == 1 and "see --help" in err
    assert (f"did you mean {said}?" in err) if said else "did you mean" not in err


def test_without_requests_installed_one_line_says_how_to_install_it(tmp_path):
    proc = subprocess.run([sys.executable, "-S", str(HERE / "redrive.py"), str(write_ids(tmp_path, ["a"]))],
                          capture_output=True, text=True, timeout=30)  # -S: no site-packages, so no requests
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "requests is not installed" in proc.stderr and "-m pip install -r requirements.txt" in proc.stderr
    assert proc.stderr.index("venv") < proc.stderr.index("pip install")  # the venv first: PEP 668 refuses the rest


# -------------------------------------------------- processes and signals


def wait_until(condition, failure, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(failure)
        time.sleep(0.01)


def wait_for_lines(path, count, proc, timeout=20.0):
    def enough():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.stderr.read()}")
        return path.exists() and path.read_bytes().count(b"\n") >= count
    wait_until(enough, f"{path} never reached {count} lines", timeout)


def read_line_with(proc, text, timeout=10.0):
    """The first line of proc's stderr that holds text (every line before it is read and dropped)."""
    found = queue.Queue()

    def reader():
        for line in proc.stderr:
            if text in line:
                found.put(line)
                return
        found.put("")  # the stream ended first

    threading.Thread(target=reader, daemon=True).start()
    try:
        line = found.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no line with {text!r} within {timeout} s") from None
    assert line, f"stderr ended with no line holding {text!r}"
    return line


@pytest.mark.parametrize("signum, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_stop_signal_mid_run_then_rerun_resumes_without_refetching(server, tmp_path, signum, expected):
    ids = [f"n{i}" for i in range(300)]
    for item in ids:
        server.replies[item] = [("sleep", 0.01, 200)]
    ids_file = write_ids(tmp_path, ids)
    cmd = redrive_cmd(ids_file, "--url", server.template, "--concurrency", "4")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "ids.redrive" / "done.txt", 20, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == expected, err
    assert "rerun the same command to resume" in err
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["exit_code"] == expected and report["stop"] in ("interrupted", "terminated", "hung up")
    done_before = state(tmp_path, "done.txt")
    assert 20 <= len(done_before) < 300
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids)
    assert [r["id"] for r in state(tmp_path, "results.jsonl")] == state(tmp_path, "done.txt")
    assert set(server.hits) == set(ids) and max(server.hits.values()) == 1


def test_a_limit_found_before_ctrl_c_is_where_the_rerun_starts(server, tmp_path):
    # a real process stopped by SIGINT still leaves the limit it found; the rerun starts paced at it
    bucket = [3.0, time.monotonic()]

    def limited():  # 40 a second with 3 of slack, in real time
        with server.lock:
            now = time.monotonic()
            bucket[:] = [min(3.0, bucket[0] + (now - bucket[1]) * 40), now]
            if bucket[0] >= 1:
                bucket[0] -= 1
                return 200
            return 429, b"", {}
    ids = [f"c{i}" for i in range(150)]
    server.replies.update({item: [limited] for item in ids})
    cmd = redrive_cmd(write_ids(tmp_path, ids), "--url", server.template, "--concurrency", "8")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "ids.redrive" / "done.txt", 60, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130, err
    [learnt] = json.loads((tmp_path / "ids.redrive" / "paces.json").read_text())["hosts"].values()
    assert 20 <= learnt["pace"] <= 60
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "the limit found before" in proc.stderr.splitlines()[0]
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids)


def test_second_ctrl_c_exits_at_once(server, tmp_path):
    ids = [f"s{i}" for i in range(20)]
    for item in ids:
        server.replies[item] = [("sleep", 0.2, 200)]
    server.replies["s5"] = [("sleep", 8.0, 200)]
    ids_file = write_ids(tmp_path, ids)
    proc = subprocess.Popen(redrive_cmd(ids_file, "--url", server.template, "--concurrency", "2"),
                            stderr=subprocess.PIPE, text=True)
    wait_until(lambda: server.hits["s5"] == 1 and not proc.poll(), "s5 (8 s to answer) never asked")
    wait_for_lines(tmp_path / "ids.redrive" / "done.txt", 5, proc)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    said = read_line_with(proc, "press Ctrl+C again to quit now")  # the first one is taken: s5 is awaited
    assert "interrupted: finishing the " in said and "request(s) in flight" in said
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and time.monotonic() - started < 3
    lines = (tmp_path / "ids.redrive" / "done.txt").read_bytes()
    assert lines.endswith(b"\n") and len(lines.splitlines()) >= 5
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())  # written, as for every stop
    assert report["stop"] == "interrupted" and report["exit_code"] == 130 and report["counts"]["pending"] >= 1
    assert err.endswith("\n") and "rerun the same command to resume" in err


def test_second_run_on_the_same_state_dir_exits_75(server, tmp_path):
    import fcntl
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    fd = os.open(sdir / "lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"pid 4242, started 2026-01-01T00:00:00.000000Z\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        code, err, _ = crawl(server, tmp_path, ["a"])
    finally:
        os.close(fd)
    assert code == ExitCode.LOCKED
    assert f"another run (pid 4242, started 2026-01-01T00:00:00.000000Z) is using {sdir}" in err
    assert server.hits["a"] == 0
    assert crawl(server, tmp_path, ["a"])[0] == ExitCode.OK


# ------------------------------------------------- content and request shape


def test_expect_json_retries_a_login_wall_then_settles_it_as_unavailable(server, tmp_path):
    server.replies["w"] = [(200, b"<html>please log in</html>", {"Content-Type": "text/html"})]
    code, _, _ = crawl(server, tmp_path, ["w"], "--expect-json", "--tries", "2")
    assert code == ExitCode.OK and server.hits["w"] == 4
    [record] = state(tmp_path, "unavailable.jsonl")
    assert record["reason"] == "invalid JSON" and "still invalid JSON after 2 passes" in record["action"]
    assert state(tmp_path, "done.txt") == []


def test_require_text_and_field(server, tmp_path):
    server.replies["t"] = [(200, b"access denied", {}), (200, b"price: 3", {})]
    server.replies["f"] = [(200, b'{"price": null}', {}), (200, b'{"name": "x"}', {}), (200, b'{"price": 3}', {})]
    code, _, _ = crawl(server, tmp_path, ["t"], "--require", "price", "--state-dir", tmp_path / "a")
    assert code == ExitCode.OK and server.hits["t"] == 2
    code, _, _ = crawl(server, tmp_path, ["f"], "--require-field", "price", "--state-dir", tmp_path / "b",
                       "--tries", "2", "--cooldown", "0")
    assert code == ExitCode.OK and server.hits["f"] == 3
    errors = [json.loads(line)["error"] for line in (tmp_path / "b" / "failed.jsonl").read_text().splitlines()]
    assert errors == ["missing field 'price'"]
    result = json.loads((tmp_path / "b" / "results.jsonl").read_text())
    assert result["body"] == {"price": 3}


def test_missing_text_is_the_recorded_reason(server, tmp_path):
    server.replies["t"] = [(200, b"access denied", {})]
    crawl(server, tmp_path, ["t"], "--require", "price", "--tries", "1", "--passes", "1")
    assert state(tmp_path, "unavailable.jsonl")[0]["reason"] == "missing text 'price'"


def test_body_over_max_bytes_is_skipped_and_never_retried(server, tmp_path):
    server.replies["big"] = [(200, b"x" * 5000, {})]
    code, _, _ = crawl(server, tmp_path, ["big", "small"], "--max-bytes", "4096")
    assert code == ExitCode.OK and server.hits["big"] == 1
    [record] = state(tmp_path, "unavailable.jsonl")
    assert record["reason"] == "body over 4096 bytes" and record["bucket"] == "skip"
    assert state(tmp_path, "done.txt") == ["small"]


def test_post_with_a_json_body_escapes_the_id(server, tmp_path):
    item = 'he said "hi"\\'
    code, _, _ = crawl(server, tmp_path, [item], "--method", "post", "--data", '{"id": "{id}", "n": 1}')
    assert code == ExitCode.OK
    assert json.loads(server.bodies[0]) == {"id": item, "n": 1}
    assert server.seen_headers[0]["Content-Type"] == "application/json"


def test_post_with_a_form_body_percent_encodes_the_id(server, tmp_path):
    code, _, _ = crawl(server, tmp_path, ["a&b=c d"], "--method", "POST", "--data", "id={id}&x=1")
    assert code == ExitCode.OK
    assert server.bodies == [b"id=a%26b%3Dc+d&x=1"]
    assert server.seen_headers[0]["Content-Type"] == "application/x-www-form-urlencoded"


def test_a_server_dripping_its_body_hits_the_whole_attempt_timeout(server, tmp_path):
    server.replies["drip"] = [("drip", 200, 0.02), 200]  # a byte every 20 ms: no read ever waits 1 s
    code, _, _ = crawl(server, tmp_path, ["drip"], "--timeout", "1", "--cooldown", "0", "--tries", "1")
    assert code == ExitCode.OK
    assert state(tmp_path, "failed.jsonl")[0]["error"] == "timeout after 1 s"  # cut at 1 s, not read in 4
    assert server.hits["drip"] == 2


# ---------------------------------------------------------- run.json, drift


def test_run_json_records_the_shape_but_no_secret(server, tmp_path):
    env = {"API_KEY": SECRET}
    crawl(server, tmp_path, ["a"], "-H", "X-API-Key: ${API_KEY}", "-H", "X-Literal: " + SECRET + "2", environ=env)
    record = json.loads((tmp_path / "ids.redrive" / "run.json").read_text())
    assert record["shape"]["url"] == server.template and record["shape"]["method"] == "GET"
    assert record["shape"]["headers"] == ["x-api-key", "x-literal"]
    assert record["headers"] == [{"name": "X-API-Key", "value": "${API_KEY}"}, {"name": "X-Literal", "value": None}]
    assert len(record["hash"]) == 16 and SECRET not in all_output(tmp_path)


def test_a_changed_request_is_refused_unless_allowed(server, tmp_path):
    assert crawl(server, tmp_path, ["a"])[0] == ExitCode.OK
    code, err, _ = crawl(server, tmp_path, ["a", "b"], "--require", "id")
    assert code == ExitCode.USAGE and "require: [] -> ['id']" in err and "--allow-config-change" in err
    assert server.hits["b"] == 0
    code, _, _ = crawl(server, tmp_path, ["a", "b"], "--require", "id", "--allow-config-change")
    assert code == ExitCode.OK and server.hits["b"] == 1
    assert crawl(server, tmp_path, ["a", "b"], "--require", "id")[0] == ExitCode.OK


def test_knobs_are_not_part_of_the_shape(server, tmp_path):
    assert crawl(server, tmp_path, ["a"])[0] == ExitCode.OK
    code, _, _ = crawl(server, tmp_path, ["a", "b"], "--concurrency", "3", "--tries", "2", "--timeout", "9")
    assert code == ExitCode.OK


def test_a_bare_rerun_reuses_the_recorded_request_and_rereads_the_key(server, tmp_path):
    ids = write_ids(tmp_path, ["a", "b"])
    server.replies["b"] = [(401, b"", {})]
    code, _, _ = run_cli([ids, "--url", server.template, "-H", "X-API-Key: ${API_KEY}"], environ={"API_KEY": "old"})
    assert code == ExitCode.FATAL
    server.replies["b"] = [200]
    code, _, _ = run_cli([ids], environ={"API_KEY": "new"})
    assert code == ExitCode.OK
    assert [h["X-API-Key"] for h in server.seen_headers] == ["old", "old", "new"]


def test_a_bare_rerun_asks_again_for_a_literal_header(server, tmp_path):
    ids = write_ids(tmp_path, ["a", "b"])
    server.replies["b"] = [(401, b"", {})]
    run_cli([ids, "--url", server.template, "-H", "X-API-Key: literal-value"])
    code, err, _ = run_cli([ids])
    assert code == ExitCode.USAGE and "header X-API-Key was given as a literal value" in err
    assert "literal-value" not in err
    server.replies["b"] = [200]
    code, err, _ = run_cli([ids, "-H", "X-API-Key: literal-value"])  # -H again: the recorded --url is reused
    assert code == ExitCode.OK, err
    assert server.seen_headers[-1]["X-API-Key"] == "literal-value" and state(tmp_path, "done.txt") == ["a", "b"]


def test_the_readmes_bearer_header_resumes_on_a_bare_rerun_in_a_real_process(server, tmp_path):
    ids = [f"n{i}" for i in range(200)]
    server.replies.update({item: [("sleep", 0.01, 200)] for item in ids})
    ids_file = write_ids(tmp_path, ids)
    env = {**os.environ, "API_KEY": SECRET}
    cmd = redrive_cmd(ids_file, "--url", server.template, "-H", "Authorization: Bearer ${API_KEY}", "--concurrency", "2")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_lines(tmp_path / "ids.redrive" / "done.txt", 10, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == ExitCode.INTERRUPTED
    proc = subprocess.run(redrive_cmd(ids_file), capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {h["Authorization"] for h in server.seen_headers} == {f"Bearer {SECRET}"}
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids) and max(server.hits.values()) == 1
    assert SECRET not in all_output(tmp_path)
    recorded = json.loads((tmp_path / "ids.redrive" / "run.json").read_text())["headers"]
    assert recorded == [{"name": "Authorization", "value": "Bearer ${API_KEY}"}]


@pytest.mark.parametrize("value", ["Bearer sk-live-1234", "Token ${K} extra", "key=${K}"])
def test_a_header_whose_literal_text_could_be_a_secret_is_never_stored(server, tmp_path, value):
    code, _, _ = crawl(server, tmp_path, ["a"], "-H", f"Authorization: {value}", environ={"K": "k-value"})
    recorded = json.loads((tmp_path / "ids.redrive" / "run.json").read_text())["headers"]
    assert code == ExitCode.OK and recorded == [{"name": "Authorization", "value": None}]


def test_url_secrets_given_as_env_references_are_reusable(server, tmp_path):
    ids = write_ids(tmp_path, ["a"])
    code, _, _ = run_cli([ids, "--url", server.template + "?api_key=${API_KEY}"], environ={"API_KEY": SECRET})
    assert code == ExitCode.OK and server.paths == [f"/items/a?api_key={SECRET}"]
    record = json.loads((tmp_path / "ids.redrive" / "run.json").read_text())
    assert record["shape"]["url"].endswith("?api_key=${API_KEY}")
    assert SECRET not in all_output(tmp_path)


# -------------------------------------------------------------------- check


def test_check_reconciles_without_network_or_writes(server, tmp_path):
    server.replies["gone"] = [404]
    crawl(server, tmp_path, ["a", "gone", "old"])
    sdir = tmp_path / "ids.redrive"
    with open(sdir / "done.txt", "ab") as fh:
        fh.write("ghost\nhé".encode()[:-1])  # torn inside a UTF-8 character
    before = {p.name: p.read_bytes() for p in sdir.iterdir()}
    hits = sum(server.hits.values())
    ids = write_ids(tmp_path, ["a", "gone", "new", "ghost"])
    out = io.StringIO()
    code = redrive.main([str(ids), "--check"], out=out, err=io.StringIO(), environ={})
    text = out.getvalue()
    assert code == ExitCode.INCOMPLETE
    assert summary_count(text, "done") == 2 and summary_count(text, "unavailable") == 1
    assert summary_count(text, "pending") == 1 and summary_count(text, "not in input") == 1
    assert "done ids without a result line: 1 (ghost)" in text and "torn last lines: 1 (done.txt)" in text
    assert {p.name: p.read_bytes() for p in sdir.iterdir()} == before
    assert sum(server.hits.values()) == hits


def test_check_exits_0_when_every_id_is_settled_and_consistent(server, tmp_path):
    server.replies["gone"] = [404]
    crawl(server, tmp_path, ["a", "gone"])
    out = io.StringIO()
    code = redrive.main([str(tmp_path / "ids.txt"), "--check", "-q"], out=out, err=io.StringIO(), environ={})
    assert code == ExitCode.OK and out.getvalue() == ""


def check_text(ids_file):
    out = io.StringIO()
    code = redrive.main([str(ids_file), "--check"], out=out, err=io.StringIO(), environ={})
    return code, out.getvalue()


def test_check_counts_a_result_the_input_does_not_list_as_a_stranger_when_the_files_agree(server, tmp_path):
    crawl(server, tmp_path, ["a", "b", "x"])  # results and done in lockstep: a, b, x
    code, text = check_text(write_ids(tmp_path, ["a", "b", "c"]))
    assert code == ExitCode.INCOMPLETE
    assert summary_count(text, "done") == 2 and summary_count(text, "pending") == 1
    assert summary_count(text, "not in input") == 1 and "the state is consistent" in text


def test_check_finds_a_done_file_in_another_order_or_with_a_line_twice_consistent(server, tmp_path):
    ids = ["a", "b", "c", "d"]
    crawl(server, tmp_path, ids)
    done = tmp_path / "ids.redrive" / "done.txt"
    done.write_text("d\nb\nc\na\nb\n")  # out of lockstep with results.jsonl, the same ids
    code, text = check_text(tmp_path / "ids.txt")
    assert code == ExitCode.OK and summary_count(text, "done") == 4 and summary_count(text, "pending") == 0
    assert "the state is consistent" in text
    done.write_text("d\nb\nc\nz\n")  # a lost a's done line; z is done with no result, and no input line
    code, text = check_text(tmp_path / "ids.txt")
    assert summary_count(text, "done") == 3 and summary_count(text, "pending") == 1
    assert summary_count(text, "not in input") == 1
    assert "done ids without a result line: 1 (z)" in text and "result lines without a done line: 1 (a)" in text


def test_a_done_file_that_is_not_utf8_is_a_one_line_error_for_a_run_and_for_check(server, tmp_path):
    crawl(server, tmp_path, ["a", "b"])
    done = tmp_path / "ids.redrive" / "done.txt"
    done.write_bytes(b"a\n\xff\xfe\n")  # not redrive's: nothing is rewritten, nothing is sent
    hits = sum(server.hits.values())
    for extra in (["--url", server.template], ["--check"]):
        err = io.StringIO()
        code = redrive.main([str(tmp_path / "ids.txt"), *extra], out=io.StringIO(), err=err, environ={})
        [line] = err.getvalue().splitlines()  # one line, no traceback
        assert code == ExitCode.USAGE and line.endswith("done.txt: not readable as redrive's UTF-8 id list; move it away")
    assert done.read_bytes() == b"a\n\xff\xfe\n" and sum(server.hits.values()) == hits


def test_check_of_a_state_larger_than_a_part_names_each_inconsistency_and_writes_nothing(tmp_path):
    ids = [f"id{n:07d}" for n in range(200_000)]  # with done.txt and the results, several parts of the match
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    done = ids[:150_000] + ["stranger"]
    fetched = [i for i in done if i not in ("id0100000", "id0000007")] + ["id0199999"]
    (sdir / "done.txt").write_text("".join(f"{i}\n" for i in done))
    line = '{{"id":"{0}","url":"u","status":200,"fetched_at":"2026-12-01T00:00:00.000000Z","body":{{}}}}\n'
    (sdir / "results.jsonl").write_text("".join(map(line.format, fetched[::-1])))  # another order than done's
    before = sorted(p.name for p in sdir.iterdir())
    code, text = check_text(write_ids(tmp_path, ids))
    assert code == ExitCode.INCOMPLETE and sorted(p.name for p in sdir.iterdir()) == before
    assert summary_count(text, "done") == 150_000 and summary_count(text, "pending") == 50_000
    assert summary_count(text, "not in input") == 1
    assert "done ids without a result line: 2 (id0000007, id0100000)" in text
    assert "result lines without a done line: 1 (id0199999)" in text


def limited_run(size, *args):
    """redrive.py in a process whose files may not grow past size bytes
    (RLIMIT_FSIZE): a full disk, as every write call sees it."""
    import resource
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))  # noqa: E731
    return subprocess.run(redrive_cmd(*args), preexec_fn=limit, capture_output=True, text=True, timeout=30)


def test_a_disk_that_fills_mid_run_is_one_line_exit_2_and_the_rerun_resumes(server, tmp_path):
    ids = [f"item-{n:03d}" for n in range(40)]
    proc = limited_run(1500, write_ids(tmp_path, ids), "--url", server.template)
    assert proc.returncode == ExitCode.USAGE and "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("redrive: error")]
    assert "results.jsonl: write failed (File too large); free space, then rerun" in line
    code, err, _ = crawl(server, tmp_path, ids)
    assert code == ExitCode.OK and "cut off a torn last line" in err
    assert sorted(state(tmp_path, "done.txt")) == ids and sorted(r["id"] for r in state(tmp_path, "results.jsonl")) == ids


class FailingDisk(FastForward):
    """Real time; every fsync fails as a dying disk's does."""

    def fsync(self, fd):
        raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("busy", [False, True])
def test_an_fsync_that_fails_is_one_line_exit_2_and_the_rerun_resumes(server, tmp_path, monkeypatch, busy):
    if busy:  # the fsync thread's failure, mid-run, not only the last one at close
        monkeypatch.setattr(redrive, "SYNC_INTERVAL", 0.01)
        monkeypatch.setattr(redrive, "MAX_WAIT", 0.01)
    ids = [f"f{n}" for n in range(30)]
    for item in ids:
        server.replies[item] = [("sleep", 0.005, 200)]
    code, err, _ = crawl(server, tmp_path, ids, fake=FailingDisk())
    assert code == ExitCode.USAGE and "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("redrive: error")]
    assert line.endswith("fsync failed (Input/output error); check the disk")
    stored = state(tmp_path, "done.txt")
    assert (len(stored) < len(ids)) == busy  # the failure stopped the run at once
    code, err, _ = crawl(server, tmp_path, ids)
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == sorted(ids)
    assert all(server.hits[i] == 1 for i in stored), "a stored result was fetched again"


def test_a_disk_full_at_start_is_one_line_exit_2(server, tmp_path):
    proc = limited_run(0, write_ids(tmp_path, ["a"]), "--url", server.template)
    assert proc.returncode == ExitCode.USAGE and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "lock: write failed (file too large)" in proc.stderr


def test_an_unreadable_state_file_is_one_line_exit_2(server, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / "failed.jsonl").write_text("")
    (sdir / "failed.jsonl").chmod(0)
    code, err, _ = crawl(server, tmp_path, ["a"])
    assert code == ExitCode.USAGE and err.count("\n") == 1 and "failed.jsonl: permission denied" in err


@pytest.mark.parametrize("name", ["results.jsonl", "done.txt", "lock", "run.json", "report.json", "paces.json"])
def test_a_state_file_that_is_a_symlink_is_refused_before_anything_is_cut_or_written(server, tmp_path, name):
    foreign = tmp_path / "precious.txt"
    foreign.write_bytes(b"somebody else's data, with no newline at the end")
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / name).symlink_to(foreign)
    for args in ([], ["--check"]):
        code, err, _ = crawl(server, tmp_path, ["a"], *args)
        assert code == ExitCode.USAGE and err.count("\n") == 1 and f"{name}: a symlink" in err
    assert foreign.read_bytes() == b"somebody else's data, with no newline at the end"
    assert server.hits["a"] == 0 and sorted(p.name for p in sdir.iterdir()) == [name]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the fsynced files from /proc")
def test_fsync_mode_fsyncs_every_line_before_the_next_step(server, tmp_path):
    code, _, fake = crawl(server, tmp_path, ["a", "b"], "--fsync")
    assert code == ExitCode.OK and state(tmp_path, "done.txt") == ["a", "b"]
    assert fake.fsyncs == ["results.jsonl", "done.txt", "results.jsonl", "done.txt"]
    ids = [f"i{n}" for n in range(20)]
    code, _, fake = crawl(server, tmp_path, ids)  # without it: batched, not one per line (40 lines)
    assert code == ExitCode.OK and state(tmp_path, "done.txt") == ["a", "b", *ids]
    assert 1 <= len(fake.fsyncs) <= 4 and set(fake.fsyncs) <= {"results.jsonl", "done.txt"}
    assert fake.fsyncs[:2] == ["results.jsonl", "done.txt"], "a done line on disk before its result"


class SlowDisk(FastForward):
    """Real time; the first fsync lasts until the server has answered `more`
    requests past it (or `limit` seconds): how many did is kept."""

    def __init__(self, server, more, limit=3.0):
        super().__init__()
        self.server, self.more, self.limit, self.answered_meanwhile = server, more, limit, None

    def fsync(self, fd):
        if self.answered_meanwhile is None:
            start, end = sum(self.server.hits.values()), time.monotonic() + self.limit
            while sum(self.server.hits.values()) < start + self.more and time.monotonic() < end:
                time.sleep(0.005)
            self.answered_meanwhile = sum(self.server.hits.values()) - start
        super().fsync(fd)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the fsynced files from /proc")
@pytest.mark.parametrize("paced", [False, True])
def test_a_slow_fsync_holds_neither_the_answers_nor_the_paced_starts(server, tmp_path, monkeypatch, paced):
    monkeypatch.setattr(redrive, "SYNC_INTERVAL", 0.02)  # a sync while the run is busy, not only at its end
    monkeypatch.setattr(redrive, "MAX_WAIT", 0.02)  # (workers that go straight on do not wake the main thread)
    ids = [f"s{n}" for n in range(40)]
    for item in ids:
        server.replies[item] = [("sleep", 0.005, (200, json.dumps({"id": item}).encode(), {}))]
    fake = SlowDisk(server, more=8)
    # paced: a worker that answers before the next slot leaves the start to the main thread
    pace = ["--rate", "50"] if paced else []
    code, err, _ = crawl(server, tmp_path, ids, "--concurrency", "2", *pace, fake=fake)
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == sorted(ids), err
    assert fake.answered_meanwhile >= 8, "the run waited for the disk"


# ------------------------------------------------------- kill -9 and repair


def check_any_moment_invariants(sdir):
    """What must hold in the state dir whenever a process dies, before repair."""
    texts = {name: (sdir / name).read_bytes() if (sdir / name).exists() else b"" for name in redrive.STATE_FILES}
    complete = {name: data[:data.rfind(b"\n") + 1].decode().splitlines() for name, data in texts.items()}
    done = complete["done.txt"]
    results = [json.loads(line)["id"] for line in complete["results.jsonl"]]
    assert len(done) == len(set(done)), "an id is in done.txt twice"
    assert set(done) <= set(results), "a done id has no result line"
    assert len(results) == len(set(results)), "an id has two result lines"
    assert set(results) - set(done) <= set(results[-1:]), "only the last result may lack its done line"
    unavailable = {json.loads(line)["id"] for line in complete["unavailable.jsonl"]}
    assert not unavailable & set(done)


def check_finished_invariants(sdir, ids):
    done = (sdir / "done.txt").read_text().splitlines()
    results = [json.loads(line)["id"] for line in (sdir / "results.jsonl").read_text().splitlines()]
    unavailable = [json.loads(line)["id"] for line in (sdir / "unavailable.jsonl").read_text().splitlines()]
    assert sorted(done) == sorted(results) and len(done) == len(set(done))
    assert sorted(done + unavailable) == sorted(ids), "every id in exactly one terminal place"
    for name in redrive.STATE_FILES:
        data = (sdir / name).read_bytes()
        assert not data or data.endswith(b"\n"), f"{name} has a torn line"


def kill_script(server, ids):
    for n, item in enumerate(ids):
        size = 600_000 if n % 13 == 0 else 200 + n * 37
        body = json.dumps({"id": item, "pad": "p" * size}).encode()
        ok = ("sleep", 0.003, (200, body, {"Content-Type": "application/json"}))
        server.replies[item] = [404] if n % 10 == 3 else [503, ok] if n % 20 == 2 else [ok]


@pytest.mark.parametrize("kill_points", [(1, 9, 30, 55), (4, 17, 41, 80)])
def test_kill_9_at_many_points_then_rerun_loses_and_duplicates_nothing(server, tmp_path, kill_points):
    ids = [f"k{n}" for n in range(100)]
    kill_script(server, ids)
    ids_file = write_ids(tmp_path, ids)
    sdir = tmp_path / "ids.redrive"
    cmd = redrive_cmd(ids_file, "--url", server.template, "--concurrency", "4", "--backoff", "0.01",
                      "--cooldown", "0", "-q")
    snapshots = []
    for k in kill_points:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        wait_for_lines(sdir / "done.txt", k, proc)
        proc.kill()
        proc.wait(timeout=10)
        check_any_moment_invariants(sdir)
        snapshots.append((set(state(tmp_path, "done.txt")), Counter(server.hits)))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    check_finished_invariants(sdir, ids)
    for done_then, hits_then in snapshots:
        assert all(server.hits[i] == hits_then[i] for i in done_then), "a stored result was fetched again"


# The ledger's transitions and its repair, as a state machine: every write a
# run can make, a kill between a result and its done line, and a kill in the
# middle of any line; after each restart the files must match the model.

from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

IDS = st.sampled_from(["a", "b", "c", "d", "é-ü", "with space", "x" * 300])


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-"))
        self.done, self.failed, self.unavailable = [], {}, set()
        self.last_file = None
        self.ledger = redrive.Ledger(self.dir)
        self.ledger.open()

    def teardown(self):
        self.ledger.close()
        import shutil
        shutil.rmtree(self.dir)

    def restart(self):
        """A new run: repair, read, complete a lost done line."""
        self.ledger.close()
        self.state = redrive.load_state(self.dir)
        self.ledger = redrive.Ledger(self.dir)
        self.ledger.open()
        redrive.complete_lost_done(self.state, self.ledger)
        self.last_file = None

    def pending(self, item):
        return item not in self.done and item not in self.unavailable

    def result(self, item):
        return {"id": item, "url": "http://x/" + item, "status": 200, "fetched_at": "t", "body": {"v": item * 3}}

    @rule(item=IDS)
    def succeed(self, item):
        if self.pending(item):
            self.ledger.success(item, json.dumps(self.result(item)))
            self.done.append(item)
            self.last_file = "done.txt"

    @rule(item=IDS, pass_no=st.integers(1, 3))
    def fail_a_pass(self, item, pass_no):
        if self.pending(item):
            self.ledger.record("failed.jsonl", {"id": item, "pass": pass_no, "bucket": "retryable", "status": 503,
                                                "error": "503", "tries": 5, "at": "2026-01-01T00:00:00.000000Z"})
            self.previous_failed = self.failed.get(item)
            self.failed[item] = pass_no
            self.last_file, self.last_item = "failed.jsonl", item

    @rule(item=IDS)
    def give_up(self, item):
        if self.pending(item):
            self.ledger.record("unavailable.jsonl", {"id": item, "reason": "404", "status": 404, "bucket": "skip",
                                                     "tries": 1, "at": "2026-01-01T00:00:00.000001Z", "action": "drop"})
            self.unavailable.add(item)
            self.last_file, self.last_item = "unavailable.jsonl", item

    @rule(item=IDS)
    def killed_between_result_and_done(self, item):
        if self.pending(item):
            self.ledger.record("results.jsonl", self.result(item))
            self.restart()
            self.done.append(item)

    @rule(item=IDS, keep=st.floats(0.0, 0.999))
    def killed_while_writing_a_result(self, item, keep):
        if self.pending(item):
            line = json.dumps(self.result(item)).encode()
            with open(self.dir / "results.jsonl", "ab") as fh:
                fh.write(line[:int(len(line) * keep)])
            self.restart()

    @precondition(lambda self: self.last_file is not None)
    @rule(cut=st.floats(0.001, 1.0))
    def killed_while_writing_the_last_line(self, cut):
        """Tear the last line written: keep a prefix of it, without its newline."""
        path = self.dir / self.last_file
        data = path.read_bytes()
        start = data.rfind(b"\n", 0, len(data) - 1) + 1
        keep = start + int((len(data) - 1 - start) * (1 - cut))
        path.write_bytes(data[:keep])
        if self.last_file == "failed.jsonl":
            self.failed.pop(self.last_item)
            if self.previous_failed is not None:
                self.failed[self.last_item] = self.previous_failed
        elif self.last_file == "unavailable.jsonl":
            self.unavailable.discard(self.last_item)
        self.restart()  # a torn done line is cut, then completed from its result line

    @invariant()
    def files_match_the_model(self):
        state = redrive.load_state(self.dir, repair=False)
        done = self.dir / "done.txt"
        assert sorted(done.read_text().splitlines() if done.exists() else []) == sorted(self.done)  # each once
        results = [r["id"] for r in redrive.read_records(self.dir / "results.jsonl")]
        assert sorted(results) == sorted(self.done), "each done id has exactly one result line"
        assert {i: r["pass"] for i, r in state.failed.items()} == self.failed
        assert set(state.unavailable) == self.unavailable
        for name in redrive.STATE_FILES:
            assert not redrive.has_torn_tail(self.dir / name)


LedgerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase


# ------------------------------------------------- progress and the report


def test_progress_off_a_terminal_is_a_plain_line_every_30_s(server, tmp_path):
    server.replies["f"] = [500, 200]
    code, err, fake = crawl(server, tmp_path, ["f", "g"], "--tries", "1", "--cooldown", "70")
    assert code == ExitCode.OK and fake.sleeps == [70.0]
    lines = [x for x in err.splitlines() if re.match(r"redrive: pass \d+, ", x)]
    # 2 requests and 1 id settled in the 70 s since the start; f is due for pass 2 now, and takes its turn
    assert lines == ["redrive: pass 1, 1/2 done, 0 unavailable, 1 failed, 0.03 req/s, ETA 1m10s"]
    assert "\r" not in err and "\x1b" not in err


def status_line(progress, snap, now):
    return ", ".join(text for _, text in progress.render(snap, now))


def test_a_resumed_runs_eta_counts_only_its_own_work_and_a_known_wait_is_shown():
    clock = FakeTime()
    progress = redrive.Progress(io.StringIO(), 40, clock.clock, quiet=False)
    progress.begin(30)  # an earlier run settled 30 of the 40
    later = clock.now + 10.0  # ten seconds in, 5 more settled: half an id a second
    assert "ETA 10 s" in status_line(progress, redrive.Snapshot(10, 35, 0, 0, 0.0, 1, 0.0, None), later)
    # before: the earlier run's 30 counted as settled in these ten seconds, and 5 left took "1 s"
    waits = redrive.Snapshot(10, 35, 0, 0, later + 60.0, 1, 0.0, None)  # one of them waits out a 60 s backoff
    assert "ETA 1m00s" in status_line(progress, waits, later)
    idle = redrive.Progress(io.StringIO(), 40, clock.clock, quiet=False)
    idle.begin(35)  # nothing settled yet, and the next id is due in 7 s: a wait of known length
    assert "ETA 7 s at least" in status_line(idle, redrive.Snapshot(0, 35, 0, 0, 0.0, 1, 0.0, clock.now + 7.0), clock.now)
    down = redrive.Snapshot(10, 35, 0, 0, 0.0, 1, later + 9.0, None, down=True)
    line = status_line(progress, down, later)
    assert "unreachable, probing" in line and "throttled" not in line


def test_a_refresh_shows_its_own_count_and_its_eta_counts_the_ids_left_to_refresh():
    clock = FakeTime()
    progress = redrive.Progress(io.StringIO(), 100, clock.clock, quiet=False)
    progress.begin(100)  # every id done already: all the work is the refresh of 60 of them
    later = clock.now + 10.0  # 20 refreshed in ten seconds: 40 left at 2 a second
    line = status_line(progress, redrive.Snapshot(20, 100, 0, 0, 0.0, 1, 0.0, None, refresh=(20, 60)), later)
    assert "100/100 done, 20/60 refreshed" in line and "ETA 20 s" in line


def read_terminal(master, slave):
    """Everything a process wrote to its terminal (a pty), until it closed it."""
    os.close(slave)
    output = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break  # EIO: the other side is closed
        if not chunk:
            break
        output += chunk
    return output


def test_progress_on_a_terminal_rewrites_one_line_and_hides_secrets(server, tmp_path):
    import pty
    ids = [f"p{i}" for i in range(120)]
    for item in ids:
        server.replies[item] = [("sleep", 0.01, 200)]
    ids_file = write_ids(tmp_path, ids)
    master, slave = pty.openpty()
    env = {**os.environ, "API_KEY": SECRET}
    proc = subprocess.Popen(redrive_cmd(ids_file, "--url", server.template + "?token=" + SECRET, "--concurrency", "2",
                                        "-H", "X-API-Key: ${API_KEY}"),
                            stdin=slave, stdout=slave, stderr=slave, env=env)
    output = read_terminal(master, slave)
    assert proc.wait(timeout=30) == 0
    text = output.decode()
    statuses = re.findall(r"\r(pass 1, \d+/120 done[^\r\x1b]*)\x1b\[K", text)
    assert len(statuses) >= 2 and "req/s" in statuses[-1]
    assert SECRET not in text


def test_progress_on_a_narrow_terminal_never_wraps(server, tmp_path):
    import fcntl
    import pty
    import termios
    ids = [f"p{i}" for i in range(150)]
    server.replies.update({item: [("sleep", 0.01, 200)] for item in ids})
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 50, 0, 0))  # 50 columns
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(redrive_cmd(write_ids(tmp_path, ids), "--url", server.template, "--concurrency", "2"),
                            stdin=slave, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    output = read_terminal(master, slave)
    assert proc.wait(timeout=30) == 0
    statuses = re.findall(r"\r(pass 1, [^\r\x1b]*)\x1b\[K", output.decode())
    assert len(statuses) >= 2 and all(len(line) <= 49 for line in statuses)
    # it had more to say: whole fields were dropped from the least needed, the counts and the ETA kept to the last
    assert all(re.search(r"\d+/150 done", line) for line in statuses)
    assert any("ETA" in line and "req/s" not in line for line in statuses)


def test_report_json_lists_every_unresolved_id_with_reason_and_action(server, tmp_path):
    server.replies.update({"gone1": [404], "gone2": [404], "bad": [500], "slow": [500, 200]})
    ids = ["ok", "gone1", "gone2", "bad", "slow", "later"]
    code, err, _ = crawl(server, tmp_path, ids, "--tries", "1", "--passes", "1", "--max-time", "0.001",
                         "--report", tmp_path / "copy.json")
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == report
    assert report["exit_code"] == code
    assert report["counts"]["input"] == 6
    assert sum(report["counts"][k] for k in ("done", "unavailable", "failed", "pending")) == 6
    unresolved = {r["id"]: r for r in report["unresolved"]}
    assert set(unresolved) | set(state(tmp_path, "done.txt")) == set(ids)
    for row in unresolved.values():
        assert row["reason"] and row["action"] and row["state"] in ("unavailable", "failed", "pending")


def test_summary_groups_the_residue_by_reason_with_one_action_each(server, tmp_path):
    server.replies.update({"g1": [404], "g2": [404], "t": [429], "b": [401]})
    code, err, _ = crawl(server, tmp_path, ["g1", "g2", "t", "ok"], "--tries", "1", "--cooldown", "0")
    assert code == ExitCode.OK
    assert "  2 x 404 Not Found: not found (404): check them or drop them from the input list" in err
    assert "  1 x 429 Too Many Requests: refused for itself after 2 passes while the host took others" in err
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert [(g["reason"], g["count"]) for g in report["reasons"]] == [("404 Not Found", 2),
                                                                      ("429 Too Many Requests", 1)]
    code, err, _ = crawl(server, tmp_path, ["g1", "g2", "t", "ok", "b", "c", "d"])
    assert code == ExitCode.FATAL
    assert "3 x pending, run halted by a fatal response: fix the key or the account, then rerun" in err
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["stop"] == "fatal" and report["exit_code"] == 3


def test_secrets_are_redacted_in_errors_too(tmp_path):
    ids = write_ids(tmp_path, ["a"])
    code, err, _ = run_cli([ids, "--url", "ftp://x.example/{id}?api_key=" + SECRET])
    assert code == ExitCode.USAGE and SECRET not in err and "api_key=REDACTED" in err
    code, err, _ = run_cli([ids, "--url", "http://x.example/items?key=" + SECRET])
    assert code == ExitCode.USAGE and SECRET not in err


# ------------------------------------------------------ throttle and shards
# The pacing model (redrive.Host) is tested by what a run would see, over a
# fake clock: drive() plays a server's limiter against one host's gate as the
# run loop does, each answer read by redrive's own interpret().

WALL = 1.8e9  #: the fake wall clock at the fake run clock's 0: whole seconds


def response(status, headers=None, body=b""):
    """A requests.Response as fetch hands it to interpret (built, not mocked: nothing is sent)."""
    resp = requests.Response()
    resp.status_code, resp.url, resp._content = status, "http://127.0.0.1/x", body
    resp.headers = requests.structures.CaseInsensitiveDict(headers or {})
    resp.encoding = requests.utils.get_encoding_from_headers(resp.headers)
    return resp


def drive(serve, count, until=900.0, latency=0.02, cap=32, tmp=None, order=None, tick=0.0, wait_tick=0.0,
          **options):
    """Ids 0..count-1 through redrive's own run loop on a fake clock: a real
    Batch (its Schedule, host gates, Settler, Timekeeper and ledgers in a
    temporary state dir), driven as its main thread and workers would drive
    it, but with no thread and no socket. Each request is answered `latency`
    after it leaves (plus any delay serve adds; with a seed `order`, a
    thousandth more or less, so that the answers of one round trip come in an
    order no one chose, as on a network) by serve(id, n, now) ->
    (status, headers, body[, delay]) for its n-th request, read by redrive's
    own interpret. Returns when each id ended and how (from the state
    files), the requests, the refusals, the refusals sent after the first
    answer that declared a quota, those sent before the first refusal came
    back (blind: sent before any answer told of a limit), and the times
    requests were sent. With a `tick`, redrive's clock reads the time rounded
    down to it, as Windows' time.monotonic did before Python 3.13 (15.6 ms);
    with a `wait_tick`, each wait of the run loop ends at the next multiple of
    it, as a wait on a coarse system timer does."""
    with tempfile.TemporaryDirectory(prefix="drive-") as folder:
        return _drive(serve, count, until, latency, cap, Path(tmp or folder), order, (tick, wait_tick), options)


def _drive(serve, count, until, latency, cap, folder, order, ticks, options):
    clock = [0.0]
    tick, wait_tick = ticks
    read = (lambda: math.floor(clock[0] / tick) * tick) if tick else (lambda: clock[0])
    fx = Effects(clock=read, wallclock=lambda: WALL + clock[0], sleep=lambda s: None,
                 rand=random.Random(7).random, fsync=lambda fd: None)
    cfg = Config(write_ids(folder, map(str, range(count))), folder / "state",
                 request=redrive.Request(url_spec="http://h/{id}", url="http://h/{id}"), concurrency=cap, quiet=True,
                 guard=False, **options)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    ledger = redrive.Ledger(cfg.state_dir, False, fx.clock, fx.fsync)
    ledger.open()
    state, paces = redrive.load_state(cfg.state_dir), redrive.read_paces(cfg.state_dir)
    listing = redrive.read_input(cfg, state, False, redrive.Redactor(()), io.StringIO())  # as run() reads it
    batch = redrive.Batch(cfg, ledger, state, fx, redrive.Redactor(()),
                          redrive.Progress(io.StringIO(), count, fx.clock, True))
    redrive.plan(listing, state, cfg, batch, ledger, fx)
    batch.timeline.recalled = paces  # as run_passes hands them over
    inflight, asked, refused, sends, seq = [], Counter(), [], [], itertools.count()
    spread = (lambda: 0.0) if order is None else random.Random(order).random
    declared_at, switch = math.inf, sys.getswitchinterval()  # a paced Batch sets it; Batch.run sets it back
    first_refusal = math.inf  # when the first refusal came back: what was sent before it met the limit unwarned

    def send(item):
        asked[item.id] += 1
        answer = serve(int(item.id), asked[item.id], clock[0])
        sends.append(clock[0])
        delay = latency * (1 + spread() * 1e-3) + (answer[3] if len(answer) > 3 else 0.0)
        heapq.heappush(inflight, (clock[0] + delay, next(seq),
                                  clock[0], item, answer[:3]))

    try:
        while clock[0] < until:
            with batch.lock:
                look = batch.look()  # the main thread's look, as Batch.run takes it
            if look is None:
                break
            timeout, _, dirty = look
            ledger.flush_files(dirty)
            while not batch.jobs.empty():  # idle workers take what it handed out
                send(batch.jobs.get())
            wake = clock[0] + redrive.bounded_wait(timeout)  # as long as the main thread would sleep
            wake = math.ceil(wake / wait_tick) * wait_tick if wait_tick else wake
            if inflight and inflight[0][0] <= wake:
                at, _, sent, item, (status, headers, body) = heapq.heappop(inflight)
                clock[0] = max(clock[0], at)
                out = redrive.interpret(response(status, headers, body), body,
                                        redrive.classify_status(status, cfg), cfg, redrive.Redactor(()),
                                        fx.wallclock())
                declared_at = min(declared_at, clock[0]) if out.quota else declared_at
                if out.throttle:
                    refused.append(sent)
                    first_refusal = min(first_refusal, clock[0])
                with batch.lock:
                    mine = batch._finish(item, out)
                if mine is not None:
                    send(mine)
            else:
                clock[0] = max(clock[0], wake)
    finally:
        ledger.close()
        batch.wake.close()
        batch.watchdog.close()
        sys.setswitchinterval(switch)
    redrive.remember_paces(cfg.state_dir, batch.timeline.hosts, paces, fx.clock(), fx.wallclock())  # as run_passes
    ended = {}
    for line in (cfg.state_dir / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        ended[int(record["id"])] = (redrive.parse_iso(record["fetched_at"]) - WALL, Bucket.OK, record["status"])
    for line in (cfg.state_dir / "unavailable.jsonl").read_text().splitlines():
        record = json.loads(line)
        ended[int(record["id"])] = (redrive.parse_iso(record["at"]) - WALL, Bucket(record["bucket"]),
                                    record["status"])
    end = max((t for t, _, _ in ended.values()), default=0.0)
    return {"ended": ended, "end": end, "requests": sum(asked.values()), "refused": len(refused), "refusals": refused,
            "late": sum(1 for t in refused if t > declared_at), "sends": sends, "clock": clock[0],
            "blind": sum(1 for t in refused if t < first_refusal),
            "failed": (cfg.state_dir / "failed.jsonl").read_text().count("\n")}


class Leaky:
    """nginx's limit_req: `rate` a second with `burst` of slack (its rate halved from halved[0] to
    halved[1] s); past it `status` and no Retry-After. With `delay`, an accepted request over the
    rate is held until its turn (nginx without nodelay); without, answered at once. Every 50th
    id a real 404."""

    def __init__(self, rate, burst, halved=None, status=429, delay=False):
        self.rate, self.burst, self.halved, self.status, self.delay = rate, burst, halved, status, delay
        self.excess, self.last, self.start = 0.0, 0.0, None

    def rate_at(self, t):
        return self.rate / 2 if self.halved and self.halved[0] <= t < self.halved[1] else self.rate

    def ideal(self, n):
        """The fastest the limit lets n through: n - burst at its rate in turn."""
        need, spans = n - self.burst, ((0, self.halved[0]), self.halved, (self.halved[1], math.inf)) \
            if self.halved else ((0, math.inf),)
        for a, b in spans:
            if need <= self.rate_at(a) * (b - a):
                return a + need / self.rate_at(a)
            need -= self.rate_at(a) * (b - a)

    def __call__(self, item, n, now):
        first = self.start is None
        self.start = now if first else self.start
        t = now - self.start
        excess = 0.0 if first else max(0.0, self.excess - self.rate_at(t) * (t - self.last) + 1.0)  # one free, as nginx
        if excess > self.burst:
            return self.status, {}, b""
        self.excess, self.last = excess, t
        held = (excess - 1.0) / self.rate_at(t) if self.delay and excess > 1.0 else 0.0
        return ((404, {}, b"") if item % 50 == 49 else (200, {}, b'{"ok":1}')) + (held,)


class PenaltyBox(Leaky):
    """A limit that blocks on the first excess (SEC's way): `rate` a second with no slack; a request
    over it blocks every request for `block` s, and each request during a block starts it again.
    `blocks` counts the blocks begun (a request refused during one extends it: no new block)."""

    def __init__(self, rate, block):
        super().__init__(rate, 0)
        self.block, self.until, self.blocks = block, -math.inf, 0

    def __call__(self, item, n, now):
        if now < self.until:
            self.until = now + self.block
            return self.status, {}, b""
        answer = super().__call__(item, n, now)
        if answer[0] == self.status:
            self.until, self.blocks = now + self.block, self.blocks + 1
        return answer


class Spell:
    """A host that refuses every request (`status`, with `retry_after` if given) from `start` to `end` s of the
    clock and takes every other: a deploy, a cold start. Every 50th id a real 404."""

    def __init__(self, start, end, status=503, retry_after=None):
        self.start, self.end, self.status, self.retry_after = start, end, status, retry_after

    def __call__(self, item, n, now):
        if self.start <= now < self.end:
            return self.status, {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}, b""
        return (404, {}, b"") if item % 50 == 49 else (200, {}, b'{"ok":1}')


class SlidingLog:
    """`size` requests in any `seconds` before now (the accepted ones are logged); 429 past it."""

    def __init__(self, size, seconds):
        self.size, self.seconds, self.log = size, seconds, deque()

    def ideal(self, n):
        return (math.ceil(n / self.size) - 1) * self.seconds

    def __call__(self, item, n, now):
        while self.log and self.log[0] <= now - self.seconds:
            self.log.popleft()
        if len(self.log) >= self.size:
            return 429, {}, b""
        self.log.append(now)
        return 200, {}, b'{"ok":1}'


class TokenBucket:
    """`burst` tokens, `rate` more a second; 429 + Retry-After: 1 when none is left."""

    def __init__(self, rate, burst):
        self.rate, self.burst, self.tokens, self.last = rate, burst, float(burst), None

    def ideal(self, n):
        return (n - self.burst) / self.rate

    def __call__(self, item, n, now):
        self.last = now if self.last is None else self.last
        self.tokens, self.last = min(self.burst, self.tokens + (now - self.last) * self.rate), now
        if self.tokens < 1:
            return 429, {"Retry-After": "1"}, b""
        self.tokens -= 1
        return 200, {}, b'{"ok":1}'


class Window:
    """`size` requests a window of `seconds` of the clock; past it `status` (and `body`), with a
    Retry-After to the window's end in whole seconds or none, and the quota declared in `dialect`'s
    headers on every answer (None: nowhere)."""

    def __init__(self, size, seconds, retry_after=True, dialect=None, status=429, body=b""):
        self.size, self.seconds, self.retry_after, self.dialect = size, seconds, retry_after, dialect
        self.status, self.body, self.window, self.used = status, body, -1, 0

    def ideal(self, n):
        return (math.ceil(n / self.size) - 1) * self.seconds

    def __call__(self, item, n, now):
        window = int(now // self.seconds)
        if window != self.window:
            self.window, self.used = window, 0
        end = (window + 1) * self.seconds
        over = self.used >= self.size
        self.used += not over
        headers = declared_headers(self.dialect, self.size, self.size - self.used, end - now, WALL + end)
        if not over:
            return 200, headers, b'{"ok":1}'
        if self.retry_after:
            headers["Retry-After"] = str(math.ceil(end - now))
        return self.status, headers, self.body


class Cheap(Window):
    """A declared window (GitHub's headers) that counts only every `every`-th id's request: the
    others cost nothing, as GitHub counts no 304 to a conditional request."""

    def __init__(self, size, seconds, every):
        super().__init__(size, seconds, False, "github")
        self.every = every

    def ideal(self, n):
        return max(super().ideal(-(-n // self.every)), n * 0.02 / 32)  # the quota's windows, or the work

    def __call__(self, item, n, now):
        if item % self.every == 0:
            return super().__call__(item, n, now)
        end = (int(now // self.seconds) + 1) * self.seconds
        used = self.used if int(now // self.seconds) == self.window else 0
        return 200, declared_headers("github", self.size, self.size - used, end - now, WALL + end), b'{"ok":1}'


def declared_headers(dialect, size, remaining, left, at):
    """A quota in one dialect's headers: `remaining` of `size`, renewed in `left` s (epoch `at`)."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(at)))
    return {
        None: {},
        "github": {"X-RateLimit-Limit": str(size), "X-RateLimit-Remaining": str(remaining),
                   "X-RateLimit-Reset": str(math.ceil(at)), "X-RateLimit-Resource": "core"},
        "x": {"x-rate-limit-limit": str(size), "x-rate-limit-remaining": str(remaining),
              "x-rate-limit-reset": str(math.ceil(at))},
        "ietf": {"RateLimit-Limit": str(size), "RateLimit-Remaining": str(remaining),
                 "RateLimit-Reset": str(math.ceil(left))},
        "structured": {"RateLimit-Policy": f'"default";q={size};w=2',
                       "RateLimit": f'"default";r={remaining};t={math.ceil(left)}'},
        "reddit": {"X-Ratelimit-Used": str(size - remaining), "X-Ratelimit-Remaining": f"{remaining:.1f}",
                   "X-Ratelimit-Reset": str(math.ceil(left))},
        "openai": {"x-ratelimit-limit-requests": str(size), "x-ratelimit-remaining-requests": str(remaining),
                   "x-ratelimit-reset-requests": f"{int(left * 1000)}ms"},
        "anthropic": {"anthropic-ratelimit-requests-limit": str(size),
                      "anthropic-ratelimit-requests-remaining": str(remaining),
                      "anthropic-ratelimit-requests-reset": when},
        "discord": {"X-RateLimit-Limit": str(size), "X-RateLimit-Remaining": str(remaining),
                    "X-RateLimit-Reset": f"{at:.3f}", "X-RateLimit-Reset-After": f"{left:.3f}",
                    "X-RateLimit-Bucket": "abcd"},
    }[dialect]


class Lone:
    """No limit at all; `share` % of ids answer 429 + Retry-After: 1 once (an item being
    rebuilt), and `busy` % answer 503 twice."""

    def __init__(self, share, busy=0):
        self.share, self.busy = share, busy

    def __call__(self, item, n, now):
        slot = item * 37 % 100  # spread over the ids
        if slot < self.share and n == 1:
            return 429, {"Retry-After": "1"}, b""
        if self.share <= slot < self.share + self.busy and n <= 2:
            return 503, {}, b""
        return 200, {}, b'{"ok":1}'


class Behind:
    """A limiter in front of an application with ids in trouble of their own."""

    def __init__(self, limit, lone):
        self.limit, self.lone = limit, lone

    def ideal(self, n):
        return self.limit.ideal(n)

    def __call__(self, item, n, now):
        answer = self.limit(item, n, now)
        return answer if answer[0] != 200 else self.lone(item, n, now)


class Later:
    """A limiter whose answers come later than drive's latency by `extra(item, n)` s: a server's time varies from
    answer to answer, so a request sent before another can be answered after it."""

    def __init__(self, limit):
        self.limit = limit

    def ideal(self, n):
        return self.limit.ideal(n)

    def __call__(self, item, n, now):
        answer = self.limit(item, n, now)
        return answer[:3] + ((answer[3:] or (0.0,))[0] + self.extra(item, n),)


class Varied(Later):
    """Answers in `latency` x e^N(0, sigma) (a seeded draw) rather than `latency`."""

    def __init__(self, limit, sigma, latency=0.02, seed=5):
        super().__init__(limit)
        self.sigma, self.latency, self.draw = sigma, latency, random.Random(seed)

    def extra(self, item, n):
        return self.latency * (math.exp(self.draw.gauss(0.0, self.sigma)) - 1.0)


class TwoSpeed(Later):
    """One answer in `every` (a seeded draw) `slow` s late: a cache missed."""

    def __init__(self, limit, every, slow, seed=5):
        super().__init__(limit)
        self.every, self.slow, self.draw = every, slow, random.Random(seed)

    def extra(self, item, n):
        return self.slow if self.draw.random() < 1 / self.every else 0.0


class Late(Later):
    """The answer to the first request of each of the ids `late`, `delay` s late."""

    def __init__(self, limit, late, delay):
        super().__init__(limit)
        self.late, self.delay = late, delay

    def extra(self, item, n):
        return self.delay if item in self.late and n == 1 else 0.0


GITHUB_LIMITED = b'{"message":"API rate limit exceeded for user ID 1.","documentation_url":"https://docs.github.com"}'
GRAPHQL_LIMITED = b'{"errors":[{"type":"RATE_LIMITED","message":"API rate limit exceeded"}]}'

#: One row per limiter shape: (limiter, ids, concurrency, most time over ideal, most refusals of all
#: requests). The bounds are what the model does here, run through the real loop (docs/benchmarks.md
#: has the real servers' figures and the misses against the targets): a row that moves past its
#: bound is a change in the model's behaviour, to be explained.
LIMITERS = {
    'leaky 50/s, no burst': (Leaky(50, 0), 1000, 32, 1.25, 0.03),
    'leaky 100/s, no burst': (Leaky(100, 0), 2000, 32, 1.28, 0.02),
    'leaky 50/s, burst 10': (Leaky(50, 10), 1010, 32, 1.08, 0.07),
    'leaky 100/s, burst 20': (Leaky(100, 20), 2020, 32, 1.08, 0.04),
    'leaky 100/s halved from 10 s to 25 s': (Leaky(100, 10, halved=(10, 25)), 4500, 32, 1.09, 0.03),
    'token bucket 100/s, burst 100, Retry-After': (TokenBucket(100, 100), 2100, 32, 1.08, 0.07),
    'token bucket 100/s, burst 10, Retry-After': (TokenBucket(100, 10), 2010, 32, 1.08, 0.03),
    'token bucket 50/s, burst 10, Retry-After': (TokenBucket(50, 10), 1010, 32, 1.08, 0.06),
    # a slot every 2 to 2.5 ms: one the run loop meets late is never made up, so its shortest wait must be far less
    'leaky 500/s, burst 5': (Leaky(500, 5), 10005, 32, 1.15, 0.01),
    'token bucket 400/s, burst 5, Retry-After': (TokenBucket(400, 5), 8005, 32, 1.15, 0.01),
    'window 100 a second, Retry-After': (Window(100, 1), 3000, 32, 1.22, 0.05),
    'window 100 a second, none': (Window(100, 1, retry_after=False), 3000, 32, 1.15, 0.09),
    'window 600 a minute, Retry-After': (Window(600, 60), 900, 32, 1.54, 0.08),
    'window 600 a minute, none': (Window(600, 60, retry_after=False), 1500, 32, 1.3, 0.11),
    'limit of 50/s and 3% of ids refused for themselves': (Behind(Leaky(50, 0), Lone(3)), 1000, 32, 1.45, 0.06),
    "declared, GitHub's headers, 429": (Window(60, 2, False, "github"), 400, 32, 1.09, 0.01),
    "declared, GitHub's headers, 403": (Window(60, 2, False, "github", 403, GITHUB_LIMITED), 400, 32, 1.09, 0.01),
    "declared, X's headers": (Window(60, 2, False, "x"), 400, 32, 1.09, 0.01),
    'declared, IETF draft headers': (Window(60, 2, False, "ietf"), 400, 32, 1.09, 0.01),
    'declared, IETF structured fields': (Window(60, 2, False, "structured"), 400, 32, 1.09, 0.01),
    "declared, Reddit's headers": (Window(60, 2, False, "reddit"), 400, 32, 1.09, 0.01),
    "declared, OpenAI's headers": (Window(60, 2, False, "openai"), 400, 32, 1.09, 0.01),
    "declared, Anthropic's headers": (Window(60, 2, False, "anthropic"), 400, 32, 1.09, 0.01),
    "declared, Discord's headers": (Window(60, 2, False, "discord"), 400, 32, 1.09, 0.01),
    "declared, GitHub's headers, 1 request in 20 counted": (Cheap(60, 2, 20), 6000, 32, 1.36, 0.01),
    "declared, GitHub's headers, none counted": (Cheap(60, 2, 10 ** 9), 6000, 32, 1.15, 0.01),
    # the first window's end is searched for and found up to twice late: a 12 s run pays it (0.75 s on one clock)
    'GraphQL 200 RATE_LIMITED, nothing declared': (Window(60, 2, False, None, 200, GRAPHQL_LIMITED), 400, 32,
                                                   1.21, 0.29),
    'leaky 0.5/s, no burst': (Leaky(0.5, 0), 40, 32, 1.2, 0.18),
    'leaky 0.5/s, no burst, 503': (Leaky(0.5, 0, status=503), 40, 32, 1.2, 0.18),
    'leaky 0.5/s, burst 5': (Leaky(0.5, 5), 45, 32, 1.07, 0.35),
    'leaky 0.5/s, burst 5 queued': (Leaky(0.5, 5, delay=True), 45, 32, 1.08, 0.21),
    'token bucket 0.5/s, burst 5, Retry-After': (TokenBucket(0.5, 5), 45, 32, 1.17, 0.44),
    'window 1 per 2 s, Retry-After': (Window(1, 2), 40, 32, 1.12, 0.14),
    'window 30 a minute, none': (Window(30, 60, retry_after=False), 75, 32, 1.35, 0.38),
    'sliding log 5 per 10 s': (SlidingLog(5, 10), 40, 32, 1.6, 0.38),
    'leaky 1/s, no burst': (Leaky(1, 0), 60, 32, 1.1, 0.15),
    'leaky 1/s, no burst, 503': (Leaky(1, 0, status=503), 60, 32, 1.1, 0.15),
    'leaky 1/s, burst 5': (Leaky(1, 5), 65, 32, 1.06, 0.23),
    'leaky 1/s, burst 5 queued': (Leaky(1, 5, delay=True), 65, 32, 1.08, 0.09),
    # a whole round refused, its whole-second Retry-After followed: the bucket reads as a quota of its burst a second,
    # probed up from there (see 5); on any clock, as the host's takes are counted in answers, not by time
    'token bucket 1/s, burst 5, Retry-After': (TokenBucket(1, 5), 65, 32, 1.16, 0.4),
    'window 2 per 2 s, Retry-After': (Window(2, 2), 60, 32, 1.14, 0.14),
    'window 60 a minute, none': (Window(60, 60, retry_after=False), 150, 32, 1.22, 0.35),
    'sliding log 10 per 10 s': (SlidingLog(10, 10), 60, 32, 1.41, 0.28),
    'leaky 2/s, no burst': (Leaky(2, 0), 120, 32, 1.16, 0.13),
    'leaky 2/s, no burst, 503': (Leaky(2, 0, status=503), 120, 32, 1.16, 0.13),
    'leaky 2/s, burst 5': (Leaky(2, 5), 125, 32, 1.06, 0.19),
    'leaky 2/s, burst 5 queued': (Leaky(2, 5, delay=True), 125, 32, 1.08, 0.05),
    'token bucket 2/s, burst 5, Retry-After': (TokenBucket(2, 5), 125, 32, 1.1, 0.19),
    'window 4 per 2 s, Retry-After': (Window(4, 2), 120, 32, 1.13, 0.15),
    'window 120 a minute, none': (Window(120, 60, retry_after=False), 300, 32, 1.22, 0.25),
    'sliding log 20 per 10 s': (SlidingLog(20, 10), 120, 32, 1.37, 0.34),
    'leaky 5/s, no burst': (Leaky(5, 0), 300, 32, 1.14, 0.07),
    'leaky 5/s, no burst, 503': (Leaky(5, 0, status=503), 300, 32, 1.14, 0.07),
    'leaky 5/s, burst 5': (Leaky(5, 5), 305, 32, 1.07, 0.14),
    'leaky 5/s, burst 5 queued': (Leaky(5, 5, delay=True), 305, 32, 1.08, 0.04),
    'token bucket 5/s, burst 5, Retry-After': (TokenBucket(5, 5), 305, 32, 1.09, 0.12),
    'window 10 per 2 s, Retry-After': (Window(10, 2), 300, 32, 1.15, 0.1),
    'window 300 a minute, none': (Window(300, 60, retry_after=False), 750, 32, 1.3, 0.13),
    'sliding log 50 per 10 s': (SlidingLog(50, 10), 300, 32, 1.41, 0.18),
    'leaky 10/s, no burst': (Leaky(10, 0), 600, 32, 1.15, 0.04),
    'leaky 10/s, no burst, 503': (Leaky(10, 0, status=503), 600, 32, 1.15, 0.04),
    'leaky 10/s, burst 5': (Leaky(10, 5), 605, 32, 1.07, 0.09),
    'leaky 10/s, burst 5 queued': (Leaky(10, 5, delay=True), 605, 32, 1.08, 0.04),
    'token bucket 10/s, burst 5, Retry-After': (TokenBucket(10, 5), 605, 32, 1.22, 0.12),  # read as the 1/s row
    'window 20 per 2 s, Retry-After': (Window(20, 2), 600, 32, 1.18, 0.09),
    'sliding log 100 per 10 s': (SlidingLog(100, 10), 600, 32, 1.47, 0.14),
}


#: Rows whose figures differ when the answers of one round trip come in a random order, as on Linux, from when they
#: share an instant, as on a clock that ticks every 15.6 ms (Windows): the worst of eight orders, and why.
FINE_CLOCK = {
    # the first window's end found sooner (1.15 to 1.16 x in eight orders)
    'GraphQL 200 RATE_LIMITED, nothing declared': (1.17, 0.29),
    # the limit found again at 50/s a fourth time just before it comes back: K is then 9 s (see 4)
    'leaky 100/s halved from 10 s to 25 s': (1.22, 0.03),
}


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("row", LIMITERS)
def test_each_limiter_shape_is_paced_within_its_bounds_and_every_id_ends_where_the_server_put_it(row, order):
    limiter, count, cap, most_time, most_refused = LIMITERS[row]
    if order is not None:  # the rows that answers in order move have bounds of their own on that clock
        most_time, most_refused = FINE_CLOCK.get(row, (most_time, most_refused))
    limiter = copy.deepcopy(limiter)  # the table's limiter keeps its state, and the row's other clock may run first
    run = drive(limiter, count, cap=cap, order=order)
    assert len(run["ended"]) == count
    for item, (_, bucket, status) in run["ended"].items():
        assert (status, bucket) == ((404, Bucket.SKIP) if status == 404 else (200, Bucket.OK)), item
    assert run["end"] <= most_time * limiter.ideal(count) + 0.1, row
    assert run["refused"] <= most_refused * run["requests"], row
    if row.startswith("declared"):
        assert run["late"] == 0  # no refusal of a request sent after the quota was first declared


@pytest.mark.parametrize("dialect", ["github", "x", "ietf"])
@pytest.mark.parametrize("order", range(4))
def test_class_a_declared_quota_is_paced_whatever_order_its_answers_come_in(dialect, order):
    """The answers of one burst come back in another order than the server counted them, so the first may say less
    is left than those after it: the slot set on it comes forward as they come. No window waited out, none refused."""
    limiter = Window(60, 2, False, dialect)
    run = drive(limiter, 400, order=order)
    assert sorted(status for _, _, status in run["ended"].values()) == [200] * 400
    assert run["end"] <= 1.09 * limiter.ideal(400) + 0.1 and run["refused"] == 0


@pytest.mark.parametrize("limiter, count", [
    (TokenBucket(10, 5), 1205), (Window(20, 2), 1205), (Window(120, 60, retry_after=False), 245),
], ids=["token bucket 10/s, burst 5", "window of 2 s at 10/s", "window of a minute at 2/s"])
def test_class_a_clock_too_coarse_to_order_answers_is_refused_no_more_than_a_fine_one(limiter, count):
    # on a clock that ticks every 15.6 ms (Windows) a round's takes and refusals share an instant: a take answered
    # before the cut is no take since it, so the host refusing everything since is seen as on a fine clock
    # (the code before cut again a round later at its old pace: 53, 49 and 81 refused, in order 26, 42 and 69)
    def refused(order):
        run = drive(copy.deepcopy(limiter), count, order=order)
        assert sorted(s for _, _, s in run["ended"].values()) == [200] * count
        return run["refused"]
    assert refused(None) <= max(map(refused, (1, 2, 3))) + 2


class ClockInfo(NamedTuple):
    """What time.get_clock_info tells of a clock, as far as finest_clock reads it."""
    monotonic: bool
    resolution: float


#: Python 3.9 to 3.12 on Windows: monotonic is GetTickCount64, perf_counter QueryPerformanceCounter.
WINDOWS_CLOCKS = {"monotonic": ClockInfo(True, 0.015625), "perf_counter": ClockInfo(True, 1e-7)}


@pytest.mark.parametrize("limiter, count, most_time", [(TokenBucket(50, 10), 1010, 1.08), (Leaky(10, 0), 600, 1.15)],
                         ids=["token bucket 50/s, burst 10", "leaky 10/s, no burst"])
def test_class_the_run_reads_a_clock_fine_enough_for_the_gaps_it_paces(limiter, count, most_time):
    # a clock that ticks every 15.6 ms reads each slot at the tick after it, late and never made up: one request a
    # tick at most (these rows at 1.43 and 1.39 x on it); where monotonic is that coarse, perf_counter is the clock
    assert redrive.finest_clock(WINDOWS_CLOCKS.get) is time.perf_counter
    assert redrive.finest_clock({**WINDOWS_CLOCKS, "perf_counter": ClockInfo(False, 1e-7)}.get) is time.monotonic
    assert redrive.finest_clock({**WINDOWS_CLOCKS, "monotonic": ClockInfo(True, 1e-7)}.get) is time.monotonic
    assert time.get_clock_info("perf_counter" if Effects().clock is time.perf_counter else "monotonic").resolution < 1e-3
    run = drive(limiter, count, order=1, tick=WINDOWS_CLOCKS["perf_counter"].resolution)  # the clock it chose
    assert len(run["ended"]) == count and run["failed"] == 0
    assert run["end"] <= most_time * limiter.ideal(count)


@pytest.mark.parametrize("limiter, count, most_refused", [
    (Window(300, 60, retry_after=False), 3005, 0.04), (SlidingLog(50, 10), 3005, 0.03),
    (Window(50, 10, retry_after=False), 3005, 0.04), (Window(60, 30, retry_after=False), 1205, 0.1),
], ids=["a minute's window, 5/s", "a sliding log of 10 s, 5/s", "a window of 10 s, 5/s", "a window of 30 s, 2/s"])
def test_a_quota_that_renews_unannounced_is_paced_by_its_window_once_it_has_shown_it(limiter, count, most_refused):
    # ten minutes of ideal, nothing declared and no Retry-After: the first window is spent in a burst and refuses
    # until it renews; that take ends the search and the window's takes over its length are the pace from then on
    # (the code before took the burst's pace for the limit and spent every window in a burst: 15 to 37% refused)
    run = drive(limiter, count, until=7200)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * count
    assert run["refused"] <= most_refused * run["requests"] and run["end"] <= 1.06 * limiter.ideal(count)


def test_what_a_quota_refuses_before_its_first_refusal_comes_back_is_at_most_what_is_in_flight():
    # a minute's window of 120 at 2/s, no Retry-After: nothing tells of it until it runs out, and what is in
    # flight then is refused before the first refusal can come back, so --concurrency is the user's lever
    blind = {}
    for cap in (4, 32):
        run = drive(Window(120, 60, retry_after=False), 245, cap=cap, order=1)
        assert sorted(s for _, _, s in run["ended"].values()) == [200] * 245
        assert 1 <= run["blind"] <= cap
        blind[cap] = run["blind"]
    assert blind[4] < blind[32]


@pytest.mark.parametrize("limiter", [Leaky(5, 0), TokenBucket(5, 5)], ids=["no slack", "a token bucket"])
def test_a_limit_found_again_is_probed_rarely_so_a_long_run_is_refused_little(limiter):
    # ten minutes at 5 r/s: a cycle costs about two refusals once the background is learnt under the limit,
    # and the curve holds longer each time a cut finds the limit where it was (the code before: 5.8% and 9.1%)
    run = drive(limiter, 3005, until=7200)
    gone = 3005 // 50 if isinstance(limiter, Leaky) else 0  # the leaky bucket's every 50th id is a real 404
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (3005 - gone) + [404] * gone
    assert run["refused"] <= 0.025 * run["requests"] and run["end"] <= 1.08 * limiter.ideal(3005)


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("limiter, count, most_time, most_refused", [
    (Varied(Window(600, 60, retry_after=False), 1.0), 1205, 1.10, 0.07),
    (Varied(SlidingLog(100, 10), 1.0), 1205, 1.12, 0.07),  # its renewal searched for: found up to 1.25 x late
    (Late(Leaky(1, 5), {1}, 0.5), 65, 1.06, 0.23),
    (Late(Window(20, 2), {1}, 0.5), 600, 1.18, 0.09),
], ids=["window 600 a minute, none, answers in 20 ms x e^N(0, 1)", "sliding log 100 per 10 s, the same",
        "leaky 1/s, burst 5, one early take answered 0.5 s late", "window 20 per 2 s, Retry-After, the same"])
def test_class_an_answer_to_a_request_sent_before_a_search_began_is_no_test_of_it(limiter, count, most_time,
                                                                                  most_refused, order):
    # a server's answer times vary: a take sent before the refusal that began the search, answered after it, read
    # as a test of the gap since the last take's send, showed a gap the search had found refused as taken, and
    # W_max came out at 1 / 0.1 ms (the code before: 2.33 and 1.29 x; 37 of 102 and 90 of 690 refused)
    limiter = copy.deepcopy(limiter)  # the draw and the limiter keep their state, and the row's other clock may run
    run = drive(limiter, count, order=order, until=7200)
    gone = count // 50 if isinstance(limiter.limit, Leaky) else 0  # the leaky bucket's every 50th id is a real 404
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (count - gone) + [404] * gone
    assert run["end"] <= most_time * limiter.ideal(count) + 0.1
    assert run["refused"] <= most_refused * run["requests"]


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("limiter, count", [(Varied(Window(5000, 10), 1.0), 10500),
                                            (Varied(SlidingLog(1000, 10), 1.0), 6005)],
                         ids=["window 5000 per 10 s, Retry-After", "sliding log 1000 per 10 s"])
def test_class_a_straggler_sent_before_the_cut_before_is_no_sign_the_host_still_takes(limiter, count, order):
    # answers in 20 ms x e^N(0, 1): takes sent before the quota ran out come in long after it; read as signs that the
    # host took the last cut's pace, each round trip's refusals cut again (a window of 500 r/s: 948, 668, ... 48 r/s
    # in 0.25 s), and the quota found next was held under the last (the code before: 2.93 and 1.14 x)
    limiter = copy.deepcopy(limiter)
    run = drive(limiter, count, order=order, until=7200)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * count
    assert run["end"] <= 1.10 * limiter.ideal(count)


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("limiter", [Varied(Leaky(5, 0), 1.0), TwoSpeed(Leaky(5, 0), 10, 1.0)],
                         ids=["answers in 20 ms x e^N(0, 1)", "one answer in 10 a second late"])
def test_class_the_pace_a_host_took_is_measured_between_the_sends_it_took_not_their_answers(limiter, order):
    # a limit with no slack, 5 r/s: the pace before the first refusal over answer times spans the first and the
    # last answer's delays too, and read low (the code before: 1.16 to 1.22 x)
    limiter = copy.deepcopy(limiter)
    run = drive(limiter, 605, order=order, until=7200)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * 593 + [404] * 12
    assert run["end"] <= 1.10 * limiter.ideal(605)


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("limiter, count", [(Varied(Behind(Leaky(50, 0), Lone(3)), 1.0), 1000),
                                            (Varied(Behind(Leaky(20, 0), Lone(5)), 1.0, seed=3), 400)],
                         ids=["limit of 50/s, 3% refused for themselves", "limit of 20/s, 5%"])
def test_class_the_pace_a_search_held_a_host_to_is_no_pace_of_its(limiter, count, order):
    # answers in 20 ms x e^N(0, 1): a search one request at a time, every test taken at the shortest gap it can send,
    # ends in slow start; the cut that came next measured the search's own pace over the unit, 4 r/s for 50, and the
    # curve took a minute to climb out of it (the code before: 4.0 and 2.55 x)
    limiter = copy.deepcopy(limiter)
    run = drive(limiter, count, order=order, until=7200)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (count - count // 50) + [404] * (count // 50)
    assert run["end"] <= 1.45 * limiter.ideal(count)  # the limiter table's bound for a limit behind ids in trouble


@pytest.mark.parametrize("limiter, count", [(Leaky(2, 0), 245), (Leaky(5, 0, status=503), 605), (Window(1, 2), 65)],
                         ids=["leaky 2/s", "leaky 5/s, 503", "window 1 per 2 s, Retry-After"])
def test_a_host_that_takes_one_request_then_refuses_is_paced_by_the_interval_it_searches_for(limiter, count):
    # slow start's first requests meet a limit with no slack: one is taken, so the first cut has no pace to
    # go by; the interval between takes is searched for instead (the code before: 9, 6 and 6 refusals in the
    # first 10 s, and before that 20, 16 and 15)
    run = drive(limiter, count, until=7200)
    gone = count // 50 if isinstance(limiter, Leaky) else 0  # the leaky bucket's every 50th id is a real 404
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (count - gone) + [404] * gone
    assert sum(1 for at in run["refusals"] if at < 10) <= 9
    assert run["end"] <= 1.12 * limiter.ideal(count)


@pytest.mark.parametrize("latency", [0.0001, 0.001, 0.02], ids=["0.1 ms", "1 ms", "20 ms"])
@pytest.mark.parametrize("make, count", [(lambda: Leaky(1, 0), 90), (lambda: Leaky(2, 0, status=503), 240)],
                         ids=["leaky 1/s", "leaky 2/s, 503"])
def test_a_slow_limit_is_found_with_few_refusals_however_fast_they_come_back(make, count, latency):
    # a limiter in front answers its refusals at once (nginx: a millisecond): the first cut then comes a few ms
    # in, and probes spaced by the time refused so far took 20 to 35 before one was taken a second later (the
    # code before: 26, 23 at 1 ms; 32, 29 at 0.1 ms); the search's tests do not grow with the ratio
    limiter = make()  # a limiter keeps its state: one each
    run = drive(limiter, count, until=7200, latency=latency)
    gone = count // 50  # the leaky bucket's every 50th id is a real 404
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (count - gone) + [404] * gone
    assert sum(1 for at in run["refusals"] if at < 10) <= 10
    assert run["end"] <= 1.15 * limiter.ideal(count)


@pytest.mark.parametrize("limiter", [Leaky(1, 0), TokenBucket(1, 5)], ids=["leaky 1/s", "token bucket 1/s, burst 5"])
def test_an_hour_at_a_slow_limit_found_again_and_again_is_refused_little(limiter):
    # each cut that finds the limit where it was lets the next cycle run --max-backoff longer: at 1 r/s a
    # cycle of at most a minute cost its two to five refusals every 60 requests (the code before: 3.8% and 3.5%)
    run = drive(limiter, 3605, until=36000)
    gone = 3605 // 50 if isinstance(limiter, Leaky) else 0  # the leaky bucket's every 50th id is a real 404
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (3605 - gone) + [404] * gone
    assert run["refused"] <= 0.02 * run["requests"]
    assert run["end"] <= 1.06 * limiter.ideal(3605)


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("limiter, count", [(TokenBucket(2, 5), 1205), (TokenBucket(1, 5), 605), (Leaky(1, 3), 605)],
                         ids=["token bucket 2/s, burst 5", "token bucket 1/s, burst 5", "leaky 1/s, burst 3 nodelay"])
def test_a_limit_with_slack_is_not_measured_by_the_burst_a_quiet_spell_refilled(limiter, count, order):
    # below the limit its burst refills, and the next climb past it is taken from the burst: the unit before the first
    # refusal read 2.5 r/s for 2, the cut stayed over it, and each cycle cost 10 to 20 refusals (8% after the first minute)
    limiter = copy.deepcopy(limiter)
    run = drive(limiter, count, order=order, until=36000)
    gone = count // 50 if isinstance(limiter, Leaky) else 0  # the leaky bucket's every 50th id is a real 404
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * (count - gone) + [404] * gone
    assert sum(1 for sent in run["refusals"] if sent >= 60) <= 0.012 * run["requests"]  # past the first minute's learning
    assert run["end"] <= 1.05 * limiter.ideal(count)


@pytest.mark.parametrize("limiter, count, latency", [(SlidingLog(20, 10), 245, 0.2), (SlidingLog(30, 10), 365, 0.05)],
                         ids=["sliding log 20 per 10 s, 200 ms answers", "sliding log 30 per 10 s, 50 ms answers"])
def test_a_quota_searched_for_is_no_pace_for_the_cut_after_it(limiter, count, latency):
    # the search that found the window left its refusals behind the cut; the pace since the first of them, a spell
    # of refusing all and then the window's own renewals, read 1.07 r/s for a log of 2 (1.58 x)
    run = drive(limiter, count, cap=4, latency=latency)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * count
    assert run["end"] <= 1.2 * limiter.ideal(count)


def test_a_limit_raised_after_half_an_hour_is_found_again_within_a_quarter_of_an_hour():
    # the price of probing rarely: the curve above a long-held W_max climbs slowly (the code before: 96 s)
    limiter = Leaky(2, 0, halved=(0, 1800))  # 1 r/s for half an hour, then 2 r/s
    run = drive(limiter, 1800 + 2400, until=36000)
    ends = sorted(at for at, _, _ in run["ended"].values())
    paced = next(at for at in range(1800, int(ends[-1]) - 60)
                 if bisect.bisect(ends, at + 60) - bisect.bisect(ends, at) >= 0.9 * 2 * 60)
    assert paced - 1800 <= 900 and sorted(s for _, _, s in run["ended"].values()) == [200] * 4116 + [404] * 84


def test_a_penalty_box_blocks_at_most_twice_and_every_id_ends_done():
    box = PenaltyBox(5, 20)  # one excess blocks every request for 20 s; each request during a block renews it
    run = drive(box, 300, until=3000, max_backoff=300.0)
    assert box.blocks <= 2 and sorted(s for _, _, s in run["ended"].values()) == [200] * 294 + [404] * 6
    assert run["end"] <= 16 * box.ideal(300)  # the search's tests after the block (the code before: 43.5 x)


@pytest.mark.parametrize("spell, status, retry_after", [(5, 503, None), (5, 429, 5), (20, 503, None)])
def test_a_host_that_refuses_all_before_it_takes_any_is_not_paced_as_a_slow_limit_after(spell, status, retry_after):
    clean = drive(Spell(0, 0), 4000)["end"]  # about 2.5 s at 32 in flight and 20 ms answers
    run = drive(Spell(0, spell, status, retry_after), 4000)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * 3920 + [404] * 80
    # the search's tests find the spell's end no later than 3 x its length; then the pace of a host with no limit
    # (the code before: 566, 646 and 871 s, paced at one request per gap refused in the spell)
    assert run["end"] <= 3 * spell + 2 * clean


@pytest.mark.parametrize("order", [None, 1])
def test_a_limit_whose_first_answer_is_a_refusal_is_measured_by_its_takes(order):
    bucket = TokenBucket(10, 5)
    bucket.tokens = 0.0  # another client spent its burst: the first request meets an empty bucket
    run = drive(bucket, 1205, order=order)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * 1205
    assert run["end"] <= 1.3 * bucket.ideal(1205)  # the code before: 2.86 x, a refused gap read as its interval


def test_a_host_that_takes_nothing_for_longer_than_max_backoff_ends_the_run_with_every_id_pending():
    box = PenaltyBox(5, 20)  # its blocks outlast the default --max-backoff once probes renew them
    run = drive(box, 300, until=3000)
    assert run["failed"] == 0 and all(s == 200 or s == 404 for _, _, s in run["ended"].values())
    assert len(run["ended"]) < 300 and run["clock"] < 300  # it stopped: the rest are pending, no try spent


@pytest.mark.parametrize("share, busy, cap, count, slack", [(3, 0, 16, 10000, 1.0), (4, 1, 32, 10000, 3.0),
                                                        (8, 8, 4, 200, 3.0)],
                         ids=["3% lone 429s", "4% lone 429s, 1% 503 twice", "the demo's mix"])
def test_one_id_throttles_do_not_slow_a_host_that_has_no_limit(share, busy, cap, count, slack):
    clean = drive(Lone(0), count, cap=cap)["end"]
    run = drive(Lone(share, busy), count, cap=cap)
    assert len(run["ended"]) == count
    # the longest chain of waits one id takes: a Retry-After of 1 s, or 503 twice at the default backoff
    assert run["end"] <= 1.1 * (clean + slack)


@pytest.mark.parametrize("share, busy, most", [(20, 0, 10.0), (25, 0, 10.0), (30, 0, 10.0), (0, 25, 40.0), (10, 10, 10.0)],
                         ids=["20% 429 once", "25% 429 once", "30% 429 once", "25% 503 twice", "10% of each"])
def test_ids_refused_for_their_own_reasons_at_a_large_share_are_not_taken_for_a_limit(share, busy, most):
    # refused at any pace, so cuts bring no relief; each cut also took the refusals above its own W_max for the
    # limit's, so the background stayed low and W_max fell cut after cut (20%: 1,313 s for a clean run of 1.3 s)
    run = drive(Lone(share, busy), 2000)
    assert run["failed"] == 0 and [s for _, _, s in run["ended"].values()] == [200] * 2000
    assert run["requests"] == 2000 + 20 * share + 2 * 20 * busy  # each asked again only for its own refusals
    assert run["end"] <= most


def runs_in_one_state_dir(*runs):
    """drive() once for each (limiter, new ids), every run in the same state dir, each with ids of its own
    (the ids of the runs before it are done); per run: its drive() dict, with `end` over its own ids, and
    the paces.json it left."""
    out, total = [], 0
    with tempfile.TemporaryDirectory(prefix="drive-") as folder:
        for serve, count in runs:
            total += count
            run = drive(serve, total, until=7200, tmp=folder)
            run["end"] = max(at for item, (at, _, _) in run["ended"].items() if item >= total - count)
            run["early"] = sum(1 for sent in run["refusals"] if sent < 10)
            paces = Path(folder, "state", "paces.json")
            run["paces"] = paces.read_text() if paces.exists() else None
            out.append(run)
    return out


@pytest.mark.parametrize("shape, count", [(lambda: Leaky(2, 5), 245), (lambda: Window(120, 60, retry_after=False), 245),
                                          (lambda: SlidingLog(50, 10), 605), (lambda: Window(300, 60, retry_after=False), 605)],
                         ids=["leaky 2/s burst 5", "window 120 a minute", "sliding log 50 per 10 s", "window 300 a minute"])
def test_a_limit_one_run_found_is_where_the_next_run_starts(shape, count):
    # the first run's refusals are mostly the learning: slow start's bunches, a window's first overshoot, the search;
    # the next run starts the curve as the first run's last cut did, at the W_max and window it left in paces.json
    first, second = runs_in_one_state_dir((shape(), count), (shape(), count))
    assert first["early"] >= 20 and second["early"] <= first["early"] / 4
    assert second["refused"] <= first["refused"] / 2 and second["end"] <= 1.15 * shape().ideal(count)
    assert len(second["ended"]) == 2 * count and second["failed"] == 0
    hosts = json.loads(second["paces"])["hosts"]
    assert list(hosts) == [redrive.pace_key("http://h")] and "http://h" not in second["paces"]  # no host name


def test_a_limit_that_changed_between_runs_is_found_again_and_a_lifted_one_is_left_behind():
    # a remembered pace is a cut's W_max that this run has not seen: a lower limit cuts it, a little higher one is
    # climbed to along the curve, and once the host has taken CUBIC_C requests more than it allows with none refused it
    # is no longer there: the host is met anew (slow start), and the next run starts from what it found, or from nothing
    pace = lambda run: json.loads(run["paces"])["hosts"][redrive.pace_key("http://h")]["pace"]  # noqa: E731
    lower = runs_in_one_state_dir((Leaky(10, 0), 1205), (Leaky(2, 0), 245), (Leaky(2, 0), 245))
    assert lower[1]["end"] <= 1.5 * Leaky(2, 0).ideal(245) and lower[1]["refused"] <= 40 and 1.8 <= pace(lower[1]) <= 2.2
    assert lower[2]["end"] <= 1.15 * Leaky(2, 0).ideal(245) and lower[2]["early"] == 0
    higher = runs_in_one_state_dir((Leaky(2, 0), 245), (Leaky(10, 0), 1205), (Leaky(10, 0), 1205))
    assert higher[1]["end"] <= 1.8 * Leaky(10, 0).ideal(1205) and 9 <= pace(higher[1]) <= 11
    assert higher[2]["end"] <= 1.1 * Leaky(10, 0).ideal(1205)
    burst = runs_in_one_state_dir((Leaky(2, 5), 245), (Leaky(10, 5), 1205), (Leaky(10, 5), 1205))  # slack hides the rise
    assert burst[1]["end"] <= 1.7 * Leaky(10, 5).ideal(1205) and burst[2]["end"] <= 1.05 * Leaky(10, 5).ideal(1205)
    near = runs_in_one_state_dir((Leaky(2, 0), 245), (Leaky(2.5, 0), 305), (Leaky(2.5, 0), 305))  # within a cut's
    assert near[1]["early"] == near[2]["early"] == 0 and near[2]["end"] <= 1.12 * Leaky(2.5, 0).ideal(305)  # error
    clean = drive(Lone(0), 2000)["end"]
    lifted = runs_in_one_state_dir((Leaky(2, 0), 245), (Lone(0), 2000), (Lone(0), 2000), (Lone(0), 2000))
    assert all(r["refused"] == 0 for r in lifted[1:]) and lifted[1]["end"] <= 110
    assert lifted[1]["paces"] is None or redrive.pace_key("http://h") not in lifted[1]["paces"]  # left behind
    assert lifted[2]["end"] <= 1.05 * clean and lifted[3]["end"] <= 1.05 * clean
    window = runs_in_one_state_dir((Window(120, 60, retry_after=False), 245), (Lone(0), 2000), (Lone(0), 2000))
    assert window[1]["refused"] == 0 and window[1]["end"] <= 200 and window[2]["end"] <= 1.05 * clean
    held = runs_in_one_state_dir((Leaky(10, 20), 1205), (Leaky(10, 20), 1205))  # a burst takes the climb: no rise
    assert held[1]["early"] == 0 and held[1]["refused"] <= 35 and pace(held[1]) >= 9
    assert [len(r["ended"]) for r in lifted] == [245, 2245, 4245, 6245]


def test_a_host_with_no_limit_leaves_no_pace_to_remember():
    assert runs_in_one_state_dir((Lone(0), 500), (Lone(4), 500))[1]["paces"] is None


def test_a_403_without_a_sign_of_a_rate_limit_is_a_permission_answer_and_the_host_goes_on():
    def forbidden(item, n, now):
        return (403, {}, b'{"message":"Resource not accessible by integration"}') if item % 10 == 0 else \
            (200, {}, b'{"ok":1}')
    clean, run = drive(Lone(0), 500)["end"], drive(forbidden, 500)
    assert sorted(s for _, _, s in run["ended"].values()) == [200] * 450 + [403] * 50
    assert all(b is Bucket.SKIP for _, b, s in run["ended"].values() if s == 403)
    assert run["refused"] == 0 and run["end"] <= 1.05 * clean


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.0005, 0.01, 0.1, 0.4, 1.0, 2.5, 30.0]),
                          st.sampled_from(["ok", "429", "503", "none", "said", "spent"]),
                          st.sampled_from([None, 0.0, 0.3, 1.0, 2.0, 5.0, 90.0]),
                          st.booleans(), st.sampled_from([0.0, 0.001, 0.05, 1.0])), max_size=120),
       st.sampled_from([None, (0.5, 0.0), (2.0, 0.0), (40.0, 2.0)]))
def test_no_sequence_of_answers_breaks_a_hosts_gate(events, recalled):
    host, now = redrive.Host(cap=16, longest=60.0), 0.0
    for step, kind, wait, fresh, took in events:
        opens = host.opens_at(now + step)
        if opens is None:
            continue  # the gate is full: the run loop sends nothing now
        sent = opens  # sent when the gate lets it, answered `took` later
        now = sent + took
        first = host.first_sent is None
        host.start(sent)
        if first and recalled:  # a pace an earlier run left (paces.json)
            host.recall(sent, *recalled)
        declared = redrive.Declared(0.0 if kind == "spent" else 10.0, wait or 0.0)
        if kind == "ok":
            host.succeeded(now, sent, declared)
        elif kind == "none":
            host.answered(now, sent)
        else:
            host.throttled(now, sent, wait, fresh=fresh, said=kind == "said", declared=declared)
        opens = host.opens_at(now)
        assert opens is None or now <= opens <= now + max(wait or 0.0, 60.0) + 1.0
        assert host.inflight >= 0 and all(math.isfinite(q.reset_at) for q in host.quotas.values())


@pytest.mark.parametrize("headers, remaining, reset, limit, bucket", [
    ({"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "4999", "X-RateLimit-Reset": str(int(WALL) + 3600),
      "X-RateLimit-Resource": "core"}, 4999, 3600, 5000, "core"),  # GitHub: an epoch
    ({"x-rate-limit-limit": "900", "x-rate-limit-remaining": "0", "x-rate-limit-reset": str(int(WALL) + 60)},
     0, 60, 900, ""),  # X
    ({"RateLimit-Limit": "100, 100;w=60", "RateLimit-Remaining": "50", "RateLimit-Reset": "30"}, 50, 30, 100, ""),
    ({"RateLimit-Policy": '"default";q=100;w=60', "RateLimit": '"default";r=50;t=30'}, 50, 30, 100, "default"),
    ({"RateLimit": "limit=100, remaining=7, reset=12"}, 7, 12, 100, ""),  # draft -07
    ({"X-Ratelimit-Remaining": "598.0", "X-Ratelimit-Reset": "332", "X-Ratelimit-Used": "2"}, 598, 332, None, ""),
    ({"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
      "x-ratelimit-reset-requests": "6m0s"}, 59, 360, 60, ""),  # OpenAI
    ({"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "12ms"}, 3, 0.012, None, ""),
    ({"anthropic-ratelimit-requests-remaining": "9", "anthropic-ratelimit-requests-reset":
      time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(WALL + 90))}, 9, 90, None, ""),
    ({"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": f"{WALL + 1.25:.3f}",
      "X-RateLimit-Reset-After": "1.250", "X-RateLimit-Bucket": "abcd"}, 0, 1.25, 5, "abcd"),  # Discord
    ({"X-RateLimit-Remaining": "10", "X-RateLimit-Reset": str(int(WALL) - 5)}, 10, 0.0, None, ""),  # past: now
])
def test_a_declared_quota_is_read_in_every_dialect(headers, remaining, reset, limit, bucket):
    quota = redrive.declared_quota(requests.structures.CaseInsensitiveDict(headers), WALL)
    assert quota == redrive.Declared(remaining, pytest.approx(reset), limit, bucket)


@pytest.mark.parametrize("headers", [
    {"X-RateLimit-Remaining": "lots", "X-RateLimit-Reset": "60"},
    {"X-RateLimit-Remaining": "-1", "X-RateLimit-Reset": "60"},
    {"X-RateLimit-Remaining": "nan", "X-RateLimit-Reset": "60"},
    {"X-RateLimit-Remaining": "5", "X-RateLimit-Reset": "tomorrow"},
    {"X-RateLimit-Remaining": "5", "X-RateLimit-Reset": str(int(WALL) + 10 ** 8)},  # three years away: absurd
    {"X-RateLimit-Remaining": "5"},
    {"RateLimit": '"default";r=5'},
    {"RateLimit": "garbage;;;==,,"},
    {"x-ratelimit-remaining-requests": "5", "x-ratelimit-reset-requests": "6y"},
    {},
])
def test_a_malformed_or_absurd_quota_is_ignored(headers):
    assert redrive.declared_quota(requests.structures.CaseInsensitiveDict(headers), WALL) is None


def test_a_quota_that_resets_past_max_backoff_ends_the_run_and_says_when_it_comes_back(server, tmp_path):
    fake = FakeTime()
    reset = int(fake.wallclock()) + 3600
    spent = {"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)}
    server.replies.update({"a": [(200, b'{"a":1}', {**spent, "X-RateLimit-Remaining": "1"})],
                           "b": [(200, b'{"b":1}', spent)], "c": [(403, GITHUB_LIMITED, spent)]})
    code, err, fake = crawl(server, tmp_path, ["a", "b", "c", "d"], "--concurrency", "1", fake=fake)
    assert code == ExitCode.INCOMPLETE
    assert state(tmp_path, "done.txt") == ["a", "b"] and server.hits["c"] == 0 and server.hits["d"] == 0
    assert state(tmp_path, "failed.jsonl") == [] and state(tmp_path, "unavailable.jsonl") == []
    assert time.strftime("%H:%M", time.gmtime(reset)) in err and "quota" in err
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["stop"] == "later" and report["counts"]["pending"] == 2
    assert report["quota"]["remaining"] == 0 and report["quota"]["limit"] == 2


def test_githubs_403_at_no_quota_left_is_a_throttle_not_a_skip(server, tmp_path):
    fake = FakeTime()
    reset = str(int(fake.wallclock()) + 5)
    spent = {"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}
    server.replies["b"] = [(403, GITHUB_LIMITED, spent), 200]
    code, err, fake = crawl(server, tmp_path, ["a", "b", "c"], "--concurrency", "1", fake=fake)
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == ["a", "b", "c"]
    assert state(tmp_path, "unavailable.jsonl") == [] and state(tmp_path, "failed.jsonl") == []
    assert server.hits["b"] == 2 and fake.sleeps and 5.0 <= sum(fake.sleeps) <= 5.0 + 2 * redrive.QUOTA_MARGIN


@pytest.mark.parametrize("body, headers", [(b'{"message":"You have exceeded a secondary rate limit."}', {}),
                                           (b"", {"Retry-After": "3"})], ids=["says so", "Retry-After"])
def test_a_403_that_says_it_is_a_rate_limit_is_retried_and_one_that_does_not_is_skipped(server, tmp_path, body,
                                                                                      headers):
    server.replies["limited"] = [(403, body, headers), 200]
    server.replies["denied"] = [(403, b'{"message":"Must have admin rights to Repository."}', {})]
    code, err, fake = crawl(server, tmp_path, ["limited", "denied", "c"], "--max-backoff", "120")
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == ["c", "limited"]
    [denied] = state(tmp_path, "unavailable.jsonl")
    assert denied["id"] == "denied" and denied["status"] == 403 and server.hits["denied"] == 1
    fetched = {r["id"]: r["fetched_at"] for r in state(tmp_path, "results.jsonl")}
    waited = 3.0 if headers else redrive.SECONDARY_WAIT  # a minute when it says not how long
    assert fetched["limited"] >= redrive.iso(FakeTime().wallclock() + waited)


@pytest.mark.parametrize("status, headers", [
    (429, {"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "0"}),
    (429, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(time.time()) - 3600)}),  # an epoch in the past
    (429, {"RateLimit-Policy": '"d";q=60;w=60', "RateLimit": '"d";r=0;t=0'}),
    (429, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1"}),  # a reset that never comes: a second on, always
    (429, {"RateLimit": '"d";r=0;t=1'}),
    (403, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1"}),
], ids=["reset 0", "reset an hour ago", "structured t=0", "reset always a second on", "structured t=1 always",
        "403, reset always a second on"])
def test_throttle_bound_a_spent_quota_whose_reset_is_past_or_never_comes_ends_the_run_with_every_id_pending(
        server, tmp_path, status, headers):
    ids = [f"s{n}" for n in range(6)]
    server.replies.update({item: [(status, b"", headers)] for item in ids})
    code, err, _ = crawl(server, tmp_path, ids, "--max-backoff", "5", fake=FastForward())
    assert code == ExitCode.INCOMPLETE and state(tmp_path, "unavailable.jsonl") == []
    assert sum(server.hits.values()) <= 40  # refusals that back off and end the run, not 10 a second for ever
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["stop"] == "later" and report["counts"]["pending"] + report["counts"]["failed"] == len(ids)


@pytest.mark.parametrize("retry_after, workers", [
    ("0", 1), ("1", 1), ("0", 4), ("Wed, 21 Oct 2015 07:28:00 GMT", 4), ("0.001", 4),
], ids=["Retry-After: 0", "Retry-After: 1", "Retry-After: 0, 4 workers", "a date past, 4 workers",
        "a millisecond, 4 workers"])
def test_throttle_bound_a_host_whose_retry_after_is_never_true_ends_the_run_with_every_id_pending(server, tmp_path,
                                                                                                 retry_after, workers):
    # a refusal at the time the host said it would take is its word proved wrong: the search stops following it,
    # so a "come back now" refused for ever is not a request per round trip; and the host paused past the run's
    # reach stays past it at a look that a refused id's own wait puts later (a real run, on the real clock).
    # Before the host's refusals are told from the ids' own, an id asked again at once (a wait of none, or of less
    # than a round trip) would spend every try before any other id was asked: no id may fail for the host's refusals
    ids = [f"r{n}" for n in range(6)]
    server.replies.update({item: [(429, b"", {"Retry-After": retry_after})] for item in ids})
    cmd = redrive_cmd(write_ids(tmp_path, ids), "--url", server.template, "--concurrency", str(workers),
                      "--max-backoff", "2", "--cooldown", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.INCOMPLETE and state(tmp_path, "unavailable.jsonl") == []
    assert state(tmp_path, "failed.jsonl") == [] and state(tmp_path, "done.txt") == []
    assert "longer than --max-backoff" in proc.stderr and sum(server.hits.values()) <= 40


@pytest.mark.parametrize("count, workers, status", [(2, 2, 429), (3, 1, 503)])
def test_throttle_bound_a_list_too_short_for_the_share_rule_fails_no_id_on_a_host_refusing_all(server, tmp_path, count,
                                                                                               workers, status):
    # fewer ids than the share rule's bar wants fresh refusals: each refusal stays the id's own, but the others were
    # refused as often meanwhile, so none spends its last try on them; the host took nothing for longer than
    # --max-backoff, so the run ends with every id pending (a real run, on the real clock)
    ids = [f"r{n}" for n in range(count)]
    server.replies.update({item: [status] for item in ids})
    cmd = redrive_cmd(write_ids(tmp_path, ids), "--url", server.template, "--concurrency", str(workers),
                      "--max-backoff", "2", "--backoff", "0.1", "--cooldown", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.INCOMPLETE, proc.stderr
    assert state(tmp_path, "failed.jsonl") == [] and state(tmp_path, "unavailable.jsonl") == []
    assert "longer than --max-backoff" in proc.stderr and sum(server.hits.values()) <= 10 * count


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("share, cap", [(30, 4), (30, 32), (20, 4)])
def test_class_a_third_of_the_ids_refused_for_ever_leaves_the_rest_of_the_list_done(share, cap, order):
    # their first refusals pass the share rule's bar and cut the pace; their refusals again, with nothing taken since
    # the cut, started a search whose tests were theirs, and the run ended with the ids that are fine still pending
    # (at a fifth and more the refused ids may end the run pending once they are all that is left: see the stop line)
    def serve(item, n, now):
        return (503, {}, b"") if item * 37 % 100 < share else (200, {}, b'{"ok":1}')

    good = {i for i in range(200) if i * 37 % 100 >= share}
    run = drive(serve, 200, cap=cap, until=900, order=order)
    done = {i for i, (when, bucket, _) in run["ended"].items() if bucket is Bucket.OK and when <= 30}
    assert done == good, f"{len(good - done)} of {len(good)} not done in 30 s"  # the code before: 94 and 75
    assert all(bucket is not Bucket.OK for i, (_, bucket, _) in run["ended"].items() if i not in good)


@pytest.mark.parametrize("status", [503, 429])
def test_throttle_bound_ids_refused_for_ever_when_all_else_is_done_end_pending_with_the_way_to_list_them(server,
                                                                                                         tmp_path,
                                                                                                         status):
    # the ids left are a part of the API that is down, the rest done by an earlier run: this run's host takes nothing,
    # as a host refusing everyone does, so they stay pending; the stop line says how to list them as unavailable
    good, bad = ["a", "b", "c"], ["x", "y"]
    server.replies.update({item: [status] for item in bad})
    ids = write_ids(tmp_path, good)
    options = ["--url", server.template, "--max-backoff", "2", "--backoff", "0.1", "--cooldown", "1"]
    assert subprocess.run(redrive_cmd(ids, *options), capture_output=True, timeout=60).returncode == ExitCode.OK
    write_ids(tmp_path, good + bad)
    proc = subprocess.run(redrive_cmd(ids, *options), capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.INCOMPLETE and state(tmp_path, "unavailable.jsonl") == [], proc.stderr
    assert f"rerun with --skip {status} to list them as unavailable" in proc.stderr
    proc = subprocess.run(redrive_cmd(ids, *options, "--skip", str(status)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert sorted((r["id"], r["status"]) for r in state(tmp_path, "unavailable.jsonl")) == [("x", status), ("y", status)]


def test_throttle_bound_a_rate_limit_said_in_a_200_names_no_skip_when_the_host_takes_nothing(server, tmp_path):
    # the way out for ids refused for ever is --skip with their status; a GraphQL 200 that says RATE_LIMITED would
    # make that --skip 200, and every success unavailable
    server.replies.update({item: [(200, GRAPHQL_LIMITED, {"Content-Type": "application/json"})] for item in "xy"})
    cmd = redrive_cmd(write_ids(tmp_path, ["x", "y"]), "--url", server.template, "--max-backoff", "2", "--backoff",
                      "0.1", "--cooldown", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.INCOMPLETE and "longer than --max-backoff" in proc.stderr, proc.stderr
    assert "--skip" not in proc.stderr


@pytest.mark.parametrize("body", [
    b'{"message":"Resource not accessible by integration",'
    b'"documentation_url":"https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"}',
    b'<html><body>Forbidden. See <a href="https://example.com/help/throttling">the help</a>.</body></html>',
], ids=["GitHub's documentation_url", "an HTML link"])
def test_throttle_bound_a_403_that_only_links_to_rate_limit_docs_is_a_permission_answer(server, tmp_path, body):
    server.replies["denied"] = [(403, body, {})]
    code, err, _ = crawl(server, tmp_path, ["a", "denied", "b"])
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == ["a", "b"]
    [denied] = state(tmp_path, "unavailable.jsonl")
    assert denied["status"] == 403 and server.hits["denied"] == 1


@pytest.mark.parametrize("reply", [
    (200, GRAPHQL_LIMITED, {"Content-Type": "application/json"}),
    (403, b'{"message":"API rate limit exceeded for this resource."}', {}),
    (429, b"", {"Retry-After": "1"}),
], ids=["GraphQL RATE_LIMITED", "403 that says rate limit", "429 with Retry-After"])
def test_throttle_bound_one_ids_refusal_that_never_lifts_is_its_own_and_ends(server, tmp_path, reply):
    ids = [f"i{n:02}" for n in range(30)]
    server.replies["i07"] = [reply]  # refused for ever, while the host answers every other id
    code, err, _ = crawl(server, tmp_path, ids, "--tries", "3", fake=FastForward())
    assert sorted(state(tmp_path, "done.txt")) == [i for i in ids if i != "i07"]
    [stuck] = state(tmp_path, "unavailable.jsonl")
    assert stuck["id"] == "i07" and stuck["status"] == reply[0]
    assert server.hits["i07"] <= redrive.OWN_REFUSALS + 3 * 2  # its tries in each of the two passes at most


def test_a_graphql_200_that_says_rate_limited_is_retried_and_never_stored(server, tmp_path):
    server.replies["q"] = [(200, GRAPHQL_LIMITED, {"Content-Type": "application/json", "Retry-After": "2"}),
                           (200, b'{"data":{"viewer":{"login":"x"}}}', {"Content-Type": "application/json"})]
    code, err, fake = crawl(server, tmp_path, ["q"])
    assert code == ExitCode.OK and fake.sleeps == [2.0]
    [result] = state(tmp_path, "results.jsonl")
    assert result["body"] == {"data": {"viewer": {"login": "x"}}}


def test_the_status_line_and_the_report_show_the_declared_quota(server, tmp_path):
    fake = FakeTime()
    reset = int(fake.wallclock()) + 600
    quota = {"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "812", "X-RateLimit-Reset": str(reset)}
    server.replies.update({item: [(200, b"{}", quota)] for item in ("a", "b")})
    server.replies["b"] = [(500, b"", quota), (200, b"{}", quota)]
    code, err, _ = crawl(server, tmp_path, ["a", "b"], "--tries", "1", "--cooldown", "70", fake=fake)
    assert code == ExitCode.OK
    shown = time.strftime("%H:%M", time.gmtime(reset))
    assert f"quota 812/5000, resets {shown}" in err  # the plain line written while b waited for its next pass
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["quota"] == {"remaining": 812, "limit": 5000, "resets_at": redrive.iso(reset), "bucket": ""}


def test_a_host_is_down_after_requests_in_a_row_never_reach_it_and_probed_one_at_a_time():
    host = redrive.Host(cap=8)
    waits = lambda n: 10.0 * n  # noqa: E731
    for _ in range(redrive.START_LIMIT):
        host.start(0.0)
    assert [host.unreachable(1.0, waits) for _ in range(redrive.DOWN_AFTER - 1)] == [False] * (redrive.DOWN_AFTER - 1)
    host.start(1.0)
    assert host.unreachable(1.5, waits)  # the DOWN_AFTER-th in a row: down, paused for wait(1)
    assert host.opens_at(2.0) == 11.5
    host.start(11.5)
    assert host.opens_at(11.5) is None  # one probe at a time
    assert host.unreachable(12.0, waits) and host.opens_at(12.0) == 32.0  # the next after wait(2)
    host.start(32.0)
    host.reached(33.0)
    host.answered(33.0, 32.0)
    for _ in range(redrive.START_LIMIT):  # back: the gate is as wide as before it went down
        assert host.opens_at(33.0) == 33.0
        host.start(33.0)
    assert host.opens_at(33.0) is None


def test_a_throttle_whose_neighbours_were_taken_is_undone_and_its_id_still_waits_its_retry_after(server, tmp_path):
    ids = [f"s{n:03d}" for n in range(120)]
    for item in ids:
        server.replies[item] = [("sleep", 0.03, 200)]
    for item in ids[30:34]:  # four plain 429s in a row: the host's limit, and a paced host after it
        server.replies[item] = [429, ("sleep", 0.03, 200)]
    asked = []

    def rebuilt():  # one item being rebuilt: "come back in a second", while the others are taken
        asked.append(time.monotonic())
        return (429, b"", {"Retry-After": "1"}) if len(asked) == 1 else ("sleep", 0.03, 200)

    server.replies["s090"] = [rebuilt, rebuilt]
    argv = [str(write_ids(tmp_path, ids)), "--url", server.template, "--concurrency", "8"]
    code = redrive.main(argv, err=io.StringIO(), environ={})  # real time: the in-flight answers decide
    assert code == ExitCode.OK and sorted(state(tmp_path, "done.txt")) == ids
    assert len(asked) == 2 and asked[1] - asked[0] >= 1.0  # its Retry-After, though the host's pause was lifted


def test_threads_switch_every_millisecond_once_a_host_is_paced_and_as_before_after_the_run(server, tmp_path):
    seen = []  # the interpreter's switch interval as each request is answered (the server runs in-process)

    def ok():
        seen.append(sys.getswitchinterval())
        return 200

    def quota():
        seen.append(sys.getswitchinterval())
        return 200, b"{}", {"RateLimit-Remaining": "100", "RateLimit-Reset": "60"}  # a declared quota: paced

    ids = [f"p{n}" for n in range(12)]
    for n, item in enumerate(ids):
        server.replies[item] = [ok] if n < 2 or n > 5 else [quota]
    before = sys.getswitchinterval()
    code, err, _ = crawl(server, tmp_path, ids, fake=FastForward())
    assert code == ExitCode.OK, err
    assert seen[:2] == [before, before] and seen[-1] == redrive.SWITCH_INTERVAL != before
    assert sys.getswitchinterval() == before
    code, err, _ = crawl(server, tmp_path, ["q"], "--rate", "100", fake=FastForward())  # paced from the start
    assert code == ExitCode.OK and seen[-1] == redrive.SWITCH_INTERVAL and sys.getswitchinterval() == before


def test_host_settings_are_read_once_per_host_and_stay_bounded(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    monkeypatch.setenv("no_proxy", "skip.example")
    settings = redrive.HostSettings(size=3)
    origin = redrive.origin_of("http://a.example/x")
    assert settings("http://a.example/x", origin)[0]["http"] == "http://proxy.invalid:3128"
    assert settings("http://a.example/y", origin) is settings.memo[origin]  # read once
    assert "http" not in settings("http://skip.example/", redrive.origin_of("http://skip.example/"))[0]
    for n in range(10):
        url = f"http://h{n}.example/"
        settings(url, redrive.origin_of(url))
        assert len(settings.memo) <= 3


def test_the_schedule_starts_what_is_due_host_by_host_and_says_when_the_next_may_start():
    cfg = Config(Path("i"), Path("s"), concurrency=8, rate=10.0)  # --rate 10: one start every 0.1 s
    timeline = redrive.Schedule(cfg)
    for item_id in ("http://a.test/1", "http://a.test/2", "http://b.test/1"):
        timeline.add(redrive.Item(item_id), 0.0, now=0.0)
    timeline.add(redrive.Item("http://b.test/2"), 5.0, now=0.0)  # due later: waits on the heap
    assert timeline.pending() == 4 and timeline.next_due() == 5.0
    first = timeline.take(0.0)
    assert first.id == "http://a.test/1" and timeline.take(0.0) is None  # the --rate slot is taken
    assert timeline.next_wake(0.0) == pytest.approx(0.1)
    assert timeline.take(0.1).id == "http://b.test/1"  # hosts take turns
    assert timeline.take(0.2).id == "http://a.test/2"
    assert timeline.take(0.3) is None and timeline.next_wake(0.3) == 5.0  # nothing due before 5 s
    assert timeline.take(5.0).id == "http://b.test/2" and timeline.inflight == 4 and timeline.pending() == 0


def test_the_schedule_holds_ids_behind_a_paused_host_and_lets_other_hosts_go():
    timeline = redrive.Schedule(Config(Path("i"), Path("s"), concurrency=8))
    for item_id in ("http://a.test/1", "http://a.test/2", "http://b.test/1"):
        timeline.add(redrive.Item(item_id), 0.0, now=0.0)
    a = timeline.take(0.0)
    timeline.hosts[a.host].paused_until = 3.0  # its Retry-After
    timeline.settled(a, 0.0)
    assert timeline.take(0.0).id == "http://b.test/1"
    assert timeline.take(0.0) is None and timeline.next_wake(0.0) == 3.0 and timeline.paused_until(0.0) == 3.0
    assert timeline.take(3.0).id == "http://a.test/2"
    assert timeline.paused_until(3.0) == 0.0 and not timeline.pauses  # the pause is over: forgotten


def test_the_schedule_takes_ids_on_many_hosts_in_turn_without_scanning_them():
    timeline = redrive.Schedule(Config(Path("i"), Path("s"), concurrency=8))
    for n in range(20000):
        timeline.add(redrive.Item(f"http://h{n}.test/x"), 0.0, now=0.0)
    taken = []
    while (item := timeline.take(0.0)) is not None:  # one id a host: each take empties its host's queue
        taken.append(item.id)
        timeline.inflight -= 1
    assert taken == [f"http://h{n}.test/x" for n in range(20000)] and not timeline.active
    assert timeline.paused_until(0.0) == 0.0


def planned_batch(tmp_path, ids, *extra):
    """(a Batch with every id planned, as run() makes it, its Ledger, its FakeTime)."""
    ids_file = write_ids(tmp_path, ids)
    cfg = redrive.config_from_args(redrive.build_parser().parse_args([str(ids_file), *extra]), {}, None)
    fake = FakeTime()
    cfg.state_dir.mkdir()
    state = redrive.load_state(cfg.state_dir)
    listing = redrive.listing_of(cfg.ids_file, redrive.current_index(cfg.ids_file, cfg.state_dir, None), state, False)
    ledger = redrive.Ledger(cfg.state_dir)
    ledger.open()
    progress = redrive.Progress(io.StringIO(), len(ids), fake.clock, True)
    batch = redrive.Batch(cfg, ledger, state, fake.effects(), redrive.Redactor(()), progress)
    redrive.plan(listing, state, cfg, batch, ledger, fake.effects())
    return batch, ledger, fake


def test_a_finished_batch_is_freed_at_once_with_its_million_ids_not_left_to_the_cycle_collector(tmp_path):
    import gc
    import weakref
    batch, ledger, _ = planned_batch(tmp_path, [f"i{n}" for n in range(100)])
    gone = weakref.ref(batch)
    gc.disable()
    try:
        batch.wake.close()
        del batch
        assert gone() is None  # no reference cycle through the batch: a stopped run exits in 0.3 s, not 0.7
    finally:
        gc.enable()
        ledger.close()


def run_batch(tmp_path, ids, *extra):
    """A Batch run in-process, as run() does it, to look at its hosts afterwards."""
    batch, ledger, _ = planned_batch(tmp_path, ids, *extra)
    try:
        batch.run()
    finally:
        ledger.close()
    return batch


def test_idle_hosts_are_forgotten_and_throttled_ones_kept(server, tmp_path):
    port = server.server_address[1]
    for n in range(1, 7):
        server.replies[f"t{n}"] = [429, 200]  # "too fast" five in a row: the host's; its pace is set, it is kept
    ids = [f"http://127.0.0.1:{port}/items/a", f"http://127.0.0.1:{port}/items/b",
           *(f"http://localhost:{port}/items/t{n}" for n in range(1, 7))]
    batch = run_batch(tmp_path, ids, "--concurrency", "1", "--backoff", "0")
    assert server.hits == Counter({"a": 1, "b": 1, **{f"t{n}": 2 for n in range(1, 7)}})
    assert list(batch.timeline.hosts) == [f"http://localhost:{port}"]  # the 127.0.0.1 gate was as new: gone


def test_an_answer_that_opens_a_gate_early_wakes_the_main_thread(tmp_path):
    ids = [f"i{n}" for n in range(5)]
    batch, ledger, fake = planned_batch(tmp_path, ids, "--url", "http://127.0.0.1:9/items/{id}", "--no-guard")
    try:
        first, second = batch._take_ready(), batch._take_ready()
        spent = redrive.Outcome(Bucket.OK, status=200, body="{}", quota=redrive.Declared(0.0, 10.0))
        assert batch._finish(first, spent) is None  # none left until the quota resets in 10 s: the gate is shut
        assert batch._take_ready() is None
        batch.wakes_at = fake.now + 1.0  # the main thread looks again in a second
        fake.now += 0.01
        renewed = redrive.Outcome(Bucket.OK, status=200, body="{}", quota=redrive.Declared(2.0, 0.5))
        mine = batch._finish(second, renewed)  # an answer from a new window: two left in half a second
        assert mine.id == "i2"  # this worker goes on with the next id
        assert batch._take_ready() is None  # the one after it is due a quarter second on, spread to the reset
        assert batch.wake.reader.recv(1) == b"!"  # so the main thread hands it out then, not a second later
    finally:
        ledger.close()
        batch.wake.close()
        batch.watchdog.close()


def test_shards_split_the_ids_with_no_overlap(server, tmp_path):
    ids = [f"s{n}" for n in range(60)]
    ids_file = write_ids(tmp_path, ids)
    for k in (1, 2, 3):
        code, _, _ = run_cli([ids_file, "--url", server.template, "--shard", f"{k}/3", "--state-dir", tmp_path / str(k)])
        assert code == ExitCode.OK
    shards = [set((tmp_path / str(k) / "done.txt").read_text().split()) for k in (1, 2, 3)]
    assert set().union(*shards) == set(ids) and sum(map(len, shards)) == 60
    assert all(8 <= len(shard) <= 32 for shard in shards)
    assert max(server.hits.values()) == 1


def test_a_shards_state_dir_remembers_its_shard_and_refuses_another(server, tmp_path):
    ids = [f"s{n}" for n in range(60)]
    ids_file, sdir = write_ids(tmp_path, ids), tmp_path / "one"
    mine = {i for i in ids if redrive.in_shard(i, (1, 3))}
    code, _, _ = run_cli([ids_file, "--url", server.template, "--shard", "1/3", "--state-dir", sdir, "--max-time",
                          "0.001"], fake=FastForward())
    code, err, _ = run_cli([ids_file, "--state-dir", sdir])  # a plain rerun: its shard, from run.json
    assert code == ExitCode.OK, err
    assert set(server.hits) == mine and set((sdir / "done.txt").read_text().split()) == mine
    code, err, _ = run_cli([ids_file, "--state-dir", sdir, "--shard", "2/3"])
    assert code == ExitCode.USAGE and "shard 1/3" in err and err.count("\n") == 1
    out = io.StringIO()  # --check knows the shard: a complete shard is settled
    assert redrive.main([str(ids_file), "--check", "--state-dir", str(sdir)], out=out, environ={}) == ExitCode.OK
    assert f"({len(mine)} ids, shard 1/3)" in out.getvalue()


def test_shards_started_without_a_state_dir_each_get_their_own(server, tmp_path):
    ids = [f"s{n}" for n in range(30)]
    ids_file = write_ids(tmp_path, ids)
    for k in (1, 2):
        code, err, _ = run_cli([ids_file, "--url", server.template, "--shard", f"{k}/2"])
        assert code == ExitCode.OK, err
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".redrive"))
    assert dirs == ["ids.shard-1-of-2.redrive", "ids.shard-2-of-2.redrive"]
    assert max(server.hits.values()) == 1 and len(server.hits) == 30


@pytest.mark.parametrize("env, spec, shard", [
    ({"JOB_COMPLETION_INDEX": "0"}, "auto/3", (1, 3)),  # Kubernetes counts from 0
    ({"AWS_BATCH_JOB_ARRAY_INDEX": "2"}, "auto/3", (3, 3)),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}, "auto", (2, 3)),
])
def test_shard_auto_reads_the_job_engines_index(server, tmp_path, env, spec, shard):
    ids = [f"s{n}" for n in range(30)]
    out = io.StringIO()
    code = redrive.main([str(write_ids(tmp_path, ids)), "--url", server.template, "--shard", spec, "--dry-run"],
                        err=io.StringIO(), out=out, environ=env)
    mine = sum(1 for i in ids if redrive.in_shard(i, shard))
    assert code == ExitCode.OK and f"{mine} ids (shard {shard[0]}/{shard[1]} of 30)" in out.getvalue()


@pytest.mark.parametrize("env, said", [({}, "JOB_COMPLETION_INDEX AWS_BATCH_JOB_ARRAY_INDEX SLURM_ARRAY_TASK_ID"),
                                       ({"JOB_COMPLETION_INDEX": "7"}, "outside 1 to 3")])
def test_shard_auto_without_an_engine_index_is_one_line_and_exit_2(tmp_path, env, said):
    code, err, _ = run_cli([write_ids(tmp_path, ["a"]), "--shard", "auto/3"], environ=env)
    assert code == ExitCode.USAGE and said in err and err.count("\n") == 1


@pytest.mark.parametrize("env, named", [
    ({"JOB_COMPLETION_INDEX": "\u00b2"}, "JOB_COMPLETION_INDEX"),  # str.isdigit takes it, int does not
    ({"JOB_COMPLETION_INDEX": "-1"}, "JOB_COMPLETION_INDEX"),
    ({"AWS_BATCH_JOB_ARRAY_INDEX": "\u0661"}, "AWS_BATCH_JOB_ARRAY_INDEX"),  # an Arabic-Indic 1: int takes it
    ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "x"}, "SLURM_ARRAY_TASK_MIN"),
    ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3.0"},
     "SLURM_ARRAY_TASK_COUNT"),
], ids=["superscript two", "negative", "Arabic-Indic digit", "Slurm's MIN not a number", "Slurm's COUNT 3.0"])
def test_number_from_outside_an_engine_variable_that_is_no_decimal_number_is_named_and_exit_2(tmp_path, env,
                                                                                              named):
    code, err, _ = run_cli([write_ids(tmp_path, ["a"]), "--shard", "auto"], environ=env)
    assert code == ExitCode.USAGE and err.count("\n") == 1, err
    assert f"{named}=" in err and "not a whole number" in err and "Traceback" not in err


@pytest.mark.parametrize("headers", [{"X-RateLimit-Remaining": "\u0661\u0662", "X-RateLimit-Reset": "60"},
                                     {"X-RateLimit-Remaining": "5", "X-RateLimit-Reset": "\u0666\u0660"}])
def test_number_from_outside_a_quota_header_in_other_digits_is_no_quota(headers):
    assert redrive.declared_quota(requests.structures.CaseInsensitiveDict(headers), WALL) is None


def test_a_bare_run_beside_shard_dirs_says_the_list_is_run_in_shards(server, tmp_path):
    ids = write_ids(tmp_path, ["p00001", "p00002"])
    code, err, _ = run_cli([ids, "--url", server.template, "--shard", "1/2"])
    assert code == ExitCode.OK, err
    code, err, _ = run_cli([ids])  # a bare rerun beside the shard's state dir, without --shard
    assert code == ExitCode.USAGE and "ids.shard-1-of-2.redrive" in err and "--shard K/N" in err
    assert err.count("\n") == 1


def test_cover_with_a_folder_that_does_not_exist_says_so_and_where_shards_keep_their_state(tmp_path):
    ids = write_ids(tmp_path, ["a"])
    code, err, _ = run_cli([ids, "--cover", tmp_path / "state-1"])
    assert code == ExitCode.USAGE and "no such folder" in err and "run.json" not in err
    assert ".shard-K-of-N.redrive" in err and err.count("\n") == 1


def test_shards_run_by_a_job_engine_are_disjoint_resume_in_their_own_dir_and_cover_the_list(server, tmp_path):
    ids = [f"j{n}" for n in range(90)]
    server.replies.update({item: [("sleep", 0.03, 200)] for item in ids})
    ids_file = write_ids(tmp_path, ids)
    volumes = [tmp_path / f"volume-{index}" for index in range(3)]  # an Indexed Job: a volume for each index

    def worker(index):
        env = {**os.environ, "JOB_COMPLETION_INDEX": str(index)}  # Kubernetes counts from 0
        cmd = redrive_cmd(ids_file, "--url", server.template, "--shard", "auto/3", "--state-dir", volumes[index],
                          "--concurrency", "1")
        return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)

    procs = [worker(index) for index in range(3)]
    wait_for_lines(volumes[1] / "done.txt", 3, procs[1])
    procs[1].kill()  # a worker replaced mid-run: its volume stays
    procs[1].wait()
    assert [p.wait(timeout=60) for p in (procs[0], procs[2])] == [0, 0]
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--cover", *map(str, volumes)], out=out, environ={}) == ExitCode.INCOMPLETE
    assert "ids not settled yet" in out.getvalue()
    assert worker(1).wait(timeout=60) == 0  # the replacement resumes in the same volume
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--cover", *map(str, volumes)], out=out, environ={}) == ExitCode.OK
    done = [set((v / "done.txt").read_text().split()) for v in volumes]
    assert set().union(*done) == set(ids) and sum(map(len, done)) == 90  # disjoint, and together the list
    assert max(server.hits.values()) <= 2  # at most the one in flight when the worker was killed, asked again
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--cover", str(volumes[0]), str(volumes[2])], out=out,
                        environ={}) == ExitCode.INCOMPLETE
    assert "shards missing: 2/3" in out.getvalue()


def test_proxy_settings_from_the_environment_are_honoured(server, tmp_path, monkeypatch):
    proxy, thread = start_server()
    try:
        monkeypatch.setenv("HTTP_PROXY", proxy.base)
        ids = write_ids(tmp_path, ["a", "b"])
        code, _, _ = run_cli([ids, "--url", "http://upstream.invalid/items/{id}"])
        assert code == ExitCode.OK
        assert sorted(proxy.paths) == ["http://upstream.invalid/items/a", "http://upstream.invalid/items/b"]
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        code, _, _ = run_cli([ids, "--url", server.template, "--state-dir", tmp_path / "direct"])
        assert code == ExitCode.OK and sorted(server.paths) == ["/items/a", "/items/b"] and len(proxy.paths) == 2
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()


# ------------------------------------------------- faults at the socket level

JSON = [("Content-Type", "application/json")]
CHUNKED = [("Transfer-Encoding", "chunked")]
BOMB = 64 << 20  #: 64 MiB of zeros, about 64 KB on the wire

#: (fault, the server's script, bucket, reason): every row through main(),
#: --tries 2, --passes 1, --timeout 0.3, --max-bytes 1000000.
FAULTS = [
    ("reset before the status line", ["reset"], "retryable", "connection dropped before the answer"),
    ("closed before the status line", ["close"], "retryable", "connection dropped before the answer"),
    ("a status line that is not HTTP", [b"SSH-2.0-OpenSSH_9.6\r\n", "close"], "retryable", "not an HTTP answer"),
    ("garbage bytes", [b"\x00\xff\x13\x10garbage\r\n\r\n", "close"], "retryable", "not an HTTP answer"),
    ("a body with no status line", [b'{"id": "x"}', "close"], "retryable", "not an HTTP answer"),
    ("an empty status line", [b"HTTP/1.1 \r\n\r\n", "close"], "retryable", "not an HTTP answer"),
    ("body cut short of Content-Length", [answer(200, headers=[("Content-Length", "30")]) + b"0123456789", "close"],
     "retryable", "connection dropped mid-body"),
    ("chunked body cut short", [answer(200, headers=CHUNKED) + b"a\r\n0123456789\r\n5\r\nab", "close"],
     "retryable", "connection dropped mid-body"),
    ("broken chunk framing", [answer(200, headers=CHUNKED) + b"zz\r\n0123\r\n0\r\n\r\n", "close"],
     "retryable", "broken chunked encoding"),
    ("gzip that is not gzip", [answer(200, b"plain text", [("Content-Encoding", "gzip")])],
     "retryable", "undecodable body (gzip)"),
    ("gzip cut short", [answer(200, gzipped(b'{"id": "x", "pad": "' + b"y" * 500 + b'"}')[:-12],
                               [("Content-Encoding", "gzip")])], "retryable", "undecodable body (gzip)"),
    ("an encoding never asked for", [answer(200, b"\x1b\x00", [("Content-Encoding", "br")])],
     "retryable", "undecodable body (br)"),
    ("a stall mid-body", [answer(200, headers=[("Content-Length", "100")]) + b"0123456789", ("sleep", 2.5)],
     "retryable", "timeout after 1 s"),
    ("headers dripped a byte at a time", [("drip", b"HTTP/1.1 200 OK\r\nX-Slow: " + b"s" * 100, 0.02), "close"],
     "retryable", "timeout after 1 s"),  # each byte in time for a read timeout: only the whole attempt's cuts it
    ("a status line dripped", [("drip", b"HTTP/1.1 200 Taking my time " + b"." * 100, 0.02), "close"],
     "retryable", "timeout after 1 s"),
    ("a gzip bomb", [answer(200, zero_bomb(BOMB, 31), [("Content-Encoding", "gzip")])],
     "skip", "body over 1000000 bytes"),
    ("a deflate bomb", [answer(200, zero_bomb(BOMB, 15), [("Content-Encoding", "deflate")])],
     "skip", "body over 1000000 bytes"),
    ("a redirect loop", lambda item, hit: [answer(302, headers=[("Location", f"/items/{item}")])],
     "skip", "too many redirects"),
    ("a redirect without Location", [answer(302)], "skip", "302 Found (a redirect without a Location)"),
    ("a redirect to file:", [answer(302, headers=[("Location", "file:///etc/passwd")])],
     "skip", "redirect to an unsupported URL"),
    ("a redirect to ftp:", [answer(302, headers=[("Location", "ftp://127.0.0.1/x")])],
     "skip", "redirect to an unsupported URL"),
    ("a redirect to a broken URL", [answer(302, headers=[("Location", "http://[::1/x")])],
     "skip", "redirect to an unsupported URL"),
    ("more than 100 headers", [answer(200, b"{}", [(f"X-H{i}", "v") for i in range(120)])],
     "skip", "an answer with more than 100 headers"),
    ("a header line over 64 KiB", [answer(200, b"{}", [("X-Big", "v" * 70000)])],
     "skip", "an answer with a header line over 64 KiB"),
    ("more interim answers than any server sends", [b"HTTP/1.1 103 Early Hints\r\n\r\n" * 20 + answer(200, b"{}")],
     "retryable", "not an HTTP answer"),
    ("a final 101", [answer(101, headers=[("Upgrade", "nothing")], length=False)], "skip", "101 Switching Protocols"),
    ("a status nobody defined", [answer(999, b"?")], "skip", "HTTP 999"),
    ("a 2xx with an invalid JSON body", [answer(200, b'{"id": ', JSON)], "retryable", "invalid JSON"),
]


@pytest.mark.parametrize("charset, body", [("utf-7", b"+2AA-"), ("unicode-escape", b"\\ud800"), ("rot13", b"uryyb")])
def test_a_body_that_cannot_be_stored_as_its_charset_says_is_stored_losslessly_and_never_blocks_the_batch(
        raw_server, tmp_path, charset, body):
    raw_server.replies["odd"] = [[answer(200, body, [("Content-Type", f"text/plain; charset={charset}")])]]
    ids = ["odd"] + [f"n{k}" for k in range(20)]
    code, err, _ = crawl(raw_server, tmp_path, ids)
    assert code == ExitCode.OK and "Traceback" not in err and sorted(state(tmp_path, "done.txt")) == sorted(ids)
    [odd] = [r for r in state(tmp_path, "results.jsonl") if r["id"] == "odd"]
    # stored losslessly, never as the charset's lone surrogate: its bytes as UTF-8 text when they are, else base64
    stored = base64.b64decode(odd["body"]) if odd.get("body_encoding") == "base64" else odd["body"].encode("utf-8")
    assert stored == body


def test_a_host_that_takes_the_connection_and_never_answers_is_probed_then_exit_69_with_nothing_marked(raw_server,
                                                                                                       tmp_path):
    raw_server.replies.update({f"h{n}": [[("sleep", 30)]] for n in range(12)})  # accepts, reads, never answers
    argv = [str(write_ids(tmp_path, [f"h{n}" for n in range(12)])), "--url", raw_server.template, "--timeout", "1",
            "--concurrency", "4", "--tries", "3", "--passes", "1", "--backoff", "0.05"]
    err = io.StringIO()
    code = redrive.main(argv, err=err, environ={})  # real time: the silence is measured on the clock
    err = err.getvalue()
    assert code == ExitCode.UNREACHABLE and "unreachable (timeout after 1 s)" in err
    assert state(tmp_path, "failed.jsonl") == [] and state(tmp_path, "unavailable.jsonl") == []
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["stop"] == "unreachable" and report["counts"]["pending"] == 12


def test_a_late_second_answer_on_a_kept_open_connection_never_puts_one_ids_body_under_another(raw_server, tmp_path):
    def twice(item, hit):  # its answer, then 50 ms later an error page on the same connection, as some frameworks do
        return [answer(200, json.dumps({"id": item}).encode(), [("Content-Type", "application/json")]),
                ("sleep", 0.05), answer(503, b"late error page")]
    ids = [f"t{n}" for n in range(40)]
    raw_server.replies.update({item: [twice] for item in ids})
    code, err, _ = crawl(raw_server, tmp_path, ids, "--concurrency", "1", "--backoff", "0", "--tries", "10")
    assert code == ExitCode.OK, err
    results = state(tmp_path, "results.jsonl")
    # the stale 503 is taken by the next request, which is retried; the connection that carried it is closed,
    # so that request's own answer, still on its way, is never read as the request after's
    assert sorted(r["id"] for r in results) == sorted(ids)
    assert all(r["body"] == {"id": r["id"]} for r in results)


def test_a_304_that_carries_a_body_at_once_or_late_never_shifts_a_body_and_every_refresh_ends(raw_server, tmp_path):
    def tagged(item, hit):  # first a 200 with an ETag; then 304s that carry the body anyway, as some proxies do
        body = json.dumps({"id": item}).encode()
        if hit == 1:
            return [answer(200, body, [("Content-Type", "application/json"), ("ETag", f'"{item}"')])]
        head = answer(304, b"", [("ETag", f'"{item}"'), ("Content-Length", str(len(body)))])
        return [head + body] if item.startswith("now") else [head, ("sleep", 0.02), body]
    ids = [f"{kind}{n}" for n in range(12) for kind in ("now", "late")]
    raw_server.replies.update({item: [tagged] for item in ids})
    fake = FakeTime()
    assert crawl(raw_server, tmp_path, ids, "--concurrency", "2", fake=fake)[0] == ExitCode.OK
    fake.now += 60
    code, err, _ = crawl(raw_server, tmp_path, ids, "--refresh", "--concurrency", "2", "--backoff", "0", "--tries", "10",
                         fake=fake)
    assert code == ExitCode.OK, err
    assert [r["id"] for r in state(tmp_path, "results.jsonl")] == state(tmp_path, "done.txt")  # no new line
    assert all(r["body"] == {"id": r["id"]} for r in state(tmp_path, "results.jsonl"))
    assert {r["id"]: r["result"] for r in state(tmp_path, "refreshed.jsonl")} == {i: "unchanged" for i in ids}


def test_require_with_the_id_retries_a_body_that_is_another_ids_and_never_stores_it(raw_server, tmp_path):
    def swapped(item, hit):
        other = "b" if item == "a" else "a"
        body = {"id": other if hit == 1 else item}
        return [answer(200, json.dumps(body, separators=(",", ":")).encode(), [("Content-Type", "application/json")])]
    raw_server.replies.update({"a": [swapped], "b": [swapped]})
    code, err, _ = crawl(raw_server, tmp_path, ["a", "b"], "--require", '"id":"{id}"', "--backoff", "0")
    assert code == ExitCode.OK, err
    assert {r["id"]: r["body"]["id"] for r in state(tmp_path, "results.jsonl")} == {"a": "a", "b": "b"}
    assert raw_server.hits["a"] == 2 and raw_server.hits["b"] == 2


def test_a_post_answered_before_its_body_was_read_never_shifts_the_next_request(raw_server, tmp_path):
    raw_server.early = True  # the unread body would be read as the start of the next request on that connection
    raw_server.replies["a"] = [[answer(503, b"busy")], ok_answer]
    code, err, _ = crawl(raw_server, tmp_path, ["a", "b", "c"], "--method", "POST", "--data", '{"item":"{id}"}',
                         "--concurrency", "1", "--backoff", "0")
    assert code == ExitCode.OK, err
    assert sorted(state(tmp_path, "done.txt")) == ["a", "b", "c"] and state(tmp_path, "unavailable.jsonl") == []
    assert not any(head.startswith("{") for head in raw_server.requests)  # no request began with a body's bytes


@pytest.mark.parametrize("fault, script, bucket, reason", FAULTS, ids=[row[0] for row in FAULTS])
def test_every_fault_is_an_outcome_with_its_bucket_and_reason(raw_server, tmp_path, fault, script, bucket, reason):
    raw_server.replies["x"] = [script]
    raw_server.replies["after"] = [ok_answer]  # the run goes on after the fault
    code, err, _ = crawl(raw_server, tmp_path, ["x", "after"], "--tries", "2", "--passes", "1", "--timeout", "1",
                         "--max-bytes", "1000000")
    assert code == ExitCode.OK and "Traceback" not in err
    [record] = state(tmp_path, "unavailable.jsonl")
    assert (record["id"], record["bucket"], record["reason"]) == ("x", bucket, reason)
    assert record["action"]
    assert state(tmp_path, "done.txt") == ["after"]
    if bucket == "retryable":
        assert [f["error"] for f in state(tmp_path, "failed.jsonl")] == [reason]
        assert record["tries"] == 2
    else:
        assert record["tries"] == 1 and state(tmp_path, "failed.jsonl") == []


class BASE64(str):
    """An expected body stored as base64 of these bytes (latin-1 text here)."""


#: (what the server sends, what results.jsonl holds as the body): odd but usable answers.
ODD_ANSWERS = [
    (answer(200, b'{"a": NaN, "b": 1e999}', JSON), '{"a": NaN, "b": 1e999}'),
    (answer(200, b"[" * 100000 + b"]" * 100000, JSON), "[" * 100000 + "]" * 100000),
    (answer(200, b'{"s": "\\ud800"}', JSON), {"s": "\ud800"}),
    (answer(200, b"caf\xe9", [("Content-Type", "text/plain; charset=no-such-charset")]), BASE64("caf\xe9")),
    (answer(200, b"caf\xe9", [("Content-Type", "text/plain; charset=idna")]), BASE64("caf\xe9")),
    (answer(200, b"caf\xc3\xa9", [("Content-Type", "text/plain; charset=idna")]), "caf\xe9"),  # UTF-8 after all
    (answer(200, b"\x89PNG\r\n\x1a\n\x00\xff", [("Content-Type", "image/png")]), BASE64("\x89PNG\r\n\x1a\n\x00\xff")),
    (answer(200, b'{"a": "\xff"}', JSON), BASE64('{"a": "\xff"}')),  # invalid UTF-8 inside JSON
    (answer(200, b"caf\xe9", [("Content-Type", "text/plain; charset=latin-1")]), "caf\xe9"),
    (answer(200, b"hello", [("Content-Length", "abc")]), "hello"),  # unframed: read to the close
    (b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" + answer(200, b'{"id": "x"}', JSON), {"id": "x"}),
    (answer(200, gzipped(b'{"id": "x"}') + gzipped(b""), JSON + [("Content-Encoding", "gzip")]), {"id": "x"}),
    (answer(200, zlib.compress(b'{"id": "x"}')[2:-4], JSON + [("Content-Encoding", "deflate")]), {"id": "x"}),
    (answer(200, b'{"id": "x"}', JSON + [("Content-Encoding", "identity")]), {"id": "x"}),
]


@pytest.mark.parametrize("sent, stored", ODD_ANSWERS, ids=range(len(ODD_ANSWERS)))
def test_odd_but_usable_answers_are_stored_as_strict_json(raw_server, tmp_path, sent, stored):
    raw_server.replies["x"] = [[sent, "close"]]
    code, err, _ = crawl(raw_server, tmp_path, ["x"], "--timeout", "2")
    assert code == ExitCode.OK and "Traceback" not in err, err
    line = (tmp_path / "ids.redrive" / "results.jsonl").read_text(encoding="utf-8")
    record = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in results.jsonl"))
    if isinstance(stored, BASE64):
        assert record["body_encoding"] == "base64" and base64.b64decode(record["body"]) == stored.encode("latin-1")
    else:
        assert record["body"] == stored and "body_encoding" not in record


def test_a_tls_handshake_with_a_plain_http_server_is_a_tls_error(server, tmp_path):
    ids = write_ids(tmp_path, ["x"])
    url = f"https://127.0.0.1:{server.server_address[1]}/items/{{id}}"
    code, err, _ = run_cli([ids, "--url", url, "--timeout", "2"])
    [record] = state(tmp_path, "unavailable.jsonl")
    assert code == ExitCode.OK and record["reason"] == "TLS error (certificate or handshake)"


def test_early_hints_never_put_one_ids_body_under_another(raw_server, tmp_path):
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
    raw_server.replies.update({f"e{i}": [lambda item, hit: [hints, ("sleep", 0.005)] + ok_answer(item, hit)]
                               for i in range(60)})  # keep-alive: the connection serves id after id
    code, err, _ = crawl(raw_server, tmp_path, [f"e{i}" for i in range(60)], "--concurrency", "4")
    assert code == ExitCode.OK, err
    results = state(tmp_path, "results.jsonl")
    assert len(results) == 60 and all(r["body"] == {"id": r["id"]} for r in results)


@given(status=st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.0 204 No Content", b"HTTP/1.1 301 Moved", b"HTTP/1.1 429 x",
                               b"HTTP/1.1 103 Early", b"HTTP/1.1 99 low", b"HTTP/2 200", b"HTTP/1.1 200", b"HTTP/1.1 1000 x",
                               b"HTTP/1.1 401 no", b"HTTP/1.1 503 busy"]) | st.binary(max_size=40),
       headers=st.lists(st.tuples(st.sampled_from([b"Content-Type", b"Content-Encoding", b"Content-Length",
                                                   b"Transfer-Encoding", b"Retry-After", b"Location", b"Set-Cookie",
                                                   b"X-Any"]) | st.binary(min_size=1, max_size=10),
                                  st.sampled_from([b"application/json; charset=utf-16", b"text/html; charset=x-bogus",
                                                   b"gzip", b"deflate, gzip", b"chunked", b"-1", b"99999", b"0",
                                                   b"Fri, 31 Dec 9999 23:59:59 GMT", b"1e11", b"\xb2", b"file:///x",
                                                   b"//[::1", b"a=b; Max-Age=x"]) | st.binary(max_size=30)),
                        max_size=6),
       body=st.binary(max_size=200) | st.sampled_from([b'{"a": NaN}', b"[" * 5000, b"\x1f\x8b\x08\x00", b"0\r\n\r\n"]))
@settings(max_examples=150, deadline=None)
def test_no_answer_a_server_can_send_escapes_the_attempt(fuzz_server, status, headers, body):
    """Whatever the bytes, fetch returns an Outcome: it never raises."""
    head = b"\r\n".join([status, *(name + b": " + value for name, value in headers)])
    fuzz_server.replies["x"] = [[head + b"\r\n\r\n" + body, "close"]]
    cfg = Config(Path("ids.txt"), Path("state"), request=redrive.Request(url=fuzz_server.template), timeout=0.5,
                 max_bytes=100000)
    session = redrive.make_session(cfg, redrive.HostSettings(), fuzz_server.watchdog)
    outcome = redrive.fetch(session, "x", cfg, redrive.Redactor(()), time.time)
    assert isinstance(outcome.bucket, Bucket) and isinstance(outcome.error, str)
    if outcome.bucket is Bucket.OK:
        json.loads(outcome.body, parse_constant=lambda name: pytest.fail(name))


@pytest.fixture(scope="module")
def fuzz_server():
    srv = RawServer()
    srv.watchdog = redrive.Watchdog()
    yield srv
    srv.watchdog.close()
    srv.close()


def test_a_batch_mixing_every_fault_settles_every_id_in_a_real_process(raw_server, tmp_path):
    ids = [f"{n}-{i}" for n, _ in enumerate(FAULTS) for i in range(2)] + [f"ok-{i}" for i in range(20)]
    for item in ids:
        number = item.split("-")[0]
        raw_server.replies[item] = [FAULTS[int(number)][1]] if number != "ok" else [ok_answer]
    cmd = redrive_cmd(write_ids(tmp_path, ids), "--url", raw_server.template, "--concurrency", "8", "--timeout", "1",
                      "--tries", "2", "--backoff", "0.01", "--max-backoff", "0.02", "--cooldown", "0.05",
                      "--max-bytes", "1000000")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    done, unavailable = set(state(tmp_path, "done.txt")), {r["id"] for r in state(tmp_path, "unavailable.jsonl")}
    assert done == {i for i in ids if i.startswith("ok")} and unavailable == set(ids) - done


#: Runs redrive.py, then writes the process's peak RSS (VmHWM, KiB) to $PEAK_FILE.
#: Not os.wait4's ru_maxrss: that counts the pytest process the child was forked from.
PEAK = """import os, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open(os.environ["PEAK_FILE"], "w") as out, open("/proc/self/status") as status:
        out.write(next(line for line in status if line.startswith("VmHWM")).split()[1])
"""


def peak_memory(tmp_path, *args):
    """(exit code, stderr, peak RSS in MiB) of redrive.py run with args."""
    if not Path("/proc/self/status").exists():
        pytest.skip("peak memory is read from /proc (Linux)")
    env = {**os.environ, "PEAK_FILE": str(tmp_path / "peak.txt")}
    proc = subprocess.run([sys.executable, "-c", PEAK, *redrive_cmd(*args)[1:]], env=env, capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, proc.stderr, int((tmp_path / "peak.txt").read_text()) / 1024


def test_a_redirect_whose_body_is_a_gzip_bomb_is_not_read(raw_server, tmp_path):
    bomb = zero_bomb(256 << 20, 31)  # 256 MiB decoded, 256 KB on the wire
    raw_server.replies["r"] = [[answer(302, bomb, [("Location", "/items/target"), ("Content-Encoding", "gzip")])]]
    code, err, peak = peak_memory(tmp_path, write_ids(tmp_path, ["r"]), "--url", raw_server.template)
    assert code == 0 and "Traceback" not in err
    assert peak < 100  # MiB: redrive's own ~40, not the 256 that reading the redirect's body costs
    [result] = state(tmp_path, "results.jsonl")
    assert result["final_url"].endswith("/items/target") and result["body"] == {"id": "target"}


@pytest.mark.parametrize("value", ["100000000000", "Fri, 31 Dec 9999 23:59:59 GMT", "86400"])
def test_a_retry_after_past_the_runs_reach_ends_the_run_and_says_when_to_rerun(server, tmp_path, value):
    server.replies["t"] = [(429, b"", {"Retry-After": value})]
    code, err, fake = crawl(server, tmp_path, ["t", "ok"], "-q")
    assert code == ExitCode.INCOMPLETE
    assert fake.sleeps == []  # a lone throttle holds back no other id, and nobody waits a day
    [failed] = state(tmp_path, "failed.jsonl")
    assert failed["retry_after"] == redrive.MAX_RETRY_AFTER == 86400.0
    assert redrive.parse_iso(failed["due"]) - redrive.parse_iso(failed["at"]) == 86400.0
    assert f"nothing is due before {failed['due']}" in err and "rerun the same command after then" in err
    assert state(tmp_path, "done.txt") == ["ok"]


def test_a_retry_after_in_the_year_9999_ends_a_real_quiet_run(server, tmp_path):
    server.replies["t"] = [(503, b"", {"Retry-After": "Fri, 31 Dec 9999 23:59:59 GMT"})]
    cmd = redrive_cmd(write_ids(tmp_path, ["t"]), "--url", server.template, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "nothing is due before" in proc.stderr


@pytest.mark.parametrize("given, bounded", [
    (None, 1.0), (0.0, 0.0001), (-5.0, 0.0001), (1e-9, 0.0001), (1e-6, 0.0001), (0.0005, 0.0005), (0.25, 0.25), (1e300, 1.0),
    (float("inf"), 1.0), (float("nan"), 1.0)])
def test_bounded_wait_never_rounds_to_nothing_nor_runs_away(given, bounded):
    assert redrive.bounded_wait(given) == bounded


def test_every_wait_of_the_run_loop_wakes_whatever_its_timeout_and_load():
    wake, stop, finished = redrive.Wake(), threading.Event(), []

    def busy():  # GIL pressure and a stream of wake-ups, as workers give
        while not stop.is_set():
            wake.set()
            sum(range(2000))
            time.sleep(0.0001)

    def waits():
        timeouts = [1e-9, 1e-6, 0.0, -1.0, float("nan"), None, 1e300, float("inf"), 2e-3]
        for n in range(5000):
            wake.wait(timeouts[n % len(timeouts)])
        finished.append(n + 1)

    workers = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
    waiter = threading.Thread(target=waits, daemon=True)
    for thread in [*workers, waiter]:
        thread.start()
    waiter.join(30)
    stop.set()
    assert finished == [5000], "a wait hung or raised"
    wake.close()


@pytest.mark.parametrize("grain, slept", [(0.0, False), (0.5, True)],
                         ids=["select on time, as on Linux", "select late by more than the wait, as on Windows"])
def test_class_a_wait_shorter_than_select_can_time_is_slept_and_a_longer_one_still_wakes(grain, slept):
    # select on Windows ends on the system timer's 15.6 ms tick: a paced slot met that late is never made up, so a
    # wait shorter than select's lateness is slept (finer there since Python 3.11); a longer one wakes at a wake-up
    assert 0.0 <= redrive.Wake().grain < 0.5  # measured on this platform
    wake = redrive.Wake(grain)

    def waited(seconds):
        started = time.perf_counter()
        wake.wait(seconds)
        return time.perf_counter() - started

    wake.set()
    assert waited(5.0) < 2.5  # longer than select's lateness: the pending wake-up ends it
    wake.set()
    assert (waited(0.2) >= 0.2) is slept  # shorter: slept through the wake-up, or ended by it
    assert waited(0.3) >= 0.3  # that wake-up was read either way: nothing ends this one early
    wake.close()


def run_in_thread(function, limit=15.0):
    """function() in a thread that must end within limit seconds: a hang fails the test."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the run hung"
    return result[0]


def test_a_bug_while_handling_one_id_stops_with_70_and_keeps_the_state(server, tmp_path, monkeypatch):
    real = redrive.interpret

    def buggy(resp, raw, *args):
        if resp.url.endswith("/items/i77"):
            raise KeyError("a bug")
        return real(resp, raw, *args)

    monkeypatch.setattr(redrive, "interpret", buggy)
    ids = [f"i{n}" for n in range(400)]
    code, err, _ = run_in_thread(lambda: crawl(server, tmp_path, ids, "--concurrency", "32", "--tries", "1"))
    assert code == ExitCode.SOFTWARE == 70
    [line] = [line for line in err.splitlines() if line.startswith("redrive: internal error")]
    assert "on id 'i77': KeyError: 'a bug'" in line and "crash.log" in line and "Traceback" not in err
    sdir = tmp_path / "ids.redrive"
    assert "Traceback" in (sdir / "crash.log").read_text() and "KeyError" in (sdir / "crash.log").read_text()
    report = json.loads((sdir / "report.json").read_text())
    assert report["stop"] == "crash" and report["exit_code"] == 70 and report["crash"]["id"] == "i77"
    check_any_moment_invariants(sdir)
    settled = set(state(tmp_path, "done.txt")) | {r["id"] for r in state(tmp_path, "failed.jsonl")}
    assert "i77" not in settled and len(settled) < 400  # left pending, and the run stopped starting requests
    monkeypatch.undo()  # the bug fixed, a rerun finishes the batch
    assert redrive.main([str(tmp_path / "ids.txt"), "--url", server.template], err=io.StringIO()) == 0
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids)


def test_a_bug_in_the_main_loop_is_exit_70_with_a_report(server, tmp_path, monkeypatch):
    monkeypatch.setattr(redrive.Progress, "tick", lambda self, batch: 1 / 0)
    code, err, _ = run_in_thread(lambda: crawl(server, tmp_path, ["a", "b"]))
    assert code == 70 and "internal error: ZeroDivisionError" in err and "Traceback" not in err
    assert json.loads((tmp_path / "ids.redrive" / "report.json").read_text())["stop"] == "crash"


def test_a_bug_outside_the_batch_is_one_line_and_exit_70(server, tmp_path, monkeypatch):
    monkeypatch.setattr(redrive, "build_report", lambda *args: {}["missing"])
    code, err, _ = crawl(server, tmp_path, ["a"])
    assert code == 70
    [line] = [line for line in err.splitlines() if "internal error" in line]
    assert "KeyError" in line and "Traceback" not in err
    assert "Traceback" in (tmp_path / "ids.redrive" / "crash.log").read_text()
    assert state(tmp_path, "done.txt") == ["a"]


def test_a_post_that_may_have_been_processed_is_not_sent_again(server, tmp_path):
    server.replies.update({"p500": [500, 200], "pempty": [(200, b"", {}), 200], "pdrop": ["drop", 200],
                           "p503": [503, 200], "p429": [(429, b"", {"Retry-After": "1"}), 200]})
    ids = ["p500", "pempty", "pdrop", "p503", "p429"]
    code, err, _ = crawl(server, tmp_path, ids, "--method", "POST", "--data", '{"id": "{id}"}')
    assert code == ExitCode.OK
    unavailable = {r["id"]: r for r in state(tmp_path, "unavailable.jsonl")}
    assert set(unavailable) == {"p500", "pempty", "pdrop"} and state(tmp_path, "failed.jsonl") == []
    assert unavailable["p500"]["reason"] == "may have been processed (500 Internal Server Error)"
    assert unavailable["pdrop"]["reason"] == "may have been processed (connection dropped before the answer)"
    assert "--retry-unsafe --retry-unavailable" in unavailable["pempty"]["action"]
    assert server.hits == Counter({"p500": 1, "pempty": 1, "pdrop": 1, "p503": 2, "p429": 2})


def test_retry_unsafe_retries_a_post_like_any_request(server, tmp_path):
    server.replies.update({"p500": [500, 200], "pdrop": ["drop", 200]})
    code, _, _ = crawl(server, tmp_path, ["p500", "pdrop"], "--method", "PATCH", "--data", "x={id}", "--retry-unsafe")
    assert code == ExitCode.OK and server.hits == Counter({"p500": 2, "pdrop": 2})
    assert sorted(state(tmp_path, "done.txt")) == ["p500", "pdrop"]


def test_a_post_that_never_reached_the_server_is_retried(tmp_path):
    ids = write_ids(tmp_path, [f"http://127.0.0.1:{closed_port()}/x"])
    code, _, _ = run_cli([ids, "--method", "POST", "--data", "{id}", "--tries", "2", "--passes", "1"])
    [record] = state(tmp_path, "unavailable.jsonl")
    assert code == ExitCode.OK and record["reason"] == "connection refused" and record["tries"] == 2


def test_put_and_delete_are_retried_as_before(server, tmp_path):
    server.replies.update({"a": [500, 200]})
    assert crawl(server, tmp_path, ["a"], "--method", "PUT", "--data", "{id}")[0] == ExitCode.OK
    assert server.hits["a"] == 2 and state(tmp_path, "done.txt") == ["a"]


def test_a_reader_that_goes_away_never_stops_the_crawl(server, tmp_path):
    server.replies.update({f"f{i}": [500, 200] for i in range(10)})
    ids = [f"f{i}" for i in range(10)] + [f"k{i}" for i in range(30)]
    cmd = redrive_cmd(write_ids(tmp_path, ids), "--url", server.template, "--tries", "1", "--cooldown", "0.3")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    proc.stderr.readline()
    proc.stderr.close()  # as `redrive ... 2>&1 | head -1` does
    assert proc.wait(timeout=30) == 0
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids)
    assert json.loads((tmp_path / "ids.redrive" / "report.json").read_text())["exit_code"] == 0


def test_a_closed_stderr_never_stops_the_crawl_nor_reaches_a_state_file(server, tmp_path):
    server.replies["f"] = [500, 200]
    cmd = redrive_cmd(write_ids(tmp_path, ["f", "g"]), "--url", server.template, "--tries", "1", "--cooldown", "0.1")
    proc = subprocess.run(cmd, preexec_fn=lambda: os.close(2), timeout=30)  # `2>&-`
    assert proc.returncode == 0 and sorted(state(tmp_path, "done.txt")) == ["f", "g"]
    for name in ("results.jsonl", "failed.jsonl"):
        assert all(line["id"] in ("f", "g") for line in state(tmp_path, name))  # every line parses: no message in it
    assert b"redrive" not in (tmp_path / "ids.redrive" / "lock").read_bytes().split(b"\n", 1)[1]


def test_a_run_stopped_and_continued_goes_on_to_its_end(server, tmp_path):
    ids = [f"s{i}" for i in range(60)]
    server.replies.update({item: [("sleep", 0.02, 200)] for item in ids})
    cmd = redrive_cmd(write_ids(tmp_path, ids), "--url", server.template, "--concurrency", "2", "-q")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "ids.redrive" / "done.txt", 5, proc)
    proc.send_signal(signal.SIGTSTP)  # Ctrl+Z
    time.sleep(0.5)
    proc.send_signal(signal.SIGCONT)  # fg
    assert proc.wait(timeout=30) == 0 and proc.stderr.read() == ""
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids) and set(server.hits.values()) == {1}


def test_a_set_cookie_storm_is_ignored_past_the_bound(raw_server, tmp_path):
    def storm(item, hit):
        cookies = [("Set-Cookie", f"c{item}x{k}={'v' * 1000}") for k in range(60)]
        return [answer(200, json.dumps({"id": item}).encode(), JSON + cookies)]

    ids = [f"c{i}" for i in range(30)]
    raw_server.replies.update({item: [storm] for item in ids})
    code, _, _ = crawl(raw_server, tmp_path, ids)
    sent = [re.search(r"(?im)^cookie: (.*)$", head) for head in raw_server.requests]
    longest = max(len(found.group(1)) for found in sent if found)
    assert code == ExitCode.OK and len(state(tmp_path, "done.txt")) == 30
    assert 10000 < longest <= redrive.MAX_COOKIE_BYTES + 3 * redrive.MAX_COOKIES


def test_a_cookie_header_given_by_the_user_survives_a_same_origin_redirect(server, tmp_path):
    server.replies["r"] = [(302, b"", {"Location": server.base + "/items/target"})]
    code, _, _ = crawl(server, tmp_path, ["r"], "-H", "Cookie: session=abc")
    assert code == ExitCode.OK and [h.get("Cookie") for h in server.seen_headers] == ["session=abc"] * 2


def test_a_redirect_to_a_dead_host_is_that_ids_problem_not_the_apis(server, tmp_path):
    dead = f"http://127.0.0.1:{closed_port()}/gone"
    ids = [f"r{i}" for i in range(8)]
    server.replies.update({item: [(302, b"", {"Location": dead})] for item in ids})
    code, err, _ = crawl(server, tmp_path, [*ids, "fine"], "--tries", "1", "--passes", "1")
    assert code == ExitCode.OK, err  # not 69: the API answered every request
    assert {r["reason"] for r in state(tmp_path, "unavailable.jsonl")} == {"redirect target: connection refused"}
    assert state(tmp_path, "done.txt") == ["fine"]


def test_a_decompression_bomb_costs_about_max_bytes_of_memory(raw_server, tmp_path):
    raw_server.replies["b"] = [[answer(200, zero_bomb(256 << 20, 31), JSON + [("Content-Encoding", "gzip")])]]
    code, _, peak = peak_memory(tmp_path, write_ids(tmp_path, ["b"]), "--url", raw_server.template,
                                "--max-bytes", "4000000")
    assert code == 0 and peak < 60  # MiB: redrive's own ~40 and a few --max-bytes, not 256
    assert state(tmp_path, "unavailable.jsonl")[0]["reason"] == "body over 4000000 bytes"


@pytest.fixture
def full_backlog():
    """A port whose listen queue is full: the kernel drops new SYNs, so connecting times out."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    waiting = []
    for _ in range(4):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(listener.getsockname())
        waiting.append(sock)
    time.sleep(0.05)
    yield listener.getsockname()[1]
    for sock in [listener, *waiting]:
        sock.close()


def test_a_connect_timeout_is_named_and_points_at_the_host(full_backlog, tmp_path):
    ids = write_ids(tmp_path, [f"http://127.0.0.1:{full_backlog}/x"])
    code, err, _ = run_cli([ids, "--timeout", "1", "--tries", "1", "--passes", "1"])
    [record] = state(tmp_path, "unavailable.jsonl")
    assert code == ExitCode.OK and record["reason"] == "connect timeout after 1 s"
    assert record["action"].startswith("host not reachable (connect timeout after 1 s)")


def test_a_connect_the_local_stack_refuses_is_cannot_connect_and_points_at_the_host(tmp_path):
    # connect() to the broadcast address fails in the kernel (EACCES, or
    # ENETUNREACH with no route): no packet leaves the machine
    ids = write_ids(tmp_path, ["http://255.255.255.255:9/x"])
    code, err, fake = run_cli([ids, "--tries", "2", "--passes", "1"])
    [record] = state(tmp_path, "unavailable.jsonl")
    assert code == ExitCode.OK and (record["reason"], record["cause"]) == ("cannot connect", "unreached")
    assert record["action"].startswith("host not reachable (cannot connect)") and record["tries"] == 2
    assert state(tmp_path, "done.txt") == [] and not os.path.exists(tmp_path / "results.jsonl")


def test_a_read_timeout_raised_by_requests_itself_is_a_timeout_not_a_dead_host(server):
    import requests
    server.replies["s"] = [("sleep", 0.5, 200)]
    with pytest.raises(requests.exceptions.ReadTimeout) as caught:
        requests.get(server.base + "/items/s", timeout=0.1)
    assert redrive.transport_failure(caught.value, redrive.Phase.REQUEST, 0.1) == (
        redrive.Bucket.RETRYABLE, redrive.Cause.TIMEOUT, "timeout after 0.1 s")
    assert not redrive.never_connected(caught.value)


def test_a_host_name_that_does_not_resolve_is_named(tmp_path):
    ids = write_ids(tmp_path, ["http://no-such-host.invalid/x"])  # .invalid never resolves (RFC 6761)
    code, _, _ = run_cli([ids, "--tries", "1", "--passes", "1"])
    [record] = state(tmp_path, "unavailable.jsonl")
    assert code == ExitCode.OK and record["reason"] == "host name not found"
    assert record["action"].startswith("host not reachable (host name not found)")


# ------------------------------------------------- bad input and bad state


@given(item_id=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40) |
       st.sampled_from([".", "..", "...", "./", "../x", "%2e%2E", "%2F", "a/../b", "?", "#", "@evil.example", "\\\\"]))
@settings(max_examples=300, deadline=None)
def test_an_id_never_leaves_its_place_in_the_url(item_id):
    """The path requests will send decodes back to the id, under the template's
    prefix and before its suffix; only a pure dot segment is refused."""
    import requests
    template = "http://api.example/v1/items/{id}/detail?x=1"
    if redrive.makes_dot_segment(template, item_id):
        assert item_id in (".", "..")
        return
    prepared = requests.PreparedRequest()
    prepared.prepare_url(redrive.build_url(template, item_id), None)
    parts = urlsplit(prepared.url)
    assert (parts.hostname, parts.query) == ("api.example", "x=1")
    assert parts.path.startswith("/v1/items/") and parts.path.endswith("/detail")
    assert unquote(parts.path[len("/v1/items/"):-len("/detail")]) == item_id


def test_dot_segment_ids_are_never_sent_even_with_delete(server, tmp_path):
    code, err, _ = crawl(server, tmp_path, [".", "..", "...", "a.b"], "--method", "DELETE")
    assert code == ExitCode.OK
    refused = {r["id"]: r for r in state(tmp_path, "unavailable.jsonl")}
    assert set(refused) == {".", ".."} and refused[".."]["reason"] == redrive.DOT_SEGMENT
    assert "put {id} in the query" in refused["."]["action"]
    assert sorted(server.paths) == ["/items/...", "/items/a.b"]  # nothing went to /items/ or to /


def test_a_url_env_value_never_reaches_a_file_even_outside_a_key_parameter(server, tmp_path):
    environ = {"ACCOUNT": "acct-7781-private", "V": "v-99-private"}
    ids = write_ids(tmp_path, ["a", "gone"])
    server.replies["gone"] = [404]
    code, err, _ = run_cli([ids, "--url", server.base + "/${ACCOUNT}/items/{id}?version=${V}"], environ=environ)
    assert code == ExitCode.OK and server.hits["a"] == 1
    assert state(tmp_path, "results.jsonl")[0]["url"].endswith("/${ACCOUNT}/items/a?version=${V}")  # as given
    for text in (all_output(tmp_path), err):
        assert "acct-7781-private" not in text and "v-99-private" not in text


def test_keys_in_url_list_ids_are_hidden_in_every_output_and_warned_about(server, tmp_path):
    ids = [f"{server.base}/items/a?api_key={SECRET}", f"{server.base}/items/gone?api_key={SECRET}"]
    server.replies["gone"] = [404]
    ids_file = write_ids(tmp_path, ids)
    code, err, _ = run_cli([ids_file])
    assert code == ExitCode.OK and "carry a key-like query parameter" in err
    assert SECRET not in err and "gone?api_key=REDACTED" in err
    report = (tmp_path / "ids.redrive" / "report.json").read_text()
    assert SECRET not in report and "api_key=REDACTED" in report
    assert state(tmp_path, "done.txt") == [ids[0]]  # the ledgers keep ids as given: the README says so
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--check"], out=out, err=io.StringIO()) == ExitCode.OK
    assert "carry a key-like query parameter" in out.getvalue() and SECRET not in out.getvalue()


def test_a_secret_echoed_near_the_excerpt_cut_shows_none_of_its_characters(server, tmp_path):
    server.replies["a"] = [(401, b"x" * 190 + SECRET.encode(), {})]
    code, err, _ = crawl(server, tmp_path, ["a"], "-H", "X-Key: ${K}", environ={"K": SECRET})
    assert code == ExitCode.FATAL and "x" * 190 + "***" in err and SECRET[:4] not in err


def test_ids_and_reasons_reach_the_terminal_with_control_characters_escaped(server, tmp_path):
    evil = "bad\x1b[2J\x1b]0;owned\x07\u202eid"
    server.replies[evil] = [404]
    code, err, _ = crawl(server, tmp_path, [evil])
    assert code == ExitCode.OK and "\x1b" not in err and "\u202e" not in err and "\x07" not in err
    assert "bad\\x1b[2J\\x1b]0;owned\\x07\\u202eid" in err
    assert state(tmp_path, "unavailable.jsonl")[0]["id"] == evil  # the state keeps it exact


def test_a_reason_without_a_status_is_said_once(raw_server, tmp_path):
    raw_server.replies["x"] = [[answer(302, headers=[("Location", "file:///etc/passwd")])]]
    code, err, _ = crawl(raw_server, tmp_path, ["x"])
    assert code == ExitCode.OK and err.count("redirect to an unsupported URL") == 1  # the group names the id
    assert "\n      x\n" in err
    assert "redirect to an unsupported URL: redirect to" not in err


def test_a_run_stopped_before_it_sends_reports_every_id_of_a_long_list_with_its_records_in_file_order(
        server, tmp_path):
    ids = [f"id{n:07d}" for n in range(250_000)]  # 2.5 MB: the file is read in three blocks, one with no record
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    failed = [{"id": ids[n], "pass": 1, "bucket": "retryable", "status": 503, "error": "503 Service Unavailable",
               "tries": 3, "at": "2023-11-14T22:29:00.000000Z"} for n in (249_999, 5)]
    (sdir / "failed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in failed))
    code, err, _ = crawl(server, tmp_path, ids, "--max-time", "4", fake=SlowStart(5.0))
    report = json.loads((sdir / "report.json").read_text())
    assert code == ExitCode.INCOMPLETE and sum(server.hits.values()) == 0
    assert report["counts"] | {"input": 0} == {"input": 0, "duplicates": 0, "done": 0, "unavailable": 0, "failed": 2,
                                               "pending": 249_998}
    rows = report["unresolved"]
    assert [r["id"] for r in rows if r["state"] == "pending"] == ids[:5] + ids[6:1001]
    assert [r["id"] for r in rows if r["state"] == "failed"] == [ids[5], ids[249_999]]  # in file order


def test_a_stopped_run_over_many_ids_lists_pending_ids_by_count_not_one_by_one(server, tmp_path):
    ids = [f"p{n}" for n in range(3000)]
    server.replies.update({item: [("sleep", 0.01, 200)] for item in ids[:10]})
    code, err, _ = crawl(server, tmp_path, ids, "--max-time", "0.05", fake=FastForward())
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    pending = report["counts"]["pending"]
    assert code == ExitCode.INCOMPLETE and 2000 < pending <= 3000  # however few finish in 0.05 s on a busy machine
    assert report["pending_listed"] == redrive.PENDING_LISTED == 1000
    assert len([r for r in report["unresolved"] if r["state"] == "pending"]) == 1000
    assert report["counts"]["done"] + pending == 3000
    [group] = report["reasons"]
    assert group == {"state": "pending", "reason": "time budget reached", "count": pending, "action": "rerun to resume"}
    assert f"{pending} x pending, time budget reached" in err


@pytest.mark.parametrize("shape, message", [
    ({"url": None}, "not a redrive run record (bad 'url')"),
    ({"headers": "X-Key"}, "not a redrive run record (bad 'headers')"),
    ({"future_field": 1}, "written by redrive 9.9, whose request has fields this version does not know (future_field)"),
])
def test_a_damaged_or_newer_run_json_is_one_line_and_exit_2(server, tmp_path, shape, message):
    crawl(server, tmp_path, ["a"])
    path = tmp_path / "ids.redrive" / "run.json"
    record = json.loads(path.read_text())
    record["shape"].update(shape)
    record["redrive"] = "9.9"
    path.write_text(json.dumps(record))
    code, err, _ = crawl(server, tmp_path, ["a", "b"])
    assert code == ExitCode.USAGE and err.count("\n") == 1 and message in err and server.hits["b"] == 0


@pytest.mark.parametrize("text", ["{", '{"hosts": []}', '{"hosts": {"127.0.0.1": {"pace": 2, "window": 0, "at": "x"}}}',
                                  '{"hosts": {"0123456789abcdef": {"pace": -1, "window": 0, '
                                  '"at": "2026-01-01T00:00:00.000000Z"}}}',
                                  '{"hosts": {"0123456789abcdef": {"pace": 2, "window": 1e300, '
                                  '"at": "2026-01-01T00:00:00.000000Z"}}}', '[1, 2]', '{"hosts": {"0123456789abcdef": '
                                  '{"pace": NaN, "window": 0, "at": "2026-01-01T00:00:00.000000Z"}}}'])
def test_a_damaged_paces_json_is_one_line_and_exit_2(server, tmp_path, text):
    crawl(server, tmp_path, ["a"])
    (tmp_path / "ids.redrive" / "paces.json").write_text(text)
    for args in (["--check"], []):  # --check says what the next run would
        code, err, _ = crawl(server, tmp_path, ["a", "b"], *args)
        assert code == ExitCode.USAGE and err.count("\n") == 1 and server.hits["b"] == 0
        assert "paces.json: not a redrive pace record; remove it" in err


@pytest.mark.parametrize("urls", [False, True], ids=["a --url template", "ids that are URLs"])
def test_a_pace_an_earlier_run_left_paces_the_hosts_first_requests(server, tmp_path, urls):
    # the curve starts as that run's cut: the first request at once, then at BETA x its pace, climbing back to it
    # (a new host would send four at once); a host met through a list of URLs is the same host
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    at, key, elsewhere = "2026-01-01T00:00:00.000000Z", redrive.pace_key(server.base), redrive.pace_key("http://gone:1")
    learnt = {key: {"pace": 4, "window": 0, "at": at}, elsewhere: {"pace": 9, "window": 0, "at": at}}
    (sdir / "paces.json").write_text(json.dumps({"hosts": learnt}))
    ids = ["a", "b", "c", "d", "e"]
    if urls:
        code, err, _ = run_cli([write_ids(tmp_path, [server.template.replace("{id}", i) for i in ids]), "--concurrency", "4"])
    else:
        code, err, _ = crawl(server, tmp_path, ids, "--concurrency", "4")
        assert "; the limit found before, 4 r/s, paces it (paces.json)" in err.splitlines()[0]
    fetched = [redrive.parse_iso(r["fetched_at"]) for r in state(tmp_path, "results.jsonl")]
    gaps = [b - a for a, b in zip(fetched, fetched[1:])]
    assert code == ExitCode.OK and 1 / (4 * redrive.BETA) - 1e-6 <= gaps[0] and gaps == sorted(gaps, reverse=True)
    assert gaps[-1] >= 0.25  # not past the pace yet
    # its limit found again keeps its record; a host this run did not ask (a demo's last port) is not kept
    assert json.loads((sdir / "paces.json").read_text())["hosts"] == {key: learnt[key]}


def test_a_pace_an_earlier_run_left_is_dropped_once_the_host_takes_far_more_than_it(server, tmp_path):
    # an API that lifted its limit since: once the host has taken CUBIC_C requests more than the record allows, none
    # refused, it is met anew (slow start), and the next run is not held to the old record
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    key = redrive.pace_key(server.base)
    (sdir / "paces.json").write_text(json.dumps({"hosts": {key: {"pace": 100, "window": 0,
                                                                   "at": "2026-01-01T00:00:00.000000Z"}}}))
    code, err, _ = crawl(server, tmp_path, [str(i) for i in range(1500)], "--concurrency", "4")
    assert code == ExitCode.OK and len(state(tmp_path, "results.jsonl")) == 1500
    assert key not in json.loads((sdir / "paces.json").read_text())["hosts"]


def test_a_limit_a_run_finds_is_kept_for_the_next_by_a_digest_of_its_host(server, tmp_path):
    # the first run learns 20 a second the way a new host does (slow start's bunch is refused at once); the next starts
    # paced at what it learnt: its first refusal is the curve's first probe past it, a K later
    clock, bucket, first, refused = [None], [3.0, 0.0], {}, {0: [], 1: []}

    def limited(run):  # 20 a second, 3 of slack (a thread's hiccup is no excess), on the run's own clock
        def answer():
            with server.lock:
                now = clock[0].clock()
                first.setdefault(run, now)
                bucket[:] = [min(3.0, bucket[0] + (now - bucket[1]) * 20), now]
                if bucket[0] >= 1:
                    bucket[0] -= 1
                    return 200
                refused[run].append(now - first[run])
                return 429, b"", {}
        return answer
    ids = [f"r{n}" for n in range(400)]
    for run, some in enumerate((ids[:200], ids[200:])):
        server.replies.update({item: [limited(run)] for item in some})
        clock[0] = FastForward()
        bucket[:] = [3.0, clock[0].clock()]  # a new clock, and the server's bucket full again
        code, err, _ = crawl(server, tmp_path, ids[:200 * (run + 1)], "--concurrency", "8", fake=clock[0])
        assert code == ExitCode.OK, err
    text = (tmp_path / "ids.redrive" / "paces.json").read_text()
    [(key, learnt)] = json.loads(text)["hosts"].items()
    assert key == redrive.pace_key(server.base) and "127.0.0.1" not in text
    assert 15 <= learnt["pace"] <= 25 and learnt["window"] < 1
    assert min(refused[0]) < 0.5 and min(refused[1]) >= 1.0


def test_a_changed_request_names_the_changed_fields(server, tmp_path):
    crawl(server, tmp_path, ["a"])
    code, err, _ = crawl(server, tmp_path, ["a"], "--method", "PUT", "--expect-json")
    assert code == ExitCode.USAGE and "method: 'GET' -> 'PUT'; expect_json: False -> True" in err


LEDGER_VALUES = st.none() | st.booleans() | st.integers(-5, 1000) | st.floats(allow_nan=False) | st.text(max_size=30) | \
    st.just("2026-01-01T00:00:00.000000Z") | st.sampled_from(["retryable", "skip", "ok"])


@given(name=st.sampled_from(["failed.jsonl", "unavailable.jsonl", "results.jsonl"]),
       record=st.fixed_dictionaries({"id": st.text(max_size=5) | st.integers()},
                                    optional={key: LEDGER_VALUES for key in
                                              ("pass", "bucket", "status", "error", "tries", "at", "reason",
                                               "action", "url", "fetched_at", "retry_after", "due")}))
@settings(max_examples=150, deadline=None)
def test_any_json_line_with_an_id_in_a_state_file_is_read_or_refused_in_one_line(tmp_path_factory, name, record):
    tmp_path = tmp_path_factory.mktemp("ledger")
    ids = write_ids(tmp_path, ["a"])
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / name).write_text(json.dumps(record) + "\n")
    url = f"http://127.0.0.1:{closed_port()}/{{id}}"
    for argv in ([ids, "--check"], [ids, "--url", url, "--tries", "1", "--passes", "1"]):
        code, err, _ = run_cli(argv)
        assert code in (0, 1, 2, 69), err
        if code == ExitCode.USAGE:
            assert err.count("\n") == 1 and "not a redrive record" in err, err


def test_a_wrong_url_halts_after_20_alike_answers_and_the_fixed_url_then_completes(server, tmp_path):
    ids = [f"item-{n:03d}" for n in range(200)]
    ids_file = write_ids(tmp_path, ids)
    wrong = server.base + "/item/{id}"  # the API serves /items/
    server.replies.update({f"/item/{item}": [404] for item in ids})
    code, err, _ = run_cli([ids_file, "--url", wrong, "-q", "--concurrency", "4"])
    assert code == ExitCode.FATAL == 3
    assert "the first 20 answers were all 404 Not Found, e.g. GET " + server.base + "/item/item-0" in err
    assert "is --url (or the ids file) right?" in err and "--no-guard" in err
    assert state(tmp_path, "unavailable.jsonl") == [] and state(tmp_path, "failed.jsonl") == []
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["stop"] == "misconfigured" and report["counts"]["pending"] == 200
    assert len(server.paths) < 40  # it stopped asking
    code, err, _ = run_cli([ids_file, "--url", server.template])  # no extra flag: nothing was done yet
    assert code == ExitCode.OK and "no id is done yet, so the new one is taken" in err
    assert sorted(state(tmp_path, "done.txt")) == ids


def test_a_csv_header_taken_for_ids_trips_the_guard_too(server, tmp_path):
    rows = ["id,name,price"] + [f"{n},Widget {n},9.99" for n in range(10)]
    server.replies.update({row: [404] for row in rows})
    code, err, _ = crawl(server, tmp_path, rows, "-q")
    assert code == ExitCode.FATAL and "the first 11 answers were all 404 Not Found" in err


def test_the_guard_lets_a_run_with_any_other_answer_go_on_and_settles_what_it_held(server, tmp_path):
    ids = [f"g{n}" for n in range(15)] + ["found"] + [f"h{n}" for n in range(10)]
    server.replies.update({item: [404] for item in ids if item != "found"})
    code, err, _ = crawl(server, tmp_path, ids)
    assert code == ExitCode.OK and state(tmp_path, "done.txt") == ["found"]
    assert len(state(tmp_path, "unavailable.jsonl")) == 25 and max(server.hits.values()) == 1


def test_no_guard_never_halts_and_alike_answers_broken_up_by_others_are_settled(server, tmp_path):
    ids = [f"g{n}" for n in range(30)]
    server.replies.update({item: [404] for item in ids})
    assert crawl(server, tmp_path, ids, "--no-guard")[0] == ExitCode.OK
    (tmp_path / "ids.redrive").rename(tmp_path / "first.redrive")
    mixed = [item for n in range(0, 30, 10) for item in (*ids[n:n + 10], f"ok{n}")]  # rows of 10 404s
    assert crawl(server, tmp_path, mixed)[0] == ExitCode.OK
    assert len(state(tmp_path, "unavailable.jsonl")) == 30


def test_verdicts_made_under_an_old_url_are_asked_again_and_a_rotated_key_keeps_them(server, tmp_path):
    ids_file = write_ids(tmp_path, ["a", "gone"])
    server.replies["gone"] = [404]
    assert run_cli([ids_file, "--url", server.template, "-H", "X-Key: ${K}"], environ={"K": "one"})[0] == 0
    assert server.hits["gone"] == 1
    code, err, _ = run_cli([ids_file, "--url", server.base + "/v2/items/{id}", "-H", "X-Key: ${K}"], environ={"K": "x"})
    assert code == ExitCode.USAGE and "ids unavailable under the old request are then asked again" in err
    env = {"K": "two", "ORG": "1"}
    code, err, _ = run_cli([ids_file, "-H", "X-Key: ${K}", "-H", "X-Org: ${ORG}", "--allow-config-change"],
                           environ=env)
    assert code == ExitCode.OK and server.hits["gone"] == 1  # headers only: the 404 still stands
    later = FakeTime()
    later.now += 3600  # an hour after the first verdict
    code, err, _ = run_cli([ids_file, "--url", server.base + "/v2/items/{id}", "--allow-config-change"],
                           fake=later, environ=env)
    assert code == ExitCode.OK and "will be asked again" in err and server.hits["gone"] == 2
    later.now += 60
    code, err, _ = run_cli([ids_file], fake=later, environ=env)  # the new verdict stands on the next run
    assert code == ExitCode.OK and server.hits["gone"] == 2


def test_the_guard_holds_alike_answers_trips_at_its_size_and_lets_everything_go_at_the_first_other():
    tripping = redrive.Guard(3)
    assert [tripping.offer(i, f"out-{i}", "404 Not Found") for i in "abc"] == [[], [], []]
    assert tripping.tripped and tripping.held == [("a", "out-a"), ("b", "out-b"), ("c", "out-c")]
    assert tripping.offer("d", "out-d", "404 Not Found") == []  # in flight when it tripped: not recorded either
    assert tripping.offer("e", "out-e", None) == [("e", "out-e")]  # a success is still stored
    rows = redrive.Guard(3)
    assert rows.offer("a", 1, "404 Not Found") == [] and rows.offer("b", 2, "403 Forbidden") == [("a", 1)]
    assert rows.offer("c", 3, None) == [("b", 2), ("c", 3)] and not rows.tripped  # a row ends at any other answer
    assert [rows.offer(i, i, "403 Forbidden") for i in "def"] == [[], [], []]  # it watches the whole run
    assert rows.tripped and rows.fine == 1
    short = redrive.Guard(3)
    short.offer("a", 1, "TLS error (certificate or handshake)")
    assert short.release() == [("a", 1)] and short.held == []


@pytest.mark.parametrize("out, expect_json, sign", [
    (redrive.Outcome(Bucket.SKIP, 404, "404 Not Found"), False, "404 Not Found"),
    (redrive.Outcome(Bucket.SKIP, 410, "410 Gone"), False, "410 Gone"),
    (redrive.Outcome(Bucket.SKIP, None, "TLS error (certificate or handshake)"), False,
     "TLS error (certificate or handshake)"),
    (redrive.Outcome(Bucket.RETRYABLE, 200, "invalid JSON"), True, "not JSON (--expect-json)"),
    (redrive.Outcome(Bucket.RETRYABLE, 200, "invalid JSON"), False, None),
    (redrive.Outcome(Bucket.RETRYABLE, 503, "503 Service Unavailable"), False, None),
    (redrive.Outcome(Bucket.SKIP, 501, "501 Not Implemented"), False, None),
    (redrive.Outcome(Bucket.OK, 200, body="{}"), False, None),
    (redrive.Outcome(Bucket.SKIP, None, redrive.DOT_SEGMENT), False, None),
])
def test_what_counts_as_a_sign_of_a_wrong_setup(out, expect_json, sign):
    cfg = Config(Path("ids.txt"), Path("state"), request=redrive.Request(expect_json=expect_json))
    assert redrive.misconfiguration_sign(out, cfg) == sign


@given(st.lists(st.text(st.sampled_from("ab1#\t \r\x0b\x1fé"), max_size=6), max_size=8))
@settings(max_examples=200, deadline=None)
def test_the_fast_path_for_plain_ids_reads_what_the_careful_one_does(lines):
    text = "\n".join(lines)
    careful = [line for line in map(str.strip, text.split("\n")) if line and line[0] != "#"]
    assert [i for i in redrive.id_lines(text) if i] == careful


def test_check_reads_results_without_a_json_parse_yet_checks_every_line(tmp_path):
    ids = [f"i{n}" for n in range(20000)] + ['q"uote']
    ids_file = write_ids(tmp_path, ids)
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    lines = [json.dumps({"id": i, "url": "u", "status": 200, "fetched_at": "t", "body": {"x": "}\\n"}},
                        separators=(",", ":")) for i in ids]
    (sdir / "results.jsonl").write_text("\n".join(lines) + "\n")
    (sdir / "done.txt").write_text("".join(f"{i}\n" for i in ids[:-1]) + "stranger\n")
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--check"], out=out, err=io.StringIO()) == ExitCode.INCOMPLETE
    text = out.getvalue()
    assert summary_count(text, "done") == 20000 and summary_count(text, "pending") == 1
    assert summary_count(text, "not in input") == 1  # the stranger, in done.txt alone
    assert "done ids without a result line: 1 (stranger)" in text
    assert "result lines without a done line: 1 (q\"uote)" in text  # an escaped id: read through the full parse
    lines[15000] = lines[15000][:40]  # damaged in the middle, in the second block
    (sdir / "results.jsonl").write_text("\n".join(lines) + "\n")
    err = io.StringIO()
    assert redrive.main([str(ids_file), "--check"], out=io.StringIO(), err=err) == ExitCode.USAGE
    assert "results.jsonl line 15001: not a redrive record (not JSON)" in err.getvalue()


def test_answers_the_guard_held_are_recorded_when_the_run_ends_before_it_decides(server, tmp_path):
    ids = [f"g{n}" for n in range(5)] + ["w"]
    server.replies.update({item: [404] for item in ids[:5]})
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    fake = FakeTime()
    waiting = {"id": "w", "pass": 1, "bucket": "retryable", "status": 429, "error": "429 Too Many Requests",
               "tries": 1, "at": redrive.iso(fake.wallclock()), "retry_after": 86400.0}
    (sdir / "failed.jsonl").write_text(json.dumps(waiting) + "\n")  # w is due in a day: beyond this run's reach
    code, err, _ = run_in_thread(lambda: crawl(server, tmp_path, ids, fake=fake))
    assert code == ExitCode.INCOMPLETE and "nothing is due before" in err and "internal error" not in err
    assert sorted(r["id"] for r in state(tmp_path, "unavailable.jsonl")) == ids[:5]  # answered: recorded


def test_a_guard_that_releases_at_the_very_end_lets_the_run_finish(server, tmp_path, monkeypatch):
    server.replies.update({f"g{n}": [404] for n in range(5)})
    monkeypatch.setattr(redrive, "GUARD_SAMPLE", 50)  # more answers awaited than the run will give
    real = redrive.Guard
    monkeypatch.setattr(redrive, "Guard", lambda size, *rest: real(6 if size else 0, *rest))
    code, err, _ = run_in_thread(lambda: crawl(server, tmp_path, [f"g{n}" for n in range(5)]))
    assert code == ExitCode.OK and "internal error" not in err, err
    assert len(state(tmp_path, "unavailable.jsonl")) == 5


STRAYS = [  # (what follows each clean answer on its kept-alive connection, concurrency)
    ("a second 200 2 ms late", [("sleep", 0.002), answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")])], 1),
    ("a second 200 2 ms late, 4 workers", [("sleep", 0.002), answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")])], 4),
    ("a late 404", [("sleep", 0.002), answer(404, b"gone")], 1),
    ("a second 200 in the same write", [answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")])], 1),
    ("a late 503 after 20 ms", [("sleep", 0.02), answer(503, b"busy")], 2),
]


@pytest.mark.parametrize("stray, after, workers", STRAYS, ids=[row[0] for row in STRAYS])
def test_class_a_connection_carries_one_answer_per_request(raw_server, tmp_path, stray, after, workers):
    ids = [f"s{i}" for i in range(40)]
    raw_server.replies.update({i: [lambda item, hit: ok_answer(item, hit) + after] for i in ids})
    code, err, _ = crawl(raw_server, tmp_path, ids, "--concurrency", str(workers), "--backoff", "0")
    assert code == ExitCode.OK, err
    results = state(tmp_path, "results.jsonl")
    assert {r["id"]: r["body"]["id"] for r in results} == {i: i for i in ids}  # no id holds another's answer
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids) and state(tmp_path, "unavailable.jsonl") == []


def test_class_a_connection_carries_one_answer_per_request_in_a_refresh(raw_server, tmp_path):
    ids = [f"r{i}" for i in range(30)]

    def tagged(item, hit):
        return [answer(200, json.dumps({"id": item}).encode(), [("Content-Type", "application/json"), ("ETag", f'"{item}"')])]

    def unchanged_then_stray(item, hit):  # a 304, then 2 ms later another id's 200
        other = answer(200, b'{"id":"stray"}', [("Content-Type", "application/json"), ("ETag", '"stray"')])
        return [answer(304, b"", [("ETag", f'"{item}"')], length=False), ("sleep", 0.002), other]
    raw_server.replies.update({i: [tagged, unchanged_then_stray] for i in ids})
    assert crawl(raw_server, tmp_path, ids, "--concurrency", "2")[0] == ExitCode.OK
    code, err, _ = crawl(raw_server, tmp_path, ids, "--concurrency", "2", "--refresh", "--backoff", "0")
    assert code == ExitCode.OK, err
    assert {i: r["body"]["id"] for i, r in latest(tmp_path).items()} == {i: i for i in ids}
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids) and state(tmp_path, "unavailable.jsonl") == []
    code, err, _ = run_cli([str(tmp_path / "ids.txt"), "--url", raw_server.template, "--check"])
    assert code == ExitCode.OK, err


STRAYS_UNWATCHED = [  # (ids, the one whose answer a stray follows, seconds late, the server's time for every answer)
    ("the answer behind it in the same read", 40, 20, 0.03, 0.0),
    ("300 ms late", 40, 20, 0.3, 0.0),
    ("one answer ahead to the run's end", 40, 30, 0.03, 0.005),
    ("one answer ahead to a later watch", 2 * redrive.IN_STEP_EVERY + 40, 20, 0.03, 0.005),
]


@pytest.mark.parametrize("stray, after, workers", STRAYS[2:4], ids=[row[0] for row in STRAYS[2:4]])
def test_class_a_connection_carries_one_answer_per_request_over_tls(raw_tls_server, tmp_path, stray, after, workers):
    """Over TLS what was read past an answer may wait decrypted in the TLS layer, not the reader's buffer."""
    test_class_a_connection_carries_one_answer_per_request(raw_tls_server, tmp_path, stray, after, workers)


def test_class_a_stray_in_the_tls_record_of_a_large_answer_is_seen(raw_tls_server, tmp_path):
    """A body read straight into its buffer leaves the rest of its TLS record decrypted in the TLS layer."""
    ids = [f"t{i}" for i in range(40)]
    stray = answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")])
    large = lambda item, hit: [answer(200, json.dumps({"id": item, "pad": "x" * 20000}).encode(),  # noqa: E731
                                      [("Content-Type", "application/json")]) + stray]
    raw_tls_server.replies.update({i: [large] for i in ids})
    code, err, _ = crawl(raw_tls_server, tmp_path, ids, "--concurrency", "1", "--backoff", "0")
    assert code == ExitCode.OK, err
    assert {i: r["body"]["id"] for i, r in latest(tmp_path).items()} == {i: i for i in ids}
    assert sum(raw_tls_server.hits.values()) == len(ids)  # seen at once, on the first answer: none asked twice


@pytest.mark.parametrize("case, count, where, late, slow", STRAYS_UNWATCHED, ids=[row[0] for row in STRAYS_UNWATCHED])
def test_class_a_stray_later_than_any_watch_puts_no_answer_under_another_id(raw_server, tmp_path, case, count, where,
                                                                             late, slow):
    """A stray behind an answer no watch looks at, coming after the next
    request went out: read as that request's answer. With a server slower
    than the client turns around, the connection stays one answer ahead."""
    ids = [f"s{i}" for i in range(count)]
    stray = answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")])
    raw_server.replies.update({i: [lambda item, hit: [("sleep", slow)] + ok_answer(item, hit)] for i in ids})
    raw_server.replies[ids[where]] = [lambda item, hit: ok_answer(item, hit) + [("sleep", late), stray], ok_answer]
    code, err, _ = crawl(raw_server, tmp_path, ids, "--concurrency", "1", "--backoff", "0")
    assert code == ExitCode.OK, err
    assert {i: r["body"]["id"] for i, r in latest(tmp_path).items()} == {i: i for i in ids}  # the last line wins
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids) and state(tmp_path, "unavailable.jsonl") == []
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    assert report["out_of_step"] >= 1 and report["counts"]["done"] == count and report["per_pass"]["1"]["done"] == count
    assert "ids asked again: the server sent an answer too many" in err
    out = io.StringIO()
    assert redrive.main([str(tmp_path / "ids.txt"), "--export", "jsonl"], out=out) == ExitCode.OK
    assert [(r["id"], r["body"]["id"]) for r in map(json.loads, out.getvalue().splitlines())] == [(i, i) for i in ids]
    assert redrive.main([str(tmp_path / "ids.txt"), "--check"], out=io.StringIO()) == ExitCode.OK
    if count > 2 * redrive.IN_STEP_EVERY:  # found by a watch mid-run: asked again then, not at the run's end
        asked = [head.split(" ", 2)[1].rsplit("/", 1)[-1] for head in raw_server.requests]
        assert asked.index(ids[where + 1], asked.index(ids[where + 1]) + 1) < asked.index(ids[-1])


def test_class_an_answer_in_doubt_before_its_verdict_is_asked_again_when_the_verdict_comes(raw_server, tmp_path):
    """The stray is a 404, read as the next id's answer and held by the
    guard among other 404s when the doubt comes: that id is asked again
    when the guard lets its verdict go, not confirmed unavailable."""
    ids = [f"g{i}" for i in range(12)]
    slow = lambda item, hit: [("sleep", 0.02)] + ok_answer(item, hit)  # noqa: E731
    raw_server.replies.update({i: [slow] for i in ids})
    raw_server.replies["g0"] = [lambda item, hit: ok_answer(item, hit) + [("await",), answer(404, b"stray")], slow]
    raw_server.replies.update({i: [[("sleep", 0.02), answer(404, b"gone")]] for i in ids[2:6]})
    code, err, _ = crawl(raw_server, tmp_path, ids, "--concurrency", "1", "--backoff", "0")
    assert code == ExitCode.OK, err
    assert sorted(latest(tmp_path)) == sorted(ids[:2] + ids[6:]) and latest(tmp_path)["g1"]["body"] == {"id": "g1"}
    assert sorted(r["id"] for r in state(tmp_path, "unavailable.jsonl")) == ids[2:6]
    assert raw_server.hits["g1"] == 2


def test_class_ids_in_doubt_not_answered_again_are_named(raw_server, tmp_path):
    """The ids a stray put in doubt whose answer again never comes (it times
    out, and the run has no try left): report.json names them and the
    summary says what to do."""
    ids = [f"s{i}" for i in range(40)]
    stray = answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")])
    hang = [("sleep", 10.0)]
    raw_server.replies.update({i: [ok_answer, hang] for i in ids})
    raw_server.replies["s20"] = [lambda item, hit: ok_answer(item, hit) + [("sleep", 0.03), stray], hang]
    code, err, _ = crawl(raw_server, tmp_path, ids, "--concurrency", "1", "--backoff", "0", "--timeout", "1",
                         "--passes", "1", "--tries", "1", "-q", "--metrics-file", str(tmp_path / "redrive.prom"))
    report = json.loads((tmp_path / "ids.redrive" / "report.json").read_text())
    # an id whose own answer was seen out of step has spent its one try: s21 if it read the stray and the
    # bytes behind it were seen at once, s22 too if they came only after s22 was sent and read s21's answer
    out = state(tmp_path, "unavailable.jsonl")
    gone = [r["id"] for r in out]
    assert len(out) <= 1 and all(r["cause"] == "out of step" and ids.index(r["id"]) > 20 for r in out), out  # one
    # sign closes the connection, and its host gets a new one for every request after
    asked = sorted(i for i in ids if raw_server.hits[i] > 1 and i not in gone)
    assert sorted(state(tmp_path, "done.txt")) == sorted(set(ids) - set(gone)), err
    bodies = {r["id"]: r["body"] for r in state(tmp_path, "results.jsonl")}  # an id's last line wins
    assert all(bodies[i] == {"id": i} for i in set(ids) - set(gone) - set(report["in_doubt"]))  # the rest named
    assert report["counts"]["done"] == 40 - len(gone) and report["per_pass"]["1"]["done"] == 40 - len(gone)
    assert asked and report["in_doubt"] == asked and report["out_of_step"] >= len(asked)  # stored results kept
    assert f"{len(asked)} ids in doubt, not answered again" in err and "--refresh" in err  # -q: a person must look
    assert read_metrics(tmp_path / "redrive.prom")[("redrive_in_doubt",)] == len(asked)


def test_class_bytes_that_come_between_answers_put_those_since_the_last_watch_in_doubt(raw_server):
    """A stray that comes while the connection is idle is seen when it is
    reused: the answers read on it since it was last watched are in doubt."""
    stray, sent = answer(200, b'{"id":"stray"}', [("Content-Type", "application/json")]), threading.Event()
    raw_server.replies["b"] = [lambda item, hit: ok_answer(item, hit) + [("sleep", 0.02), stray, ("set", sent)]]
    cfg = Config(Path("ids.txt"), Path("state"), request=redrive.Request(url=raw_server.template))
    watchdog = redrive.Watchdog()
    session = redrive.make_session(cfg, redrive.HostSettings(), watchdog)
    try:
        get = lambda item: redrive.fetch(session, item, cfg, redrive.Redactor(()), time.time)  # noqa: E731
        first = [get(f"a{n}") for n in range(2 * redrive.IN_STEP_CHECKS + 2)]  # past the host's first watches,
        # each on its connection's second answer (a watched connection is set aside: the next one opens anew)
        assert all(out.bucket is Bucket.OK and not out.doubted for out in first)
        assert json.loads(get("b").body) == {"id": "b"}
        assert sent.wait(10)  # the stray comes while the connection waits
        time.sleep(0.05)  # and is there when it is reused
        after = get("c")
        assert json.loads(after.body) == {"id": "c"} and ("b", True) in after.doubted
        assert "a0" not in [item for item, _ in after.doubted]
        assert [json.loads(get(i).body)["id"] for i in ("d", "e")] == ["d", "e"]
    finally:
        watchdog.close()
    assert raw_server.hits["b"] == 1


def test_class_require_finds_the_id_however_the_json_escapes_it(raw_server, tmp_path):
    ids = ["a/b", "café", 'q"t', "b\\s", "t\tab", "\U0001f600"]  # the last is a surrogate pair when escaped

    def escaped(item, hit):  # what PHP's json_encode and many others send
        body = json.dumps({"id": item}, ensure_ascii=True, separators=(",", ":")).replace("/", "\\/")
        return [answer(200, body.encode(), [("Content-Type", "application/json")])]
    raw_server.replies.update({i: [escaped] for i in ids + ["other"]})
    raw_server.replies["x"] = [lambda item, hit: escaped("not x", hit)]
    code, err, _ = crawl(raw_server, tmp_path, ids + ["x"], "--require", '"id":"{id}"', "--tries", "1", "--passes", "1")
    assert code == ExitCode.OK, err
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids)
    assert [r["id"] for r in state(tmp_path, "unavailable.jsonl")] == ["x"]  # another id's answer is still refused


@pytest.mark.parametrize("status", [403, 404, 400])
def test_class_a_row_of_alike_failures_after_successes_halts_any_run(server, tmp_path, status):
    first = [f"a{n}" for n in range(10)]
    assert crawl(server, tmp_path, first)[0] == ExitCode.OK  # the set-up worked once
    later = [f"b{n}" for n in range(60)]
    server.replies.update({item: [200] if n < 15 else [status] for n, item in enumerate(later)})  # the key revoked
    code, err, _ = crawl(server, tmp_path, first + later, "--concurrency", "2")
    assert code == ExitCode.FATAL and f"20 ids in a row answered {status}" in err and "after 15 answers" in err
    assert state(tmp_path, "unavailable.jsonl") == [] and state(tmp_path, "failed.jsonl") == []
    assert sorted(state(tmp_path, "done.txt")) == sorted(first + later[:15])
    assert json.loads((tmp_path / "ids.redrive" / "report.json").read_text())["stop"] == "misconfigured"
    server.replies.update({item: [200] for item in later})  # a new key: the same command finishes
    assert crawl(server, tmp_path, first + later)[0] == ExitCode.OK and len(state(tmp_path, "done.txt")) == 70


def test_local_fault_a_dead_proxy_is_named_not_the_api(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("http_proxy", f"http://user:s3cret@127.0.0.1:{port}")
    ids = write_ids(tmp_path, [f"p{n}" for n in range(6)])
    code, err, _ = run_cli([ids, "--url", "http://api.example.test/items/{id}", "--tries", "1", "--passes", "1"])
    assert code == ExitCode.UNREACHABLE and f"the proxy 127.0.0.1:{port} is unreachable" in err, err
    assert "s3cret" not in err and "api.example.test is unreachable" not in err
    assert state(tmp_path, "unavailable.jsonl") == [] and state(tmp_path, "failed.jsonl") == []


@pytest.mark.parametrize("hang", [("sleep", 30, 200), ("drip", 1000, 0.5)], ids=["no answer", "a body that drips"])
def test_class_a_host_that_answers_others_is_not_silent_and_a_block_of_hanging_ids_spends_its_tries(server, tmp_path,
                                                                                                   hang):
    ids = [f"h{n}" for n in range(30)]
    stuck = set(ids[2:10])  # a block of 8 in a row: every worker waits on them at once, for 4 timeouts
    server.replies.update({item: [hang] for item in stuck})
    code, err, _ = crawl(server, tmp_path, ids, "--concurrency", "2", "--timeout", "1", "--tries", "1",
                         "--passes", "1", fake=FastForward())
    assert code == ExitCode.OK, err  # not "unreachable": the host answered every other id at once
    assert sorted(state(tmp_path, "done.txt")) == sorted(set(ids) - stuck)
    assert {r["id"] for r in state(tmp_path, "unavailable.jsonl")} == stuck


def test_class_userinfo_is_sent_as_requests_sends_it(server, tmp_path):
    host = urlsplit(server.base).netloc
    ids = write_ids(tmp_path, ["a"])
    code, err, _ = run_cli([ids, "--url", f"http://robot:{SECRET}@{host}/items/{{id}}"])
    assert code == ExitCode.OK, err
    basic = base64.b64encode(f"robot:{SECRET}".encode()).decode()
    assert server.seen_headers[-1].get("Authorization") == f"Basic {basic}"
    assert SECRET not in all_output(tmp_path) and basic not in all_output(tmp_path)


@pytest.mark.parametrize("echo", [
    lambda key: json.dumps({"error": f"bad key {key}/x"}),  # JSON escapes its '/'
    lambda key: quote(key, safe=""),
    lambda key: html.escape(key),
    lambda key: key.upper(),
    lambda key: f"key {key[:6]}...{key[-6:]} and {key[::-1]}",  # cut, reversed: no known form
], ids=["JSON-escaped", "percent-encoded", "HTML-escaped", "upper-cased", "cut and reversed"])
def test_class_a_fatal_answer_echoing_the_key_in_any_form_never_shows_it(server, tmp_path, echo):
    key = "Ab/cd&ef<gh\\\"ij-" + "9f8e7d6c5b4a39281706"
    server.replies["a"] = [(401, echo(key).encode(), {"Content-Type": "text/plain"})]
    ids = write_ids(tmp_path, ["a"])
    code, err, _ = run_cli([ids, "--url", server.template, "-H", "Authorization: Bearer ${K}"], environ={"K": key})
    assert code == ExitCode.FATAL
    for form in (key, json.dumps(key)[1:-1], quote(key, safe=""), html.escape(key), key.upper(), key[::-1],
                 "9f8e7d6c5b4a39281706"):
        assert form not in err and form not in all_output(tmp_path)


def test_public_query_values_are_kept_and_a_plain_rerun_reuses_them(server, tmp_path):
    ids = write_ids(tmp_path, ["a", "b"])
    url = server.template + "?lang=english&appid=" + SECRET
    code, err, _ = run_cli([ids, "--url", url, "--public", "lang"])
    assert code == ExitCode.OK, err
    assert latest(tmp_path)["a"]["url"].endswith("/items/a?lang=english&appid=REDACTED")
    code, err, _ = run_cli([ids])  # the appid is no public value: asked for again
    assert code == ExitCode.USAGE and "give --url again" in err
    (tmp_path / "two").mkdir()
    ids2 = write_ids(tmp_path / "two", ["c"])
    code, err, _ = run_cli([ids2, "--url", server.template + "?lang=english", "--public", "lang"])
    code, err, _ = run_cli([ids2])
    assert code == ExitCode.OK and server.paths[-1] == "/items/c?lang=english", err


def test_a_state_dir_from_an_earlier_release_keeping_its_url_verbatim_still_resumes_plainly(server, tmp_path):
    ids = write_ids(tmp_path, ["a", "b"])
    url = server.template + "?lang=english"
    assert run_cli([ids, "--url", url, "--public", "lang"])[0] == ExitCode.OK
    run_json = tmp_path / "ids.redrive" / "run.json"
    record = json.loads(run_json.read_text())
    del record["shape"]["public"]  # as the release before --public and hidden values wrote it
    record["hash"] = redrive.shape_hash(record["shape"])
    run_json.write_text(json.dumps(record))
    with open(ids, "a") as fh:
        fh.write("c\n")
    code, err, _ = run_cli([ids])
    assert code == ExitCode.OK and server.paths[-1] == "/items/c?lang=english", err
    assert json.loads(run_json.read_text())["shape"] == record["shape"]  # nothing it kept was rewritten


def test_class_a_refresh_that_fails_again_and_again_leaves_one_line_per_id_in_every_ledger(server, tmp_path):
    ids = ["k", "j", "ok"]
    fake = FakeTime()
    assert crawl(server, tmp_path, ids, fake=fake)[0] == ExitCode.OK
    server.replies.update({"k": [500], "j": [503]})  # a 5xx and a throttle: each refresh fails them again
    for night in range(3):
        fake.now += 86400
        code, err, _ = crawl(server, tmp_path, ids, "--refresh", "--tries", "1", "--cooldown", "0", fake=fake)
        assert code == ExitCode.OK, err
    failed = state(tmp_path, "failed.jsonl")
    assert sorted(f["id"] for f in failed if f["id"] in ids) == ["j", "k"]
    assert sorted(state(tmp_path, "done.txt")) == sorted(ids)


@pytest.mark.parametrize("change", [["--url", "{base}/v2/items/{{id}}"], ["-H", "X-Org: ${{ORG}}"]],
                         ids=["a changed --url", "a -H given on a rerun"])
def test_dry_run_answers_as_the_run_would_a_changed_request_is_exit_2_with_the_same_message(server, tmp_path,
                                                                                             change):
    ids = write_ids(tmp_path, ["a", "b"])
    assert run_cli([ids, "--url", server.template])[0] == ExitCode.OK
    argv = [ids, *(part.format(base=server.base) for part in change)]
    run_json = (tmp_path / "ids.redrive" / "run.json").read_bytes()
    dry, dry_err, _ = run_cli([*argv, "--dry-run"], environ={"ORG": "7"})
    real, real_err, _ = run_cli(argv, environ={"ORG": "7"})
    assert dry == real == ExitCode.USAGE
    assert dry_err.strip().splitlines()[-1] == real_err.strip().splitlines()[-1]
    assert (tmp_path / "ids.redrive" / "run.json").read_bytes() == run_json


def test_export_says_when_each_result_was_last_confirmed_and_gone_lists_what_went_away(server, tmp_path):
    server.versions["a"] = ('"a1"', version("a", 1))
    server.replies.update({"never": [404], "b": [200, (404, b"", {})]})
    ids = write_ids(tmp_path, ["never", "a", "b", "c"])
    fake = FakeTime()
    assert run_cli([ids, "--url", server.template], fake=fake)[0] == ExitCode.OK
    fake.now += 86400  # the next night: a answers 304, b is gone, c unchanged (no validator: a new 200)
    code, err, _ = run_cli([ids, "--refresh"], fake=fake)
    assert code == ExitCode.OK, err
    out = io.StringIO()
    assert redrive.main([str(ids), "--export", "jsonl"], out=out, err=io.StringIO(), environ={}) == ExitCode.OK
    rows = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert sorted(rows) == ["a", "c"]
    assert rows["a"]["fetched_at"] == redrive.iso(FakeTime().wallclock())  # the body is the first night's
    assert rows["a"]["confirmed_at"] == redrive.iso(fake.wallclock())  # the 304 said it is still current
    out = io.StringIO()
    assert redrive.main([str(ids), "--export", "csv", "--fields", "id,confirmed_at"], out=out, err=io.StringIO(),
                        environ={}) == ExitCode.OK
    assert out.getvalue().splitlines()[1] == f"a,{redrive.iso(fake.wallclock())}"
    out = io.StringIO()
    assert redrive.main([str(ids), "--export", "gone"], out=out, err=io.StringIO(), environ={}) == ExitCode.OK
    gone = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(g["id"], g["status"]) for g in gone] == [("never", 404), ("b", 404)]  # input order
    assert all(g["reason"] and g["at"] and g["action"] for g in gone)


# ------------------------------------------------------------ docs that run


def doc_blocks(name, lang):
    """The fenced blocks of a doc in one language, in order."""
    text = (HERE / name).read_text(encoding="utf-8")
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def localize(text, tmp, server):
    """A doc's block with only its host, paths and key replaced: the API is
    the test's server, /srv/sync (or /shared/sync, /app) the tmp dir, the
    venv's python this one."""
    text = re.sub(r"(?<![\w.])(?:/srv/sync/)?\.venv/bin/python", lambda _: sys.executable, text)
    text = re.sub(r"(?<![\w.-])(?:/srv/sync/)?redrive\.py", lambda _: str(HERE / "redrive.py"), text)
    text = text.replace("https://api.example.com/v2/products/{id}", server.template)
    for root in ("/srv/sync", "/shared/sync", "/shared/keys", "/keys", "/state"):
        local = str(tmp / root.strip("/").replace("/", "-"))
        text = re.sub(rf"(?<![\w.-]){re.escape(root)}\b", lambda _: local, text)
    return text


def catalogue(server, items):
    """The server as a product API: item -> price, or None for a deleted one, with ETags (a 304 when unchanged)."""
    for item, price in items.items():
        if price is None:
            server.versions.pop(item, None)
            server.replies[item] = [404]
        else:
            server.replies.pop(item, None)
            server.versions[item] = (f'"{price}"', json.dumps({"id": item, "price": price}).encode())


def test_the_nightly_sync_script_and_cron_line_run_as_written_night_after_night(server, tmp_path):
    [script] = doc_blocks("docs/nightly-sync.md", "sh")
    [cron] = doc_blocks("docs/nightly-sync.md", "cron")
    home = tmp_path / "srv-sync"
    home.mkdir()
    (home / "key").write_text(SECRET)
    (home / "nightly.sh").write_text(localize(script, tmp_path, server))
    (home / "nightly.sh").chmod(0o755)
    command = localize(cron.splitlines()[-1].split(None, 5)[5], tmp_path, server)
    night = {f"p{n}": 10 + n for n in range(12)}
    catalogue(server, night)
    (home / "products.txt").write_text("".join(f"{item}\n" for item in night))
    first = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    live = {r["id"]: r["body"]["price"] for r in map(json.loads, (home / "out" / "products.jsonl").open())}
    assert live == night and (home / "out" / "gone.jsonl").read_text() == ""
    # the next night: p0 and p1 changed, p2 deleted, p12 new; every done id is due again
    run_json = home / "products.redrive" / "results.jsonl"
    lines = run_json.read_text().replace(redrive.iso(time.time())[:10], "2000-01-01")  # fetched long ago
    run_json.write_text(lines)
    changed = {**night, "p0": 99, "p1": 98, "p2": None, "p12": 50}
    catalogue(server, changed)
    with open(home / "products.txt", "a") as fh:
        fh.write("p12\n")
    second = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "p2" in second.stderr and "removed upstream" in second.stderr and SECRET not in second.stderr
    live = {r["id"]: r["body"]["price"] for r in map(json.loads, (home / "out" / "products.jsonl").open())}
    assert live == {k: v for k, v in changed.items() if v is not None}
    assert [json.loads(line)["id"] for line in (home / "out" / "gone.jsonl").open()] == ["p2"]
    assert SECRET not in all_output(home / "products.redrive") + all_output(home / "out")


def systemd_units(tmp_path, server):
    units = {}
    for block in doc_blocks("docs/nightly-sync.md", "ini"):
        name = "redrive-sync.timer" if "[Timer]" in block else "redrive-sync.service"
        units[name] = tmp_path / name
        units[name].write_text(localize(block, tmp_path, server))
    return units


def test_the_systemd_units_verify_and_their_exec_start_runs_with_the_key_kept_out_of_the_command_line(server,
                                                                                                     tmp_path):
    home = tmp_path / "srv-sync"
    home.mkdir()
    (home / "key.env").write_text(f"API_KEY={SECRET}\n")
    (home / "products.txt").write_text("a\nb\n")
    units = systemd_units(tmp_path, server)
    assert sorted(units) == ["redrive-sync.service", "redrive-sync.timer"]
    service = units["redrive-sync.service"].read_text()
    if shutil.which("systemd-analyze"):
        done = subprocess.run(["systemd-analyze", "verify", *map(str, units.values())], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    exec_start = re.search(r"^ExecStart=(.*)$", service, re.M).group(1)
    assert "$${API_KEY}" in exec_start  # systemd would expand ${API_KEY} itself, onto the command line
    argv = [arg.replace("$$", "$") for arg in shlex.split(exec_start)]  # what systemd passes, unexpanded
    assert SECRET not in " ".join(argv)
    env = dict(line.split("=", 1) for line in (home / "key.env").read_text().splitlines())
    done = subprocess.run(argv, cwd=home, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted((home / "products.redrive" / "done.txt").read_text().split()) == ["a", "b"]
    assert server.seen_headers[-1]["Authorization"] == f"Bearer {SECRET}"
    assert re.search(r"^SuccessExitStatus=1$", service, re.M)


def test_the_kubernetes_indexed_job_parses_validates_and_its_command_runs_as_written(server, tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML (with kubernetes-validate, requirements-dev.txt) is not installed")
    [manifest] = doc_blocks("docs/across-machines.md", "yaml")
    job = yaml.safe_load(manifest)
    validate = pytest.importorskip("kubernetes_validate")
    validate.validate(job, "1.33", strict=True)  # the Kubernetes schema, offline: what kubectl apply checks
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"  # podFailurePolicy needs Never
    [rule] = spec["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailIndex" and rule["onExitCodes"] == {"operator": "In", "values": [3]}
    assert spec["backoffLimitPerIndex"] >= 1  # 1, 69, 75: the index runs again and resumes
    [container] = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["state"].get("subPathExpr") == "$(JOB_COMPLETION_INDEX)"  # each index its own state dir
    assert {v["name"] for v in pod["volumes"]} == set(mounts) and mounts["keys"]["readOnly"]
    [command] = container["args"]
    assert container["command"] == ["sh", "-c"] and "--shard auto/3" in command
    ids = [f"k{n}" for n in range(30)]
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
    (tmp_path / "keys").mkdir()
    for index in range(3):
        (tmp_path / "keys" / f"key-{index}").write_text(f"key-of-{index}")
        state = tmp_path / "state" / str(index)  # the volume's subPathExpr
        state.mkdir(parents=True)
        script = localize(command, tmp_path, server).replace(str(tmp_path / "state"), str(state))
        done = subprocess.run(["sh", "-c", script], cwd=tmp_path / "app", capture_output=True, text=True,
                              env={**os.environ, "JOB_COMPLETION_INDEX": str(index)}, timeout=60)
        assert done.returncode == 0, done.stderr
    dirs = [str(tmp_path / "state" / str(index) / "shard") for index in range(3)]
    code, err, _ = run_cli([tmp_path / "app" / "ids.txt", "--cover", *dirs])
    assert code == ExitCode.OK, err
    assert {h.get("Authorization") for h in server.seen_headers} == {f"Bearer key-of-{i}" for i in range(3)}


def test_the_slurm_array_script_runs_as_written(server, tmp_path):
    [script] = [b for b in doc_blocks("docs/across-machines.md", "sh") if "#SBATCH" in b]
    home, keys = tmp_path / "shared-sync", tmp_path / "shared-keys"
    home.mkdir()
    keys.mkdir()
    ids = [f"s{n}" for n in range(30)]
    (home / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
    for task in (1, 2, 3):
        (keys / f"key-{task}").write_text(f"key-of-{task}")
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": "1",
               "SLURM_ARRAY_TASK_MAX": "3", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_JOB_ID": "77"}
        done = subprocess.run(["bash", "-c", localize(script, tmp_path, server)], capture_output=True, text=True,
                              env=env, timeout=60)
        assert done.returncode == 0, done.stderr
    code, err, _ = run_cli([home / "ids.txt", "--cover", *(str(home / f"state-{t}") for t in (1, 2, 3))])
    assert code == ExitCode.OK, err


def test_the_gnu_parallel_line_runs_every_night_and_the_cover_line_names_its_dirs(server, tmp_path):
    if not shutil.which("parallel"):
        pytest.skip("GNU parallel is not installed: the docs' parallel line cannot run here")
    [line] = [b for b in doc_blocks("docs/across-machines.md", "sh") if b.startswith("parallel ")]
    home = tmp_path / "srv-sync"
    home.mkdir()
    (home / "key").write_text(SECRET)
    ids = [f"g{n}" for n in range(30)]
    (home / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
    for night in ("2026-12-04", "2026-12-05"):  # the job log is the night's
        script = localize(line, tmp_path, server).replace("host1,host2,host3", ":").replace("$(date +%F)", night)
        sent = sum(server.hits.values())
        done = subprocess.run(["bash", "-c", script], cwd=home, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr + done.stdout
        assert sum(server.hits.values()) > sent  # night 2 runs too: its new ids are fetched
        with open(home / "ids.txt", "a") as fh:
            fh.write("".join(f"new-{night}-{n}\n" for n in range(6)))
    text = (HERE / "docs" / "across-machines.md").read_text()
    cover = re.search(r"`(\.venv/bin/python redrive\.py ids\.txt --cover [^`]*)`", text).group(1)
    with open(home / "ids.txt", "w") as fh:  # the list as the second night ran it
        fh.write("".join(f"{i}\n" for i in ids + [f"new-2026-12-04-{n}" for n in range(6)]))
    done = subprocess.run(["bash", "-c", localize(cover, tmp_path, server)], cwd=home, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def read_metrics(path):
    """The metrics file read by prometheus_client's own parser: {(name, labels...): value}."""
    parser = pytest.importorskip("prometheus_client.parser")
    text = path.read_text()
    assert text.endswith("\n") and "\n\n" not in text
    found = {}
    for family in parser.text_string_to_metric_families(text):
        assert family.type == "gauge" and family.documentation
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("state_dir").endswith("ids.redrive")
            found[(sample.name, *sorted(labels.values()))] = sample.value
    return found


def test_metrics_file_says_what_the_run_did_in_the_prometheus_text_format_at_every_exit(server, tmp_path):
    metrics = tmp_path / "redrive.prom"
    server.replies.update({"gone": [404], "busy": [429, 200], "bad": [401]})
    fake = FakeTime()
    reset = int(fake.wallclock()) + 600
    server.replies["a"] = [(200, b'{"id":"a"}', {"Content-Type": "application/json", "X-RateLimit-Limit": "100",
                                                 "X-RateLimit-Remaining": "97", "X-RateLimit-Reset": str(reset)})]
    code, err, _ = crawl(server, tmp_path, ["a", "gone", "busy", "b"], "--metrics-file", str(metrics), fake=fake)
    assert code == ExitCode.OK, err
    m = read_metrics(metrics)
    assert m[("redrive_exit_code",)] == 0 and m[("redrive_last_success_timestamp_seconds",)] == fake.wallclock()
    assert m[("redrive_ids", "done")] == 3 and m[("redrive_ids", "unavailable")] == 1
    assert m[("redrive_ids", "failed")] == m[("redrive_ids", "pending")] == 0
    assert m[("redrive_requests", "2xx")] == 3 and m[("redrive_requests", "4xx")] == 2
    assert m[("redrive_refusals",)] == 1 and m[("redrive_quota_remaining",)] == 97 and m[("redrive_in_doubt",)] == 0
    assert m[("redrive_quota_reset_timestamp_seconds",)] == reset
    success = m[("redrive_last_success_timestamp_seconds",)]
    fake.now += 3600
    code, err, _ = crawl(server, tmp_path, ["a", "gone", "busy", "b", "bad"], "--metrics-file", str(metrics),
                         fake=fake)
    assert code == ExitCode.FATAL
    m = read_metrics(metrics)
    assert m[("redrive_exit_code",)] == 3 and m[("redrive_last_success_timestamp_seconds",)] == success  # kept
    assert m[("redrive_ids", "pending")] == 1
    with redrive.RunLock(tmp_path / "ids.redrive", time.time):  # another run holds the state dir: exit 75
        code, err, _ = crawl(server, tmp_path, ["a"], "--metrics-file", str(metrics))
    assert code == ExitCode.LOCKED
    assert read_metrics(metrics) == {("redrive_exit_code",): 75, ("redrive_last_success_timestamp_seconds",): success}
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, err, _ = crawl(server, tmp_path, ["a"], "--metrics-file", str(fifo))
    assert code == ExitCode.USAGE and "--metrics-file" in err and "not a regular file" in err


def test_the_readmes_real_use_block_and_cron_line_run_as_written(server, tmp_path):
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    real = readme.split("## Real use", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    [cron] = doc_blocks("README.md", "cron")
    (tmp_path / "products.txt").write_text("a\nb\n")
    script = localize(real.replace("export API_KEY=...", f"export API_KEY={SECRET}"), tmp_path, server)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert server.seen_headers[-1]["Authorization"] == f"Bearer {SECRET}"
    with open(tmp_path / "products.txt", "a") as fh:
        fh.write("c\n")
    plain = localize(".venv/bin/python redrive.py products.txt", tmp_path, server)  # "plain ... resumes"
    done = subprocess.run(["bash", "-c", plain], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "API_KEY": SECRET})
    assert done.returncode == 0 and server.paths[-1] == "/items/c", done.stderr
    home = tmp_path / "srv-sync"
    home.mkdir()
    (home / "key").write_text(SECRET)
    (home / "products.txt").write_text("d\ne\n")
    command = localize(cron.split(None, 5)[5], tmp_path, server)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == done.stderr == "", done.stderr  # -q: nothing to mail
    assert sorted((home / "products.redrive" / "done.txt").read_text().split()) == ["d", "e"]


def test_the_benchmark_commands_in_the_docs_are_ones_the_bench_takes():
    bench = importlib.import_module("bench_redrive")
    lines = []
    for block in doc_blocks("docs/benchmarks.md", "sh"):
        lines += [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    commands = [part.strip() for line in lines for part in line.split("&&") if "bench_redrive.py" in part]
    assert len(commands) >= 6
    for command in commands:
        argv = shlex.split(command)
        bench.build_parser().parse_args(argv[argv.index("bench_redrive.py") + 1:])  # exits 2 on a wrong name
    revisions = set(re.findall(r"git show ([0-9a-f]{7,}\S*):redrive\.py", "\n".join(lines)))  # REV: a placeholder
    if (HERE / ".git").exists() and shutil.which("git"):
        for rev in revisions:
            assert subprocess.run(["git", "-C", str(HERE), "cat-file", "-e", f"{rev}:redrive.py"]).returncode == 0


class Burst(Window):
    """A declared hourly window (GitHub's headers) that another client on the key spends `burst`
    of at once, at `at` seconds, and then no more."""

    def __init__(self, size, seconds, burst, at):
        super().__init__(size, seconds, False, "github")
        self.burst, self.at, self.spent = burst, at, False

    def __call__(self, item, n, now):
        if now >= self.at and not self.spent:
            self.spent, self.used = True, self.used + self.burst
        return super().__call__(item, n, now)


def test_class_one_burst_of_another_client_on_the_key_is_not_taken_for_its_steady_rate():
    limit = Burst(5000, 3600, 2000, at=0.1)  # 40 % of the hour's quota gone at once, early
    run = drive(limit, 400, until=3600)
    assert len(run["ended"]) == 400 and {b for _, b, _ in run["ended"].values()} == {Bucket.OK}
    assert run["refused"] == 0
    assert run["end"] < 60  # 400 ids of the 3,000 left: paced over seconds, not stopped until the reset


class Shared(Window):
    """A declared window that another client on the key spends as fast as the run does: one request of its own
    for each of the run's, so the count falls by two per answer and the run's share is half."""

    def ideal(self, n):
        return (math.ceil(n / (self.size // 2)) - 1) * self.seconds

    def __call__(self, item, n, now):
        window = int(now // self.seconds)
        if window != self.window:
            self.window, self.used = window, 0
        self.used = min(self.size, self.used + 1)  # the other client's, as the run's reaches the server
        return super().__call__(item, n, now)


@pytest.mark.parametrize("dialect", ["github", "ietf"])
def test_class_a_key_another_client_spends_as_fast_is_shared_from_each_windows_first_answer(dialect):
    # a window's first answers show no fall yet: the share the last window showed is where the new one starts, or
    # a run whose ids left fit in what the count says is left sends them at once and spends the other client's half
    limit = Shared(60, 2, retry_after=False, dialect=dialect)
    for count in (100, 160):  # the last window asked for 40 ids, 30 its share: more than half of the 60
        run = drive(limit, count)
        assert len(run["ended"]) == count and {b for _, b, _ in run["ended"].values()} == {Bucket.OK}
        assert run["refused"] == 0, (count, run["refusals"])
        assert run["end"] <= 1.10 * limit.ideal(count) + 0.1, count


class Liar:
    """A quota that says 5 a minute, with none left after 5 and a reset always a minute ahead, on a
    server that takes everything: the declaration is not what limits it."""

    def __call__(self, item, n, now):
        return 200, declared_headers("github", 5, max(0, 4 - item), 60, WALL + now + 60), b'{"ok":1}'


def test_class_a_declared_quota_the_answers_contradict_is_not_believed():
    run = drive(Liar(), 500, until=600)
    assert len(run["ended"]) == 500 and run["refused"] == 0
    assert run["end"] < 120  # not 1 request a minute: 500 ids would take 8 hours


@pytest.mark.parametrize("rate, count, later", [(2, 245, 4), (50, 6005, 12)])
def test_class_a_cut_that_found_the_limit_is_kept_though_its_sample_began_over_it(rate, count, later):
    # a sample of the background can begin before the cut that finds a bucket's rate (the first cut read its burst
    # as pace); relief shows after the last cut, so the refusals before it do not make the host be met anew
    limit = Leaky(rate, 5)
    run = drive(limit, count)
    assert len(run["ended"]) == count and run["failed"] == 0
    assert run["end"] <= 1.10 * limit.ideal(count)
    after = [sent for sent in run["refusals"] if sent > 10.0]  # the first seconds are the search's
    assert len(after) <= later, after


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("size, seconds, count", [(20, 10, 245), (40, 5, 965)])
def test_class_a_lone_cut_late_in_a_sample_is_judged_on_the_answers_after_it(size, seconds, count, order):
    # a sliding log is found by a search, then its curve climbs over the limit and one cut comes late in the search's
    # sample: the refusals before that cut were the climb to it, so they alone do not make the host be met anew
    # (met anew, slow start sends its whole limit at once, and all of it is refused)
    limit = SlidingLog(size, seconds)
    run = drive(limit, count, order=order)
    assert len(run["ended"]) == count and run["failed"] == 0
    later = sorted(sent for sent in run["refusals"] if sent > 15.0)  # the first seconds are the search's
    at_once = max((sum(1 for other in later if sent <= other < sent + 0.1) for sent in later), default=0)
    assert at_once <= 2 and len(later) <= 30, later  # the code before, at one instant: 11 and 23 at once
    assert run["end"] <= 1.15 * limit.ideal(count)


class Overloaded:
    """A host that takes one request in `every`, whichever id it is for, and refuses the rest with `status` and
    `headers`: its refusals are everyone's, though no id is refused twice in a row by the count alone."""

    def __init__(self, every, status=429, headers=()):
        self.every, self.status, self.headers, self.count = every, status, dict(headers), 0

    def __call__(self, item, n, now):
        self.count += 1
        if self.count % self.every == 1 or self.every == 1:
            return 200, {}, b'{"ok":1}'
        return self.status, dict(self.headers), b""


@pytest.mark.parametrize("every, status, headers, cap", [
    (10, 429, {"Retry-After": "0"}, 4),  # paced to a request every ten seconds, one id at a time
    (2, 503, {}, 4),  # ids refused in turn: each one's repeats are no fresh sign
    (2, 429, {}, 1),
])
def test_class_a_host_refusing_most_requests_fails_no_id_with_its_refusals(every, status, headers, cap):
    # an id's repeated refusal is no fresh sign of the host's: asked again and again with no other id asked in
    # between, it spent its every try before the host's refusals could be told from its own
    run = drive(Overloaded(every, status, headers), 20, until=600, cap=cap)
    assert run["failed"] == 0, run["failed"]
    assert run["ended"] and {bucket for _, bucket, _ in run["ended"].values()} == {Bucket.OK}


def test_class_ids_refused_for_themselves_keep_their_last_try_for_tries_more_at_most():
    # many ids refused for ever, each asked again and again, make the host's refused share high, as a host
    # refusing everyone does: their last tries are kept, but for --tries refusals more at most
    bad = {1, 3, 5, 7, 9, 11, 13, 15}
    asks = Counter()

    def serve(item, n, now):
        asks[item] += 1
        return (429, {}, b"") if item in bad else (200, {}, b'{"ok":1}')

    run = drive(serve, 20, cap=4, passes=1)
    assert {i for i, (_, bucket, _) in run["ended"].items() if bucket is Bucket.OK} == set(range(20)) - bad
    assert {i for i, (_, bucket, _) in run["ended"].items() if bucket is not Bucket.OK} == bad
    assert all(5 <= asks[i] <= 2 * 5 for i in bad), sorted(asks[i] for i in bad)


@pytest.mark.parametrize("order", [None, 1], ids=["answers at one instant", "answers in order"])
@pytest.mark.parametrize("share, status, cap, count", [(10, 503, 4, 200), (5, 429, 4, 200), (15, 503, 8, 400)])
def test_class_ids_refused_for_ever_while_the_host_takes_the_rest_end_unavailable_with_their_status(share, status,
                                                                                                  cap, count, order):
    # a shard of ids down (its ids refused for ever with the host's refusal), the rest taken: other ids are refused
    # too, so "refused alone" never held, the last ids left were all refused, and the host seemed to refuse
    # everything: the run ended with them pending, and every rerun did the same. A host refuses an id it refused
    # before no more often than one it never asked, so an id refused in a row more than that is refused for itself
    def serve(item, n, now):
        return (status, {}, b"") if item * 37 % 100 < share else (200, {}, b'{"ok":1}')

    bad = {i for i in range(count) if i * 37 % 100 < share}
    run = drive(serve, count, cap=cap, until=900, order=order)
    assert len(run["ended"]) == count, f"{count - len(run['ended'])} pending"  # the code before: 20, 10, 44
    assert {i for i, (_, bucket, _) in run["ended"].items() if bucket is not Bucket.OK} == bad
    assert {s for i, (_, _, s) in run["ended"].items() if i in bad} == {status}
    assert run["clock"] < 300  # its tries and the second pass, no search spelled out over minutes


# ------------------------------------------------- the state's index at scale
#
# The class: done.index is derived from the ids file and done.txt, so any
# change to either (where, how big, how the bytes are spelled), and any kill
# while it is written, must leave a run asking exactly the ids the ledgers say
# are left: never a done id again, never a new id skipped.


def ids_text(ids, end="\n"):
    return "".join(f"{i}{end}" for i in ids)


def asked_ids(server):
    return [unquote(path.split("?")[0].split("/items/")[-1]) for path in server.paths]


LONG = "x" * 200  #: two ids that differ only in a byte late in the line


@pytest.mark.parametrize("before, after, asked", [
    (ids_text(["a", "b", "c"]), ids_text(["a", "b", "c", "d", "e"]), ["d", "e"]),  # appended
    (ids_text(["a", "b", "c", "d"]), ids_text(["a", "n1", "d", "n2"]), ["n1", "n2"]),  # edited in the middle
    (ids_text(["aa", "bb", "cc"]), ids_text(["aa", "zz", "cc"]), ["zz"]),  # in place, the same size
    ("a\nb\nc", "a\nb\ncd\n", ["cd"]),  # a last line with no LF, grown
    (ids_text([LONG + "1", "b"]), ids_text([LONG + "1", "b", LONG + "2"]), [LONG + "2"]),  # a late byte
    (ids_text(["a", "b"]), "\ufeff" + ids_text(["a", "b", "c"], "\r\n"), ["c"]),  # the same ids, new bytes
    (ids_text(["a", "b"]), ids_text(["a", "b", "a", "  b ", "c", "c"]), ["c"]),  # repeats of old and new ids
    (ids_text(["a", "b", "c"]), ids_text(["c", "b", "a"]), []),  # reordered
], ids=["appended", "middle", "in place same size", "grown last line", "late byte", "BOM and CRLF",
        "repeats", "reordered"])
def test_class_the_index_follows_every_change_to_the_ids_file(server, tmp_path, before, after, asked):
    ids_file = tmp_path / "ids.txt"
    ids_file.write_bytes(before.encode("utf-8"))
    argv = [ids_file, "--url", server.template, "--concurrency", "1"]
    assert run_cli(argv)[0] == ExitCode.OK
    first = asked_ids(server)
    assert (tmp_path / "ids.redrive" / "done.index").is_file()
    server.paths.clear()
    ids_file.write_bytes(after.encode("utf-8"))
    code, err, _ = run_cli(argv)
    assert code == ExitCode.OK, err
    assert asked_ids(server) == asked  # the new ids, in file order, and nothing done before
    assert len(first) == len(set(first))
    out = io.StringIO()
    assert redrive.main([str(ids_file), "--export", "jsonl"], out=out) == ExitCode.OK
    assert [json.loads(line)["id"] for line in out.getvalue().splitlines()] == \
        list(dict.fromkeys(i.strip() for i in after.lstrip("\ufeff").split()))  # every id, in file order


def test_class_the_index_follows_every_change_to_done_txt(server, tmp_path):
    """done.txt moved away, cut short, or written by another tool: the index is
    no truth of its own, and a run asks what done.txt no longer lists."""
    ids = [f"d{n}" for n in range(6)]
    argv = [write_ids(tmp_path, ids), "--url", server.template, "--concurrency", "1"]
    sdir = tmp_path / "ids.redrive"
    assert run_cli(argv)[0] == ExitCode.OK
    done = (sdir / "done.txt").read_text()
    (sdir / "done.txt").write_text(done.replace("d2\n", "").replace("d4\n", ""))  # two ids taken out
    server.paths.clear()
    assert run_cli(argv)[0] == ExitCode.OK and asked_ids(server) == ["d2", "d4"]
    (sdir / "done.txt").unlink()  # moved away with the results: every id again
    (sdir / "results.jsonl").unlink()
    server.paths.clear()
    assert run_cli(argv)[0] == ExitCode.OK and asked_ids(server) == ids
    with open(sdir / "done.txt", "w") as fh:  # the same size, other ids (not listed): an edit in place
        fh.write(ids_text([f"e{n}" for n in range(5)] + ["d5"]))
    server.paths.clear()
    assert run_cli(argv)[0] == ExitCode.OK and asked_ids(server) == ids[:5]


@pytest.mark.parametrize("damage", ["torn", "garbage", "flag out of range", "scratch of a killed rebuild"])
def test_class_a_damaged_index_is_rebuilt_from_the_ledgers(server, tmp_path, damage):
    ids = [f"g{n}" for n in range(8)]
    argv = [write_ids(tmp_path, ids), "--url", server.template, "--concurrency", "1"]
    sdir = tmp_path / "ids.redrive"
    assert run_cli(argv, environ={})[0] == ExitCode.OK
    with open(write_ids(tmp_path, ids + ["g8", "g9"]), "a"):
        pass
    index = sdir / "done.index"
    data = index.read_bytes()
    if damage == "torn":
        index.write_bytes(data[:-3])
    elif damage == "garbage":
        index.write_bytes(b"\x00" * len(data))
    elif damage == "flag out of range":
        index.write_bytes(data[:-1] + b"\x07")
    else:
        scratch = sdir / ".index-killed"
        scratch.mkdir()
        (scratch / "lines.0").write_text("0\tg0\n")
    server.paths.clear()
    code, err, _ = run_cli(argv)
    assert code == ExitCode.OK, err
    assert asked_ids(server) == ["g8", "g9"]
    assert not list(sdir.glob(".index-*"))


def big_state(tmp_path, count, left):
    """An ids file of `count` long ids and a state dir whose done.txt lists all but the last `left`
    (as an earlier release leaves it: no done.index), big enough for a rebuild in parts."""
    ids_file = tmp_path / "ids.txt"
    ids = [f"item-{n:09d}-{'p' * 12}" for n in range(count)]
    ids_file.write_text(ids_text(ids))
    sdir = tmp_path / "ids.redrive"
    sdir.mkdir()
    (sdir / "done.txt").write_text(ids_text(ids[:-left]))
    (sdir / "results.jsonl").write_text("".join(
        f'{{"id":"{i}","url":"u","status":200,"fetched_at":"2026-12-01T00:00:00Z","body":{{}}}}\n'
        for i in ids[:-left]))
    assert ids_file.stat().st_size > 2 * redrive.INDEX_PART  # the rebuild splits it into parts on disk
    return ids_file, sdir, ids


def test_state_of_an_earlier_release_at_scale_is_indexed_in_parts_and_asks_only_what_is_left(server, tmp_path):
    ids_file, sdir, ids = big_state(tmp_path, 120_000, 7)
    argv = [ids_file, "--url", server.template, "--concurrency", "1"]
    code, err, _ = run_cli(argv)
    assert code == ExitCode.OK, err
    assert asked_ids(server) == ids[-7:]
    assert not list(sdir.glob(".index-*"))
    with open(ids_file, "a") as fh:  # the next night: ids appended, one a repeat of a done one
        fh.write(ids_text(["late-1", ids[5], "late-2"]))
    server.paths.clear()
    code, err, _ = run_cli(argv)
    assert code == ExitCode.OK and asked_ids(server) == ["late-1", "late-2"]
    assert json.loads((sdir / "report.json").read_text())["counts"]["duplicates"] == 1


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_a_run_stopped_while_it_builds_the_index_loses_nothing_and_leaves_no_scratch(server, tmp_path, how):
    ids_file, sdir, ids = big_state(tmp_path, 120_000, 5)
    cmd = redrive_cmd(ids_file, "--url", server.template, "--concurrency", "1")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: list(sdir.glob(".index-*")) or proc.poll() is not None, "no rebuild was seen", 60)
    proc.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
    proc.wait(timeout=30)
    err = proc.stderr.read()
    if how == "SIGTERM":  # caught while building (or, on a fast machine, just after): 143, one line
        assert proc.returncode in (ExitCode.TERMINATED, ExitCode.OK), err
        assert "Traceback" not in err and not list(sdir.glob(".index-*"))  # removed on the way out
    stopped = state(tmp_path, "done.txt")
    assert len(stopped) == len(set(stopped)) and stopped[:len(ids) - 5] == ids[:-5]  # nothing lost or rewritten
    code, err, _ = run_cli([ids_file, "--url", server.template, "--concurrency", "1"])
    assert code == ExitCode.OK, err
    listed = set(stopped)
    left = [i for i in ids if i not in listed]
    assert asked_ids(server)[len(asked_ids(server)) - len(left):] == left  # the rerun asks what is left, in order
    assert len(asked_ids(server)) == 5  # each id asked once, over both runs
    assert not list(sdir.glob(".index-*")) and sorted(state(tmp_path, "done.txt")) == sorted(ids)


def stop_at(instant, signum):
    """A profile hook that sends signum to this process once, at the first event for which instant(event,
    frame) is true, counting only from the run's stop handlers being installed to the batch's start."""
    armed, sent = [False], []

    def hook(frame, event, arg):
        name = frame.f_code.co_name
        if event == "return" and name == "__enter__" and isinstance(frame.f_locals.get("self"), redrive.StopSignals):
            armed[0] = True
        elif event == "call" and name == "run_passes":
            armed[0] = False
        elif armed[0] and not sent and instant(event, frame):
            sent.append(name)
            signal.raise_signal(signum)
    return hook, sent


def test_a_stop_signal_at_any_instant_before_the_first_request_exits_with_its_code_and_leaves_no_scratch(
        server, tmp_path):
    # where the stop lands does not matter: as a scratch dir is made, as one is removed, as the index is written,
    # or at any call along the way, the run exits with the signal's code and one line, and leaves nothing behind
    ids_file, sdir, ids = big_state(tmp_path, 90_000, 3)
    pristine = tmp_path / "pristine"
    shutil.copytree(sdir, pristine)
    argv = [ids_file, "--url", server.template, "--concurrency", "1"]
    calls = []  # every call the run makes before the batch, counted on a copy of the state
    hook, _ = stop_at(lambda event, frame: event == "call" and calls.append(1) and False, signal.SIGTERM)
    sys.setprofile(hook)
    try:
        run_cli(argv)
    finally:
        sys.setprofile(None)
    assert len(calls) > 1000
    named = [lambda e, f: e == "return" and f.f_code.co_name == "mkdtemp",  # made, its name not yet kept
             lambda e, f: e == "call" and f.f_code.co_name == "rmtree",  # while it is removed
             lambda e, f: e == "call" and f.f_code.co_name == "write_atomically"]  # as the index is written
    spread = [lambda e, f, n=len(calls) * j // 10: e == "call" and next(counter) == n for j in range(1, 10)]
    kinds = [(signal.SIGTERM, ExitCode.TERMINATED), (signal.SIGINT, ExitCode.INTERRUPTED),
             (signal.SIGHUP, ExitCode.HANGUP)]
    stopped_at = []
    for k, instant in enumerate(named + spread):
        shutil.rmtree(sdir)
        shutil.copytree(pristine, sdir)
        counter = itertools.count()
        signum, expected = kinds[k % len(kinds)]
        hook, sent = stop_at(instant, signum)
        server.paths.clear()
        sys.setprofile(hook)
        try:
            code, err, _ = run_cli(argv)
        finally:
            sys.setprofile(None)
        assert sent, k  # the signal was sent before the batch
        stopped_at.append(sent[0])
        assert code == expected and err.count("\n") == 1 and "before the first request" in err, (sent, err)
        assert server.paths == []  # nothing was sent
        assert not list(sdir.glob(".index-*")) and not list(Path(tempfile.gettempdir()).glob(f".index-{os.getpid()}-*"))
        assert (sdir / "done.txt").read_bytes() == (pristine / "done.txt").read_bytes()  # no line lost or rewritten
    assert stopped_at[:3] == ["mkdtemp", "rmtree", "write_atomically"]
    code, err, _ = run_cli(argv)  # the same command afterwards asks what is left, once each
    assert code == ExitCode.OK and asked_ids(server) == ids[-3:], err


def test_a_refresh_stopped_as_its_join_makes_its_scratch_dir_leaves_none_and_sends_nothing(server, tmp_path):
    # the neighbour of a stop in the rebuild: the refresh's join on disk makes a scratch dir of its own, later
    ids_file, sdir, ids = big_state(tmp_path, 90_000, 3)
    made = []
    hook, sent = stop_at(lambda e, f: e == "return" and f.f_code.co_name == "mkdtemp" and made.append(1) is None
                         and len(made) == 2, signal.SIGTERM)
    done_before = (sdir / "done.txt").read_bytes()
    sys.setprofile(hook)
    try:
        code, err, _ = run_cli([ids_file, "--url", server.template, "--concurrency", "1", "--refresh"])
    finally:
        sys.setprofile(None)
    assert sent == ["mkdtemp"] and code == ExitCode.TERMINATED and err.count("\n") == 1, err
    assert server.paths == [] and (sdir / "done.txt").read_bytes() == done_before
    assert not list(sdir.glob(".index-*")) and not list(Path(tempfile.gettempdir()).glob(f".index-{os.getpid()}-*"))


@pytest.mark.parametrize("reader", [["--check"], ["--export", "jsonl"], ["--dry-run"]])
def test_a_reader_stopped_as_it_makes_its_scratch_dir_exits_with_the_signals_code_and_leaves_none(
        server, tmp_path, reader):
    ids_file, sdir, ids = big_state(tmp_path, 90_000, 3)
    before = {p.name: p.read_bytes() for p in sdir.iterdir()}
    hook, sent = stop_at(lambda e, f: e == "return" and f.f_code.co_name == "mkdtemp", signal.SIGINT)
    out = io.StringIO()
    sys.setprofile(hook)
    try:
        code = redrive.main([str(ids_file), "--url", server.template, *reader], err=(err := io.StringIO()), out=out,
                            environ={})
    finally:
        sys.setprofile(None)
    assert sent == ["mkdtemp"] and code == ExitCode.INTERRUPTED, err.getvalue()
    assert err.getvalue() == "redrive: error: interrupted while reading the state; rerun the same command\n"
    assert {p.name: p.read_bytes() for p in sdir.iterdir()} == before  # nothing left, nothing written
    assert not list(Path(tempfile.gettempdir()).glob(f".index-{os.getpid()}-*")) and server.paths == []


def test_the_readers_of_a_state_at_scale_write_nothing_and_leave_a_running_rebuilds_scratch_alone(tmp_path):
    ids_file, sdir, ids = big_state(tmp_path, 120_000, 5)
    running = sdir / ".index-running"  # a run's rebuild in progress: its lock is held, its scratch in use
    running.mkdir()
    (running / "lines.0").write_text("x\n")
    before = {p.name: p.stat().st_mtime_ns for p in sdir.iterdir()}
    for reader in (["--check"], ["--export", "jsonl"], ["--dry-run", "--url", "http://127.0.0.1:9/{id}"]):
        out = io.StringIO()
        code = redrive.main([str(ids_file), *reader], out=out, err=io.StringIO(), environ={})
        assert code == (ExitCode.INCOMPLETE if reader == ["--check"] else ExitCode.OK), reader
        assert {p.name: p.stat().st_mtime_ns for p in sdir.iterdir()} == before, reader
    assert "119995 done, 0 unavailable, 0 failed earlier, 5 new" in out.getvalue()
    assert (running / "lines.0").read_text() == "x\n"


LINES = st.sampled_from(["a", "b", "c", "é", "  d ", "#c", "", "x\ty", LONG + "1", LONG + "2"])


@settings(max_examples=60, deadline=None)
@given(first=st.lists(LINES, min_size=1, max_size=12), edits=st.lists(st.tuples(
    st.lists(LINES, max_size=6), st.integers(0, 12), st.integers(0, 3), st.lists(LINES, max_size=4),
    st.sampled_from(["\n", "\r\n", "\r"]), st.booleans()), min_size=1, max_size=4),
    shard=st.sampled_from([None, (1, 2)]))
def test_the_index_says_what_the_ledgers_say_after_any_edits(tmp_path_factory, first, edits, shard):
    """Against the whole-list reader (the list and done.txt read whole, as a
    dry run does): after any run of edits to the ids file and done.txt, the
    index leaves the same ids, in the same order, with the same counts."""
    folder = tmp_path_factory.mktemp("index")
    ids_file, sdir = folder / "ids.txt", folder / "ids.redrive"
    sdir.mkdir()
    lines = list(first)
    for added, at, removed, done, end, last_lf in edits:
        lines[at:at + removed] = added
        text = end.join(lines) + (end if last_lf else "")
        ids_file.write_bytes(text.encode("utf-8"))
        with open(sdir / "done.txt", "a", encoding="utf-8") as fh:
            fh.write("".join(f"{d.strip() or 'q'}\n" for d in done))
        listed = [i for i in redrive.block_ids(ids_file, text.removeprefix("\ufeff").encode("utf-8"), 0) if i]
        if not listed:
            continue  # no ids at all
        ids = [i for i in dict.fromkeys(listed) if shard is None or redrive.in_shard(i, shard)]
        duplicates = len(listed) - len(set(listed))
        left = set(ids) - set((sdir / "done.txt").read_text(encoding="utf-8").splitlines())
        index = redrive.current_index(ids_file, sdir, shard)
        assert index.counts() == (len(ids), duplicates)
        feed = redrive.Feed(redrive.Listing(ids_file, index.flags, *index.counts(), []))  # what a run reads
        assert [i for _, i, _ in feed.take(len(ids) + 1)] == [i for i in ids if i in left] and feed.left == 0
