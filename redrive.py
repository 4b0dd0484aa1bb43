# /// script
# requires-python = ">=3.9"
# dependencies = ["requests>=2.32,<3"]
# ///
"""redrive: finish a batch of HTTP requests, pay for nothing twice, say what is missing.

usage: python3 redrive.py IDS_FILE [--url TEMPLATE] [-H 'NAME: VALUE'] [options]

IDS_FILE holds one id per line (UTF-8; blank lines and '#' lines are skipped).
Each id becomes one request: --url TEMPLATE with {id} replaced by the
percent-encoded id, or, by default, the line itself as a full http(s) URL.

Every response falls into one bucket:
  fatal      401, 402, 407 (--fatal): halt at once, mark nothing failed, exit 3
  retryable  408, 429, 5xx but 501/505, timeouts, dropped connections, answers
             that are not HTTP, bodies cut short, undecodable, empty or
             invalid (--retry): backoff with jitter, Retry-After honoured
             (up to a day), at most --tries attempts per pass
  skip       404, 400, 410 and every other status (--skip), TLS errors,
             redirect loops, bodies over --max-bytes: recorded as
             unavailable, never requested again
A POST or PATCH that may have reached the server is not sent again (it
may have been processed) unless --retry-unsafe: refused connections, 429
and 503 are still retried. --timeout bounds each attempt as a whole.
Pass one tries every pending id; pass two (up to --passes) re-drives only the
failures, each --cooldown seconds after it failed. What still fails is
confirmed unavailable, with its reason and a recommended action.

Each host is paced by the quota it declares (X-RateLimit-*, RateLimit-*
and the like): what is left is spread up to its reset, and at none left
nothing is sent until then, unless the answers contradict it. A 403 that says it is a rate limit, or a
GraphQL 200 whose errors say so, is a throttle too. Where nothing is
declared, a 429 or 503 is one id's (it waits alone) unless the host's
refusals outnumber its background share; the host's costs the id no try,
cuts the host's rate to 0.85 of what it took, which then climbs back along
CUBIC's curve; a host that refuses everything gets one request at a time,
after its Retry-After (--rate and --per-host cap it all; --shard K/N splits
the ids over machines).

State, in STATE_DIR (default: IDS_FILE without extension + ".redrive"),
the ledgers append-only, one record per line, flushed as written:
  results.jsonl      one line per success: id, url, status, fetched_at, body
                     (the last line of an id wins)
  done.txt           one id per line, written after its result line
  failed.jsonl       one line per failed (id, pass): bucket, status, error, tries
  unavailable.jsonl  one line per settled failure: reason, action
  refreshed.jsonl    one line per id a refresh asked: unchanged, changed, gone, kept
  run.json           the request's shape (never a secret): drift is refused
  report.json        the last run: counts, and every unresolved id with its action
  lock               held by the running process
Rerun the same command after Ctrl+C, a kill or a reboot to resume; plain
`python3 redrive.py IDS_FILE` reuses the request recorded in run.json.
A done id is not asked again, unless --refresh (all) or --refresh-older-than
DURATION asks it with the ETag and Last-Modified its result was stored
with: a 304, or the same body, keeps the result; a new body is a new result
line; a 404 or 410 makes it unavailable; a refresh that fails keeps it.

When every id goes to one host and it stops answering (refused, no such
name, connect timeout), redrive probes it with backoff, spends no tries, and
resumes when it answers, or stops after --tries x --passes probes: exit 69.
A run halts (exit 3, nothing recorded for them) when 20 answers in a row
fail alike (the same 4xx, a TLS error), first or after answers that were
fine: is --url right, is the key valid? --no-guard turns this off.
With -q, redrive prints only when a person must act: an exit code but 0,
or ids newly confirmed unavailable. --export jsonl|csv|files gives what is
live, --export gone what went away; --metrics-file FILE the run's figures
for Prometheus. Literal query values of --url are never stored or shown
unless named --public.
When all that is left is due later than the run can usefully wait (past
--max-time, or past both --cooldown and twice --max-backoff: a long
Retry-After), the run ends at once with exit 1 and says when to rerun.

Exit codes: 0 every id settled, 1 some ids pending or failed, 2 usage or
input error, 3 halted by a fatal response, 69 the API's host stayed
unreachable, 70 a bug in redrive (state kept, traceback in STATE_DIR/crash.log),
75 another run holds the state dir, 129 hung up (SIGHUP), 130 interrupted
(Ctrl+C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import signal
import sys

if __name__ == "__main__":  # a Ctrl+C while the imports load (requests takes a moment): one line, exit 130
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write("redrive: interrupted while starting; "
                                                              "rerun the same command\n"), sys.exit(130)))

import argparse
import array
import base64
import codecs
import contextlib
import copy
import csv
import dataclasses
import email.utils
import functools
import glob
import hashlib
import heapq
import html
import http
import http.server
import importlib.util
import ipaddress
import itertools
import json
import math
import mmap
import os
import queue
import random
import re
import select
import shlex
import shutil
import socket
import ssl
import stat
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Optional
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit, urlunsplit

try:
    import requests
    import urllib3
    from requests.adapters import HTTPAdapter
except ImportError as missing:  # run by a python without requests: say how to get it, no traceback
    if __name__ != "__main__":
        raise
    sys.stderr.write(f"redrive: error: {missing.name} is not installed for {sys.executable}; make a virtualenv "
                     "and run redrive with its python: 'python3 -m venv .venv && .venv/bin/python -m pip install "
                     "-r requirements.txt', then '.venv/bin/python redrive.py ...' (the README's set-up)\n")
    sys.exit(2)

__version__ = "0.1.0"

# --------------------------------------------------------------- constants

#: Statuses that halt the whole job: no key, no credit, a proxy that wants
#: credentials (407 is always the local set-up's). Retrying cannot help.
FATAL_STATUSES = frozenset({401, 402, 407})

#: Statuses worth another try: throttles and server-side trouble. 501 (Not
#: Implemented) and 505 (HTTP Version Not Supported) are answers, not trouble.
RETRY_STATUSES = frozenset({408, 429} | (set(range(500, 600)) - {501, 505}))

#: Definitive answers. Any status not mapped anywhere is skipped too: an
#: unknown answer is never retried blindly (fail closed).
SKIP_STATUSES = frozenset({400, 404, 410})

#: Successes that carry no body by definition (RFC 9110), as does any answer
#: to HEAD: for them an empty body is the answer, not a failure.
BODILESS_STATUSES = frozenset({204, 205})

#: Query parameter names whose values are secrets and are shown redacted.
SECRET_NAME = re.compile(r"key|token|secret|sig|pass|pwd|\bpw\b|auth|credential|session|jwt|bearer|private", re.I)

#: A header value run.json may keep, to re-read on a rerun: a ${VAR}
#: reference, alone or after an auth scheme word, whose literal text holds
#: no secret. Any other literal could be one, and is never stored.
STORABLE_HEADER = re.compile(r"(?:(?i:bearer|token|basic|bot|digest|apikey|api-key|key|jwt|sso-key)\s+)?"
                             r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")

#: A key-like query parameter with a value, somewhere in a URL.
KEY_PARAM = re.compile(r"[?&;][^=&#]*(?:" + SECRET_NAME.pattern + r")[^=&#]*=[^&#]", re.I)

#: A literal query value this long or longer, under any name, is scrubbed
#: from output as a secret would be (shorter ones: only under key-like names).
MIN_HIDDEN = 6

#: A ${VAR} reference, read from the environment at run time.
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

#: How long an interrupted or halted run waits for requests already in flight.
GRACE_SECONDS = 5.0

#: Pending ids report.json lists one by one; past that it gives their count.
PENDING_LISTED = 1000

#: Without --fsync, dirty state files are fsynced at least this often (seconds).
SYNC_INTERVAL = 1.0

#: Seconds between two progress lines: on a terminal, and in a log or pipe.
TTY_INTERVAL = 0.25
LOG_INTERVAL = 30.0

#: Statuses that say "not now": a throttle, the host's or one id's (see Host).
THROTTLE_STATUSES = frozenset({429, 503})

#: An id's rate-limit 403 that says nothing of when waits a minute, doubled for
#: each in a row (the rule GitHub documents for its secondary limits).
SECONDARY_WAIT = 60.0

#: Seconds of history behind the requests-per-second figure and the ETA.
RATE_WINDOW = 10.0

#: Bytes of a fatal response's body shown to the user.
EXCERPT_CHARS = 200

#: Bytes read from an error response, so that its connection can be reused.
ERROR_BODY_BYTES = 65536

READ_CHUNK = 65536

#: Watches for a stray answer (see in_step): a host's first IN_STEP_CHECKS
#: reused answers, every IN_STEP_EVERY-th on a connection, its last
#: twice IN_STEP_EVERY in doubt; a look waits IN_STEP_WAIT s at most.
IN_STEP_CHECKS = 8
IN_STEP_EVERY = 128
IN_STEP_WAIT = 1.0

#: Hosts each worker keeps a keep-alive connection to.
POOLED_HOSTS = 16

#: Hosts whose proxy and .netrc settings are remembered (see HostSettings).
REMEMBERED_HOSTS = 1024

#: The misconfiguration guard halts when this many answers in a row fail alike
#: (or all of them, in a run of fewer ids, but at least GUARD_MIN).
GUARD_SAMPLE = 20
GUARD_MIN = 5

#: The reasons transport_failure gives a request that never reached its host.

#: Bytes of a redirect's body read before the connection is dropped instead
#: (requests would read all of it, decompressed: a gzip bomb on a 302).
REDIRECT_BODY_BYTES = 65536

#: 1xx interim answers (103 Early Hints...) skipped before one is taken as
#: no answer at all; a real server sends one or two.
MAX_INTERIM = 16

#: Cookies an API may set, and their bytes in all: a Set-Cookie storm is
#: ignored past this instead of growing every later request's Cookie header.
MAX_COOKIES = 50
MAX_COOKIE_BYTES = 16384

#: The longest Retry-After honoured (a day): a date in the year 9999 is a
#: server bug, not a plan.
MAX_RETRY_AFTER = 86400.0

#: Bounds of every wait of the run loop: never one that rounds to nothing (a busy loop, a SimpleQueue stuck for ever), never
#: one past MAX_WAIT without a look. A paced slot met late is never made up (a limit with no slack refuses two sent closer
#: than its rate), so MIN_WAIT is far under the shortest interval a host is paced at.
MIN_WAIT = 0.0001
MAX_WAIT = 1.0

#: The interpreter's thread switch interval once requests are paced (CPython's
#: is 5 ms): a paced request leaves up to a switch interval late, and a limit
#: with no slack refuses two that jitter brought closer than its rate.
SWITCH_INTERVAL = 0.001

#: The reason a TLS handshake or certificate check failed: no retry will fix it.
TLS_ERROR = "TLS error (certificate or handshake)"

#: The reason given an id that would be a '.' or '..' path segment: never sent.
DOT_SEGMENT = "an id that is a path step ('.' or '..'), never sent"

#: The reason given an answer a second answer followed on its kept-alive connection.
OUT_OF_STEP = "another answer followed it on the connection: asked again on a new one"

#: The reason given a POST or PATCH that failed after it may have reached the server.
MAY_HAVE_BEEN_PROCESSED = "may have been processed"

#: Methods the server may repeat without harm (RFC 9110 9.2.2): any other
#: (POST, PATCH) is not retried once it may have reached the server.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

#: Statuses that say the request was not processed, so retrying is safe
#: even for POST: a throttle, or a server that is not taking work.
NOT_PROCESSED_STATUSES = frozenset({429, 503})

#: Requests in a row that never reach the API's host (refused, name not
#: found, connect timeout) before redrive takes the host as down.
DOWN_AFTER = 5
STATE_FILES = ("results.jsonl", "done.txt", "failed.jsonl", "unavailable.jsonl", "refreshed.jsonl")

#: Every file redrive keeps in a state dir (refuse_foreign_files).
OWN_FILES = (*STATE_FILES, "run.json", "report.json", "paces.json", "lock", "crash.log", "done.index")

#: A refresh's answers that say the id is gone upstream: it leaves done for unavailable.
GONE_STATUSES = frozenset({404, 410})

#: How a refresh settled an id (refreshed.jsonl's "result"): a 304 or the same body,
#: a new body (a new result line), gone upstream, or the old result kept (the
#: refresh failed).
REFRESH_RESULTS = ("unchanged", "changed", "gone", "kept")

#: An ETag or Last-Modified longer than this is not kept: redrive sends it back.
MAX_VALIDATOR = 512

#: Opening a state file never follows a symlink (where the OS can say so).
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class ExitCode(IntEnum):
    OK = 0  #: every id settled: done or confirmed unavailable
    INCOMPLETE = 1  #: some ids still pending or failed; rerun to continue
    USAGE = 2  #: bad command line, input file or state
    FATAL = 3  #: halted by a fatal response (401, 402, 407, --fatal)
    UNREACHABLE = 69  #: the API's host stayed unreachable; its ids are left pending (EX_UNAVAILABLE)
    SOFTWARE = 70  #: a bug in redrive: state kept, traceback in STATE_DIR/crash.log (EX_SOFTWARE)
    LOCKED = 75  #: another run holds the state dir (EX_TEMPFAIL)
    HANGUP = 129  #: SIGHUP: the terminal went away
    INTERRUPTED = 130  #: Ctrl+C
    TERMINATED = 143  #: SIGTERM


#: What each exit code tells a script or a cron job: --help ends with these.
EXIT_MEANINGS = {
    ExitCode.OK: "every id settled: done, or confirmed unavailable",
    ExitCode.INCOMPLETE: "some ids pending or failed (--max-time, a later pass, a long wait), or a refresh not "
                         "over: rerun",
    ExitCode.USAGE: "bad command line, input or state: one line says what and how to fix it",
    ExitCode.FATAL: "halted: a fatal answer (401, 402, 407), or a row of answers that failed alike",
    ExitCode.UNREACHABLE: "the API's host stayed unreachable; nothing marked failed: rerun later",
    ExitCode.SOFTWARE: "a bug in redrive; state kept, traceback in STATE_DIR/crash.log",
    ExitCode.LOCKED: "another run holds the state dir",
    ExitCode.HANGUP: "hung up (SIGHUP): rerun to resume",
    ExitCode.INTERRUPTED: "interrupted (Ctrl+C): rerun to resume",
    ExitCode.TERMINATED: "terminated (SIGTERM): rerun to resume",
}


class Stop(Enum):
    """Why a run stopped before every id was settled: the report's "stop",
    what each id it left pending is told, and the exit code (None: that of
    what is left, 0 or 1)."""

    def __new__(cls, word: str, pending: str, action: str, code: Optional[ExitCode]):
        stop = object.__new__(cls)
        stop._value_, stop.pending, stop.action, stop.code = word, pending, action, code
        return stop

    TIME = "time", "time budget reached", "rerun to resume", None
    INTERRUPTED = "interrupted", "run interrupted", "rerun to resume", ExitCode.INTERRUPTED
    TERMINATED = "terminated", "run terminated", "rerun to resume", ExitCode.TERMINATED
    HUNG_UP = "hung up", "run hung up (SIGHUP)", "rerun to resume", ExitCode.HANGUP
    FATAL = "fatal", "run halted by a fatal response", "fix the key or the account, then rerun to resume", \
        ExitCode.FATAL
    UNREACHABLE = "unreachable", "the API's host stayed unreachable", "rerun the same command once it is back", \
        ExitCode.UNREACHABLE
    LATER = "later", "not due yet", "rerun the same command later", None
    MISCONFIGURED = "misconfigured", "run halted: a row of its answers all failed alike", \
        "check --url and the ids file, then rerun", ExitCode.FATAL
    CRASH = "crash", "run stopped by an internal error", "rerun to resume; report crash.log if it happens again", \
        ExitCode.SOFTWARE


#: What an id not requested yet is told when no stop explains it.
NOT_REQUESTED = ("not requested yet", "rerun to continue")
SIGNAL_STOPS = frozenset({Stop.INTERRUPTED, Stop.TERMINATED, Stop.HUNG_UP})


class Cause(Enum):
    """What kind of failure an Outcome is: what recommend and the report
    switch on (the error text is for people, and may be reworded)."""

    STATUS = "status"  #: the HTTP status says it all
    BAD_BODY = "bad body"  #: a 2xx that is no real answer: empty, invalid JSON, a text or field missing
    TOO_LARGE = "too large"  #: a body over --max-bytes
    TIMEOUT = "timeout"  #: no whole answer within --timeout
    UNREACHED = "unreached"  #: the host itself: refused, not found, cannot connect, connect timeout
    TRANSPORT = "transport"  #: any other failure of the connection, the redirect or the answer's framing
    DOT_SEGMENT = "dot segment"  #: an id that would be a path step: never sent
    MAY_HAVE_BEEN_PROCESSED = "may have been processed"  #: a POST that failed past the point of no return
    THROTTLED = "throttled"  #: an answer that says it is a rate limit: a 403 or a GraphQL 200 so marked
    OUT_OF_STEP = "out of step"  #: another answer followed on the connection: this one may have been its neighbour's


CAUSES = frozenset(cause.value for cause in Cause)


class Bucket(Enum):
    OK = "ok"
    FATAL = "fatal"
    RETRYABLE = "retryable"
    SKIP = "skip"


class RedriveError(Exception):
    """A problem the user can fix: shown as one line, mapped to an exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.USAGE):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------- types


@dataclass(frozen=True)
class Request:
    """What is asked of the API for each id, and what a real answer must
    hold. It gives every result its meaning, so it may not drift within one
    state dir. run.json keeps its shape: each field with a "shape" key, in
    the form the user gave (never a secret). A bare rerun takes each one back
    as the option its "option" key names. A change is named field by field."""

    method: str = field(default="GET", metadata={"shape": "method", "option": "method"})
    url_spec: str = field(default="{id}", metadata={"shape": "url", "option": "url"})  #: as given, ${VAR} unread
    data_spec: Optional[str] = field(default=None, metadata={"shape": "data", "option": "data"})  #: as given
    #: (name, "${VAR}" or None): what run.json may keep of each header
    header_specs: tuple = field(default=(), metadata={"shape": "headers", "option": "header"})
    expect_json: bool = field(default=False, metadata={"shape": "expect_json", "option": "expect_json"})
    require: tuple = field(default=(), metadata={"shape": "require", "option": "require"})  #: texts the body must hold
    require_field: tuple = field(default=(), metadata={"shape": "require_field", "option": "require_field"})
    public: tuple = field(default=(), metadata={"shape": "public", "option": "public"})  #: query names with no secret
    demo: bool = field(default=False, metadata={"option": "demo"})  #: the url is the demo server's
    url: str = "{id}"  #: the template, ${VAR} references read from the environment
    data: Optional[str] = None  #: the body template, ${VAR} read
    headers: tuple = ()  #: (name, value) pairs; values are secrets

    @property
    def header_names(self) -> frozenset:
        return frozenset(name.lower() for name, _ in self.headers)

    @property
    def json_data(self) -> bool:
        """A request body is JSON when a header says so or it looks like JSON."""
        declared = [v for n, v in self.headers if n.lower() == "content-type"]
        if declared:
            return "json" in declared[0].lower()
        return (self.data or "").lstrip()[:1] in ("{", "[")

    @property
    def wants_json(self) -> bool:
        return self.expect_json or bool(self.require_field)


#: The command-line options a Request is made from (see Request).
REQUEST_OPTIONS = tuple(f.metadata["option"] for f in dataclasses.fields(Request) if "option" in f.metadata)


@dataclass(frozen=True)
class Config:
    """Everything a run needs, decided once from the command line."""

    ids_file: Path
    state_dir: Path
    request: Request = field(default_factory=Request)  #: what is asked for each id
    concurrency: int = 4
    timeout: float = 30.0
    tries: int = 5
    passes: int = 2
    backoff: float = 1.0
    max_backoff: float = 60.0
    cooldown: float = 30.0
    fatal: frozenset = FATAL_STATUSES
    retry: frozenset = RETRY_STATUSES
    skip: frozenset = SKIP_STATUSES
    retry_unavailable: Optional[frozenset] = None  #: what --retry-unavailable brings back (see wants_again)
    refresh: Optional[float] = None  #: re-ask done ids fetched this many seconds ago or more (0: --refresh, all)
    max_time: Optional[float] = None
    rate: Optional[float] = None  #: at most this many requests per second, over all workers
    per_host: Optional[int] = None  #: at most this many requests in flight per host
    shard: Optional[tuple] = None  #: (K, N): only ids whose hash falls in shard K of N
    max_bytes: int = 50 * 1024 * 1024
    quiet: bool = False
    verbose: bool = False  #: -v: a line for each request
    fsync: bool = False
    report: Optional[Path] = None
    metrics_file: Optional[Path] = None  #: --metrics-file: Prometheus text for node_exporter's textfile collector
    allow_config_change: bool = False
    guard: bool = True  #: halt when a row of answers fail alike (see Guard)
    retry_unsafe: bool = False  #: retry POST/PATCH even when the attempt may have been processed
    secrets: tuple = ()  #: header values and ${VAR} values: shown as *** if ever echoed

    @property
    def unsafe(self) -> bool:
        """A method whose repeat may do the work twice, unless --retry-unsafe."""
        return self.request.method not in IDEMPOTENT_METHODS and not self.retry_unsafe


@dataclass
class Outcome:
    """What one attempt produced. Built by a worker, never raised."""

    bucket: Bucket
    status: Optional[int] = None
    error: str = ""
    body: Optional[str] = None  #: a success's body, as the JSON text results.jsonl stores
    encoding: Optional[str] = None  #: "base64" when body holds bytes that are not text
    final_url: Optional[str] = None
    retry_after: Optional[float] = None
    excerpt: str = ""
    unreached: bool = False  #: the request never reached the host: see never_connected
    via: Optional[str] = None  #: the proxy a failure to connect was a failure to reach (host[:port])
    heard: bool = False  #: a failure after the answer began to arrive: the host is there
    cause: Cause = Cause.STATUS  #: what kind of failure, for recommend
    throttle: bool = False  #: a refusal that says "not now" (see Host): 429, 503, or a rate limit said
    said: bool = False  #: the answer says it is a rate limit (see rate_limit_sign): the host's, always
    quota: Optional[Declared] = None  #: the quota its headers declared, whatever its status
    unchanged: bool = False  #: a 304 to a conditional request: the stored result stands
    etag: Optional[str] = None  #: a success's validators, sent back by a refresh
    last_modified: Optional[str] = None
    doubted: tuple = ()  #: (id, a success) answered before it on its connection, maybe with others' answers (see in_step)


class Prior(NamedTuple):
    """What a refresh knows of a done id's stored result: the validators it
    asks with (its result line's, or newer ones a refresh was answered with),
    those of its result line, and a digest of the body, which tells a 200
    that brings the same body (a server that ignores validators) from a
    change. A tuple: a refresh holds one for each done id."""

    etag: Optional[str] = None
    last_modified: Optional[str] = None
    digest: Optional[bytes] = None
    stored: tuple = (None, None)  #: (etag, last_modified) of the result line

    def headers(self) -> tuple:
        """The conditional request's headers (RFC 9110 13.1)."""
        return tuple((name, value) for name, value in (("If-None-Match", self.etag),
                                                       ("If-Modified-Since", self.last_modified)) if value)


@dataclass
class Item:
    """One id on its way through the passes."""

    id: str
    pass_no: int = 1
    tries: int = 0
    line: int = -1  #: its line in the ids file (from 0), where the run's index has it (-1: a refresh's)
    host: str = ""  #: the origin it is sent to: throttles and caps are per host
    sent: float = -1.0  #: when its last request started (-1: never, in this pass)
    order: int = 0  #: its last request's place among the run's requests (see Guard)
    refused: bool = False  #: its last answer was a refusal of its own: a new one is no fresh sign (see Host)
    throttles: int = 0  #: its refusals in a row (see Settler._throttled)
    streak: tuple = (0, 0, 0, 0)  #: its host's (takes, refusals, *firsts) at the first of them
    heard: tuple = (0, 0)  #: its host's (takes, refusals) counted after the last of them
    alone: bool = False  #: refused again with no other id answered since its previous refusal (see Settler._alone)
    asked_alone: bool = False  #: it kept its last try once for want of other ids' answers (see Settler._alone)
    own: bool = False  #: its refusals were found its own: they spend tries, in later passes too
    turned_away: bool = False  #: refused by the host, or timed out: it goes behind the ids ready
    timed_out: bool = False  #: an attempt of it timed out before: a slow item, no sign of a host gone silent
    prior: Optional[Prior] = None  #: a done id being refreshed: its stored result's validators
    listed: bool = False  #: done.txt lists it already (a refresh, or an id gone upstream that came back)
    doubted: bool = False  #: its answer may have been another id's (see in_step): asked again


def finest_clock(info: Callable = time.get_clock_info) -> Callable[[], float]:
    """time.monotonic, or time.perf_counter where that is monotonic and finer. Before Python 3.13 Windows'
    monotonic ticks every 15.6 ms, longer than a gate's gaps (2 ms at 500 r/s): each slot is read at the tick
    after it, met late and never made up: one request a tick at most, 64 a second."""
    fine, coarse = info("perf_counter"), info("monotonic")
    return time.perf_counter if fine.monotonic and fine.resolution < coarse.resolution else time.monotonic


@dataclass(frozen=True)
class Effects:
    """The clock, the sleep and the randomness: parameters, so tests are exact."""

    clock: Callable[[], float] = finest_clock()
    wallclock: Callable[[], float] = time.time
    sleep: Optional[Callable[[float], None]] = None  #: None: an interruptible wait
    rand: Callable[[], float] = random.random
    fsync: Callable[[int], None] = os.fsync  #: the state files' flush to disk


class RedirectFailed(Exception):
    """Following a redirect failed; its cause says how (see Phase.REDIRECT)."""


class UndecodableBody(Exception):
    """A body that does not decompress as its Content-Encoding says."""

    def __init__(self, coding: str):
        super().__init__(coding)
        self.coding = coding


class AttemptTimeout(Exception):
    """The whole attempt ran past --timeout (a server dripping its answer)."""


# ---------------------------------------------------------------- pure core


def classify_status(status: int, cfg: Config) -> Bucket:
    """Sort an HTTP status into a bucket; 2xx is a success, the rest fails closed."""
    if status in cfg.fatal:
        return Bucket.FATAL
    if status in cfg.retry:
        return Bucket.RETRYABLE
    if status in cfg.skip or not 200 <= status < 300:
        return Bucket.SKIP
    return Bucket.OK


def status_reason(status: int) -> str:
    """'503 Service Unavailable' for a known status, 'HTTP 599' otherwise."""
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


class Phase(Enum):
    """Where in an attempt a failure happened: it decides what the failure means."""

    REQUEST = "request"  #: connecting, sending, waiting for the status line and headers
    REDIRECT = "redirect"  #: following a Location
    BODY = "body"  #: reading and decoding the body


def exception_chain(exc: BaseException) -> list:
    """exc and every exception it wraps, outermost first.

    requests wraps urllib3, which wraps http.client, which wraps the socket
    error, through args, __cause__, __context__ and .reason alike.
    """
    chain, todo = [], [exc]
    while todo and len(chain) < 32:
        e = todo.pop(0)
        if isinstance(e, BaseException) and not any(e is seen for seen in chain):
            chain.append(e)
            todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]
    return chain


def transport_failure(exc: BaseException, phase: Phase, timeout: float, chunked: bool = False) -> tuple:
    """Sort a failure of the network, the server or the HTTP libraries into
    (bucket, cause, short reason). Never raises, whatever the exception.

    Order matters: ConnectTimeout is both a ConnectionError and a Timeout,
    RemoteDisconnected both a reset and a bad status line, and a TLS error
    while reading the body is a dropped connection, not a certificate problem.
    """
    chain = exception_chain(exc)
    has = functools.partial(chain_has, chain)
    if has(AttemptTimeout):
        return Bucket.RETRYABLE, Cause.TIMEOUT, f"timeout after {timeout:g} s"
    redirect = phase is Phase.REDIRECT
    where, unreached = ("redirect target: ", Cause.TRANSPORT) if redirect else ("", Cause.UNREACHED)
    if has(requests.exceptions.TooManyRedirects):
        return Bucket.SKIP, Cause.TRANSPORT, "too many redirects"
    if redirect and has(requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL,
                        requests.exceptions.MissingSchema, ValueError):
        return Bucket.SKIP, Cause.TRANSPORT, "redirect to an unsupported URL"
    if has(ConnectionRefusedError):
        return Bucket.RETRYABLE, unreached, f"{where}connection refused"
    if has(socket.gaierror):
        return Bucket.RETRYABLE, unreached, f"{where}host name not found"
    if has(urllib3.exceptions.NewConnectionError):  # a ConnectTimeoutError too, in urllib3 2
        return Bucket.RETRYABLE, unreached, f"{where}cannot connect"
    if has(requests.exceptions.ConnectTimeout, urllib3.exceptions.ConnectTimeoutError):
        return Bucket.RETRYABLE, unreached, f"{where}connect timeout after {timeout:g} s"
    if phase is not Phase.BODY and has(ssl.SSLError, urllib3.exceptions.SSLError):
        return Bucket.SKIP, Cause.TRANSPORT, TLS_ERROR
    if has(requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, socket.timeout):
        return Bucket.RETRYABLE, Cause.TIMEOUT, f"timeout after {timeout:g} s"
    if phase is Phase.BODY:
        return Bucket.RETRYABLE, Cause.TRANSPORT, body_failure(chain, chunked)
    return answer_failure(chain, where)


def body_failure(chain: list, chunked: bool) -> str:
    """The reason a body that had begun to arrive did not arrive whole."""
    undecodable = next((e for e in chain if isinstance(e, UndecodableBody)), None)
    if undecodable is not None:
        return f"undecodable body ({undecodable.coding})"
    if chunked and chain_has(chain, ValueError, urllib3.exceptions.InvalidChunkLength):
        return "broken chunked encoding"
    return "connection dropped mid-body"


def chain_has(chain: list, *types) -> bool:
    """Whether any exception of the chain is one of types."""
    return any(isinstance(e, types) for e in chain)


def answer_failure(chain: list, where: str) -> tuple:
    """(bucket, Cause.TRANSPORT, reason) for a connection that failed before a usable answer came."""
    has = functools.partial(chain_has, chain)
    if has(http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
        return Bucket.RETRYABLE, Cause.TRANSPORT, f"{where}connection dropped before the answer"
    if has(http.client.LineTooLong):
        return Bucket.SKIP, Cause.TRANSPORT, f"{where}an answer with a header line over 64 KiB"
    if any(type(e) is http.client.HTTPException and "headers" in str(e) for e in chain):
        return Bucket.SKIP, Cause.TRANSPORT, f"{where}an answer with more than 100 headers"
    if has(http.client.HTTPException, urllib3.exceptions.ProtocolError):
        return Bucket.RETRYABLE, Cause.TRANSPORT, f"{where}not an HTTP answer"
    if has(requests.exceptions.ConnectionError, OSError):
        return Bucket.RETRYABLE, Cause.TRANSPORT, f"{where}connection error"
    return Bucket.SKIP, Cause.TRANSPORT, f"{where}request not sendable ({type(chain[0]).__name__})"


def never_connected(exc: BaseException) -> bool:
    """True when the request never reached the server: the host name did
    not resolve, the connection was refused, or connecting timed out.

    Such a failure is about the host, not the id (nothing was sent), so
    when it repeats the host is down and trying more ids only burns their
    tries: see Host.unreachable. It is also the one failure after which a
    POST is safe to repeat.
    """
    return chain_has(exception_chain(exc), requests.exceptions.ConnectTimeout, urllib3.exceptions.ConnectTimeoutError,
                     urllib3.exceptions.NewConnectionError)


def misconfiguration_sign(out: "Outcome", cfg: "Config") -> Optional[str]:
    """What an answer says when it may mean that the whole set-up is wrong,
    not this id: a client error (the same 404 for every id: a wrong --url, or
    a CSV header taken for ids), a TLS failure, not JSON under --expect-json.
    None for an answer that says nothing of the kind."""
    if out.bucket is Bucket.SKIP and out.status is not None and 400 <= out.status < 500:
        return status_reason(out.status)
    if out.error == TLS_ERROR:
        return out.error
    if cfg.request.expect_json and out.error == "invalid JSON":
        return "not JSON (--expect-json)"
    return None


class Guard:
    """The misconfiguration guard: a row of answers no real list gives.

    It holds back answers that fail alike (one misconfiguration_sign) while
    they come in a row; `size` of them in a row trip it: the run halts like
    a fatal answer and nothing is recorded for them (they stay pending, and
    so do the alike answers still in flight). Any other answer ends the row,
    and every held answer is settled as it would have been. It watches the
    whole run, so it catches the first answers failing alike (a wrong --url)
    and a row of them after answers that were fine (a key revoked mid-run,
    an API that answers an unauthorized request 404, a refresh's "gone").
    """

    def __init__(self, size: int, fresh: bool = True):
        self.size, self.open, self.tripped, self.fresh = size, size > 0, False, fresh
        self.sign, self.held, self.fine = None, [], 0  #: fine: answers that were not alike failures
        self.began = 0  #: the place of the row's first request among the run's requests

    def offer(self, item: "Item", out: "Outcome", sign: Optional[str], sent: int = 0) -> list:
        """The (item, outcome) pairs to settle now: none while holding. A row
        is in the order requests were sent: an answer to a request sent
        before the row began (one in flight beside it) does not end it."""
        if self.tripped:
            return [] if sign == self.sign else [(item, out)]
        if sign is None:
            self.fine += 1
            if self.held and sent < self.began:
                return [(item, out)]
            released, self.held, self.sign = [*self.held, (item, out)], [], None
            return released
        released, self.held = (self.held, []) if sign != self.sign else ([], self.held)
        if not self.held:
            self.began = sent
        self.sign = sign
        self.held.append((item, out))
        self.tripped = len(self.held) >= self.size
        return released

    def release(self) -> list:
        """Hand back what is held: the run ran out of answers first."""
        released, self.held = self.held, []
        return released


def backoff_delay(attempt: int, base: float, cap: float, rand: Callable[[], float]) -> float:
    """Wait before retry number `attempt` (1 = after the first failure).

    delay = min(cap, base * 2 ** (attempt - 1)), then "equal jitter":
    wait = delay / 2 + delay / 2 * rand(), so a cohort that failed together
    spreads over [delay / 2, delay] instead of returning as one hammer.
    """
    delay = min(cap, base * 2 ** (attempt - 1))
    return delay / 2 + delay / 2 * rand()


def parse_retry_after(value: Optional[str], now: float) -> Optional[float]:
    """Seconds to wait from a Retry-After value: delay-seconds or an HTTP-date.

    Delay-seconds may carry a decimal part ("2.0", "0.5"): the RFC asks for
    whole seconds, but Shopify's and Discord's APIs send such values, and
    read as no Retry-After they were no wait at all. Returns None for a
    missing or unparseable value, 0 for a date in the past, and at most
    MAX_RETRY_AFTER: whatever the server sent, never an exception and
    never a wait of centuries.
    """
    if not value:
        return None
    value = value.strip()
    whole, dot, part = value.partition(".")
    if whole.isascii() and whole.isdigit() and (not dot or part.isascii() and part.isdigit()):
        return min(MAX_RETRY_AFTER, float(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return min(MAX_RETRY_AFTER, max(0.0, when.timestamp() - now))
    except (TypeError, ValueError, IndexError, OverflowError, AttributeError):
        return None


def bounded_wait(seconds: Optional[float]) -> float:
    """A wait the run loop can always make: at least MIN_WAIT (never a busy
    loop, never a timeout that rounds to nothing) and at most MAX_WAIT,
    whatever comes in: None for "until woken", 0, negative, NaN or 1e300."""
    if seconds is None or not seconds < MAX_WAIT:
        return MAX_WAIT
    return max(MIN_WAIT, seconds)


@dataclass(frozen=True)
class Declared:
    """A quota one answer declared: requests left, seconds until the quota
    renews, its size if said, and the bucket it is of (GitHub's
    X-RateLimit-Resource, Discord's X-RateLimit-Bucket; "" for the host's one)."""

    remaining: float
    reset: float
    limit: Optional[float] = None
    bucket: str = ""


#: The header families a quota is declared in, as (remaining, reset, limit,
#: bucket) names; an answer's first family is read (structured RateLimit
#: fields: see structured_quota). For reset values, see reset_seconds.
QUOTA_FAMILIES = (
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "x-ratelimit-limit-requests", None),  # OpenAI
    ("anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset",
     "anthropic-ratelimit-requests-limit", None),
    ("x-ratelimit-remaining", ("x-ratelimit-reset-after", "x-ratelimit-reset"), "x-ratelimit-limit",
     ("x-ratelimit-resource", "x-ratelimit-bucket")),  # GitHub, Reddit, Discord, most gateways
    ("x-rate-limit-remaining", "x-rate-limit-reset", "x-rate-limit-limit", None),  # X
    ("ratelimit-remaining", "ratelimit-reset", "ratelimit-limit", None),  # IETF draft up to -06
)

#: A reset value given as a Go-style duration (OpenAI): "1h2m3.5s", "6m0s", "12ms".
DURATION_PARTS = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?"
                            r"(?:(\d+(?:\.\d+)?)ms)?$")

#: An epoch time is past this (2001); a count of seconds left is not.
EPOCH_FROM = 1e9
HEADER_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?", re.ASCII)


def decimal(text, low: int, high: int) -> Optional[int]:
    """A whole number written in ASCII decimal digits (no sign, no '²', no
    '١٢' that str.isdigit and int accept) from low to high; None otherwise.
    Numbers in text from outside (the environment, --shard, --retry-unavailable,
    a --fields index) go through it; headers through HEADER_NUMBER."""
    if not isinstance(text, str) or not (0 < len(text) <= 20 and text.isascii() and text.isdigit()):
        return None
    number = int(text)
    return number if low <= number <= high else None


def header_number(value: Optional[str]) -> Optional[float]:
    """A finite, non-negative number ("59", "598.0", "100, 100;w=60" takes its
    first); None for anything else."""
    try:
        text = value.split(",")[0].split(";")[0].strip()
        number = float(text) if HEADER_NUMBER.fullmatch(text) else math.nan  # ASCII only: float takes '١٢'
    except (AttributeError, ValueError):
        return None
    return number if math.isfinite(number) and 0 <= number <= 1e12 else None


def reset_seconds(value: Optional[str], now: float) -> Optional[float]:
    """Seconds from `now` (epoch) until a quota renews, from any form a
    reset is sent in; a reset already past is 0, and one beyond
    MAX_RETRY_AFTER or unreadable is None (ignored)."""
    value = (value or "").strip()
    number = header_number(value) if value[:1].isdigit() and "T" not in value else None
    match = DURATION_PARTS.match(value) if number is None and value else None
    if number is not None:
        seconds = number - now if number > EPOCH_FROM else number
    elif match and any(match.groups()):
        h, m, s, ms = (float(part or 0) for part in match.groups())
        seconds = h * 3600 + m * 60 + s + ms / 1000
    else:
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
            seconds = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp() - now
        except (ValueError, OverflowError):
            return None
    if not -MAX_RETRY_AFTER <= seconds <= MAX_RETRY_AFTER:
        return None
    return max(0.0, seconds)


def sf_members(value: Optional[str]) -> dict:
    """A structured-field list as name -> {parameter: value}; draft -07's bare
    key=value members (limit=100, remaining=50, reset=30) go under ""."""
    members = {}
    for member in (value or "").split(","):
        head, *params = (part.strip() for part in member.split(";"))
        if "=" in head:
            params, head = [head, *params], ""
        members.setdefault(head.strip('"'), {}).update(p.split("=", 1) for p in params if "=" in p)
    return members


def structured_quota(headers) -> Optional[Declared]:
    """RateLimit: "name";r=50;t=30, sized by RateLimit-Policy: "name";q=100;w=60
    (IETF draft -08 on), or draft -07's RateLimit: limit=100, remaining=50,
    reset=30. Of several quotas, the one with the fewest left."""
    policies, found = sf_members(headers.get("ratelimit-policy")), []
    for name, params in sf_members(headers.get("ratelimit")).items():
        remaining = header_number(params.get("r", params.get("remaining")))
        reset = reset_seconds(params.get("t", params.get("reset")), 0.0)
        size = header_number(policies.get(name, {}).get("q", params.get("limit")))
        if remaining is not None and reset is not None:
            found.append(Declared(remaining, reset, size, shown_text(name)[:40]))
    return min(found, key=lambda quota: quota.remaining, default=None)


def declared_quota(headers, now: float) -> Optional[Declared]:
    """The quota an answer's headers declare (any status), or None: no
    dialect found, or its values malformed or absurd (ignored, never raised)."""
    for remaining_name, reset_names, limit_name, bucket_names in QUOTA_FAMILIES:
        remaining = header_number(headers.get(remaining_name))
        if remaining is None:
            continue
        names = reset_names if isinstance(reset_names, tuple) else (reset_names,)
        reset = next((r for r in (reset_seconds(headers.get(n), now) for n in names if headers.get(n)) if r is not None),
                     None)
        if reset is None:
            return None
        buckets = bucket_names or ()
        bucket = next((headers.get(n) for n in buckets if headers.get(n)), "")
        return Declared(remaining, reset, header_number(headers.get(limit_name)), shown_text(bucket)[:40])
    return structured_quota(headers) if "ratelimit" in headers else None


class Move(Enum):
    """What one attempt's outcome does to its id (see next_step)."""

    DONE = "done"  #: stored: results.jsonl, then done.txt
    HALT = "halt"  #: a fatal answer: the whole run stops, nothing is marked
    RETRY = "retry"  #: asked again in this pass, after Step.wait
    FAIL = "fail"  #: this pass is over for it: failed.jsonl (see resume_step), then the next pass after Step.wait
    GIVE_UP = "give up"  #: failed its last pass: failed.jsonl (see resume_step), then unavailable.jsonl
    UNAVAILABLE = "unavailable"  #: settled at once: unavailable.jsonl
    LEAVE = "leave"  #: the run is stopping: nothing recorded, the id stays pending


@dataclass(frozen=True)
class Step:
    move: Move
    wait: float = 0.0  #: RETRY and FAIL: seconds until the id is due again
    outcome: Optional["Outcome"] = None  #: FAIL, GIVE_UP, UNAVAILABLE: what is recorded (its error may say more)


def next_step(out: "Outcome", tries: int, pass_no: int, cfg: "Config", stopping: bool,
              rand: Callable[[], float]) -> Step:
    """The one decision of the run: what outcome `out` of the id's try number
    `tries` in pass `pass_no` means (a refusal the host's gate took as the
    host's never comes here: see Settler.observe). `stopping`: the run is
    stopping, and a retryable failure is left pending, not recorded."""
    if out.bucket is Bucket.OK:
        return Step(Move.DONE)
    if out.bucket is Bucket.FATAL:
        return Step(Move.HALT)
    if out.bucket is Bucket.SKIP:
        return Step(Move.UNAVAILABLE, outcome=out)
    if cfg.unsafe and not out.unreached and out.status not in NOT_PROCESSED_STATUSES:
        error = f"{MAY_HAVE_BEEN_PROCESSED} ({out.error})"
        unsafe = dataclasses.replace(out, bucket=Bucket.SKIP, error=error, cause=Cause.MAY_HAVE_BEEN_PROCESSED)
        return Step(Move.UNAVAILABLE, outcome=unsafe)
    if stopping:
        return Step(Move.LEAVE)
    wait = out.retry_after
    if wait is not None and wait > cfg.max_backoff:
        out = dataclasses.replace(out, error=f"{out.error}, asked to wait {wait:g} s "
                                             f"(over --max-backoff {cfg.max_backoff:g} s)")
    elif tries < cfg.tries:
        # never sooner than the backoff: a wait of none or less than a round trip would spend its tries in a burst
        wait = max(wait or 0.0, backoff_delay(tries, cfg.backoff, cfg.max_backoff, rand))
        return Step(Move.RETRY, wait)
    if pass_no >= cfg.passes:
        return Step(Move.GIVE_UP, outcome=out)
    return Step(Move.FAIL, pass_wait(cfg, out.retry_after), out)


def pass_wait(cfg: "Config", retry_after: Optional[float]) -> float:
    """Seconds from an id's failed pass to its next: the cool-down, or the
    Retry-After of its last answer if that is longer."""
    return max(cfg.cooldown, retry_after or 0.0)


def recommend(bucket: Bucket, status: Optional[int], cause: Cause, reason: str, passes: int,
              many: bool = False) -> str:
    """The plain-words next step for an id (or, with many, a group of ids) that ends up unavailable."""
    it, item = ("them", "the items") if many else ("it", "the item")
    if cause is Cause.MAY_HAVE_BEEN_PROCESSED:
        return f"may have been processed: check {item} upstream; to send {it} again, " \
               "rerun with --retry-unsafe --retry-unavailable"
    if cause is Cause.DOT_SEGMENT:
        return f"the URL cannot hold such an id: drop {it} from the input list, or put {{id}} in the query"
    if bucket is Bucket.SKIP:
        if status == 404:  # never there, or gone: a refresh's gone ids say "removed upstream" in their reason
            return f"not found (404): check {it} or drop {it} from the input list"
        if status == 410:
            return f"gone for good (410): drop {it} from the input list"
        if status == 400:
            return "rejected as a bad request (400): check the ids and the --url template"
        if cause is Cause.TOO_LARGE:
            return "too large to read: raise --max-bytes, then rerun with --retry-unavailable"
        if status is None:
            return "fix the URL or the host, then rerun with --retry-unavailable"
        return f"{status} is not retried: check {item} upstream, or add {status} to --retry"
    after = f"after {passes} pass{'es' if passes != 1 else ''}"
    if status == 429 or cause is Cause.THROTTLED:
        return f"refused for itself {after} while the host took others: check {item} upstream, " \
               "or rerun later with --retry-unavailable"
    if cause is Cause.TIMEOUT:
        return f"still timing out {after}: raise --timeout, or rerun later with --retry-unavailable"
    if cause is Cause.BAD_BODY:
        return f"still {reason} {after}: look at one response (a login wall, an error page?), " \
               "then rerun with --retry-unavailable"
    if cause is Cause.UNREACHED:
        return f"host not reachable ({reason}) {after}: check the URL's host, " \
               "or rerun with --retry-unavailable once it is back"
    shown = status if status is not None else reason
    return f"still {shown} {after}: check {item} upstream, or rerun with --retry-unavailable"


# ----------------------------------------------------- URL and text helpers


#: Characters never printed raw: C0 and C1 controls, DEL, and the Unicode
#: marks that reorder what a terminal shows. An id is data, not escape codes.
UNPRINTABLE = {c: f"\\x{c:02x}" if c < 256 else f"\\u{c:04x}"
               for c in [*range(32), *range(127, 160), 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]}


def shown_text(text: str) -> str:
    """text with every control character escaped (\\x1b, \\u202e): safe on a terminal."""
    return text.translate(UNPRINTABLE)


def duration(seconds: float) -> str:
    """'42 s', '3m12s', '2h05m': short enough for a status line."""
    seconds = max(1, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def key_in_query(item_id: str) -> bool:
    return "?" in item_id and bool(KEY_PARAM.search(item_id))


def keyed_ids_warning(keyed: int) -> Optional[str]:
    """A warning when `keyed` URL-list ids carry a key in their query: the
    ledgers keep ids as given (a rerun matches them against the ids file),
    so the key is in done.txt and the other ledgers; outputs hide it."""
    if not keyed:
        return None
    return (f"{keyed} {'ids carry' if keyed != 1 else 'id carries'} a key-like query parameter: the state files keep ids "
            "as given, key included (outputs show it as REDACTED); to keep a key out of every file, "
            "send it with -H or --url as ${VAR}")


def shown_path(path: Path) -> str:
    """A path as text UTF-8 can hold: a byte of the file system's that is no
    UTF-8 (a surrogate escape in Python) shown as U+FFFD."""
    return os.fsencode(path).decode("utf-8", "replace")


#: An id longer than this is shown cut, its length said: a line or a report stays readable.
SHOWN_ID_CHARS = 240


def shown_id(item_id: str) -> str:
    """An id as every output shows it: a URL's password and key-like query
    values hidden. The ledgers keep ids as given (they are what a rerun
    matches against the ids file)."""
    try:
        shown = redact_url(item_id) if "://" in item_id else item_id
    except ValueError:  # not a URL after all (an unclosed '['): nothing in it is a query value
        shown = item_id
    if len(shown) <= SHOWN_ID_CHARS:
        return shown
    return f"{shown[:SHOWN_ID_CHARS // 2]}...({len(shown)} characters)...{shown[-SHOWN_ID_CHARS // 4:]}"


def redact_url(url: str) -> str:
    """The URL with its userinfo's secret (the password, or a token given
    alone: https://TOKEN@host) and the values of key-like query parameters
    hidden; a URL that does not parse is redacted as text all the same."""
    if "?" not in url and "@" not in url and ";" not in url:
        return url  # nothing to hide, and no parsing on the per-request path
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed '[': no parts, but no secret shown either
        head, mark, query = url.partition("?")
        return USERINFO.sub(_redact_userinfo, head) + mark + _redact_query(query)
    netloc = USERINFO.sub(_redact_userinfo, "//" + parts.netloc)[2:]
    return urlunsplit((parts.scheme, netloc, parts.path, _redact_query(parts.query), parts.fragment))


#: The userinfo of a URL's authority, and the separators of its query's pairs (';' as some servers read them).
USERINFO = re.compile(r"//([^/?#]*)@")  # up to the authority's last '@', where urllib3 splits it
QUERY_SEPARATOR = re.compile(r"([&;])")


#: A JSON member with a string value: "name": "value".
JSON_MEMBER = re.compile(r'("((?:[^"\\]|\\.)*)"\s*:\s*)"((?:[^"\\]|\\.)*)"')


def redact_data(text: str) -> str:
    """A --data template as run.json may keep it: the literal value of a
    key-like field (JSON "api_key": "...", or form api_key=...) hidden; a
    ${VAR} reference is kept, to be read again."""
    def member(match) -> str:
        keyed = SECRET_NAME.search(match.group(2)) and not ENV_REF.fullmatch(match.group(3))
        return f'{match.group(1)}"REDACTED"' if keyed else match.group(0)
    return JSON_MEMBER.sub(member, text) if text.lstrip()[:1] in ("{", "[") else _redact_query(text)


def hidden(value: str, digest: bool) -> str:
    """What is kept of a value that could be a secret: REDACTED, and in
    run.json a short digest of it, so a changed value is a changed request."""
    return f"REDACTED~{hashlib.sha256(value.encode()).hexdigest()[:8]}" if digest else "REDACTED"


@functools.lru_cache(maxsize=64)  # one template, asked for every result line
def kept_url(spec: str, public: tuple = (), digest: bool = False) -> str:
    """A --url template as outputs show it (and run.json keeps it, digest
    set): the userinfo's secret hidden, and every query value unless it
    holds {id}, is a ${VAR} reference, or its name is given --public. What
    could be a secret is not kept unless it is known not to be one."""
    if spec in ("{id}", "--demo"):
        return spec
    public = frozenset(public)

    def pair(text: str) -> str:
        name, eq, value = text.partition("=")
        subject = value if eq else name  # a bare ?TOKEN is all value
        keep = "{id}" in subject or ENV_REF.fullmatch(subject) or HIDDEN.fullmatch(subject) or \
            (eq and (not value or unquote_plus(name) in public))
        return text if keep or not text else f"{name if eq else ''}{eq}{hidden(subject, digest)}"
    try:
        parts = urlsplit(spec)
        netloc, path, query, fragment = USERINFO.sub(_redact_userinfo, "//" + parts.netloc)[2:], parts.path, \
            parts.query, parts.fragment
        head = f"{parts.scheme}://{netloc}{path}" if parts.scheme else f"{netloc}{path}"
    except ValueError:  # an unclosed '[': redacted as text all the same
        head, _, rest = spec.partition("?")
        head, (query, _, fragment) = USERINFO.sub(_redact_userinfo, head), rest.partition("#")
    if not query and "?" not in spec:
        return head + (f"#{fragment}" if fragment else "")
    query = "".join(part if n % 2 else pair(part) for n, part in enumerate(QUERY_SEPARATOR.split(query)))
    return f"{head}?{query}" + (f"#{fragment}" if fragment else "")


def kept_data(spec: str, public: Iterable[str] = (), digest: bool = False) -> str:
    """A --data template as run.json keeps it: as given when every value in
    it is {id}, a ${VAR} reference or JSON's true, false and null (a form's
    field named --public may hold a literal); else hidden whole."""
    if HIDDEN.fullmatch(spec):
        return spec  # hidden already, as run.json keeps it
    rest = ENV_REF.sub("", spec).replace("{id}", "")
    if spec.lstrip()[:1] in ("{", "["):
        rest = re.sub(r"\b(?:true|false|null)\b", "", JSON_NAME.sub("", rest))
        literal = bool(re.sub(r'[\s"{}\[\],:]', "", rest))
    else:
        public = frozenset(public)
        literal = any((value if eq else name).strip() and not (eq and unquote_plus(name) in public)
                      for name, eq, value in (p.partition("=") for p in re.split("[&;]", rest)))  # form, or text
    return hidden(spec, digest) if literal else spec


#: A value hidden already: REDACTED, with its digest in run.json.
HIDDEN = re.compile(r"REDACTED(?:~[0-9a-f]{8})?")

#: A JSON member's name, with its colon.
JSON_NAME = re.compile(r'"(?:[^"\\]|\\.)*"\s*:')


def _redact_query(query: str) -> str:
    return "".join(part if n % 2 else _redact_pair(part) for n, part in enumerate(QUERY_SEPARATOR.split(query)))


def _redact_userinfo(match) -> str:
    """user:password@ keeps the user; a lone TOKEN@ is all secret."""
    user, colon, _ = match.group(1).partition(":")
    return f"//{user}:REDACTED@" if colon else "//REDACTED@"


def key_like(name: str) -> bool:
    """Is a query parameter's name a secret's, as the server reads it (percent-decoded)?"""
    return SECRET_NAME.search(unquote_plus(name)) is not None


def _redact_pair(pair: str) -> str:
    """name=REDACTED for a key-like name."""
    name, eq, value = pair.partition("=")
    if eq and key_like(name) and not ENV_REF.fullmatch(value):
        return f"{name}=REDACTED"
    return pair


def shown_url(request: "Request", item_id: str) -> str:
    """An id's request URL as every output shows it: the template as
    kept_url shows it, with the id in; a URL list's id with its key-like
    values hidden (the ids file is the user's own, and done.txt keeps it)."""
    if request.url_spec == "{id}":
        return shown_id(item_id)
    return build_url(kept_url(request.url_spec, request.public), item_id)


def build_url(template: str, item_id: str) -> str:
    """The request URL: the id itself, or the template with {id} percent-encoded."""
    if template == "{id}":
        return item_id
    return template.replace("{id}", quote(item_id, safe=""))


def makes_dot_segment(template: str, item_id: str) -> bool:
    """True when the id, put in the template, makes a path segment of '.' or
    '..'. Every URL library and server reads those as steps (requests sends
    /item/.. as /, DELETE included), and a server decodes %2E before it does,
    so no encoding helps: such an id is never sent. The id cannot hold a
    '/' (it is encoded), so its URL has the template's segments, one for one."""
    if "." not in item_id or template == "{id}":
        return False
    ours = urlsplit(build_url(template, item_id)).path.split("/")
    given = urlsplit(template).path.split("/")
    return any(seg in (".", "..") and given[n] not in (".", "..") for n, seg in enumerate(ours) if n < len(given))


def build_body(template: str, item_id: str, as_json: bool) -> bytes:
    """The request body: {id} JSON-escaped in a JSON body, form-encoded in any other."""
    value = json.dumps(item_id, ensure_ascii=False)[1:-1] if as_json else quote_plus(item_id)
    return template.replace("{id}", value).encode("utf-8")


def url_problem(url: str) -> Optional[str]:
    """Why url cannot be requested, in a few words; None when it can."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return "is not an http(s) URL"
        parts.port  # raises for a port that is not a number from 0 to 65535
        urllib3.util.parse_url(url)  # the parser that sends it
    except (ValueError, urllib3.exceptions.LocationParseError):
        return "is not a valid URL (a port that is not a number from 1 to 65535, an unclosed '[', " \
               "or a host with a space or a '%')"
    if not host_name_ok(parts.hostname):
        return f"has a host no request can reach ({shown_text(parts.hostname[:80])!r}: not a name or an address)"
    return None


HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)", re.ASCII)


def host_name_ok(host: str) -> bool:
    """An IP address, or a DNS name (IDNA for other scripts): labels of 1 to 63
    letters, digits, '-' or '_', 253 characters at most, a final dot allowed."""
    try:
        ipaddress.ip_address(host.split("%")[0] if ":" in host else host)
        return True
    except ValueError:
        pass
    try:
        ascii_host = host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        return False
    labels = ascii_host[:-1].split(".") if ascii_host.endswith(".") else ascii_host.split(".")
    return len(ascii_host) <= 253 and all(HOST_LABEL.fullmatch(label) for label in labels)


def parse_codes(text: str) -> frozenset:
    """'429,500-599' -> the set of those statuses; raises ValueError on junk."""
    codes = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if not 100 <= first <= last <= 599:
            raise ValueError(part)
        codes.update(range(first, last + 1))
    if not codes:
        raise ValueError(text)
    return frozenset(codes)


def resolve_buckets(fatal, retry, skip) -> tuple:
    """Status sets from the options: a code the user names wins over a default."""
    given = {"fatal": fatal, "retry": retry, "skip": skip}
    defaults = {"fatal": FATAL_STATUSES, "retry": RETRY_STATUSES, "skip": SKIP_STATUSES}
    named = set().union(*(codes for codes in given.values() if codes))
    for a, b in itertools.combinations(given, 2):
        both = (given[a] or set()) & (given[b] or set())
        if both:
            raise RedriveError(f"status {min(both)} is given to both --{a} and --{b}; name it once")
    return tuple(given[k] if given[k] else defaults[k] - named for k in ("fatal", "retry", "skip"))


def iso(epoch: float) -> str:
    """UTC timestamp with microseconds: sortable as text."""
    whole = math.floor(epoch)
    return f"{_iso_seconds(whole)}.{min(999999, round((epoch - whole) * 1e6)):06d}Z"


@functools.lru_cache(maxsize=8)
def _iso_seconds(whole: int) -> str:
    """The date and time to the second: formatted once a second, not once a request."""
    return datetime.fromtimestamp(whole, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def parse_iso(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


#: The port each scheme implies.
DEFAULT_PORTS = {"http": 80, "https": 443}


def url_origin(url: str) -> tuple:
    """(scheme, host, port or None) of a URL, as urllib reads them: lower
    case, no user:password@ part, None for a port that is not given (or is
    not a number). The one host identity the helpers below share."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.scheme.lower(), parts.hostname, port


def origin_of(url: str) -> tuple:
    """(scheme, host, port): the port filled in from the scheme, for the origin checks of redirects and cookies."""
    scheme, host, port = url_origin(url)
    return scheme, host, port or DEFAULT_PORTS.get(scheme)


def shown_host(url: str) -> str:
    """host[:port] of a URL, as messages name it (the port only when given)."""
    _, host, port = url_origin(url)
    return f"{host or ''}{f':{port}' if port else ''}"


def host_of(template: str, item_id: str) -> str:
    """The gate an id's request goes through: one per origin, as origin_of
    names it (no user:password@, the scheme's default port the same as
    none), made from the netloc by string work alone: it runs for every id
    of a URL list, and parsing the port and host twice cost 3 us an id."""
    parts = urlsplit(build_url(template, item_id))
    netloc = parts.netloc.lower().rpartition("@")[2]
    default = DEFAULT_PORTS.get(parts.scheme)
    if default and netloc.endswith(f":{default}"):
        netloc = netloc[:-len(f":{default}")]
    return f"{parts.scheme}://{netloc}"


def in_shard(item_id: str, shard: tuple) -> bool:
    """Stable across machines and runs: crc32 of the UTF-8 id, modulo N."""
    k, n = shard
    return zlib.crc32(item_id.encode("utf-8")) % n == k - 1


def encoded_forms(secret: str) -> set:
    """A secret as a server may echo it back: as it is, percent-encoded,
    JSON-escaped, HTML-escaped, base64 (a Basic credential), and, for a
    header value with a scheme ('Bearer TOKEN'), its token alone. Case is
    left to the matcher (see Redactor)."""
    token = secret.rsplit(None, 1)[-1]
    forms = set()
    for value in {secret, token} if len(token) >= 8 else {secret}:
        forms |= {value, quote(value, safe=""), quote_plus(value), quote(value), html.escape(value),
                  html.escape(value, quote=False), json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1],
                  json.dumps(value).replace("/", "\\/")[1:-1], base64.b64encode(value.encode()).decode()}
    return forms


class Redactor:
    """Replaces every known secret in a text with '***', in each of its
    encoded forms (encoded_forms), whatever their case."""

    def __init__(self, secrets: Iterable[str]):
        forms = {form for secret in secrets if len(secret) >= 3 for form in encoded_forms(secret)}
        self.secrets = sorted((form for form in forms if len(form) >= 3), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, self.secrets)), re.I) if self.secrets else None

    def __call__(self, text: str) -> str:
        return self.pattern.sub("***", text) if self.pattern is not None else text

    def excerpt(self, text: str, size: int) -> str:
        """The first size characters of text, redacted before the cut: a
        secret that starts just before it never shows its first characters."""
        longest = len(self.secrets[0]) if self.secrets else 0
        return self(text[:size + longest])[:size]


# --------------------------------------------------------------- host gates

#: Slow start: a low limit meets a handful of requests, not --concurrency; each answer adds half a request.
START_LIMIT = 4
SLOW_START_STEP = 0.5

#: The answers the share rule counts refusals in, and a background sample's size. The pace a host
#: took is the lower of its pace over them and over its unit, RATE_SPAN or its window if longer: a burst is none.
SHARE_ANSWERS = 50
RATE_SPAN = 1.0

#: Refusals are the host's past its background bN + SHARE_SIGMAS * sqrt(bN) + 1:
#: so many standard deviations of a Poisson count, and never one refusal alone.
SHARE_SIGMAS = 2.0

#: CUBIC's cut (RFC 9438) to BETA x W_max, shallower than TCP's 0.7 (a limit is a fixed line, not a shared link), and
#: its time scale: back at W_max after CUBIC_C requests' time at it (slow limits probed as rarely per request as fast).
BETA = 0.85
CUBIC_C = 60.0

QUOTA_MARGIN = 0.1  #: slack after a declared reset, for two clocks a little apart


@dataclass
class Quota:
    """A declared quota as the gate keeps it: requests it may still send before `reset_at`."""

    left: float
    reset_at: float
    limit: Optional[float] = None
    remaining: float = 0.0  #: the least the server said is left in the window, as shown
    share: float = 1.0  #: requests this run may send per unit left: 1 / what the count falls by per answer
    answered: int = 0  #: this run's answers that declared the window since its first declaration
    spent: float = 0.0  #: what the declared remaining fell by meanwhile, everyone's requests
    largest: float = 0.0  #: the most it fell by between two answers: one burst of another client's

    def pace(self, now: float, wanted: int) -> Optional[float]:
        """What is left spread up to the reset; None when spent or over, or when `wanted` cannot spend it."""
        return self.left / (self.reset_at - now) if 1 <= self.left <= wanted and self.reset_at > now else None


@dataclass
class Host:
    """One origin's gate: how many requests may be in flight, and when the next may go, under --rate.

    1. A declared quota is believed: what is left (less what is in flight, a unit worth 1 / its fall per answer over
       this window and the last, each one's largest fall left out) spread up to its reset, as the latest answer tells;
       none left, one request after it.
       The tightest bucket governs; a renewed window whose first success says none of 2+ is left: none believed since.
    2. In flight: --per-host at most; in slow start START_LIMIT, SLOW_START_STEP more per answer, one less per refusal.
    3. A fresh refusal (429 or 503 of an id not refused for itself just before) is the host's if it says it is a rate
       limit, or if those in its last SHARE_ANSWERS answers sent since the cut exceed bN + SHARE_SIGMAS sqrt(bN) + 1
       (b: its share refused while paced below W_max, at no pace a later cut finds over it; 1/N unmeasured).
    4. The host's refusal of a request sent after the last cut (or search) is a cut: W_max the pace it took, or over the unit
       of sends before its first refusal since if higher, or since that if a unit ago, 1 in 3 refused at most; the rate BETA W_max, then
       W(t) = W_max (1 - BETA) ((t - K) / K)^3 + W_max, K = CUBIC_C 2^n / W_max in [unit, (n + 1) --max-backoff], n: cuts in a
       row within [BETA, 1/BETA] of the last. N answers over the bar (N/2+ after the last or only cut) undo them; twice, their refusals.
    5. A cut after its only take, or a fresh refusal with none taken since the cut, tests with requests it sends one at a time the
       gap from the last take's send to the next take: the geometric mean of the longest refused (reset at its first take) and
       shortest taken (first --max-backoff; after 2+ takes, at most 2x the longest refused), or a Retry-After. A take after 2+ (a
       quota renewed) ends it: W_max its takes over its window, the curve at its top, the unit its shortest window over RATE_SPAN.
       One take's interval ends within sqrt(BETA): W_max 1 / the shortest taken; taken at its fastest, slow start, met anew. Refused all
       past --max-backoff: the run ends. paces.json starts the curve; CUBIC_C takes over it, none refused: slow start.
    """

    cap: int  #: --per-host, or --concurrency
    longest: float = 60.0  #: --max-backoff: no slot or probe of the model waits longer
    limit: float = float(START_LIMIT)  #: in flight at most, in slow start
    ready: deque = field(default_factory=deque)  #: items whose time has come
    inflight: int = 0
    paused_until: float = 0.0
    next_slot: float = 0.0
    first_sent: Optional[float] = None
    recent: deque = field(default_factory=deque)  #: (time, fresh refusal, taken, sent) of its last answers
    w_max: Optional[float] = None  #: the pace taken at the last cut (None: never cut)
    cut_at: float = -math.inf
    since_cut: int = 0  #: its takes since the last cut of requests sent since the one before
    before_cut: float = -math.inf  #: the cut before the last
    k: float = RATE_SPAN  #: K: seconds from the last cut back to W_max (see 4)
    hold: float = 1.0  #: K's CUBIC_C requests, doubled for each cut in a row that found about the same W_max
    again: int = 0  #: those cuts in a row: K is at most --max-backoff for each, and one more
    last_ok: float = -math.inf  #: its last answer that was no refusal
    ok_sent: float = -math.inf  #: when that one was sent
    refusing_since: Optional[float] = None  #: refusing everything since (see 5)
    bounds: Optional[list] = None  #: [lo, hi] s: the gap from its last take to its next, searched for (see 5)
    searching: float = math.inf  #: when that search began: answers to requests sent before are no tests of it
    cycle: Optional[tuple] = None  #: (sent, takes before it) of the take that began its cycle (see 5)
    window: float = 0.0  #: its shortest cycle of a quota (see 5; 0: none seen)
    takes: int = 0  #: its answers that were no refusal
    refusals: int = 0  #: its refusals of any kind
    sample: Optional[list] = None  #: answers, fresh refusals, those over a limit found since (see 3), the answers and
    #: fresh refusals since the last cut, and its cuts, until N answers
    doubt: Optional[int] = None  #: refusals the cuts explained in a sample that brought no relief (see 4)
    below: list = field(default_factory=lambda: [0, 0])  #: the same, summed over every sample completed
    quotas: dict = field(default_factory=dict)  #: bucket -> Quota
    renewed: set = field(default_factory=set)  #: buckets whose window ran out, until the next declares it
    before: dict = field(default_factory=dict)  #: bucket -> (answers, falls but the largest) of its last window
    believed: bool = True  #: its declared quotas are believed (see declared)
    unreached: int = 0  #: requests in a row that never reached the host
    down_since: Optional[float] = None
    probes: int = 0  #: probes that failed since it went down
    probing: bool = False  #: the one request let through while down is out
    heard_at: float = -math.inf  #: its last answer of any kind (see Settler.observe)
    firsts: tuple = (0, 0)  #: answers to ids not refused just before, and its refusals of them (see Settler.observe)

    def rate(self, now: float) -> Optional[float]:
        """The CUBIC rate at `now`, req/s (None: the host was never cut)."""
        curve = None if self.w_max is None else self.w_max * (1 - BETA) / self.k ** 3 * (now - self.cut_at - self.k) ** 3
        return None if curve is None else max(curve + self.w_max, 1 / self.longest)

    def opens_at(self, now: float) -> Optional[float]:
        """When the gate lets the next request through: now, later, or None (full)."""
        renewed = any(q.reset_at + QUOTA_MARGIN <= now for q in self.quotas.values())
        one = self.down_since is not None or self.bounds is not None or renewed  # a search, or down (see 5)
        ceiling = 1 if one else min(self.cap, int(self.limit)) if self.w_max is None else self.cap
        spent = [q.reset_at + QUOTA_MARGIN for q in self.quotas.values() if q.left < 1]
        return None if self.inflight >= ceiling else max(now, self.paused_until, self.next_slot, *spent)

    def start(self, now: float) -> None:
        self.inflight += 1
        self.first_sent = now if self.first_sent is None else self.first_sent
        self.probing = self.down_since is not None
        # a remembered W_max the host took CUBIC_C requests more than, none refused, is no longer there (a burst is less)
        if self.w_max and not self.refusals and self.takes >= self.w_max * (now - self.cut_at) + CUBIC_C:
            self.w_max, self.window, self.first_sent = None, 0.0, now  # the host met anew (see 5)
        gap = self.gap(now)
        for quota in self.quotas.values():
            quota.left -= 1
        self.next_slot = max(self.next_slot, now) + gap

    def gap(self, now: float) -> float:
        """The gap before the next request, at the slowest pace the curve or a declared quota sets (0: none)."""
        paces = [p for p in (self.rate(now), *(q.pace(now, len(self.ready)) for q in self.quotas.values())) if p]
        return 1.0 / min(paces) if paces else 0.0

    def succeeded(self, now: float, sent: float, declared: Optional[Declared] = None) -> None:
        """Any answer but a refusal (a 404 or a 500 says nothing of pace)."""
        self.answered(now, sent, declared, fresh=False, taken=True)
        if self.bounds is not None and sent >= self.searching:  # a test of the search (see 5)
            self.searched(now, sent, None, taken=True)
        self.last_ok, self.ok_sent, self.refusing_since, self.takes = now, sent, None, self.takes + 1
        self.since_cut += sent > self.before_cut
        self.limit = min(self.cap, self.limit + SLOW_START_STEP) if self.w_max is None else self.limit  # slow start

    def throttled(self, now: float, sent: float, wait: Optional[float], fresh: bool = True,
                  said: bool = False, declared: Optional[Declared] = None) -> bool:
        """A refusal of a request sent at `sent`, asking `wait` s (None: not said); `fresh`: the id's last
        answer was no refusal of its own; `said`: it says it is a rate limit. True when the host's (see 3)."""
        self.answered(now, sent, declared, fresh=fresh, taken=False)
        self.refusals += 1
        spent = declared is not None and declared.remaining < 1 and declared.reset > 0  # a reset now or past: no wait
        refusing = fresh and self.idle_since_cut()  # nothing taken since the cut: it refuses everything (see 5); an
        # id's refusal again is no sign of it: ids in trouble of their own would start a search whose tests are theirs
        if self.bounds is not None and not spent:  # a test of the search (see 5)
            self.searched(now, sent, wait, taken=False)
            return True
        if not (said or spent or refusing or sent <= self.cut_at or fresh and self.over_background()):
            self.limit = max(1.0, self.limit - 1.0) if self.w_max is None else self.limit  # a refused slot: not refilled
            return False
        if spent or sent <= self.cut_at:  # the quota's gate waits for its reset; one cut per round trip
            self.paused_until = max(self.paused_until, now + wait) if spent and wait is not None else self.paused_until
            # a reset that never comes (spent again at each): it refuses everything since, as in a search (see 5)
            self.refusing_since = now if spent and self.refusing_since is None else self.refusing_since
            return True
        if not refusing:
            self.cut(now)
        if refusing or self.takes == 1:  # a quota ran out, or one take is no pace: search for the next take (see 5)
            # the cut did not hold: no measure of the background; a request sent before now is no test (see 5)
            self.bounds, self.sample, self.searching = [0.0, self.longest], None, now
            self.searched(now, sent, wait, taken=False)
        return True

    def cut(self, now: float) -> None:
        """W_max to the higher of the pace the host took and its pace over the unit before the first refusal since the
        cut or search, in sends (a limit with no slack takes half once passed; answer times add the spread of their
        delays to the span, the host took them as they came), or to its pace since that refusal if a unit ago
        with two in three taken since (a limit with slack takes all it can once passed; the unit before, its burst fed);
        the rate to BETA W_max (see 4)."""
        unit = max(RATE_SPAN, self.window)  # a window's pace measured over less than it aliases
        cycle = (self.cycle or (-math.inf,))[0]  # since a search's end (see 5)
        last = max(self.recent[-min(len(self.recent), SHARE_ANSWERS)][0], cycle)  # this cycle's
        took = min(self.taken(now, last), self.taken(now, now - unit))
        begun = max(self.cut_at, cycle)  # a search's refusals are no pace's
        onset = next((at for at, fresh, _, sent in self.recent if fresh and sent > begun), now)
        since = min((sent for _, fresh, _, sent in self.recent if fresh and sent > begun), default=now)  # the onset's send
        takes = sorted(sent for _, _, ok, sent in self.recent if ok and self.first_sent + unit <= sent < since)  # no first burst
        start = max((i for i, at in enumerate(takes) if at <= since - unit), default=len(takes))
        top = takes[start:]  # from the last take sent at or before the unit that ends at the onset's send
        w_max = max(took, (len(top) - 1) / (top[-1] - top[0]) if len(top) >= 2 else 0.0)
        after = [ok for at, _, ok, _ in self.recent if at >= onset]  # no slack refuses one in two once passed at least
        if now - onset >= unit and 3 * after.count(False) <= len(after):  # slack: what it took is its limit
            w_max = self.taken(now, onset)
        over = [sent for _, fresh, _, sent in self.recent if fresh and sent > self.cut_at]  # sampled if under W_max,
        over = sum(1 for sent in over if w_max <= self.rate(sent) < self.w_max) if self.w_max else 0  # not if over this one
        self.sample = self.sample or [0, 0, 0, 0, 0, 0]  # cuts in a row share one sample (see 4)
        self.sample[3:] = [0, 0, self.sample[5] + 1]  # whether the cuts brought relief shows after the last of them
        self.again = self.again + 1 if self.w_max and BETA <= w_max / self.w_max <= 1 / BETA else 0  # found again
        span, self.sample[2] = (self.again + 1) * self.longest, self.sample[2] + over
        self.hold = max(1.0, min(2 * self.hold, span * w_max / CUBIC_C)) if self.again else 1.0
        self.climb(now, w_max)

    def recall(self, now: float, pace: float, window: float) -> None:
        """A limit an earlier run found (paces.json): its first request starts the curve as that cut did (see 5)."""
        self.window = window
        self.climb(now, pace)

    def climb(self, now: float, w_max: float, top: bool = False) -> None:
        """The curve of 4 from a cut at `now` to BETA `w_max` (`top`: at W_max), K no shorter than its quota's window."""
        k = max(CUBIC_C * self.hold / w_max, RATE_SPAN, self.window)
        self.k = min(k, (self.again + 1) * self.longest)  # a limit found again and again is probed more and more rarely
        self.before_cut, self.since_cut = self.cut_at, 0
        self.w_max, self.cut_at = w_max, now - self.k if top else now
        self.next_slot = max(self.next_slot, now + 1.0 / self.rate(now))

    def searched(self, now: float, sent: float, wait: Optional[float], taken: bool) -> None:
        """A test of the gap from the host's last take to its next (see 5): taken, the gap is at most the test's;
        refused, longer (if no shorter than one taken or said, the host changed), or as its Retry-After says."""
        last = max(self.ok_sent, self.first_sent)  # gaps as the server sees them, from the last take's send
        if not taken and self.idle_since_cut() and self.refusing_since is None:
            self.refusing_since = self.cut_at  # it refuses everything since the cut
        (lo, hi), gap = self.bounds, max(sent - last, MIN_WAIT)
        changed = not taken and gap >= hi  # refused where it took, or where it said it would: its word is no guide
        # a take right after a take, at no shorter gap: one request at a time can test none shorter
        floor = taken and gap >= hi and self.recent[-2][2]
        lo, hi = (lo, min(hi, gap)) if taken else (max(lo, gap), max(self.longest, 2 * gap) if changed else hi)
        if wait is not None and not changed:
            lo = hi = max(lo, now + wait - last)
        lo = 0.0 if taken and not self.takes else lo  # its first take: refusals before any take are no gap between two
        since, before = self.cycle or (self.first_sent, 0)
        quota, window = self.takes - before, last - since + math.sqrt(lo * hi)  # its takes in the cycle, and its end
        if taken and (quota >= 2 or math.sqrt(BETA) * hi <= lo):  # a quota renewed, or one take's interval found
            self.window = min(self.window or math.inf, max(window, MIN_WAIT)) if quota >= 2 else self.window
            w_max = min(self.w_max, quota / self.window) if quota >= 2 else 1.0 / hi  # a quota's takes over its window
            self.bounds, self.sample, self.cycle = None, [0, 0, 0, 0, 0, 0], (sent, self.takes)
            self.climb(now, w_max, top=quota >= 2 and w_max < self.w_max)  # a quota is no pace found over the limit
        elif floor:  # it takes as fast as a search can test: no interval to find, slow start, and the host met anew
            # (a cut measures no pace over the search, which held it to one request at a time)
            self.bounds, self.sample, self.cycle, self.w_max, self.cut_at = None, None, (sent, self.takes), None, -math.inf
            self.first_sent = sent
        else:
            step = hi if math.sqrt(BETA) * hi <= lo else math.sqrt(lo * hi)  # bisection in ratio, to within sqrt(BETA)
            at = (sent if taken else last) + (step if quota < 2 else min(step, 2 * lo))  # a quota's end: found late x2 at most
            self.bounds, self.next_slot = [lo, hi], min(at, now + max(self.longest, wait or 0.0))
            self.cycle = (sent, self.takes) if taken else self.cycle

    def idle_since_cut(self) -> bool:
        """Has it taken nothing since the last cut? Counted in answers, not time: a take answered at the cut's instant
        but before it is no take since; nor one sent before the cut before, which no pace since then explains (a
        straggler of a slow answer, the quota spent since)."""
        return self.cut_at > -math.inf and not self.since_cut

    def taken(self, now: float, since: float) -> float:
        """The pace of the answers it took since `since` (not before its first request)."""
        since = since if self.first_sent is None else max(since, self.first_sent)
        return max(sum(1 for at, _, ok, _ in self.recent if ok and at >= since), 1) / max(now - since, MIN_WAIT)

    def answered(self, now: float, sent: float, declared: Optional[Declared] = None, fresh: bool = False,
                 taken: bool = False) -> None:
        """One answer (or none to a request that reached it: no sign either way), counted; its declared quota kept."""
        self.inflight -= 1
        self.recent.append((now, fresh, taken, sent))
        while len(self.recent) > SHARE_ANSWERS and self.recent[0][0] < now - max(RATE_SPAN, self.window):
            self.recent.popleft()
        if self.sample is not None and sent > self.cut_at and self.rate(sent) < self.w_max:  # paced below it
            self.sample[0], self.sample[1], self.sample[3], self.sample[4] = \
                self.sample[0] + 1, self.sample[1] + fresh, self.sample[3] + 1, self.sample[4] + fresh
            # a search's sample cut once: the refusals before the cut were the climb to it, relief shows after it
            if self.sample[0] >= SHARE_ANSWERS and (2 * self.sample[3] >= SHARE_ANSWERS or self.sample[5] != 1):
                self.sampled()
        for bucket in [b for b, q in self.quotas.items() if q.reset_at + QUOTA_MARGIN <= now]:
            quota = self.quotas.pop(bucket)  # renewed: the next declaration tells the new window
            self.before[bucket] = (quota.answered, quota.spent - quota.largest)
            self.renewed.add(bucket)
        if declared is not None and self.believed:
            self.declared(now, declared, taken)

    def declared(self, now: float, declared: Declared, taken: bool = True) -> None:
        """A quota an answer declared. What is left is worth as many requests as the count falls by per answer of
        this run's in the window and the one before (more when other clients spend the key, less when some answers
        cost nothing), each window's largest fall left out (another client's burst is no steady rate) and the first
        answer costing one."""
        held, reset_at = self.quotas.get(declared.bucket), now + declared.reset
        if declared.bucket in self.renewed and held is None:
            self.renewed.discard(declared.bucket)
            if taken and declared.remaining < 1 and (declared.limit or 0) >= 2:  # renewed, yet spent: a lie (see 1)
                self.believed, self.quotas = False, {}
                return
        quota = Quota(0.0, reset_at, declared.limit, declared.remaining, held.share if held else 1.0)
        same = held is not None and abs(held.reset_at - reset_at) < 1.0  # the same window (resets are in seconds)
        if same:
            quota.reset_at = min(reset_at, held.reset_at)  # a reset in whole seconds is late by up to one
            quota.remaining = min(declared.remaining, held.remaining)  # an overtaken answer says more is left
            fall = held.remaining - quota.remaining
            quota.answered, quota.spent, quota.largest = held.answered + 1, held.spent + fall, max(held.largest, fall)
        if same or held is None:  # with the window before: a window's first answers show no fall yet
            answers, falls = self.before.get(declared.bucket, (0, 0.0))
            counted = quota.answered + answers
            quota.share = counted / (quota.spent - quota.largest + falls + 1) if counted else 1.0
        quota.left = quota.remaining * quota.share - self.inflight  # those in flight may not be counted yet
        self.quotas[declared.bucket] = quota
        if self.bounds is None:  # no later than a gap from now at the pace it tells: the slot follows the latest answer
            self.next_slot = min(self.next_slot, now + self.gap(now))

    def sampled(self) -> None:
        """N answers paced below W_max: their fresh refusals, less those at a pace a later cut found over the limit, are
        its background. Over the bar, the cuts brought no relief: W_max is forgotten; twice in a row, nor those either.
        Relief shows after the last cut: judged on the answers since it when they are half the sample or more (a lone
        cut, late in a search's sample, waits for them); cuts in a row with fewer since, on the whole sample."""
        answers, fresh, over, since, fresh_since, _ = self.sample
        relieved = fresh_since <= self.bar(since) if 2 * since >= SHARE_ANSWERS else fresh <= self.bar()
        doubted = self.doubt
        over, self.doubt = (over, None) if relieved else (over, over) if doubted is None else (-doubted, None)  # 2nd: given back
        self.w_max, self.cut_at = (self.w_max, self.cut_at) if relieved else (None, -math.inf)
        self.below, self.sample = [self.below[0] + answers, max(0, self.below[1] + fresh - over)], None

    def bar(self, answers: int = SHARE_ANSWERS) -> float:
        """The fresh refusals in `answers` its background explains (see 3): one in N, until measured."""
        expected = answers * (self.below[1] + 1) / (self.below[0] + SHARE_ANSWERS)
        return expected + SHARE_SIGMAS * math.sqrt(expected) + 1

    def over_background(self) -> bool:
        """Are the fresh refusals in its last answers sent after the last cut more than its background explains?"""
        last = itertools.islice(reversed(self.recent), SHARE_ANSWERS)
        return sum(1 for _, fresh, _, sent in last if fresh and sent > self.cut_at) > self.bar()

    def quota(self, now: float) -> Optional[tuple]:
        """(bucket, Quota): the declared quota that governs now, the one with the fewest left."""
        live = [(b, q) for b, q in self.quotas.items() if q.reset_at + QUOTA_MARGIN > now]
        return min(live, key=lambda bq: bq[1].left, default=None)

    def forgettable(self, now: float) -> bool:
        """Idle and as a new host would be (never refused): nothing is lost by dropping it."""
        return not (self.ready or self.inflight or self.w_max or self.quotas or self.unreached or self.refusals) and \
            self.paused_until <= now and self.cut_at == -math.inf  # one met anew stays, so paces.json drops its record

    def reached(self, now: float) -> None:
        """Any answer, even an error, or a connection cut after it was made: the host is there."""
        self.unreached, self.heard_at = 0, now
        if self.down_since is not None:
            self.down_since, self.probes, self.probing, self.paused_until = None, 0, False, 0.0

    def unreachable(self, now: float, wait: Callable[[int], float]) -> bool:
        """A request that never reached the host; True when the host is down. The DOWN_AFTER-th in a row takes it
        down: one request at a time, paused for wait(1); the one let through after a pause is a probe, and when
        it fails, the pause before the next is wait(failed probes + 1) (those in flight before fail too)."""
        self.inflight, self.unreached = self.inflight - 1, self.unreached + 1
        if self.down_since is None and self.unreached >= DOWN_AFTER:
            self.down_since, self.paused_until = now, max(self.paused_until, now + wait(1))
        elif self.probing:
            self.probing, self.probes = False, self.probes + 1
            self.paused_until = max(self.paused_until, now + wait(self.probes + 1))
        return self.down_since is not None


# ------------------------------------------------------------------ input


HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def check_ids_file(path: Path) -> None:
    """IDS_FILE is a regular file redrive can read; else a one-line error."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise RedriveError(f"{path}: a directory; give a text file with one id per line")
        if not stat.S_ISREG(mode):  # a FIFO would block, and a rerun must read the same ids again
            raise RedriveError(f"{path}: not a regular file (a pipe or a device); save the ids to a file, "
                               "which a rerun reads again, and give that")
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise RedriveError(f"{path}: no such file; give a text file with one id per line") from None
    except OSError as exc:
        raise RedriveError(f"{path}: cannot read it ({exc.strerror}); check the path and its permissions") from None


#: Characters other programs take for a line's end (str.splitlines does): never inside an id.
LINE_BREAKS = re.compile("[\v\f\x1c\x1d\x1e\x85\u2028\u2029]")

#: What a line may hold that calls for the slow path: whitespace to strip, a '#' comment.
STRIPPED = " \t\r\v\f\x1c\x1d\x1e\x1f#"


def id_lines(text: str) -> list:
    """Each line of text as its id: stripped, '' for a blank or '#' line. A
    million-line file of plain ids (the common case) skips the per-line strip."""
    lines = text.split("\n")
    if text.isascii() and not any(c in text for c in STRIPPED):
        return lines
    return [line if line[:1] != "#" else "" for line in map(str.strip, lines)]


def line_of(path: Path, item_id: str) -> int:
    """The first line of IDS_FILE that holds item_id (for error messages)."""
    for number, line in enumerate(path.read_bytes().decode("utf-8-sig").split("\n"), 1):
        if line.strip() == item_id:
            return number
    return 0


def check_urls(cfg: Config, ids: Iterable[str], redact: Redactor) -> int:
    """Refuse a template without {id}, or with {id} where no id can go (the
    port, the scheme), or an id that is not an http(s) URL. Returns how many
    ids (of a list of URLs) carry a key-like query parameter."""
    shown = redact(kept_url(cfg.request.url_spec, cfg.request.public))
    if "{id}" not in cfg.request.url:
        raise RedriveError(f"--url {shown!r} has no {{id}}; put {{id}} where the id goes")
    if cfg.request.url != "{id}":
        problem = url_problem(build_url(cfg.request.url, "x"))  # a word as the id: one in the port makes it no URL
        if problem == "is not an http(s) URL":
            raise RedriveError(f"--url {shown!r} is not an http(s) URL; start it with https://")
        if problem:
            raise RedriveError(f"--url {shown!r} {problem}; put {{id}} in the path or the query, never in the port")
        return 0
    keyed = 0
    for item_id in ids:
        keyed += key_in_query(item_id)
        problem = url_problem(item_id)
        if problem:
            shards = sorted(cfg.ids_file.parent.glob(f"{glob.escape(cfg.ids_file.stem)}.shard-*-of-*.redrive"))
            hint = f"; or is it run in shards ({shards[0].name}, ...)? give --shard K/N" if shards else ""
            raise RedriveError(
                f"{cfg.ids_file} line {line_of(cfg.ids_file, item_id)}: {shown_text(redact(redact_url(item_id))[:80])!r} "
                f"{problem}; list full URLs, or give --url TEMPLATE with {{id}}{hint}")
    return keyed


#: Proxy URL schemes requests can use; socks ones need PySocks.
PROXY_SCHEMES = frozenset({"http", "https", "socks4", "socks4a", "socks5", "socks5h"})

#: Origins of a list of URLs whose proxy settings are checked before the run (see check_local_settings).
CHECKED_ORIGINS = 100


def check_local_settings(cfg: Config, ids: list, redact: Redactor) -> None:
    """The proxy and CA bundle requests will use for these URLs, checked
    before anything is sent: a local setting that cannot work would fail
    every request alike, and settle every id as the server's answer. Raises
    a set-up error (exit 3) that names the setting, its value redacted."""
    urls = [build_url(cfg.request.url, "x")] if cfg.request.url != "{id}" else \
        list({origin_of(i): i for i in itertools.islice(ids, 10 * CHECKED_ORIGINS)}.values())[:CHECKED_ORIGINS]
    bundle = next(((name, os.environ[name]) for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
                   if os.environ.get(name)), None)
    if bundle and any(u.startswith("https:") for u in urls):
        problem = bundle_problem(bundle[1])
        if problem:
            raise RedriveError(f"{bundle[0]}={shown_text(bundle[1])!r} {problem}: every https request would fail; "
                               "point it at a CA bundle or unset it", ExitCode.FATAL)
    for url in urls:
        proxy = requests.utils.select_proxy(url, requests.utils.get_environ_proxies(url))
        if not proxy:
            continue
        shown = redact(redact_url(proxy))
        try:
            parsed = urllib3.util.parse_url(requests.utils.prepend_scheme_if_needed(proxy, "http"))  # as requests does
        except (ValueError, urllib3.exceptions.LocationParseError):
            parsed = None
        if parsed is None or parsed.scheme not in PROXY_SCHEMES or not parsed.host:
            raise RedriveError(f"the proxy {shown!r} (from the *_proxy environment) is not a proxy URL; "
                               "fix it, or unset it", ExitCode.FATAL)
        if parsed.scheme.startswith("socks"):
            if importlib.util.find_spec("socks") is None:  # PySocks: what requests needs for a socks proxy
                raise RedriveError(f"the proxy {shown!r} is a socks proxy, and PySocks is not installed: "
                                   "pip install 'requests[socks]', or unset it", ExitCode.FATAL)


def bundle_problem(path: str) -> Optional[str]:
    """Why a CA bundle (a file, or a folder of certificates) cannot verify
    anything, as ssl loads it; None when it holds a certificate."""
    if not os.path.exists(path):
        return "names no file"
    files = [os.path.join(path, n) for n in sorted(os.listdir(path))[:1000]] if os.path.isdir(path) else [path]
    for name in files:
        try:
            ssl.create_default_context(cafile=name)
            return None
        except (ssl.SSLError, OSError, ValueError):
            continue
    return "holds no certificate ssl can load" if os.path.isfile(path) else "is a folder with no certificate ssl can load"


def expand_env(text: str, environ, where: str) -> str:
    """Replace each ${VAR} in text with its value from the environment."""
    def value(match):
        if match.group(1) not in environ:
            raise RedriveError(f"{where}: environment variable {match.group(1)} is not set; export it first")
        return environ[match.group(1)]

    return ENV_REF.sub(value, text)


def env_values(text: str, environ) -> list:
    """The values of the ${VAR} references in text (they may be secrets)."""
    return [environ[name] for name in ENV_REF.findall(text) if name in environ]


def parse_header(text: str, environ) -> tuple:
    """'Name: value with ${VAR}' -> (name, value, spec); spec is the value
    when it is a pure ${VAR} reference (safe to record), else None."""
    name, colon, spec = text.partition(":")
    name, spec = name.strip(), spec.strip()
    if not colon or not HEADER_NAME.match(name):
        raise RedriveError(f"-H {name[:40]!r}: write it as -H 'Name: value'")
    value = expand_env(spec, environ, f"-H {name}")
    if "\n" in value or "\r" in value:
        raise RedriveError(f"-H {name}: the value holds a line break; remove it")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        raise RedriveError(f"-H {name}: the value has characters HTTP headers cannot carry (only Latin-1); "
                           "percent-encode them, or leave them out") from None
    return name, value, spec if STORABLE_HEADER.fullmatch(spec) else None


# ---------------------------------------------------------- state directory


class RunLock:
    """An exclusive flock on STATE_DIR/lock: no two runs share a state dir.
    The kernel drops the lock when its process dies, so a stale lock never blocks."""

    def __init__(self, state_dir: Path, wallclock: Callable[[], float] = time.time):
        self.path, self.wallclock = state_dir / "lock", wallclock
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # not on POSIX: no lock, nothing else changes
            return self
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
        except OSError as exc:
            raise RedriveError(f"{self.path}: cannot open ({exc.strerror.lower()}); check the state dir's "
                               "permissions") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(self.fd, 200).decode("utf-8", "replace").strip() or "pid ?, started ?"
            os.close(self.fd)
            raise RedriveError(f"another run ({shown_text(holder)}) is using {self.path.parent}",
                               ExitCode.LOCKED) from None
        try:
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"pid {os.getpid()}, started {iso(self.wallclock())}\n".encode())
        except OSError as exc:
            os.close(self.fd)
            raise RedriveError(f"{self.path}: write failed ({exc.strerror.lower()}); free some space, "
                               "then rerun") from None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)


@dataclass
class State:
    """What the state dir says about each id, read at start."""

    done: set = field(default_factory=set)  #: ids done in this run that had an unavailable record, or no line
    failed: dict = field(default_factory=dict)  #: id -> latest failed record
    unavailable: dict = field(default_factory=dict)  #: id -> latest record
    repairs: list = field(default_factory=list)  #: warnings about what was mended
    fresh: set = field(default_factory=set)  #: ids this run moved to unavailable: news for a person
    repeated: set = field(default_factory=set)  #: of those, ids unavailable before for the same reason: no news
    gone: set = field(default_factory=set)  #: ids done.txt lists that a refresh found removed upstream
    lines: Optional[bytearray] = None  #: a run's index flags: an id's line is DONE once it is done in this run


class Ledger:
    """The one writer of the state dir. Every line is one os.write on an
    O_APPEND descriptor: in the kernel when the call returns, so a killed
    process loses nothing written, and no line ever interleaves with another.

    Power loss is another matter: with fsync=True every line is fsynced
    before the next step; otherwise dirty files are fsynced at least once a
    second (the run loop takes due_files, a thread of its own fsyncs them:
    see Batch._flush) and at close.
    """

    def __init__(self, state_dir: Path, fsync: bool = False, clock: Callable[[], float] = time.monotonic,
                 flush: Callable[[int], None] = os.fsync):
        self.dir, self.fsync, self.clock, self.flush = state_dir, fsync, clock, flush
        self.fds, self.dirty = {}, set()
        self.synced_at = clock()

    def open(self) -> None:
        if self.fds:
            return
        for name in STATE_FILES:
            path = self.dir / name
            try:
                self.fds[name] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW, 0o644)
            except OSError as exc:
                raise RedriveError(f"{path}: cannot open for writing ({exc.strerror}); check --state-dir") from None
        fsync_dir(self.dir)

    def close(self) -> None:
        try:
            self.sync()
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def append(self, name: str, line: str) -> None:
        data = memoryview((line + "\n").encode("utf-8"))
        try:
            while data:
                data = data[os.write(self.fds[name], data):]
            if self.fsync:
                self.flush(self.fds[name])
            else:
                self.dirty.add(name)
        except OSError as exc:
            raise RedriveError(f"{self.dir / name}: write failed ({exc.strerror}); free space, then rerun") from None

    def sync(self) -> None:
        """fsync every file written since the last sync."""
        self.flush_files(self.take_dirty())

    def take_dirty(self) -> list:
        """The files written since the last sync, now counted as synced: to
        pass to flush_files, which needs no lock (see Batch.run). In
        STATE_FILES order: a result is on disk before its done line."""
        names = [name for name in STATE_FILES if name in self.dirty]
        self.dirty.clear()
        self.synced_at = self.clock()
        return names

    def flush_files(self, names: list) -> None:
        """fsync these files. A line appended meanwhile marks its file dirty
        again, for the next sync; the descriptors stay open until close."""
        for name in names:
            try:
                self.flush(self.fds[name])
            except OSError as exc:
                raise RedriveError(f"{self.dir / name}: fsync failed ({exc.strerror}); check the disk") from None

    def seconds_to_sync(self) -> Optional[float]:
        """How long until the once-a-second sync is due; None when nothing is dirty."""
        if not self.dirty:
            return None
        return max(0.0, self.synced_at + SYNC_INTERVAL - self.clock())

    def due_files(self, idle: bool = False) -> list:
        """take_dirty() when the once-a-second sync is due, or the run is
        about to idle (a good moment to make the state durable); else nothing."""
        return self.take_dirty() if idle or self.seconds_to_sync() == 0.0 else []

    def record(self, name: str, record: dict) -> None:
        self.append(name, json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def success(self, item_id: str, line: str) -> None:
        """The result line first, then the done line: done means stored."""
        self.append("results.jsonl", line)
        self.append("done.txt", item_id)


def fsync_dir(path: Path) -> None:
    """Make new directory entries (a state file just created) durable too."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the files still are
    finally:
        os.close(fd)


def repair_torn_tail(path: Path) -> Optional[str]:
    """Cut off a last line without its newline (a kill mid-write); say so."""
    if not has_torn_tail(path):
        return None
    with open(path, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        keep = _last_newline(fh, size) + 1
        fh.truncate(keep)
    return f"{path.name}: cut off a torn last line ({size - keep} bytes, from an interrupted write)"


def has_torn_tail(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            return size > 0 and _byte_at(fh, size - 1) != b"\n"
    except FileNotFoundError:
        return False


def _byte_at(fh, offset: int) -> bytes:
    fh.seek(offset)
    return fh.read(1)


def _last_newline(fh, size: int) -> int:
    """Offset of the last b'\\n' in the file, -1 if none; reads backwards."""
    end = size
    while end > 0:
        start = max(0, end - READ_CHUNK)
        fh.seek(start)
        found = fh.read(end - start).rfind(b"\n")
        if found >= 0:
            return start + found
        end = start
    return -1


def last_line(path: Path) -> Optional[bytes]:
    """The last complete line of a file, read from the end."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return None
            start = _last_newline(fh, size - 1) + 1
            fh.seek(start)
            return fh.read(size - start).rstrip(b"\n")
    except FileNotFoundError:
        return None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value) -> bool:
    """A finite number (JSON's NaN and Infinity are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _when(value) -> bool:
    """A time as redrive writes it, and a real one (parse_iso is used on it later)."""
    try:
        return isinstance(value, str) and ISO_TIME.fullmatch(value) is not None and parse_iso(value) > 0
    except ValueError:
        return False


ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")

#: What each kind of field must hold.
FIELD_KINDS = {
    "text": lambda v: isinstance(v, str),
    "status": lambda v: v is None or (_whole(v) and 100 <= v <= 999),
    "code": lambda v: _whole(v) and 100 <= v <= 999,
    "pass": lambda v: _whole(v) and v >= 1,
    "count": lambda v: _whole(v) and v >= 0,
    "bucket": lambda v: v in ("ok", "fatal", "retryable", "skip"),
    "cause": lambda v: v in CAUSES,
    "time": _when,
    "stamp": lambda v: isinstance(v, str) and ISO_TIME.fullmatch(v) is not None,
    "refresh": lambda v: v in REFRESH_RESULTS,
    "seconds": lambda v: v is None or (_real(v) and 0 <= v < 1e10),
}

#: The fields every line of a ledger must hold (name: kind), then those it may hold.
RECORD_FIELDS = {
    "results.jsonl": ({"id": "text", "url": "text", "status": "code", "fetched_at": "text"},
                      {"final_url": "text", "body_encoding": "text", "etag": "text", "last_modified": "text"}),
    "failed.jsonl": ({"id": "text", "pass": "pass", "bucket": "bucket", "status": "status", "error": "text",
                      "tries": "count", "at": "time"}, {"retry_after": "seconds", "due": "time", "cause": "cause"}),
    "unavailable.jsonl": ({"id": "text", "reason": "text", "status": "status", "bucket": "bucket", "tries": "count",
                           "at": "stamp", "action": "text"}, {"cause": "cause"}),
    "refreshed.jsonl": ({"id": "text", "at": "stamp", "result": "refresh", "status": "status"},
                        {"reason": "text", "etag": "text", "last_modified": "text"}),
}


def record_cause(record: dict) -> Cause:
    """The cause of a failed.jsonl or unavailable.jsonl record (or a report
    row). Records written before causes were recorded have none: it is read
    from their reason and status, as redrive wrote them then."""
    if record.get("cause") is not None:
        return Cause(record["cause"])
    reason, status = record.get("reason", record.get("error", "")), record["status"]
    for cause, test in LEGACY_CAUSES:
        if test(reason, status):
            return cause
    return Cause.STATUS if status is not None else Cause.TRANSPORT


#: How a record with no "cause" field shows its cause (see record_cause).
LEGACY_CAUSES = (
    (Cause.MAY_HAVE_BEEN_PROCESSED, lambda reason, status: reason.startswith(MAY_HAVE_BEEN_PROCESSED)),
    (Cause.DOT_SEGMENT, lambda reason, status: reason == DOT_SEGMENT),
    (Cause.TOO_LARGE, lambda reason, status: reason.startswith("body over")),
    (Cause.TIMEOUT, lambda reason, status: reason.startswith("timeout")),
    (Cause.BAD_BODY, lambda reason, status: status is not None and 200 <= status < 300),
    (Cause.UNREACHED, lambda reason, status: reason in ("connection refused", "host name not found")
     or reason.startswith(("connect timeout", "cannot connect"))),
)


def record_problem(name: str, record) -> Optional[str]:
    """Why a line read back from a ledger is not one redrive wrote; None when it is."""
    if not isinstance(record, dict):
        return "not a JSON object"
    required, optional = RECORD_FIELDS[name]
    for key, kind in required.items():
        if key not in record or not FIELD_KINDS[kind](record[key]):
            return f"{'bad' if key in record else 'no'} {key!r}"
    for key, kind in optional.items():
        if key in record and not FIELD_KINDS[kind](record[key]):
            return f"bad {key!r}"
    return None


def read_records(path: Path) -> Iterable[dict]:
    """The records of a ledger, each checked as a whole: a foreign or damaged
    line is a user error that names the file and the line."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.endswith(b"\n"):
                return  # a torn last line: repaired on start, ignored by --check
            yield checked_record(path, number, line)


def latest_records(path: Path) -> dict:
    """id -> the last record of a ledger."""
    return {record["id"]: record for record in read_records(path)}


def checked_record(path: Path, number: int, line: bytes) -> dict:
    """Line `number` of a ledger as its record, checked as a whole: else a user error naming the line."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        record = None
    problem = "not JSON" if record is None else record_problem(path.name, record)
    if problem:
        raise RedriveError(f"{path} line {number}: not a redrive record ({problem}); "
                           "move the file away or fix that line")
    return record


def load_state(state_dir: Path, repair: bool = True) -> State:
    """Repair what a kill can leave (unless only looking), then read who
    failed and who is unavailable. Who is done is the index's to say (see
    current_index): done.txt is never read into a set."""
    state = State()
    for name in STATE_FILES if repair else ():
        note = repair_torn_tail(state_dir / name)
        if note:
            state.repairs.append(note)
    state.failed = latest_records(state_dir / "failed.jsonl")
    state.unavailable = latest_records(state_dir / "unavailable.jsonl")
    return state


def read_done(state_dir: Path, reader: Callable[[Path], Any]) -> Any:
    """What reader makes of STATE_DIR/done.txt: None if there is none yet,
    a one-line error if it is not redrive's UTF-8 id list."""
    path = state_dir / "done.txt"
    try:
        return reader(path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        raise RedriveError(f"{path}: not readable as redrive's UTF-8 id list; move it away") from None


def done_lines(path: Path) -> Iterable[list]:
    """done.txt's complete lines, a block at a time: a million of them never
    sit in memory as strings all at once."""
    with open(path, "rb") as fh:
        end = _last_newline(fh, fh.seek(0, os.SEEK_END)) + 1
    yield from done_between(path, 0, end)


# ------------------------------------------------------------ the state's index
#
# Which lines of the ids file are done is derived from done.txt, the record of
# truth, and kept in STATE_DIR/done.index: a byte per line of the ids file, keyed
# to the sha256 of the bytes of the ids file and of done.txt it was made from. A
# run reads it instead of holding the whole list and a set of every done id, so
# its memory follows the work left, not the list. It is only a cache: missing,
# torn or stale, it is rebuilt from the two files, and a kill loses nothing.

#: A line's flag in the index: an id to do, done, a repeat of an earlier line,
#: a blank or '#' line, an id of another shard.
PENDING, DONE, REPEAT, NO_ID, OTHER_SHARD = range(5)

#: A run's own flags, in memory only: a PENDING line whose id the run has taken
#: in hand (on the schedule, or settled before it as unavailable); a DONE line
#: a refresh asks again, until it is taken in hand (then DONE again).
FED, DUE = OTHER_SHARD + 1, OTHER_SHARD + 2

#: The index file, and the prefix of the scratch dirs a rebuild makes in the state dir.
INDEX_FILE, SCRATCH_PREFIX = "done.index", ".index-"

#: Bytes of the ids file per part of a rebuild: one part's ids are in memory at a time.
INDEX_PART = 1 << 20

#: Lines a rebuild holds (at least 256 a part) before it writes them out to its parts' files.
SPILL_LINES = 200_000

#: Lines added to the ids file or to done.txt since the index that are merged
#: into it in memory; past that, it is rebuilt part by part on disk.
INDEX_LATE = 250_000


@dataclass
class Index:
    """done.index: flags[n] for line n of the ids file (from 0, blank lines
    counted), made from its first ids_bytes bytes and done.txt's first
    done_bytes, and valid while those have these digests. Its first lf_lines
    lines end with an LF at byte lf_bytes: what follows may yet grow."""

    ids_bytes: int
    ids_sha: str
    lf_bytes: int
    lf_lines: int
    done_bytes: int
    done_sha: str
    shard: Optional[tuple]
    flags: bytearray

    def counts(self) -> tuple:
        """(ids of this run, done or not; repeated lines)"""
        return self.flags.count(PENDING) + self.flags.count(DONE), self.flags.count(REPEAT)


def id_blocks(path: Path, start: int = 0, line: int = 0, wanted: Optional[Callable] = None) -> Iterable[tuple]:
    """The ids file from byte `start` (a line's start, line number `line`),
    a block at a time: (the block's first line number; its lines, each an id
    or '' for a blank or '#' line; the offset the
    block ends at; whether it ends with LF). The last block is what follows
    the last LF. wanted(first, end): False skips decoding a block (lines None)."""
    with open(path, "rb") as fh:
        fh.seek(start)
        tail, offset = b"", start
        if start == 0:
            head = fh.read(len(codecs.BOM_UTF8))
            tail, offset = (b"", len(head)) if head == codecs.BOM_UTF8 else (head, 0)
        while True:
            chunk = fh.read(READ_CHUNK * 16)
            data = tail + chunk
            if not data:
                return
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            if not cut:
                tail = data
                continue
            block, tail = data[:cut], data[cut:]
            count = block.count(b"\n") + (not chunk) if b"\r" not in block else None
            if wanted and count is not None and not wanted(line, line + count):
                ids = None
            else:
                ids = block_ids(path, block, line)
                if chunk:
                    ids.pop()  # the '' after the block's last LF
                count = len(ids)
            offset += cut
            yield line, ids, offset, bool(chunk)
            line += count
            if not chunk:
                return


def block_ids(path: Path, data: bytes, line: int) -> list:
    """The lines of one block of the ids file (see id_blocks), the first
    numbered `line` (from 0); a one-line error for bytes that are no UTF-8
    or an id holding a line break."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        number = line + data.count(b"\n", 0, exc.start) + 1
        raise RedriveError(f"{path} line {number}: not valid UTF-8; save the file as UTF-8") from None
    if "\r" in text:  # CRLF, and CR alone (old Mac files): each ends a line
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    ids = id_lines(text)
    plain = text.isascii() and not any(c in text for c in "\v\f\x1c\x1d\x1e")  # no search needed
    odd = None if plain else next((i for i in ids if LINE_BREAKS.search(i)), None)
    if odd is not None:
        raise RedriveError(f"{path} line {line_of(path, odd)}: an id holds a line break that is not LF or CR "
                           f"({shown_text(LINE_BREAKS.search(odd).group())}); put one id per line")
    return ids


def prefix_digest(path: Path, size: int) -> Optional[str]:
    """sha256 of a file's first `size` bytes; None if it is shorter."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while size:
                block = fh.read(min(size, READ_CHUNK * 16))
                if not block:
                    return None
                digest.update(block)
                size -= len(block)
    except FileNotFoundError:
        return None if size else digest.hexdigest()
    return digest.hexdigest()


def done_end(path: Path) -> int:
    """The offset where done.txt's complete lines end (0 with no done.txt)."""
    try:
        with open(path, "rb") as fh:
            return _last_newline(fh, fh.seek(0, os.SEEK_END)) + 1
    except FileNotFoundError:
        return 0


def done_between(path: Path, start: int, end: int) -> Iterable[list]:
    """The ids of done.txt's lines from offset start to end (line starts), a block at a time."""
    if end <= start:
        return
    with open(path, "rb") as fh:
        fh.seek(start)
        tail, left = b"", end - start
        while left:
            read = fh.read(min(left, READ_CHUNK * 16))
            left = left - len(read) if read else 0
            block = tail + read
            cut = block.rfind(b"\n") + 1
            tail = block[cut:]
            try:
                yield block[:cut].decode("utf-8").split("\n")[:-1]
            except UnicodeDecodeError:
                raise RedriveError(f"{path}: not readable as redrive's UTF-8 id list; move it away") from None


def read_index(state_dir: Path) -> Optional[Index]:
    """done.index as last written; None where it is missing or not whole."""
    try:
        with open(state_dir / INDEX_FILE, "rb") as fh:
            head = json.loads(fh.readline())
            flags = bytearray(os.fstat(fh.fileno()).st_size - fh.tell())  # read into: one copy, not two
            del flags[fh.readinto(flags):]
        index = Index(head["ids_bytes"], head["ids_sha256"], head["lf_bytes"], head["lf_lines"],
                      head["done_bytes"], head["done_sha256"], tuple(head["shard"]) if head["shard"] else None, flags)
        whole = len(flags) == head["lines"] >= index.lf_lines and not flags.translate(None, INDEX_FLAGS)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return index if whole else None


#: Every byte a flag can be (read_index: any other is no index of redrive's).
INDEX_FLAGS = bytes(range(OTHER_SHARD + 1))


def write_index(state_dir: Path, index: Index) -> None:
    """done.index replaced whole: a kill leaves the old one or the new."""
    head = {"redrive_index": 1, "ids_bytes": index.ids_bytes, "ids_sha256": index.ids_sha,
            "lf_bytes": index.lf_bytes, "lf_lines": index.lf_lines, "done_bytes": index.done_bytes,
            "done_sha256": index.done_sha, "shard": list(index.shard) if index.shard else None,
            "lines": len(index.flags)}
    write_atomically(state_dir / INDEX_FILE, json.dumps(head) + "\n", index.flags)


#: bool(id) -> its line's flag, with no shard (see built_index).
UNSHARDED = bytes([NO_ID, PENDING]) + bytes(254)


def line_flag(item_id: str, shard: Optional[tuple]) -> int:
    """A line's flag before done.txt is looked at."""
    return NO_ID if not item_id else PENDING if shard is None or in_shard(item_id, shard) else OTHER_SHARD


def current_index(ids_file: Path, state_dir: Path, shard: Optional[tuple], keep: bool = True) -> Index:
    """The index of the ids file against done.txt, up to date: taken as it
    is where neither changed; with the lines since added to either merged in
    (up to INDEX_LATE of them); else rebuilt. Written back when it changed,
    if `keep` (a run; a reader such as --export only reads the state)."""
    if keep:  # a killed rebuild's (a run holds the lock: no reader's is in use)
        remove_scratch(state_dir, SCRATCH_PREFIX)
    done_path = state_dir / "done.txt"
    done_to = done_end(done_path)
    index = read_index(state_dir)
    if (index is not None and index.shard == shard and index.done_bytes <= done_to
            and prefix_digest(ids_file, index.ids_bytes) == index.ids_sha
            and prefix_digest(done_path, index.done_bytes) == index.done_sha):
        updated = merged_index(index, ids_file, done_path, done_to)
        if updated is index:
            return index
    else:
        updated = None
    index = updated or built_index(ids_file, state_dir, shard, done_to)
    if keep:
        write_index(state_dir, index)
    return index


def scratch_prefix() -> str:
    """This process's scratch dirs' prefix: known before one is made, so
    that a stop landing while one is made or removed still finds it."""
    return f"{SCRATCH_PREFIX}{os.getpid()}-"


def remove_scratch(where: Path, prefix: str) -> None:
    """The scratch dirs in where whose name starts with prefix."""
    for leftover in where.glob(glob.escape(prefix) + "*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


def merged_index(index: Index, ids_file: Path, done_path: Path, done_to: int) -> Optional[Index]:
    """index with the lines added to the ids file and to done.txt since it
    merged in: the same object where there are none, None where there are
    more than INDEX_LATE (a rebuild costs less memory)."""
    late = set()
    for lines in done_between(done_path, index.done_bytes, done_to):
        late.update(lines)
        if len(late) > INDEX_LATE:
            return None
    flags, new = index.flags, {}  # new: id -> its first line past what the index keeps
    covered = len(flags)
    if os.stat(ids_file).st_size > index.ids_bytes:  # appended to: its last line may have grown too
        covered = index.lf_lines
        del flags[covered:]
        for line, ids, end, ends_lf in id_blocks(ids_file, index.lf_bytes, covered):
            for n, item_id in enumerate(ids, line):
                flags.append(REPEAT if item_id in new else line_flag(item_id, index.shard))
                if flags[n] in (PENDING, OTHER_SHARD):
                    new[item_id] = n
            if len(new) > INDEX_LATE:
                return None
            index.ids_bytes = end
            if ends_lf:
                index.lf_bytes, index.lf_lines = end, len(flags)
    if not late and not new:
        return index
    pending = (lambda first, end: flags.find(PENDING, first, end) >= 0) if not new else None
    for line, ids, _, _ in id_blocks(ids_file, 0, 0, pending):
        if line >= covered:
            break
        for n, item_id in enumerate(ids or (), line):
            if n >= covered:
                break
            if item_id in new and flags[n] != REPEAT:  # an old line: the new one repeats it
                flags[new.pop(item_id)] = REPEAT
            if flags[n] == PENDING and item_id in late:
                flags[n] = DONE
    for lines in done_between(done_path, 0, done_to) if new else ():
        for item_id in filter(new.__contains__, lines):
            if flags[new[item_id]] == PENDING:
                flags[new[item_id]] = DONE
    index.ids_sha = prefix_digest(ids_file, index.ids_bytes)
    index.done_bytes, index.done_sha = done_to, prefix_digest(done_path, done_to)
    return dataclasses.replace(index)


def built_index(ids_file: Path, state_dir: Path, shard: Optional[tuple], done_to: int) -> Index:
    """The index made afresh from the ids file and done.txt, with one part of
    the ids in memory at a time: the ids and the done ids are split into
    parts by a hash of the id (an id's lines all fall in one part), and each
    part is matched alone. Exact: no id is taken as done on a hash."""
    parts = max(1, os.stat(ids_file).st_size // INDEX_PART)
    flags, ids_bytes, lf_bytes, lf_lines = bytearray(), 0, 0, 0
    done_path = state_dir / "done.txt"
    with Parts(state_dir, parts) as split:
        for line, ids, end, ends_lf in id_blocks(ids_file):
            if shard is None:  # an id PENDING, a blank line NO_ID, with no Python call per line
                flags.extend(bytes(map(bool, ids)).translate(UNSHARDED))
            else:
                flags.extend(line_flag(i, shard) for i in ids)
            split.add("lines", ids, range(line, line + len(ids)))
            ids_bytes = end
            if ends_lf:
                lf_bytes, lf_lines = end, len(flags)
        for lines in done_between(done_path, 0, done_to):
            split.add("done", lines)
        for part in split:
            (numbers, ids), done = part["lines"], set(part["done"][1])
            if len(set(ids)) < len(ids):  # some repeat: each line after an id's first
                first = set()
                for n, item_id in zip(numbers, ids):
                    if item_id in first:
                        flags[n] = REPEAT
                    first.add(item_id)
            for n in [n for n, item_id in zip(numbers, ids) if item_id in done] if done else ():
                if flags[n] == PENDING:
                    flags[n] = DONE
    return Index(ids_bytes, prefix_digest(ids_file, ids_bytes), lf_bytes, lf_lines, done_to,
                 prefix_digest(done_path, done_to), shard, flags)


class Parts:
    """Ids of several kinds (the ids file's lines, done.txt's ids, a ledger's
    ids...), each with a number (its line, its offset) or none, split into
    parts by the id's hash so that an id falls in the same part in every
    kind: kept in memory when there is one part, else spilled to files of a
    scratch dir in the state dir, removed on the way out (and by the next
    run, after a kill). Each part is then matched alone."""

    #: The dirs this process makes scratch dirs in, each noted before one is made there.
    places: set = set()

    def __init__(self, state_dir: Path, count: int, kinds: tuple = ("lines", "done")):
        self.state_dir, self.count, self.kinds, self.dir, self.held = state_dir, count, kinds, None, 0
        self.ids = {kind: [[] for _ in range(count)] for kind in kinds}
        self.numbers = {kind: [array.array("q") for _ in range(count)] for kind in kinds}

    def __enter__(self):
        if self.count > 1:  # in the state dir; a dry run before the first has none yet: the system's
            where = self.state_dir if self.state_dir.is_dir() else Path(tempfile.gettempdir())
            Parts.places.add(where)
            self.dir = Path(tempfile.mkdtemp(prefix=scratch_prefix(), dir=where))
        return self

    def __exit__(self, *exc):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def add(self, kind: str, ids: list, numbers: Optional[Iterable[int]] = None) -> None:
        """Ids of a kind, with their numbers (None: numbered from 0 up, not kept); blank ones are left out."""
        count, parts = self.count, self.ids[kind]
        if numbers is None:
            for item_id in ids:
                if item_id:
                    parts[hash(item_id) % count].append(item_id)
        else:
            kept = self.numbers[kind]
            for item_id, n in zip(ids, numbers):
                if item_id:
                    k = hash(item_id) % count
                    parts[k].append(item_id)
                    kept[k].append(n)
        self.held += len(ids)
        self._spill()

    def _spill(self, now: bool = False) -> None:
        if self.dir is None or (self.held < max(SPILL_LINES, 256 * self.count) and not now):  # few opens a part
            return
        for kind in self.kinds:
            ids, numbers = self.ids[kind], self.numbers[kind]
            for k in range(self.count):
                if ids[k]:
                    with open(self.dir / f"{kind}.{k}", "ab") as fh:
                        fh.write(("\n".join(ids[k]) + "\n").encode("utf-8"))
                    ids[k] = []
                if numbers[k]:
                    with open(self.dir / f"{kind}-numbers.{k}", "ab") as fh:
                        numbers[k].tofile(fh)
                    numbers[k] = array.array("q")
        self.held = 0

    def _read(self, kind: str, k: int) -> tuple:
        """(the numbers, the ids) of one kind in part k, as spilled."""
        numbers = array.array("q")
        with contextlib.suppress(FileNotFoundError):
            numbers.frombytes((self.dir / f"{kind}-numbers.{k}").read_bytes())
        try:
            return numbers, (self.dir / f"{kind}.{k}").read_bytes().decode("utf-8").split("\n")[:-1]
        except FileNotFoundError:
            return numbers, []

    def __iter__(self):
        """Per part: {kind: (its numbers, its ids)}, each kind in the order it was added."""
        if self.dir is None:
            yield {kind: (self.numbers[kind][0], self.ids[kind][0]) for kind in self.kinds}
            return
        self._spill(now=True)
        for k in range(self.count):
            yield {kind: self._read(kind, k) for kind in self.kinds}


def ledger_blocks(path: Path, shape: Optional[re.Pattern] = None) -> Iterable[tuple]:
    """(ids, offsets) of the whole lines of a JSON-lines ledger, a block at a
    time. A block whose every line has `shape` is read with it; any other
    line is checked whole (a one-line error names a damaged one)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        tail, start, number = b"", 0, 0
        for read in iter(lambda: fh.read(READ_CHUNK * 16), b""):
            block = tail + read
            cut = block.rfind(b"\n") + 1
            block, tail = block[:cut], block[cut:]
            found = list(shape.finditer(block)) if shape else []
            if shape and len(found) == block.count(b"\n") and utf8(block):
                yield [m.group(1).decode("utf-8") for m in found], [start + m.start() for m in found]
            else:
                lines = block.splitlines(keepends=True)
                at = list(itertools.accumulate((len(line) for line in lines[:-1]), initial=start))
                yield [checked_record(path, n, line)["id"] for n, line in enumerate(lines, number + 1)], at
            number += block.count(b"\n")
            start += len(block)


def utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class LineOffsets:
    """Line of the ids file -> an offset in a ledger (get: None for none):
    4 bytes a line for a ledger under 4 GiB, else 8; a dict when under one
    line in 16 has one (a ledger of few lines costs what it holds)."""

    def __init__(self, lines: int, size: int, held: int):
        self.none = None
        if held * 16 < lines:
            self.table = {}
        else:
            code, self.none = ("I", 0xFFFFFFFF) if size < 0xFFFFFFFF else ("q", -1)
            self.table = array.array(code, [self.none]) * lines

    def __setitem__(self, n: int, offset: int) -> None:
        self.table[n] = offset

    def get(self, n: int) -> Optional[int]:
        at = self.table.get(n) if isinstance(self.table, dict) else self.table[n]
        return None if at == self.none else at


def last_lines(ids_file: Path, lines: int, path: Path, state_dir: Path,
               shape: Optional[re.Pattern] = None) -> LineOffsets:
    """For each line of the ids file: the offset in the ledger `path` of the
    last line of its id. Exact, with one part of the ids in memory at a
    time, as built_index matches them."""
    size = path.stat().st_size if path.is_file() else 0
    if not size:
        return LineOffsets(lines, 0, 0)
    with Parts(state_dir, max(1, (os.stat(ids_file).st_size + size) // INDEX_PART), ("lines", "ledger")) as split:
        for line, ids, _, _ in id_blocks(ids_file):
            split.add("lines", ids, range(line, line + len(ids)))
        held = 0
        for ids, offsets in ledger_blocks(path, shape):
            split.add("ledger", ids, offsets)
            held += len(ids)
        found = LineOffsets(lines, size, held)
        for part in split:
            (numbers, ids), (offsets, others) = part["lines"], part["ledger"]
            last = dict(zip(others, offsets))  # the last line of an id wins
            for n, item_id in zip(numbers, ids):
                if item_id in last:
                    found[n] = last[item_id]
    return found


@dataclass
class Listing:
    """The ids file as a run sees it through its index. flags: the index's,
    in memory, which the run changes as it goes (FED, DONE; never written
    back). marked: (line, id) of the lines a run must look at before it
    starts, in file order: PENDING ids with a failed or unavailable record,
    and DONE ids with an unavailable record (or, for a refresh, a failed one).
    The rest of the PENDING ids are read as they are wanted (Feed)."""

    ids_file: Path
    flags: bytearray
    total: int  #: ids of this run, done or not
    duplicates: int  #: repeated lines
    marked: list

    def pending(self) -> int:
        return self.flags.count(PENDING)

    def lines(self, flags: bytes) -> Iterable[tuple]:
        """(line, id) of the lines whose flag is one of `flags`, in file
        order; a block with none of them is not decoded."""
        table = self.flags
        wanted = lambda first, end: any(table.find(f, first, end) >= 0 for f in flags)
        for line, ids, _, _ in id_blocks(self.ids_file, 0, 0, wanted):
            for n, item_id in enumerate(ids or (), line):
                if table[n] in flags:
                    yield n, item_id

    def not_done(self, listed: int) -> Iterable[str]:
        """The ids not done, in file order, for the report: every id the run
        took in hand (FED), and untried ones (PENDING, no record: pending)
        until `listed` of those are read. The untried past that are counted
        in self.untried_past, their blocks not decoded: a run stopped early
        over millions of ids reports in a read of the file."""
        table, self.untried_past, untried = self.flags, 0, 0

        def wanted(first: int, end: int) -> bool:
            if table.find(FED, first, end) >= 0 or untried < listed and table.find(PENDING, first, end) >= 0:
                return True
            self.untried_past += table.count(PENDING, first, end)
            return False
        for line, ids, _, _ in id_blocks(self.ids_file, 0, 0, wanted):
            for n, item_id in enumerate(ids or (), line):
                if table[n] == FED:
                    yield item_id
                elif table[n] == PENDING:
                    if untried < listed:
                        untried += 1
                        yield item_id
                    else:
                        self.untried_past += 1


def listing_of(ids_file: Path, index: Index, state: State, refresh: bool) -> Listing:
    """The run's Listing from the index: the lines it must look at before it
    starts are found in one pass over the file, made only when some id has
    a record (or for a refresh); a first run over new ids makes none."""
    total, duplicates = index.counts()
    listing = Listing(ids_file, index.flags, total, duplicates, [])
    recorded = lambda item_id: item_id in state.failed or item_id in state.unavailable
    if state.unavailable or refresh and state.failed:  # a done id may be gone upstream, or failed its refresh
        wanted, keep = (PENDING, DONE), recorded if refresh else state.unavailable.__contains__
    elif state.failed:
        wanted, keep = (PENDING,), None
    else:
        return listing
    flags = listing.flags
    listing.marked = [(n, i) for n, i in listing.lines(wanted) if (recorded(i) if flags[n] == PENDING else keep(i))]
    return listing


def take_back_gone(state: State, listing: "Listing", state_dir: Path) -> None:
    """Done ids whose unavailable record is newer than their last result
    were found removed upstream by a refresh: they go back among the ids not
    done (their lines PENDING again; state.gone). Only when some done id has
    an unavailable record is results.jsonl read."""
    candidates = [(n, i) for n, i in listing.marked if listing.flags[n] == DONE and i in state.unavailable]
    heads = result_heads(state_dir / "results.jsonl", {i for _, i in candidates}) if candidates else {}
    state.gone = gone_upstream([i for _, i in candidates], state.unavailable, heads)
    for n, item_id in candidates:
        if item_id in state.gone:
            listing.flags[n] = PENDING


def listed_done(state_dir: Path, item_id: str) -> bool:
    """Does done.txt list item_id? One search of its bytes; where it does
    not, the file is read whole once to be sure it is redrive's (a one-line
    error if not), as it is about to be written to."""
    def search(path: Path) -> bool:
        with open(path, "rb") as fh:
            if not os.fstat(fh.fileno()).st_size:
                return False
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                line = item_id.encode("utf-8") + b"\n"
                if data[:len(line)] == line or data.find(b"\n" + line) >= 0:
                    return True
        return any(item_id in lines for lines in done_lines(path))
    return bool(read_done(state_dir, search))


def complete_lost_done(state: State, ledger: Ledger) -> None:
    """A kill between a result line and its done line: finish the pair. (The
    last result may be a refresh's, or of an id that came back: listed already.)"""
    tail = last_line(ledger.dir / "results.jsonl")
    if not tail:
        return
    try:
        record = json.loads(tail)
    except (ValueError, RecursionError):
        record = None
    if record is None or record_problem("results.jsonl", record):
        raise RedriveError(f"{ledger.dir / 'results.jsonl'}: last line is not a redrive record; move the file away")
    item_id = record["id"]
    done_tail = last_line(ledger.dir / "done.txt")
    if (done_tail is None or done_tail.decode("utf-8", "replace") != item_id) and not listed_done(ledger.dir, item_id):
        ledger.open()
        ledger.append("done.txt", item_id)
        state.repairs.append(f"done.txt: added {shown_id(item_id)!r}, whose result was stored just before a kill")


def latest_failure(state: State, item_id: str) -> Optional[dict]:
    """The failed record that still counts: one newer than any unavailable record."""
    failed = state.failed.get(item_id)
    settled = state.unavailable.get(item_id)
    if failed and settled and settled.get("at", "") >= failed.get("at", ""):
        return None
    return failed


def resume_step(last: dict, cfg: Config, wall: float) -> Step:
    """next_step for an id whose pass failed in an earlier run (`last`, its
    failed.jsonl line, already written): GIVE_UP if that was its last pass,
    else FAIL: its next pass once the cool-down, counted from the failure
    across runs, is over (Step.wait seconds from `wall`)."""
    if last["pass"] >= cfg.passes:
        return Step(Move.GIVE_UP)
    at = min(parse_iso(last["at"]), wall)  # a time in the future is a clock that was ahead: now, at the latest
    return Step(Move.FAIL, max(0.0, at + pass_wait(cfg, last.get("retry_after")) - wall))


def request_shape(request: Request) -> dict:
    """What run.json keeps of a Request: each field with a "shape" key, the
    url redacted (or "--demo"), the header names only (see Request)."""
    shape = {}
    for f in dataclasses.fields(request):
        if "shape" in f.metadata:
            value = getattr(request, f.name)
            shape[f.metadata["shape"]] = list(value) if isinstance(value, tuple) else value
    shape["url"] = "--demo" if request.demo else kept_url(request.url_spec, request.public, digest=True)
    shape["data"] = None if request.data_spec is None else kept_data(request.data_spec, request.public, digest=True)
    shape["headers"] = sorted(request.header_names)
    if not request.public:
        del shape["public"]  # as before there was --public: a state dir it never named keeps its hash
    return shape


def shape_hash(shape: dict) -> str:
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def read_run_record(state_dir: Path) -> Optional[dict]:
    """STATE_DIR/run.json, or None before the first run."""
    path = state_dir / "run.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        record = None
    problem = run_record_problem(record)
    if problem:
        raise RedriveError(f"{path}: not a redrive run record ({problem}); move it away, or use a new --state-dir")
    known = request_shape(Request())
    unknown = sorted(set(record["shape"]) - set(known) - {"public"})  # public: kept only when given
    if unknown:
        raise RedriveError(f"{path}: written by redrive {str(record.get('redrive', '?'))[:20]}, whose request has "
                           f"fields this version does not know ({', '.join(map(str, unknown))[:100]}); "
                           "run that version, or use a new --state-dir")
    record["shape"] = {**known, **record["shape"]}
    return record


def run_record_problem(record) -> Optional[str]:
    """Why run.json is not one redrive wrote; None when it is."""
    if not isinstance(record, dict) or not isinstance(record.get("shape"), dict):
        return "no request shape"
    texts = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
    kinds = {"method": lambda v: isinstance(v, str), "url": lambda v: isinstance(v, str),
             "data": lambda v: v is None or isinstance(v, str), "headers": texts,
             "expect_json": lambda v: isinstance(v, bool), "require": texts, "require_field": texts,
             "public": texts}
    for key, ok in kinds.items():
        if key in record["shape"] and not ok(record["shape"][key]):
            return f"bad {key!r}"
    if "verdicts_since" in record and not _when(record["verdicts_since"]):
        return "bad 'verdicts_since'"
    refresh = record.get("refresh")
    if refresh is not None and not (isinstance(refresh, dict) and _when(refresh.get("before"))):
        return "bad 'refresh'"
    shard = record.get("shard")
    if shard is not None and not (isinstance(shard, list) and len(shard) == 2 and all(_whole(x) for x in shard)
                                  and 1 <= shard[0] <= shard[1]):
        return "bad 'shard'"
    headers = record.get("headers", [])
    if not isinstance(headers, list) or not all(
            isinstance(h, dict) and isinstance(h.get("name"), str) and (h.get("value") is None or
                                                                      isinstance(h.get("value"), str))
            for h in headers):
        return "bad 'headers'"
    return None


def shape_changes(old: dict, new: dict) -> list:
    """'url: 'a' -> 'b'' for every field of the shape that differs."""
    keys = [*new, *(key for key in old if key not in new)]
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in keys if old.get(key) != new.get(key)]


#: The fields of the request a verdict belongs to: when one of them changes,
#: an "unavailable" found under the old request says nothing of the new one.
TARGET_FIELDS = ("method", "url", "data")


def settle_run_record(cfg: Config, record: Optional[dict], anything_done: bool, now: float,
                      refresh: Optional[str] = None, write: bool = True) -> tuple:
    """Refuse a changed request when done ids would mix two requests (unless
    allowed), then record the current one, and the cut-off of a refresh under
    way. Returns (a note on a change taken, or None; the time since which
    verdicts count, or None)."""
    shape = request_shape(cfg.request)
    kept = None  #: an older release's record of this same request, kept as it is (see below)
    if record:
        old, public = dict(record["shape"]), cfg.request.public
        request = cfg.request
        earlier = {"url": "--demo" if request.demo else redact_url(request.url_spec),
                   "data": None if request.data_spec is None else redact_data(request.data_spec)}
        if all(old.get(k) == v for k, v in earlier.items()):  # as an older release kept it: only its key-like
            old.update(url=shape["url"], data=shape["data"])     # values hidden; a plain rerun still reads it
            kept = (record["shape"], record.get("hash")) if "REDACTED" not in f"{earlier}" else None
        else:  # as this release keeps it: a value an older one kept verbatim is no change
            old.update(url=kept_url(old["url"], public, True),
                       data=None if old.get("data") is None else kept_data(old["data"], public, True))
        record["shape"] = old
    changes = shape_changes(record["shape"], shape) if record else []
    retarget = bool(changes) and any(record["shape"].get(k) != shape[k] for k in TARGET_FIELDS)
    if changes and anything_done and not cfg.allow_config_change:
        keeps = "ids unavailable under the old request are then asked again" if retarget else \
            "every verdict is kept, the target did not change"
        raise RedriveError(f"the request changed since this state dir was started ({'; '.join(changes)}); ids "
                           "are done under the old one, and results would mix two requests: use a new --state-dir, "
                           f"or --allow-config-change ({keeps})")
    since = iso(now) if retarget else (record or {}).get("verdicts_since")
    ahead = since is not None and since > iso(now)
    since = min(since, iso(now)) if since else since  # a clock that was ahead must not void every verdict
    if kept and not changes:
        shape = kept[0]  # an upgraded state dir's plain rerun keeps working: nothing new is stored
    new = {"shape": shape, "hash": kept[1] if kept and not changes else shape_hash(shape),
           "headers": [{"name": n, "value": spec} for n, spec in cfg.request.header_specs],
           "created": record.get("created") if record else iso(now), "redrive": __version__}
    if cfg.shard:
        new["shard"] = list(cfg.shard)
    if refresh:
        new["refresh"] = {"before": refresh}
    if since:
        new["verdicts_since"] = since
    if changes:
        new["previous_hash"] = record.get("hash")
    if write and (record is None or any(record.get(k) != new.get(k) for k in ("shape", "hash", "headers",
                                                                              "verdicts_since", "shard", "refresh"))):
        write_atomically(cfg.state_dir / "run.json", json.dumps(new, indent=2) + "\n")
    if not changes:
        return ("warning: run.json's verdicts_since was in the future (a clock ahead?); taken as now" if ahead
                else None), since
    taken = "" if anything_done else "no id is done yet, so "
    again = "; ids unavailable under the old request will be asked again" if retarget else ""
    return f"the request changed ({'; '.join(changes)}); {taken}the new one is taken{again}", since


def refresh_cutoff(cfg: Config, record: Optional[dict], now: float) -> tuple:
    """(the cut-off of this run's refresh, or None; a note, or None). Done ids
    fetched before it are asked again. --refresh-older-than D: now - D.
    --refresh: now, unless a refresh was cut short: run.json keeps its cut-off
    until it is over, and a rerun, with --refresh or without, goes on with it."""
    kept = ((record or {}).get("refresh") or {}).get("before")
    if kept and (cfg.refresh is None or cfg.refresh == 0.0):
        kept = min(kept, iso(now))  # a clock that was ahead
        return kept, f"continuing the refresh that was cut short (ids fetched before {kept})"
    return (None if cfg.refresh is None else iso(now - cfg.refresh)), None


def end_refresh(state_dir: Path) -> None:
    """The refresh is over: run.json forgets its cut-off."""
    path = state_dir / "run.json"
    record = json.loads(path.read_text(encoding="utf-8"))  # this run wrote it
    if record.pop("refresh", None):
        write_atomically(state_dir / "run.json", json.dumps(record, indent=2) + "\n")


def pace_key(host: str) -> str:
    """A host as paces.json names it: a digest, so that no host name (a key may sit in one) reaches the file."""
    return hashlib.sha256(host.encode("utf-8")).hexdigest()[:16]


def read_paces(state_dir: Path) -> dict:
    """STATE_DIR/paces.json: pace_key -> {"pace": req/s, "window": s, "at"}, the
    limits earlier runs found where none was declared ({} before the first)."""
    path = state_dir / "paces.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError):
        record = None
    hosts = record.get("hosts") if isinstance(record, dict) else None
    if not isinstance(hosts, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"[0-9a-f]{16}", k) and isinstance(v, dict) and _when(v.get("at")) and
            _real(v.get("pace")) and v["pace"] >= 1e-9 and
            _real(v.get("window")) and 0 <= v["window"] <= MAX_RETRY_AFTER  # past the longest wait: none a run learnt
            for k, v in hosts.items()):
        raise RedriveError(f"{path}: not a redrive pace record; remove it (each host's limit is then found again)")
    return hosts


def remember_paces(state_dir: Path, hosts: dict, recalled: dict, now: float, wall: float) -> None:
    """paces.json after a run that asked any host: the hosts it asked and found a limit on, each with the higher of
    its W_max and BETA x the pace the curve had reached (as much as it took over its last answers: a limit raised or
    lifted was climbed past with no cut), and its window (see Host). A limit found again (within [BETA, 1 / BETA] of
    the last) keeps its record; a host not asked is not kept (a demo's port, a list's hosts all done: the file holds
    what the last run met). Written when changed."""
    asked = {pace_key(name): host for name, host in hosts.items() if host.first_sent is not None}
    if not asked:
        return
    again = lambda old, new: old == new or old > 0 and BETA <= new / old <= 1 / BETA  # noqa: E731
    kept = {}
    for key, host in asked.items():
        if host.w_max:
            took = host.taken(now, host.recent[-min(len(host.recent), SHARE_ANSWERS)][0]) if host.recent else 0.0
            pace, window, same = max(host.w_max, BETA * min(host.rate(now), took)), host.window, recalled.get(key)
            found = same and again(same["pace"], pace) and again(same["window"], window)
            kept[key] = same if found else {"pace": round(pace, 6), "window": round(window, 6), "at": iso(wall)}
    if kept != recalled:
        write_atomically(state_dir / "paces.json", json.dumps({"redrive": __version__, "hosts": kept}, indent=1) + "\n")


def forget_old_verdicts(state: State, since: Optional[str]) -> None:
    """Failures recorded before the request last changed its target count no more."""
    if since:
        state.unavailable = {k: r for k, r in state.unavailable.items() if r["at"] >= since}
        state.failed = {k: r for k, r in state.failed.items() if r["at"] >= since}


def body_digest(body: Optional[str]) -> Optional[bytes]:
    """A digest of a body's JSON text as results.jsonl stores it."""
    return None if body is None else hashlib.blake2b(body.encode("utf-8"), digest_size=16).digest()


#: The head of a result line as redrive writes it: its id without escapes, read before any JSON parse.
RESULT_ID = re.compile(rb'\{"id":"([^"\\]*)",')


def result_heads(path: Path, wanted: set) -> dict:
    """id -> (fetched_at, Prior) from the last result line of each wanted id.
    The body is never parsed: its fields come before it, and the digest is
    taken of its text as written. A line of another shape is parsed whole,
    and its body digest left out (a 200 to its refresh counts as changed)."""
    heads = {}
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return heads
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.endswith(b"\n"):
                break  # a torn last line: repaired on start, ignored by --check
            plain = RESULT_ID.match(line)
            if plain and plain.group(1).decode("utf-8", "replace") not in wanted:
                continue
            item_id, head = result_head(path, number, line)
            if item_id in wanted:
                heads[item_id] = head
    return heads


def result_head(path: Path, number: int, line: bytes) -> tuple:
    """(id, (fetched_at, Prior)) of line `number` of results.jsonl, its body not parsed (see result_heads)."""
    cut, head = line.find(b',"body":'), None
    if cut > 0 and line.endswith(b"}\n"):
        try:
            head = json.loads(line[:cut] + b"}")
        except (ValueError, RecursionError):
            pass
    digest = body_digest(line[cut + 8:-2].decode("utf-8", "replace")) if head is not None else None
    if head is None or record_problem("results.jsonl", head):
        head = checked_record(path, number, line)
    stored = (head.get("etag"), head.get("last_modified"))
    return head["id"], (head["fetched_at"], Prior(*stored, digest, stored))


def gone_upstream(candidates: Iterable, unavailable: dict, heads: dict) -> set:
    """The done ids whose unavailable record is newer than their last result
    (heads: id -> (fetched_at, ...)): a refresh found them removed upstream
    (the later verdict wins)."""
    return {i for i in candidates if i in heads and unavailable[i]["at"] > heads[i][0]}


def refresh_due(head: tuple, last: Optional[dict], before: str) -> Optional[Prior]:
    """The Prior of a done id (head: its last result's (fetched_at, Prior);
    last: its last refreshed record) if it was neither fetched nor asked by a
    refresh since `before`, else None. A refresh's last answer that the
    result was unchanged moves the fetch time on, and may bring new validators."""
    fetched, prior = head
    if last is not None and last["at"] > fetched:
        fetched = last["at"]
        if last["result"] == "unchanged":
            prior = prior._replace(etag=last.get("etag", prior.etag),
                                   last_modified=last.get("last_modified", prior.last_modified))
    return prior if fetched < before else None


class Refresh:
    """A refresh of the done ids of a Listing: each line's id's last result
    line and last refreshed line are found by a join on disk (two offsets a
    line), and read back as they are wanted. mark() flags the lines due
    (DUE, in memory); prior(n) is line n's Prior."""

    def __init__(self, listing: "Listing", state_dir: Path, before: str):
        self.before, self.flags = before, listing.flags
        self.results, self.refreshed = state_dir / "results.jsonl", state_dir / "refreshed.jsonl"
        lines = len(listing.flags)
        self.result_at = last_lines(listing.ids_file, lines, self.results, state_dir, RESULT_SHAPE)
        self.refreshed_at = last_lines(listing.ids_file, lines, self.refreshed, state_dir)
        self.fh = open(self.results if self.results.is_file() else os.devnull, "rb")
        self.rh = open(self.refreshed if self.refreshed.is_file() else os.devnull, "rb")
        self.count = 0  #: the lines due

    def prior(self, n: int) -> Optional[Prior]:
        """Line n's Prior if its id is due (see refresh_due); None if not, or with no result line."""
        at, again = self.result_at.get(n), self.refreshed_at.get(n)
        if at is None:
            return None  # a done line without a result: --check names it; nothing to refresh
        self.fh.seek(at)
        head = result_head(self.results, 0, self.fh.readline())[1]
        last = None
        if again is not None:
            self.rh.seek(again)
            last = json.loads(self.rh.readline())  # checked whole when it was joined
        return refresh_due(head, last, self.before)

    def mark(self) -> None:
        """Flag each DONE line whose id is due DUE."""
        flags, n = self.flags, self.flags.find(DONE)
        while n >= 0:
            if self.prior(n) is not None:
                flags[n], self.count = DUE, self.count + 1
            n = flags.find(DONE, n + 1)

    def close(self) -> None:
        self.fh.close()
        self.rh.close()


def write_atomically(path: Path, text: str, data: bytes = b"") -> None:
    """Write a whole file, text then data, so that a reader sees the old or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a killed run's, or a link planted there: never written through
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644), "wb") as fh:
            fh.write(text.encode("utf-8"))
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise RedriveError(f"{path}: cannot write ({exc.strerror}); check the state dir") from None


def compact(path: Path, drop: frozenset = frozenset(), only: Optional[frozenset] = None) -> None:
    """A ledger down to one line per id, its last (the one that counts), in
    their order, less the ids of drop, replaced whole: a kill at any moment
    leaves the old file or the new one, and either tells every id's last state.
    With only, the ids not in it keep every line."""
    if not path.is_file():
        return
    lines = {}
    with open(path, "rb") as fh:
        for number, line in enumerate(fh):
            if line.endswith(b"\n"):
                item_id = json.loads(line)["id"]
                key = item_id if only is None or item_id in only else (item_id, number)
                lines.pop(key, None)
                if item_id not in drop:
                    lines[key] = line
    if sum(len(line) for line in lines.values()) < path.stat().st_size:
        write_atomically(path, "", b"".join(lines.values()))


def recorded_request(record: dict, given: frozenset = frozenset()) -> dict:
    """The request options a rerun takes from run.json: each one it does not
    name (given: the ones it names). A secret redrive did not store is asked
    for again only when it is needed."""
    shape = record["shape"]
    if shape["url"] == "--demo":
        recorded = {"url": None, "demo": True}
    else:
        recorded = {"url": shape["url"], "demo": False}
        if "REDACTED" in shape["url"] and not given & {"url", "demo"}:
            raise RedriveError("run.json keeps the --url with its secret redacted; give --url again "
                               "(write the secret as ${VAR} and it can be reused)")
    if "REDACTED" in (shape.get("data") or "") and "data" not in given:
        raise RedriveError("run.json keeps the --data with its secret redacted; give --data again "
                           "(write the secret as ${VAR} and it can be reused)")
    headers = []
    for header in record.get("headers", []) if "header" not in given else ():
        if header.get("value") is None:
            raise RedriveError(f"header {header.get('name')} was given as a literal value, which redrive does not "
                               "store; give -H again, the rest of the request is reused (write it as "
                               "'${VAR}' or 'Bearer ${VAR}' and it can be reused too)")
        headers.append(f"{header['name']}: {header['value']}")
    recorded["header"] = headers
    recorded.update({f.metadata["option"]: shape.get(f.metadata["shape"], []) for f in dataclasses.fields(Request)
                     if "shape" in f.metadata and f.metadata["option"] not in recorded})
    taken = {key: value for key, value in recorded.items() if key not in given}
    if given & {"url", "demo"}:
        taken.pop("url", None), taken.pop("demo", None)  # the target comes from the command line, whole
    return taken


# ------------------------------------------------------------------- HTTP


#: What the network, a server or the HTTP libraries may raise during an
#: attempt: each becomes an Outcome (transport_failure). Anything else is a
#: bug in redrive, which stops the run with exit 70.
TRANSPORT_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, http.client.HTTPException,
                    OSError, ValueError, AttemptTimeout, UndecodableBody, RedirectFailed)


class Attempt:
    """One attempt's deadline, and the connection it is using (see Watchdog)."""

    __slots__ = ("deadline", "conn", "expired", "strayed", "doubted")

    def __init__(self, deadline: float):
        self.deadline, self.conn, self.expired = deadline, None, False
        self.strayed = False  #: the connection it was to reuse held bytes nobody asked for (see in_step)
        self.doubted = ()  #: (id, a success) of the last answers on that connection

    def cut(self) -> None:
        """Past the deadline: shut the socket down, which wakes a read blocked on it."""
        self.expired = True
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the system call, under an SSLSocket too
            except (OSError, TypeError, ValueError):
                pass  # closed already: nothing is waiting on it


#: The attempt each worker thread is making; its connections register with it.
CURRENT = threading.local()


class Watchdog:
    """Holds every attempt to --timeout as a whole, status line and headers included.

    A socket timeout bounds each read, not the attempt: a server that drips
    one header byte a second would hold a worker for ever. One thread per
    run watches the deadlines and cuts an attempt that outlives its own.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.cond = clock, threading.Condition()
        self.attempts, self.closed = set(), False
        self.wakes_at = float("-inf")  #: when the thread looks next, unless notified
        threading.Thread(target=self._run, name="redrive-watchdog", daemon=True).start()

    def begin(self, seconds: float) -> Attempt:
        attempt = CURRENT.attempt = Attempt(self.clock() + seconds)
        with self.cond:
            self.attempts.add(attempt)
            if attempt.deadline < self.wakes_at:  # rare: only a --timeout under MAX_WAIT
                self.cond.notify()
        return attempt

    def end(self, attempt: Attempt) -> None:
        CURRENT.attempt = None
        with self.cond:
            self.attempts.discard(attempt)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while not self.closed:
                now = self.clock()
                for attempt in [a for a in self.attempts if a.deadline <= now]:
                    self.attempts.discard(attempt)
                    attempt.cut()
                soonest = min((a.deadline for a in self.attempts), default=None)
                wait = bounded_wait(None if soonest is None else soonest - now)
                self.wakes_at = now + wait
                self.cond.wait(wait)


class HeldIO(socket.SocketIO):
    """A response's raw socket reader that can be told to read nothing, so
    that what its buffered reader holds is seen with no system call: each
    one lets another thread take the GIL, a cost in CPU that shows when it
    is made for every answer (docs/benchmarks.md; see buffered)."""

    holding = False

    def readinto(self, b):
        return None if self.holding else super().readinto(b)  # None: nothing there yet, as a non-blocking read


def buffered(fp) -> bytes:
    """What a socket's buffered reader holds (and, but with a HeldIO under
    it, what can be read at once)."""
    raw = getattr(fp, "raw", None)
    if isinstance(raw, HeldIO):
        raw.holding = True
        try:
            pending = getattr(raw._sock, "pending", lambda: 0)()  # TLS: decrypted, not yet read (no system call)
            return fp.peek(1) or b"\0" * min(pending, 1)
        except (OSError, ValueError):
            return b""
        finally:
            raw.holding = False
    sock = getattr(raw, "_sock", None)
    if sock is None:
        return b""
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0)
        return fp.peek(1)
    except (OSError, ValueError):  # nothing to read now (SSLWantReadError), or the connection is broken
        return b""
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(timeout)


class FinalResponse(http.client.HTTPResponse):
    """http.client's response, reading past every 1xx interim answer.

    http.client skips only 100 Continue: a 103 Early Hints would be taken as
    the answer, and the real one left on the keep-alive connection for the
    next request to read, another id's body stored as this one's.
    """

    interim = 0
    leftover = False  #: bytes were read past the answer's end: another answer (see in_step)

    def __init__(self, sock, *args, **kwargs):
        super().__init__(sock, *args, **kwargs)
        if type(getattr(self.fp, "raw", None)) is socket.SocketIO:
            self.fp.raw.__class__ = HeldIO  # the same object: what buffered() looks at costs no system call

    def _close_conn(self):
        """The answer is read: look at what its buffer read past it (a
        connection must carry nothing more), which closing it would drop."""
        if self.fp is not None and not self.leftover and getattr(CURRENT, "attempt", None) is not None:
            self.leftover = bool(buffered(self.fp))
        super()._close_conn()

    def _read_status(self):
        version, status, reason = super()._read_status()
        if 100 < status < 200 and status != 101:
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise http.client.BadStatusLine(f"more than {MAX_INTERIM} interim answers")
            return version, 100, reason  # http.client skips a 100's headers and reads on
        return version, status, reason


class WatchedConnection:
    """urllib3's connection, seen by the attempt's watchdog and reading past
    1xx; it counts the requests sent since it connected, the answers since
    it was last watched, and the ids of its last answers (see in_step)."""

    response_class = FinalResponse
    sent = 0
    unwatched = 0  #: answers since it was last watched
    recent = ()  #: (id, a success) of its last 2 x IN_STEP_EVERY answers but its first

    def connect(self):
        self._watch()
        self.sent, self.unwatched, self.recent = 0, 0, deque(maxlen=2 * IN_STEP_EVERY)
        return super().connect()

    @property
    def is_connected(self) -> bool:
        """urllib3 asks before it reuses the connection (urllib3 2): bytes
        that came unasked since its last answer, not a close, put it out of
        step, and its last answers in doubt."""
        connected = super().is_connected
        attempt = getattr(CURRENT, "attempt", None)
        if not connected and self.sent and attempt is not None and stray_bytes(self.sock):
            attempt.strayed, attempt.doubted = True, tuple(self.recent)
            self.recent.clear()
        return connected

    def request(self, *args, **kwargs):
        self._watch()
        result = super().request(*args, **kwargs)
        self.sent += 1
        return result

    def _watch(self) -> None:
        attempt = getattr(CURRENT, "attempt", None)
        if attempt is not None:
            attempt.conn = self


class WatchedHTTPConnection(WatchedConnection, urllib3.connection.HTTPConnection):
    pass


class WatchedHTTPSConnection(WatchedConnection, urllib3.connection.HTTPSConnection):
    pass


class WatchedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = WatchedHTTPConnection


class WatchedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = WatchedHTTPSConnection


WATCHED_POOLS = {"http": WatchedHTTPPool, "https": WatchedHTTPSPool}


class WatchedAdapter(HTTPAdapter):
    """requests' transport adapter, on connections the watchdog can cut."""

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = WATCHED_POOLS

    def proxy_manager_for(self, proxy, **proxy_kwargs):
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if manager.pool_classes_by_scheme is urllib3.poolmanager.pool_classes_by_scheme:
            manager.pool_classes_by_scheme = WATCHED_POOLS  # not a SOCKS proxy's own classes
        return manager


class BoundedCookieJar(requests.cookies.RequestsCookieJar):
    """The cookies an API sets: at most MAX_COOKIES, MAX_COOKIE_BYTES in all.
    Past that a new cookie is ignored (one already held is still updated), so
    a Set-Cookie storm cannot grow every later request's Cookie header."""

    def set_cookie(self, cookie, *args, **kwargs):
        key = (cookie.name, cookie.domain, cookie.path)
        held = [c for c in self if (c.name, c.domain, c.path) != key]
        size = sum(len(c.name or "") + len(c.value or "") for c in held)
        if len(held) >= MAX_COOKIES or size + len(cookie.name or "") + len(cookie.value or "") > MAX_COOKIE_BYTES:
            return None
        return super().set_cookie(cookie, *args, **kwargs)


class HostSettings:
    """(proxies, .netrc auth) by origin, read from the environment once per
    host and shared by every worker.

    Bounded: past REMEMBERED_HOSTS origins it starts over, so a list of URLs
    on a million hosts does not keep a million entries (per worker, as a
    memo in each session would). Dict reads and writes are atomic, so there
    is no lock; two workers may read one new host's settings twice, no harm.
    """

    def __init__(self, size: int = REMEMBERED_HOSTS):
        self.memo, self.size = {}, size
        self.single_use = set()  #: origins seen out of step: a new connection for every request (see in_step)
        self.checked = {}  #: origin -> answers on a reused connection watched for a stray (see in_step)
        self.typical = {}  #: origin -> its successes' time, a moving average: how long a watch waits

    def watched(self, origin: tuple) -> bool:
        """Is the next answer from origin watched for a stray (see in_step)?"""
        return self.checked.get(origin, 0) < IN_STEP_CHECKS

    def answered(self, origin: tuple, checked: bool, took: Optional[float]) -> None:
        self.checked[origin] = self.checked.get(origin, 0) + checked
        if took is not None:
            typical = self.typical.get(origin, took)
            self.typical[origin] = typical + (took - typical) / 8  # TCP's smoothed round trip (RFC 6298)

    def watch_time(self, origin: tuple, took: float) -> float:
        """How long a watch waits for a stray: min(IN_STEP_WAIT, 4 max(this
        answer's time, the host's typical)). A connection one answer ahead
        gets each answer early by up to half the server's time, and the one
        behind it comes about half the server's time after; 4 x that, for a
        server whose time varies (a loaded one)."""
        return min(IN_STEP_WAIT, 4 * max(took, self.typical.get(origin, 0.0)))

    def __call__(self, url: str, origin: tuple) -> tuple:
        found = self.memo.get(origin)
        if found is None:
            found = (requests.utils.get_environ_proxies(url), requests.utils.get_netrc_auth(url))
            if len(self.memo) >= self.size:
                self.memo.clear()
                self.checked.clear()
                self.typical.clear()
            self.memo[origin] = found
        return found


class GuardedSession(requests.Session):
    """A Session that never carries the user's headers to another origin, and
    reads the environment (proxies, CA bundle, .netrc) once per host.

    requests itself strips only Authorization on a cross-host redirect; an
    X-API-Key header would follow the redirect anywhere. And with trust_env
    it looks proxies, the CA bundle and .netrc up in the environment on every
    request, a cost that shows against a fast API.

    open() sends a request the short way, see there.
    """

    def __init__(self, guarded: frozenset, settings: HostSettings, watchdog: Watchdog):
        super().__init__()
        self.trust_env = False  # the environment is read by HostSettings, once per host
        self.cookies = BoundedCookieJar()
        self.guarded, self.user_cookie = guarded, None
        self.origin = None
        self.unwatched = {}  #: connection -> origin, for those with answers since their last watch (see in_step)
        self.aside = []  #: Aside: sockets set aside to be watched (see in_step)
        self.environment, self.watchdog = settings, watchdog
        bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        self.verify = bundle or True

    def open(self, method: str, url: str, body: Optional[bytes], timeout: float, proxies: dict,
             auth, extra: tuple = ()) -> requests.Response:
        """Send one request as Session.request would, for a fraction of its CPU.

        Session.request merges the session's settings into every request anew
        (headers, cookies, hooks, proxies, verify), which costs about as much
        CPU as the HTTP exchange itself; with 32 threads on one GIL that CPU
        is the ceiling (see the clean scenario of bench_redrive.py). The
        settings are fixed for a whole run, so the request is prepared from
        the session's headers and cookies and goes straight to the transport
        adapter; requests' own code still does the rest: URL and body
        encoding, .netrc auth, cookies set by the answer, and redirects
        (through send, rebuild_proxies and rebuild_auth below).
        """
        prepared = requests.PreparedRequest()
        prepared.prepare_method(method)
        prepared.prepare_url(url, None)
        prepared.headers = self.headers.copy()
        prepared.headers.update(extra)  # a refresh's If-None-Match and If-Modified-Since
        prepared.prepare_cookies(self.cookies)
        prepared.prepare_body(body, None)
        if auth or "@" in url:  # .netrc's, else the URL's user:password@, as requests sends them
            prepared.prepare_auth(auth, url)
        settings = {"stream": True, "timeout": timeout, "verify": self.verify, "cert": self.cert,
                    "proxies": proxies}
        resp = self.get_adapter(prepared.url).send(prepared, **settings)
        if "Set-Cookie" in resp.headers:
            requests.cookies.extract_cookies_to_jar(self.cookies, prepared, resp.raw)
        return self.follow(resp, prepared, settings) if resp.is_redirect else resp

    def follow(self, resp: requests.Response, prepared, settings: dict) -> requests.Response:
        """Follow redirects with requests' own logic; any failure on the way is a RedirectFailed."""
        try:
            drain_redirect(resp)
            history = [resp, *self.resolve_redirects(resp, prepared, **settings)]
        except TRANSPORT_ERRORS as exc:
            raise RedirectFailed(type(exc).__name__) from exc
        resp = history.pop()
        resp.history = history
        return resp

    def send(self, request, **kwargs) -> requests.Response:
        """One redirect hop (resolve_redirects sends them here): Session.send
        would look ahead at the next hop, which reads this one's whole body."""
        kwargs.pop("allow_redirects", None)
        resp = self.get_adapter(request.url).send(request, **kwargs)
        if resp.is_redirect:
            drain_redirect(resp)
        return resp

    def rebuild_proxies(self, prepared_request, proxies):
        """A redirect to another host takes that host's proxy settings."""
        url = prepared_request.url
        return super().rebuild_proxies(prepared_request, self.environment(url, origin_of(url))[0])

    def rebuild_auth(self, prepared_request, response):
        """Drop the user's headers on the way to another origin; on the same
        origin, give back the Cookie header requests drops on every redirect."""
        super().rebuild_auth(prepared_request, response)
        if origin_of(prepared_request.url) != self.origin:
            for name in list(prepared_request.headers):
                if name.lower() in self.guarded:
                    del prepared_request.headers[name]
        elif self.user_cookie is not None:
            prepared_request.headers["Cookie"] = self.user_cookie


def drain_redirect(resp: requests.Response) -> None:
    """Read a redirect's body raw, up to REDIRECT_BODY_BYTES; past that, drop
    the connection instead. requests would read it all, decompressed."""
    raw = resp.raw
    if len(raw.read(REDIRECT_BODY_BYTES + 1, decode_content=False) or b"") > REDIRECT_BODY_BYTES:
        raw.close()  # the rest stays unread: the connection must not be reused
    resp._content, resp._content_consumed = b"", True  # requests takes it as read


def stray_bytes(sock, wait: float = 0.0) -> bool:
    """Whether bytes come on a connection's socket whose answer was read in
    full, within wait seconds: a second answer, the connection out of step.
    One byte is read to tell a stray from a close (or a TLS ticket); either
    way the caller closes the connection."""
    if sock is None:
        return False
    try:
        if not (getattr(sock, "pending", lambda: 0)() or urllib3.util.wait_for_read(sock, timeout=wait)):
            return False
        sock.settimeout(0)
        return bool(sock.recv(1))
    except (OSError, ValueError):  # nothing decrypted yet (SSLWantReadError), or the connection is broken
        return False


class Aside(NamedTuple):
    """A connection's socket set aside to be watched (see in_step)."""

    at: float  #: when it is looked at: the answer behind its last would have come
    sock: Any
    ids: tuple  #: (id, a success) of its last answers
    origin: tuple


def in_step(conn, out: Outcome, session: "GuardedSession", origin: tuple, has_body: bool, took: float,
            leftover: bool, item_id: str, attempt: Attempt) -> Outcome:
    """The outcome, unless the connection carried a stray answer around it.

    An HTTP/1.1 connection pairs answers with requests by order only: a
    server that answers twice puts one id's answer under the next, and a
    connection one answer ahead stays so, each answer under the next id.
    Bytes that come after an answer read in full mean the connection is
    out of step: it is closed, its host gets a new connection for every
    request from then on, and its last answers are in doubt (Outcome.doubted:
    asked again, the new result line wins). The answer just read stands
    only if it was the first on its connection; otherwise it is asked again.
    Bytes already read past an answer are seen at once, and urllib3's look
    before a reuse sees those that came between (WatchedConnection
    .is_connected). A connection one answer ahead sees neither, and only a
    watch finds it: the connection is set aside and looked at once the
    answer behind its last would have come (watch_time), while the worker
    goes on with a new one; so are each host's first IN_STEP_CHECKS answers
    on a reused connection, every IN_STEP_EVERY-th on each, a connection
    closed with answers unwatched, and a worker's as it goes idle
    (leave_idle). A request with a body is never followed on its connection
    (a server that answered before reading the body takes the rest for a
    request), nor is an answer that is not a clean success."""
    if conn is None:
        return out
    hosts = session.environment
    closing = has_body or out.bucket is not Bucket.OK or origin in hosts.single_use or attempt.strayed
    reused = conn.sent > 1
    watched = reused and (hosts.watched(origin) or conn.sent % IN_STEP_EVERY == 0) or closing and conn.unwatched > 0
    hosts.answered(origin, watched, took if out.bucket is Bucket.OK else None)
    doubted = attempt.doubted + (tuple(conn.recent) if leftover else ())
    if leftover or attempt.strayed:
        hosts.single_use.add(origin)
    if reused and not leftover:
        conn.recent.append((item_id, out.bucket is Bucket.OK))
        conn.unwatched += 1
    if watched and not leftover:
        set_aside(session, conn, origin, time.monotonic() + hosts.watch_time(origin, took))
    elif leftover or closing:
        conn.close()  # its next connect() starts anew
    if leftover and reused:
        return Outcome(Bucket.RETRYABLE, out.status, OUT_OF_STEP, cause=Cause.OUT_OF_STEP, doubted=doubted)
    return dataclasses.replace(out, doubted=doubted) if doubted else out


def set_aside(session: "GuardedSession", conn, origin: tuple, at: float) -> None:
    """Watch the connection (see in_step): its socket is kept to be looked at
    `at`, and the connection opens a new one for its next request."""
    sock, conn.sock, conn.unwatched = conn.sock, None, 0
    if sock is not None:
        if len(session.aside) >= POOLED_HOSTS:  # as many sockets as connections at most: the oldest is looked at now
            session.aside[0] = session.aside[0]._replace(at=-math.inf)
        session.aside.append(Aside(at, sock, tuple(conn.recent), origin))
    conn.close()
    session.unwatched.pop(conn, None)


def look_aside(aside: list, hosts: HostSettings, now: float, wait: bool = False) -> tuple:
    """Look at the sockets set aside whose time has come (every one, waiting
    for its time, when wait), and take them off the list: bytes on one put
    its ids in doubt. Each is closed."""
    due, doubted = [a for a in aside if wait or a.at <= now], []
    for one in due:
        if stray_bytes(one.sock, max(0.0, one.at - time.monotonic()) if wait else 0.0):
            doubted.extend(one.ids)
            hosts.single_use.add(one.origin)
        with contextlib.suppress(OSError):
            one.sock.close()
    if due:
        aside[:] = [a for a in aside if a not in due]
    return tuple(doubted)


def leave_idle(session: "GuardedSession") -> list:
    """A worker about to go idle sets aside its connections with answers
    since their last watch, and hands over every socket set aside, to be
    looked at by the run (see in_step): it waits for none of them."""
    hosts, now = session.environment, time.monotonic()
    for conn, origin in list(session.unwatched.items()):
        set_aside(session, conn, origin, now + hosts.watch_time(origin, 0.0))
    handed, session.aside = session.aside, []
    return handed


def drop_connection(resp: requests.Response) -> None:
    """Close the connection under an answer whose framing is in doubt."""
    conn = getattr(resp.raw, "connection", None)
    if conn is not None:
        conn.close()


def make_session(cfg: Config, settings: HostSettings, watchdog: Watchdog) -> GuardedSession:
    """One worker's session: a keep-alive connection per host (a worker sends
    one request at a time), redrive's headers, urllib3's own retries off."""
    session = GuardedSession(cfg.request.header_names, settings, watchdog)
    adapter = WatchedAdapter(pool_connections=POOLED_HOSTS, pool_maxsize=1, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers["User-Agent"] = f"redrive/{__version__}"
    session.headers["Accept-Encoding"] = "gzip, deflate"  # what read_body decodes, bounded
    if cfg.request.data is not None and "content-type" not in cfg.request.header_names:
        json_body = cfg.request.json_data
        session.headers["Content-Type"] = "application/json" if json_body else "application/x-www-form-urlencoded"
    session.headers.update(dict(cfg.request.headers))
    session.user_cookie = next((value for name, value in cfg.request.headers if name.lower() == "cookie"), None)
    return session


def fetch(session: GuardedSession, item_id: str, cfg: Config, redact: Redactor,
          now: Callable[[], float], prior: Optional[Prior] = None) -> Outcome:
    """One attempt (see attempt_once), with what the sockets set aside whose
    time has come put in doubt (see in_step)."""
    outcome = attempt_once(session, item_id, cfg, redact, now, prior)
    doubted = look_aside(session.aside, session.environment, time.monotonic()) if session.aside else ()
    return dataclasses.replace(outcome, doubted=outcome.doubted + doubted) if doubted else outcome


def attempt_once(session: GuardedSession, item_id: str, cfg: Config, redact: Redactor,
                 now: Callable[[], float], prior: Optional[Prior] = None) -> Outcome:
    """One attempt (a conditional one for a refresh: prior). Every failure of
    the network, the server or the HTTP libraries comes back as an Outcome;
    only a bug in redrive raises."""
    if makes_dot_segment(cfg.request.url, item_id):
        return Outcome(Bucket.SKIP, error=DOT_SEGMENT, cause=Cause.DOT_SEGMENT)
    url = build_url(cfg.request.url, item_id)
    body = None if cfg.request.data is None else build_body(cfg.request.data, item_id, cfg.request.json_data)
    conditional = prior.headers() if prior else ()
    attempt, started = session.watchdog.begin(cfg.timeout), time.monotonic()
    phase, chunked = Phase.REQUEST, False
    try:
        session.origin = origin_of(url)
        proxies, auth = session.environment(url, session.origin)  # parses the URL: a bad port raises here
        with session.open(cfg.request.method, url, body, cfg.timeout, proxies, auth, conditional) as resp:
            conn = getattr(resp.raw, "connection", None)  # before the body is read, which gives it back to the pool
            phase, chunked = Phase.BODY, bool(getattr(resp.raw, "chunked", False))
            bucket = classify_status(resp.status_code, cfg)
            if resp.status_code < 200:
                drop_connection(resp)  # a final 1xx (a 101): no body framing to trust on this connection
            wanted = bucket is Bucket.OK or bucket is Bucket.FATAL
            raw = read_body(resp, cfg.max_bytes if wanted else ERROR_BODY_BYTES, attempt.deadline,
                            decode=wanted or resp.status_code == 403)  # a 403's body may say it is a rate limit
    except TRANSPORT_ERRORS as exc:
        phase = Phase.REDIRECT if isinstance(exc, RedirectFailed) else phase
        unreached = phase is Phase.REQUEST and never_connected(exc)  # more precise than the deadline's cut
        cause = AttemptTimeout() if attempt.expired and not unreached else exc
        bucket, kind, reason = transport_failure(cause, phase, cfg.timeout, chunked)
        proxy = chain_has(exception_chain(exc), requests.exceptions.ProxyError, urllib3.exceptions.ProxyError) and \
            requests.utils.select_proxy(url, proxies)
        return Outcome(bucket, error=reason, unreached=unreached, cause=kind, via=shown_host(proxy) if proxy else None,
                       heard=phase is Phase.BODY)
    finally:
        session.watchdog.end(attempt)
    if attempt.expired:  # cut mid-headers, http.client may take what came as a whole answer
        bucket, kind, reason = transport_failure(AttemptTimeout(), phase, cfg.timeout)
        return Outcome(bucket, error=reason, cause=kind, heard=phase is Phase.BODY)
    if raw is None and bucket is Bucket.OK:
        outcome = Outcome(Bucket.SKIP, resp.status_code, f"body over {cfg.max_bytes} bytes", cause=Cause.TOO_LARGE)
    else:
        outcome = interpret(resp, raw or b"", bucket, cfg, redact, now(), item_id, bool(conditional))
    leftover = getattr(getattr(resp.raw, "_original_response", None), "leftover", False)
    origin = origin_of(resp.url)
    outcome = in_step(conn, outcome, session, origin, body is not None, time.monotonic() - started,
                      leftover, item_id, attempt)
    if conn is not None and conn.unwatched and conn.sock is not None:
        if len(session.unwatched) >= POOLED_HOSTS and conn not in session.unwatched:  # those closed since go
            session.unwatched = {c: o for c, o in session.unwatched.items() if c.sock is not None}
        session.unwatched[conn] = origin
    return outcome


class Inflater:
    """Undoes a gzip or deflate Content-Encoding, never more than asked at a time.

    Done here rather than by urllib3, so that a decompression bomb (a few KB
    on the wire, gigabytes decoded) costs no more memory than --max-bytes
    with any urllib3, and a body that does not decode has its own reason.
    """

    def __init__(self, coding: str):
        self.coding, self.started = coding, False
        self.wbits = zlib.MAX_WBITS | 16 if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self.obj = zlib.decompressobj(self.wbits)

    @staticmethod
    def for_header(header: str) -> Optional["Inflater"]:
        """The Inflater for a Content-Encoding value; None for no or identity coding."""
        codings = [c for c in (c.strip().lower() for c in header.split(",")) if c not in ("", "identity")]
        if not codings:
            return None
        if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
            return Inflater(codings[0])
        raise UndecodableBody(", ".join(codings)[:40])

    def feed(self, data: bytes, limit: int) -> bytes:
        """Up to limit bytes decoded from data (more means the body is too large)."""
        try:
            out = self.obj.decompress(data, limit)
            while self.obj.eof and self.obj.unused_data[:2] == b"\x1f\x8b" and len(out) < limit:
                rest, self.obj = self.obj.unused_data, zlib.decompressobj(self.wbits)  # another gzip member
                out += self.obj.decompress(rest, limit - len(out))
        except zlib.error:
            if self.coding != "deflate" or self.started:
                raise UndecodableBody(self.coding) from None
            self.started, self.obj = True, zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, as some servers send
            return self.feed(data, limit)
        self.started = True
        return out

    def finish(self) -> None:
        """The body ended: so must the compressed stream, or data is missing."""
        if self.started and not self.obj.eof:
            raise UndecodableBody(self.coding)


def read_body(resp: requests.Response, max_bytes: int, deadline: float, decode: bool = True) -> Optional[bytes]:
    """Read the body in pieces as they arrive, within the deadline, undoing
    its Content-Encoding when decode is set.

    Returns None once it grows past max_bytes, decoded: reading stops there.
    """
    raw = resp.raw
    read = getattr(raw, "read1", None) or raw.read
    inflater = Inflater.for_header(resp.headers.get("Content-Encoding", "")) if decode else None
    body, size = [], 0
    while True:
        chunk = read(READ_CHUNK, decode_content=False)
        if not chunk:
            break
        if inflater is not None:
            chunk = inflater.feed(chunk, max_bytes - size + 1)
        size += len(chunk)
        if size > max_bytes:
            return None
        if time.monotonic() > deadline:
            raise AttemptTimeout()
        body.append(chunk)
        if getattr(raw, "length_remaining", None) == 0:
            break  # all Content-Length bytes are here: no read just to see the end
    if inflater is not None:
        inflater.finish()
    return b"".join(body)


#: A run of characters a key or token is made of, with a digit and a letter in
#: it: a fatal answer's body is shown with these hidden, since it may echo the
#: key in a form the redactor does not know (cut, reversed, re-encoded).
TOKEN_LIKE = re.compile(r"(?=[\w+/=.~%-]*\d)(?=[\w+/=.~%-]*[A-Za-z])[\w+/=.~%-]{16,}")


def interpret(resp: requests.Response, raw: bytes, bucket: Bucket, cfg: Config, redact: Redactor,
              now: float, item_id: str = "", conditional: bool = False) -> Outcome:
    """Turn a status and a body into an Outcome: a 2xx must carry a real body,
    a 304 is "unchanged" only to a request that sent a validator. The quota
    the headers declare is kept, whatever the status."""
    status = resp.status_code
    final = resp.url if resp.history else None
    quota = declared_quota(resp.headers, now)
    wait = parse_retry_after(resp.headers.get("Retry-After"), now)
    if wait is None and quota is not None and quota.remaining < 1 and bucket is not Bucket.OK:
        wait = quota.reset  # a refusal at none left: back at the reset (a Retry-After says it first)
    if bucket is Bucket.FATAL:
        excerpt = TOKEN_LIKE.sub("***", redact.excerpt(decode(raw, resp)[0], EXCERPT_CHARS)).replace("\n", " ")
        return Outcome(bucket, status, status_reason(status), excerpt=excerpt, quota=quota)
    if status == 403 and 403 not in cfg.skip and rate_limit_sign(raw, resp, wait, quota):
        return Outcome(Bucket.RETRYABLE, status, f"{status_reason(status)} (rate limited)", retry_after=wait,
                       cause=Cause.THROTTLED, throttle=True, said=True, quota=quota)
    if status == 304 and bucket is Bucket.SKIP and 304 not in cfg.skip:  # unless --skip names it
        if conditional:
            return Outcome(Bucket.OK, status, final_url=final, quota=quota, unchanged=True,
                           **validators(resp.headers))
        return Outcome(Bucket.RETRYABLE, status, NO_VALIDATOR_304, quota=quota)  # a server bug: never done
    if bucket is not Bucket.OK:
        lost = " (a redirect without a Location)" if status in requests.sessions.REDIRECT_STATI and \
            "Location" not in resp.headers else ""
        return Outcome(bucket, status, status_reason(status) + lost, retry_after=wait, quota=quota,
                       throttle=bucket is Bucket.RETRYABLE and status in THROTTLE_STATUSES)
    if not raw.strip():
        bodiless = status in BODILESS_STATUSES or cfg.request.method == "HEAD"
        if bodiless and not (cfg.request.wants_json or cfg.request.require):
            return Outcome(Bucket.OK, status, body="null", final_url=final, quota=quota, **validators(resp.headers))
        return Outcome(Bucket.RETRYABLE, status, "empty body", cause=Cause.BAD_BODY, quota=quota)
    text, exact = decode(raw, resp)
    if graphql_limited(text):
        return Outcome(Bucket.RETRYABLE, status, "rate limited (GraphQL errors)", retry_after=wait,
                       cause=Cause.THROTTLED, throttle=True, said=True, quota=quota)
    body, problem = validate(text, resp.headers.get("Content-Type", ""), cfg, item_id)
    if problem:
        return Outcome(Bucket.RETRYABLE, status, problem, cause=Cause.BAD_BODY, quota=quota)
    if not exact:  # stored losslessly: the bytes, not a text with replacement characters
        return Outcome(Bucket.OK, status, body=f'"{base64.b64encode(raw).decode()}"', final_url=final,
                       encoding="base64", quota=quota, **validators(resp.headers))
    return Outcome(Bucket.OK, status, body=body, final_url=final, quota=quota, **validators(resp.headers))


#: The reason of a 304 to a request that sent no validator: "not modified" since nothing.
NO_VALIDATOR_304 = "304 Not Modified to a request that sent no validator (a server bug)"


def validators(headers) -> dict:
    """A success's ETag and Last-Modified, as a refresh sends them back: only
    short, printable ones (anything else could not go out as a header)."""
    kept = {}
    for name, key in (("ETag", "etag"), ("Last-Modified", "last_modified")):
        value = (headers.get(name) or "").strip()
        if value and len(value) <= MAX_VALIDATOR and value.isascii() and value.isprintable():
            kept[key] = value
    return kept


#: How a 403 or a GraphQL error says it is a rate limit (GitHub: "API rate
#: limit exceeded", "secondary rate limit"; Shopify: "Throttled").
RATE_LIMIT_TEXT = re.compile(r"rate[ _-]?limit|throttl", re.I)
URL_TEXT = re.compile(r"[a-z][a-z0-9+.-]*://[^\s\"'<>]*", re.I)


def rate_limit_sign(raw: bytes, resp: requests.Response, wait: Optional[float], quota: Optional[Declared]) -> bool:
    """Is a 403 a rate limit, not a refusal of permission? It is when it
    declares none left, asks to wait, or says so in its body."""
    spent = quota is not None and quota.remaining < 1
    text = URL_TEXT.sub(" ", decode(raw[:ERROR_BODY_BYTES], resp)[0])  # a link to the rate-limit docs says nothing
    return spent or wait is not None or bool(RATE_LIMIT_TEXT.search(text))


def graphql_limited(text: str) -> bool:
    """A 200 whose GraphQL errors say it is throttled: GitHub's
    errors[].type "RATE_LIMITED", Shopify's "Throttled" (extensions.code "THROTTLED")."""
    if '"errors"' not in text[:4096] or not RATE_LIMIT_TEXT.search(text):
        return False
    try:
        errors = json.loads(text).get("errors")
    except (ValueError, AttributeError, RecursionError):
        return False
    marks = ("RATE_LIMITED", "THROTTLED", "Throttled")
    return isinstance(errors, list) and any(
        isinstance(e, dict) and (e.get("type") in marks or e.get("message") in marks or
                                 isinstance(e.get("extensions"), dict) and e["extensions"].get("code") in marks)
        for e in errors)


def validate(text: str, content_type: str, cfg: Config, item_id: str = "") -> tuple:
    """(body as results.jsonl stores it, None) for a real answer, or (None,
    reason) for a 2xx that is not one: a login wall, an interstitial, a
    truncated document."""
    body = text
    if cfg.request.wants_json or "json" in content_type.lower():
        try:
            body = json.loads(text[1:] if text[:1] == "\ufeff" else text)  # a byte-order mark (IIS, .NET) is no JSON error
        except RecursionError:
            body = text  # JSON nested deeper than Python can hold: kept as its text
        except ValueError:
            return None, "invalid JSON"
    plain = None
    for needle in cfg.request.require:
        needle = needle.replace("{id}", item_id)  # '"id":"{id}"': the answer is this id's
        if needle not in text:
            plain = unescaped(text) if plain is None and body is not text else plain
            if plain is None or needle not in plain:
                return None, f"missing text {needle!r}"
    for name in cfg.request.require_field:
        if not isinstance(body, dict) or body.get(name) is None:
            return None, f"missing field {name!r}"
    return strict_json(body, text), None


#: A JSON string literal, escapes and all.
JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"')


def unescaped(text: str) -> str:
    """JSON text with each string's escapes undone ('a\\/b' is 'a/b',
    'caf\\u00e9' is 'café'), for --require to find an id however the
    server chose to escape it."""
    def plain(match):
        try:
            return '"' + json.loads(match.group()) + '"'
        except ValueError:
            return match.group()
    return JSON_STRING.sub(plain, text)


#: A JSON escape of a UTF-16 surrogate: it may decode to a lone one, which UTF-8 cannot hold.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def strict_json(body, text: str) -> str:
    """The body as RFC 8259 JSON text. JSON that Python reads but a strict
    reader would not (NaN, Infinity, nesting past what json.dumps can
    write) is kept as its text, a JSON string."""
    ascii_only = "\\u" in text and SURROGATE_ESCAPE.search(text) is not None
    try:
        return json.dumps(body, ensure_ascii=ascii_only, allow_nan=False, separators=(",", ":"))
    except (ValueError, RecursionError):
        return json.dumps(text, ensure_ascii=False)


def decode(raw: bytes, resp: requests.Response) -> tuple:
    """(text, exact): the body in its declared charset, else UTF-8. exact is
    False when the bytes are not text in either (binary, broken UTF-8, a
    charset Python cannot decode with, or one that is not a text codec), or
    decode to what UTF-8 cannot hold (a lone surrogate: utf-7's '+2AA-'): the
    text then has replacement characters, fit for checks, never for storing."""
    declared = resp.encoding if "charset=" in resp.headers.get("Content-Type", "").lower() else None
    for codec in filter(None, (declared, "utf-8")):
        try:
            if not getattr(codecs.lookup(codec), "_is_text_encoding", True):
                continue  # base64, zlib, rot13: bytes to bytes, not a charset
            text = raw.decode(codec)
            text.encode("utf-8")
            return text, True
        except (LookupError, ValueError, TypeError):  # UnicodeDecodeError and UnicodeEncodeError are ValueErrors
            continue
    return raw.decode("utf-8", errors="replace"), False


# --------------------------------------------------- scheduler and run loop


def select_lateness(sock: socket.socket, tries: int = 3) -> float:
    """How late a select of 1 ms on an idle socket ends here, the least of `tries`."""
    late = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        select.select([sock], [], [], 0.001)
        late = min(late, time.perf_counter() - start - 0.001)
    return max(late, 0.0)


class Wake:
    """Wakes the main thread: a worker went idle, or a signal came.

    A signal handler runs between any two bytecodes of the main thread, so
    set() takes no lock: it sends a byte on a socket pair. wait() is bounded
    whatever it is given (see bounded_wait). A wait shorter than select is
    late by (`grain`: on Windows it ends on the system timer's 15.6 ms tick)
    is slept on time.sleep's timer, finer there since Python 3.11: a paced
    slot met late is never made up, and so short a wait needs no waking.
    """

    def __init__(self, grain: Optional[float] = None):
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        self.grain = select_lateness(self.reader) if grain is None else grain

    def set(self) -> None:
        try:
            self.writer.send(b"!")
        except OSError:
            pass  # the pair is full (a wake-up is pending anyway) or closed (the run is over)

    def wait(self, seconds: Optional[float]) -> None:
        wait = bounded_wait(seconds)
        try:
            if wait < self.grain:
                time.sleep(wait)
            else:
                select.select([self.reader], [], [], wait)
            self.reader.recv(65536)  # once: wake-ups that keep coming must not keep it here
        except OSError:
            pass  # nothing to read (BlockingIOError), or closed

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


@dataclass
class Tally:
    """What this run did, for the summary."""

    requests: int = 0
    per_pass: dict = field(default_factory=dict)  #: pass -> Counter of results
    fatal: Optional[Outcome] = None
    fatal_id: str = ""
    stop: Optional[Stop] = None
    stop_at: Optional[float] = None  #: clock time to give up on requests in flight after the stop
    abandoned: int = 0
    down: Optional[dict] = None  #: the API's host went down: host, reason, since, probes
    due: Optional[float] = None  #: stop "later": when the first id left is due (wall clock)
    crash: Optional[dict] = None  #: stop "crash": the id, the error, when, and its traceback
    misconfigured: Optional[dict] = None  #: stop "misconfigured": the sign, one id, how many answers
    quota: Optional[dict] = None  #: the tightest quota a host declared, at the run's end (see quota_view)
    throttled: Optional[dict] = None  #: a host took nothing for longer than --max-backoff: host, since, status
    refresh: Counter = field(default_factory=Counter)  #: refreshed ids by result (see REFRESH_RESULTS)
    kept: list = field(default_factory=list)  #: the refreshed.jsonl records of ids whose refresh failed
    asked_again: set = field(default_factory=set)  #: ids a refresh asked that failed a pass (failed.jsonl compacts)
    gone: list = field(default_factory=list)  #: (line, id) of the ids a refresh found removed upstream
    answers: Counter = field(default_factory=Counter)  #: answers by status class (2xx ... 5xx, or "none")
    refusals: int = 0  #: throttles: 429, 503 and answers that said they were a rate limit
    doubted: int = 0  #: ids asked again: their answers may have been others' (see in_step)
    in_doubt: set = field(default_factory=set)  #: those whose stored verdict stands until they are answered again

    def count(self, pass_no: int, what: str, n: int = 1) -> None:
        self.per_pass.setdefault(pass_no, Counter())[what] += n

    def stopping(self, why: Stop, now: float, cfg: Config) -> None:
        """The first stop stands; requests in flight get a grace (a whole
        --timeout after --max-time, else GRACE_SECONDS at most). Takes no lock:
        a signal handler calls it (see Batch.request_stop)."""
        if not self.stop:  # the grace first: whoever sees the stop sees its grace too
            self.stop_at = now + (cfg.timeout if why is Stop.TIME else min(GRACE_SECONDS, cfg.timeout))
            self.stop = why


#: Untried ids of pass one a run holds on its schedule: it reads on in the
#: ids file when fewer are left. With hosts in the ids (a list of URLs) and
#: none of those held open, it reads further, up to LOOKAHEAD_MOST.
LOOKAHEAD, LOOKAHEAD_MOST = 10_000, 1_000_000


class Feed:
    """Pass one's untried ids, then the ids a refresh asks again, read from
    the ids file as the schedule wants them: the PENDING lines of the run's
    index in file order, then its DUE lines, each FED (DONE) as it is read.
    Only the block of the file being read is held."""

    def __init__(self, listing: Listing, refresh: Optional["Refresh"] = None):
        self.ids_file, self.flags, self.refresh = listing.ids_file, listing.flags, refresh
        self.left = listing.pending() + (self.flags.count(DUE) if refresh else 0)
        self.sweeps = [PENDING, DUE] if refresh else [PENDING]
        self._sweep()

    def _sweep(self) -> None:
        flags, flag = self.flags, self.sweeps.pop(0)
        self.flag = flag
        self.blocks = id_blocks(self.ids_file, 0, 0, lambda first, end: flags.find(flag, first, end) >= 0)
        self.first, self.ids, self.at = 0, [], 0  #: the block being read: its first line, its lines, the next

    def take(self, count: int) -> list:
        """Up to `count` (line, id, Prior or None) of the next ids."""
        taken, flags = [], self.flags
        while len(taken) < count and self.left:
            n = flags.find(self.flag, self.first + self.at, self.first + len(self.ids))
            if n < 0:
                block = next(self.blocks, None)
                if block is not None:
                    self.first, self.ids, self.at = block[0], block[1] or [], 0
                elif self.sweeps:
                    self._sweep()
                else:
                    self.left = 0  # the file was cut short since the index: what is left is not there
                continue
            refreshed = self.flag == DUE  # done still, whatever its refresh finds (a gone id is its own record)
            flags[n], self.at = DONE if refreshed else FED, n - self.first + 1
            taken.append((n, self.ids[n - self.first], self.refresh.prior(n) if refreshed else None))
            self.left -= 1
        return taken


class Schedule:
    """The run's timeline, with no threads and no clock of its own: ids
    waiting for their time (a heap), ids whose time has come queued behind
    their host's gate (see Host), the hosts in round robin, the --rate slot
    and the requests in flight. It answers "which id may start now" (take)
    and "when may the next" (next_wake)."""

    def __init__(self, cfg: Config, rand: Callable[[], float] = random.random):
        self.cfg, self.rand = cfg, rand
        self.heap, self.seq = [], itertools.count()  #: (ready_at, seq, item): ids waiting for their time
        self.hosts, self.active = {}, deque()  #: Host by name; hosts with ready ids, round robin
        self.next_slot = 0.0  #: --rate: when the next request may start
        self.inflight, self.starts = 0, itertools.count(1)  #: requests in flight; numbers for those started
        self.pauses = {}  #: host name -> the end of its pause, for the hosts an answer paused
        self.quoted = set()  #: the hosts that declared a quota (see quota)
        self.fixed_host = None if "{id}" in urlsplit(cfg.request.url).netloc or cfg.request.url == "{id}" else \
            host_of(cfg.request.url, "")  #: the one host every id goes to, if the template says so
        self.feed, self.untried = None, 0  #: pass one's ids still in the file (Feed); those held here
        self.recalled = {}  #: the limits earlier runs found, by pace_key (paces.json)

    def add(self, item: Item, ready_at: float, now: float) -> None:
        """An id due at `ready_at`: if that is now, it goes to its host's queue."""
        if not item.host:
            item.host = self.fixed_host or host_of(self.cfg.request.url, item.id)
        if ready_at <= now:
            self._make_ready(item)
        else:
            heapq.heappush(self.heap, (ready_at, next(self.seq), item))

    def add_untried(self, line: int, item_id: str, prior: Optional[Prior] = None) -> None:
        """An id of pass one, never tried, or of a refresh (with its Prior),
        due now: it waits in its host's queue as a tuple, and becomes an Item
        when it is taken."""
        name = self.fixed_host or host_of(self.cfg.request.url, item_id)
        host = self.hosts.get(name)
        if host is None:
            host = self.hosts[name] = Host(cap=self.cfg.per_host or self.cfg.concurrency, longest=self.cfg.max_backoff)
        if not host.ready:
            self.active.append(name)
        host.ready.append((line, item_id, prior))
        self.untried += 1

    def read_on(self, most: Optional[int] = None) -> None:
        """Hold up to `most` (LOOKAHEAD) untried ids, read on from the feed."""
        most = LOOKAHEAD if most is None else most
        if self.feed is not None and self.untried < most:
            for line, item_id, prior in self.feed.take(most - self.untried):
                self.add_untried(line, item_id, prior)

    def pending(self) -> int:
        held = sum(len(self.hosts[name].ready) for name in self.active)
        return len(self.heap) + held + (self.feed.left if self.feed else 0)

    def empty(self) -> bool:
        """Nothing waiting, ready or in flight."""
        return not (self.heap or self.active or self.inflight)

    def next_due(self) -> Optional[float]:
        """When the first id waiting for its time is due (None: none waits)."""
        return self.heap[0][0] if self.heap else None

    def _make_ready(self, item: Item) -> None:
        host = self.hosts.get(item.host)
        if host is None:
            host = self.hosts[item.host] = Host(cap=self.cfg.per_host or self.cfg.concurrency,
                                                longest=self.cfg.max_backoff)
        if not host.ready:
            self.active.append(item.host)
        # a retry whose time has come goes before untried ids; one refused for itself behind them, as one turned away:
        # ids in trouble of their own would take the slots of those that may be fine, and the pace is measured on them
        if item.sent >= 0 and not item.turned_away and not item.own:
            host.ready.appendleft(item)
        else:
            host.ready.append(item)

    def _promote(self, now: float) -> None:
        while self.heap and self.heap[0][0] <= now:
            self._make_ready(heapq.heappop(self.heap)[2])

    def _open_host(self, now: float) -> Optional[Host]:
        """The next host, round robin, whose gate is open now: it is left
        last in the round robin."""
        for _ in range(len(self.active)):
            host = self.hosts[self.active[0]]
            self.active.rotate(-1)
            opens = host.opens_at(now)
            if opens is not None and opens <= now:
                return host
        return None

    def take(self, now: float) -> Optional[Item]:
        """The next id whose time has come and whose host lets it through,
        started (in flight from now); None when there is none."""
        self._promote(now)
        if self.inflight >= self.cfg.concurrency or self.next_slot > now or not self.active:
            return None
        host = self._open_host(now)
        while host is None and self.fixed_host is None and self.feed and self.feed.left and \
                self.untried < LOOKAHEAD_MOST:  # the hosts held are all shut: some further on may be open
            self.read_on(self.untried + LOOKAHEAD)
            host = self._open_host(now)
        if host is None:
            return None
        item = host.ready.popleft() if host.down_since is None else self._probe(host)
        if isinstance(item, tuple):  # an untried id waits as a tuple (see add_untried)
            item = Item(item[1], host=self.active[-1], line=item[0], prior=item[2], listed=item[2] is not None)
            self.untried -= 1
        if not host.ready:
            self.active.pop()  # the host _open_host left last: no scan of a million hosts
        if self.untried < LOOKAHEAD // 2:
            self.read_on()
        new = host.first_sent is None
        host.start(now)
        learnt = new and self.recalled and self.recalled.get(pace_key(item.host))  # a host never asked was never cut
        if learnt:
            host.recall(now, learnt["pace"], learnt["window"])
        item.sent, item.order = now, next(self.starts)
        if self.cfg.rate:
            self.next_slot = max(self.next_slot, now) + 1.0 / self.cfg.rate
        self.inflight += 1
        return item

    def _probe(self, host: Host) -> Item:
        """A down host's probe: an id not tried yet, from a random place in its
        queue (the next ones may be a block of ids that hang, and only say
        that they hang); the next id when a few draws find none."""
        ready = host.ready
        for _ in range(DOWN_AFTER):
            at = int(self.rand() * len(ready)) % len(ready)
            if isinstance(ready[at], tuple) or ready[at].tries == 0 and not ready[at].timed_out:
                item = ready[at]
                del ready[at]
                return item
        return ready.popleft()

    def next_wake(self, now: float) -> Optional[float]:
        """When something may be started next: an id's time, a gate, the --rate slot."""
        self._promote(now)  # an id due now waits on its host's gate: that is its time
        times = [self.heap[0][0]] if self.heap else []
        if self.inflight < self.cfg.concurrency:
            gates = (self.hosts[name].opens_at(now) for name in self.active)
            times += [max(t, self.next_slot) for t in gates if t is not None]
        return min(times) if times else None

    def settled(self, item: Item, now: float) -> None:
        """The id's attempt is settled: a host its answer paused is noted (see
        paused_until), a host as new is forgotten (ids on a million hosts keep
        no million gates)."""
        host = self.hosts[item.host]
        if host.paused_until > now:
            self.pauses[item.host] = host.paused_until
        elif host.forgettable(now):
            del self.hosts[item.host]

    def paced(self, name: str) -> bool:
        """Is host `name` paced (it has limited, or declared a quota)? A paced host is never forgotten."""
        host = self.hosts.get(name)
        return host is not None and bool(host.w_max or host.quotas)

    def gate_opens(self, name: str, now: float) -> Optional[float]:
        """When host `name` lets its next ready id through (None: it has none, or is full)."""
        host = self.hosts.get(name)
        return host.opens_at(now) if host is not None and host.ready else None

    def quota(self, now: float) -> Optional[tuple]:
        """(bucket, Quota): the tightest quota of the hosts that declared one, or None."""
        live = [q for q in (self.hosts[name].quota(now) for name in self.quoted if name in self.hosts) if q]
        return min(live, key=lambda bq: bq[1].left, default=None)

    def paused_until(self, now: float) -> float:
        """The latest pause of a host with ids ready (0: none is paused). Only
        the hosts noted as paused are looked at, and those whose pause is over
        are dropped: a status line over a list of URLs on a million hosts
        scans no million gates under the lock."""
        for name, until in list(self.pauses.items()):
            if until <= now or name not in self.hosts:
                del self.pauses[name]
        return max((until for name, until in self.pauses.items() if self.hosts[name].ready), default=0.0)


def unavailable_record(item_id, reason, status, bucket, cause, tries, at, passes) -> dict:
    return {"id": item_id, "reason": reason, "status": status, "bucket": bucket.value, "cause": cause.value,
            "tries": tries, "at": iso(at), "action": recommend(bucket, status, cause, reason, passes)}


def give_up(record: dict, ledger: Ledger, state: State) -> None:
    """An id confirmed unavailable: unavailable.jsonl, and the report marks it new."""
    ledger.record("unavailable.jsonl", record)
    before = state.unavailable.get(record["id"])
    if before is not None and before["reason"] == record["reason"]:  # --retry-unavailable found it as it was
        state.repeated.add(record["id"])
    state.unavailable[record["id"]] = record
    state.fresh.add(record["id"])


class Books:
    """The run's accounts: each settled step written to the state files and
    the state in memory, and counted for the status line and the report.
    Batch calls it under its lock."""

    def __init__(self, cfg: Config, ledger: Ledger, state: State, redact: Redactor,
                 wallclock: Callable[[], float], tally: "Tally"):
        self.cfg, self.ledger, self.state, self.redact = cfg, ledger, state, redact
        self.wallclock, self.tally = wallclock, tally
        self.counts = Counter()  #: done, unavailable, awaiting (a later pass): for the progress line

    def done(self, item: Item, out: Outcome) -> None:
        """A success: its line in results.jsonl, then its id in done.txt (unless
        listed there already). A refresh's success goes to refreshed()."""
        if item.prior is not None:
            return self.refreshed(item, out)
        if item.doubted and item.listed:  # counted done already: the new result line wins
            return self.ledger.append("results.jsonl", self.result_line(item, out))
        if item.listed:  # an id gone upstream that came back: its done line is there already
            self.ledger.append("results.jsonl", self.result_line(item, out))
        else:
            self.ledger.success(item.id, self.result_line(item, out))
        if item.line >= 0 and self.state.lines is not None:
            self.state.lines[item.line] = DONE  # a run's done ids are its index's lines, not a set of them all
        if item.line < 0 or item.id in self.state.unavailable:
            self.state.done.add(item.id)
        self.counts["done"] += 1
        self.tally.count(item.pass_no, "done")

    def result_line(self, item: Item, out: Outcome) -> str:
        url = build_url(self.cfg.request.url, item.id)
        record = {"id": item.id, "url": self.redact(shown_url(self.cfg.request, item.id)), "status": out.status,
                  "fetched_at": iso(self.wallclock())}
        if out.final_url and out.final_url != url:
            record["final_url"] = self.redact(redact_url(out.final_url))
        if out.encoding:
            record["body_encoding"] = out.encoding
        for key in ("etag", "last_modified"):  # before the body: a refresh reads them without parsing it
            if getattr(out, key):
                record[key] = getattr(out, key)
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        return f'{line[:-1]},"body":{out.body}}}'  # the body is JSON text already

    def refreshed(self, item: Item, out: Outcome) -> None:
        """A refresh answered: a 304, or a 200 with the body stored already,
        leaves the result as it is and moves its fetch time on (one line in
        refreshed.jsonl); a new body is a new result line (the last line of an
        id wins) and then its refreshed line. Either is whole after a kill."""
        same = out.unchanged or body_digest(out.body) == item.prior.digest
        if not same:
            self.ledger.append("results.jsonl", self.result_line(item, out))
        record = {"id": item.id, "at": iso(self.wallclock()), "result": "unchanged" if same else "changed",
                  "status": out.status}
        in_force = (out.etag or item.prior.etag, out.last_modified or item.prior.last_modified)
        if same and in_force != item.prior.stored:  # the next refresh sends these: the last line of an id says them
            record.update({k: v for k, v in zip(("etag", "last_modified"), in_force) if v})
        self.note_refresh(item, record)

    def note_refresh(self, item: Item, record: dict) -> None:
        self.ledger.record("refreshed.jsonl", record)
        self.tally.refresh[record["result"]] += 1
        self.counts["refreshed"] += 1
        if record["result"] == "kept":
            self.tally.kept.append(record)

    def failed(self, item: Item, step: Step) -> None:
        """A pass over for the id (FAIL or GIVE_UP): failed.jsonl, then, after its last pass, unavailable.jsonl."""
        at, out = self.wallclock(), step.outcome
        record = {"id": item.id, "pass": item.pass_no, "bucket": out.bucket.value, "status": out.status,
                  "cause": out.cause.value, "error": out.error, "tries": item.tries, "at": iso(at)}
        if out.retry_after is not None:
            record["retry_after"] = out.retry_after
        if step.move is Move.FAIL:
            record["due"] = iso(at + step.wait)
        self.ledger.record("failed.jsonl", record)
        self.state.failed[item.id] = record
        if item.prior is not None:
            self.tally.asked_again.add(item.id)
        if step.move is Move.GIVE_UP:
            self.unavailable(item, out)
        elif item.prior is None:  # a refresh's passes are its own line of the summary
            self.tally.count(item.pass_no, "failed")

    def unavailable(self, item: Item, out: Outcome) -> None:
        """Confirmed unavailable: unavailable.jsonl, with its reason and the
        recommended action. A refreshed id is so only when it is gone upstream
        (404, 410); any other failure keeps its stored result."""
        gone = item.prior is not None and out.status in GONE_STATUSES and out.bucket is Bucket.SKIP
        if item.prior is not None and not gone:
            record = {"id": item.id, "at": iso(self.wallclock()), "result": "kept", "status": out.status,
                      "reason": out.error}
            return self.note_refresh(item, record)
        reason = f"removed upstream since its last fetch ({out.error})" if gone else out.error
        record = unavailable_record(item.id, reason, out.status, out.bucket, out.cause, item.tries,
                                    self.wallclock(), self.cfg.passes)
        give_up(record, self.ledger, self.state)  # newer than its result: the id is done no more
        self.counts["unavailable"] += 1
        if not gone:
            self.tally.count(item.pass_no, "unavailable")
        else:
            self.counts["done"] -= 1
            self.tally.gone.append((item.line, item.id))
            self.note_refresh(item, {"id": item.id, "at": record["at"], "result": "gone", "status": out.status})


@dataclass(frozen=True)
class Snapshot:
    """What the status line shows, taken from the batch under its lock."""

    requests: int
    done: int
    unavailable: int
    awaiting: int  #: ids failed in a pass, waiting for the next
    last_due: float  #: when the last of them is due
    pass_no: int
    paused_until: float  #: the latest pause of a host with ids ready
    waiting_until: Optional[float]  #: nothing in flight or ready: when the next id is due
    quota: Optional[dict] = None  #: the tightest declared quota (see quota_view)
    down: bool = False  #: the API's host is unreachable: its pause is a probe's, not a throttle's
    refresh: Optional[tuple] = None  #: (settled, due): the done ids this run refreshes


def beyond_reach(due: float, now: float, end_at: Optional[float], cfg: Config) -> bool:
    """Waiting for an id due at `due` would keep a cron run alive for
    nothing: it is due past --max-time, or past both the cool-down and twice
    --max-backoff (a Retry-After of a day)."""
    if end_at is not None and due > end_at:
        return True
    return due - now > max(2 * cfg.max_backoff, cfg.cooldown)


def stopping_line(stop: Stop, inflight: int, seconds: float) -> str:
    """What a first stop signal waits for, and how to quit now."""
    again = "press Ctrl+C again" if stop is Stop.INTERRUPTED else "send the signal again"
    return (f"redrive: {stop.value}: finishing the {inflight} request(s) in flight (up to {duration(seconds)}); "
            f"{again} to quit now, leaving them pending")


def crash_record(exc: BaseException, item_id: Optional[str], now: float) -> dict:
    """A bug, as crash.log and the report tell it."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"id": item_id, "error": f"{type(exc).__name__}: {exc}", "at": now, "traceback": trace}


#: An id refused this many times in a row while its host took others, more
#: often than the host's share of first asks refused explains (see
#: Settler._throttled), is refused for itself, whatever the refusal says.
OWN_REFUSALS = 3

#: The share rule's tail, SHARE_SIGMAS standard deviations (2.3%): refusals in
#: a row rarer than it, were everyone refused alike, are not everyone's.
SHARE_TAIL = math.erfc(SHARE_SIGMAS / math.sqrt(2)) / 2


class Settler:
    """What each outcome means, applied, with no threads (Batch calls it under
    its lock): the host's gate is told (see Host), the guard takes its sample
    (see Guard), and the id's next step (see next_step) is written down
    (see Books) and put on the timeline (see Schedule)."""

    def __init__(self, cfg: Config, timeline: Schedule, books: Books, fx: Effects, say: Callable[[str], None]):
        self.cfg, self.timeline, self.books, self.fx = cfg, timeline, books, fx
        self.tally, self.counts = books.tally, books.counts
        self.say = say
        self.api = shown_host(cfg.request.url)  #: the fixed host, as messages name it
        self.guard = Guard(0)  #: off until armed (see run_passes)
        self.last_due = 0.0  #: when the last id scheduled to wait is due (for the ETA)
        self.started_passes = set()
        self.refresh_due = 0  #: done ids this run refreshes
        self.suspect = set()  #: ids in doubt not settled then (see in_step): unavailable, they are asked again

    def take(self, now: float) -> Optional[Item]:
        """The next id that may start now (see Schedule.take), counted as started."""
        item = self.timeline.take(now)
        if item is None:
            return None
        if item.pass_no > 1 and item.tries == 0:
            self.counts["awaiting"] -= 1
        if item.pass_no not in self.started_passes:
            self.started_passes.add(item.pass_no)
            if item.pass_no > 1:
                self.say(f"redrive: pass {item.pass_no}: re-driving ids that failed pass {item.pass_no - 1}")
        self.tally.requests += 1
        return item

    def snapshot(self) -> Snapshot:
        """The status line's figures (the lock held)."""
        timeline, counts = self.timeline, self.counts
        idle = not (timeline.inflight or timeline.active)
        return Snapshot(self.tally.requests, counts["done"], counts["unavailable"], counts["awaiting"],
                        self.last_due, max(self.started_passes, default=1), timeline.paused_until(self.fx.clock()),
                        timeline.next_due() if idle else None, self.quota_view(), self.tally.down is not None,
                        (counts["refreshed"], self.refresh_due) if self.refresh_due else None)

    def quota_view(self) -> Optional[dict]:
        """The tightest quota a host declared, as the status line and report.json show it."""
        found = self.timeline.quota(self.fx.clock())
        if found is None:
            return None
        bucket, quota = found
        reset = self.fx.wallclock() + quota.reset_at - self.fx.clock()
        return {"remaining": int(max(0.0, quota.remaining)), "limit": None if quota.limit is None else int(quota.limit),
                "resets_at": iso(reset), "bucket": bucket}

    def schedule(self, item: Item, ready_at: float) -> None:
        """Put an id on the timeline (see Schedule.add), counted if it waits for a later pass."""
        self.last_due = max(self.last_due, ready_at)  # a backoff's end, or a later pass's: no ETA before it
        if item.pass_no > 1 and item.tries == 0:
            self.counts["awaiting"] += 1
        self.timeline.add(item, ready_at, self.fx.clock())

    def finish(self, item: Item, outcome: Outcome) -> None:
        """One outcome of an id in flight: the host, then the guard or the id, then the timeline."""
        item.turned_away, sent = False, item.sent
        self.tally.answers[f"{outcome.status // 100}xx" if outcome.status else "none"] += 1
        self.tally.refusals += outcome.throttle
        if self.observe(item, outcome):  # it never reached the host, or the host throttled it: no try spent
            item.turned_away = outcome.throttle  # one id in trouble must not be the host's only probe
            wait = outcome.retry_after if outcome.throttle and outcome.retry_after else 0.0
            self.schedule(item, self.fx.clock() + wait)  # its own wait, whether or not the host pauses
            decision = f"the host's {'throttle' if outcome.throttle else 'trouble'}: again, no try spent"
        elif self.guard.open:
            decision = "held while answers fail alike in a row (see --no-guard)"
            for held, out in self.guard.offer(item, outcome, misconfiguration_sign(outcome, self.cfg), item.order):
                settled = self.settle(held, out)
                decision = settled if held is item else decision
            if self.guard.tripped and not self.tally.misconfigured:
                self.tally.misconfigured = {"sign": self.guard.sign, "id": item.id, "answers": self.guard.size,
                                            "refresh": item.prior is not None, "fine": self.guard.fine,
                                            "fresh": self.guard.fresh}
                self.tally.stopping(Stop.MISCONFIGURED, self.fx.clock(), self.cfg)
        else:
            decision = self.settle(item, outcome)
        if self.cfg.verbose:
            self.say(self.request_line(item.id, sent, outcome, decision))
        self.timeline.settled(item, self.fx.clock())
        self.ask_again(outcome.doubted, item.pass_no)

    def ask_again(self, doubted: tuple, pass_no: int) -> None:
        """Ids whose answers may have been others' (see in_step), each asked
        once more in this run: a success (its new result line wins) or one
        confirmed unavailable, its verdict undone. One not yet settled is
        asked again when a verdict of unavailable comes (see settle)."""
        for item_id, ok in doubted:  # each answer is in one connection's last ones: in doubt once
            gone = not ok and item_id in self.books.state.fresh
            if not (ok or gone):
                self.suspect.add(item_id)
                continue
            self.tally.doubted += 1
            self.tally.in_doubt.add(item_id)
            if gone:  # counted unavailable: its next verdict counts instead (the later verdict wins)
                self.books.state.fresh.discard(item_id)
                self.counts["unavailable"] -= 1
                self.tally.count(pass_no, "unavailable", -1)
            now = self.fx.clock()  # asked before: it goes ahead of the untried ids
            self.schedule(Item(item_id, pass_no, listed=ok, doubted=True, sent=now), now)

    def request_line(self, item_id: str, sent: float, out: Outcome, decision: str) -> str:
        """-v: one line a request: the time, the id, the answer, how long and how big, what was decided."""
        size = len(out.body.encode("utf-8")) if out.body else 0
        answer = str(out.status) if out.status is not None and out.bucket is Bucket.OK else out.error
        return (f"redrive: {iso(self.fx.wallclock())[11:23]} {self.books.redact(shown_id(item_id))!r} {answer} "
                f"{(self.fx.clock() - sent) * 1000:.0f} ms {size} B: {decision}")

    def release_held(self) -> bool:
        """The run ends before the guard decided: the answers it held are real
        ones, settled as usual (unless it tripped, or a bug stops the run).
        True when that left work to do."""
        if not self.guard.held or self.guard.tripped or self.tally.crash:
            return False
        for held, out in self.guard.release():
            self.settle(held, out)
        return not self.timeline.empty()

    def observe(self, item: Item, out: Outcome) -> bool:
        """What an outcome says about its host: doing fine, slow down, or down.
        True when the attempt does not count against the id: it never reached
        the API's one host, or that host went silent, or refused it as the
        host's throttle: it says nothing about the id."""
        host, now = self.timeline.hosts[item.host], self.fx.clock()
        if out.unreached and self.timeline.fixed_host:
            self._unreachable(host, out, now)
            return True
        if out.heard:  # its answer began: a host that sends bytes is not silent, whatever this id does
            host.heard_at = now
        heard = max(host.heard_at, host.first_sent if host.first_sent is not None else now)
        silent = out.cause is Cause.TIMEOUT and (host.down_since is not None or not item.timed_out and
                                                 now - heard >= 2 * self.cfg.timeout)
        item.timed_out = item.timed_out or out.cause is Cause.TIMEOUT
        if silent and self.timeline.fixed_host:
            # a host that takes connections and never answers is as down as one that refuses them: DOWN_AFTER ids
            # in a row timing out afresh, and nothing heard for two timeouts, take it down (no try spent since)
            was_down = host.down_since is not None
            return self._unreachable(host, out, now) and was_down
        if out.cause is Cause.TIMEOUT:  # connected, but no answer: nothing heard from the host
            host.answered(now, item.sent)  # reached, but no answer: no sign either way
            return False
        if host.down_since is not None:
            self.say(f"redrive: {self.api} answers again; resuming")
            self.tally.down = None
        host.reached(now)
        if out.quota is not None:
            self.timeline.quoted.add(item.host)
        if not item.throttles:  # the host's own refusals are blind to which ids it refused before (see _throttled)
            host.firsts = (host.firsts[0] + 1, host.firsts[1] + out.throttle)
        if out.throttle:  # 429, 503 (unless --skip or --fatal names it), or a rate limit said
            return self._throttled(host, item, out, now)
        item.refused, item.throttles = False, 0
        if out.status is not None:
            host.succeeded(now, item.sent, out.quota)  # a 404 or a 500 is no "slow down" either
        else:
            host.answered(now, item.sent)  # reached, but no answer: no sign either way
        return False

    def _throttled(self, host: Host, item: Item, out: Outcome, now: float) -> bool:
        """A refusal. The host's costs the id no try: it goes first again
        once the gate opens, or, asked to wait past --max-backoff by a
        declared quota, stays pending until its reset (the run then ends:
        see Timekeeper). A host that has taken nothing for longer than
        --max-backoff is paused beyond the run's reach: the run ends with its
        ids pending (exit 1). An id refused OWN_REFUSALS times in a row while
        the host took others is refused for itself if the host refused no
        other, or if the share of the ids not refused just before (first
        asks) that it refused since, its own pooled in, makes so many in a row
        rarer than the share rule's tail: a host's refusals are blind to which
        ids it refused before, and ids in trouble of their own are refused
        every time. A 403 is then its permission answer, any other refusal
        spends a try and is no sign of the host's (no test of a search, no
        cut), so no refusal of one id goes on for ever. Only other ids'
        refusals are fresh signs of the host's, so on a host paced to one
        request at a time an id could spend its every try before the host's
        refusals were told from its own: its last try is kept while the host
        refuses the others too (see _kept), and once when no other id was
        answered since its previous refusal (see _alone)."""
        cap, item.throttles = self.cfg.max_backoff, item.throttles + 1
        if item.throttles == 1:
            item.streak = (host.takes, host.refusals, *host.firsts)
        item.alone = item.throttles > 1 and (host.takes, host.refusals) == item.heard
        # were everyone refused alike, the share of the others' first asks (its own pooled in) refused since its first
        asked, refused = (host.firsts[i] - item.streak[i + 2] + item.throttles for i in (0, 1))
        item.own = item.own or item.throttles >= OWN_REFUSALS and host.takes > item.streak[0] and \
            (host.refusals - item.streak[1] == item.throttles - 1 or  # since its first, refused alone among takes
             (refused / asked) ** item.throttles <= SHARE_TAIL)  # or more often than all
        if item.own:  # no sign of the host's: neither a search's test nor a cut
            host.answered(now, item.sent)
            host.refusals += 1
            item.heard = (host.takes, host.refusals)
            out.throttle = False
            if out.status == 403:
                out.bucket = classify_status(403, self.cfg)
            return False
        if out.said and out.retry_after is None and out.status == 403:  # see SECONDARY_WAIT: doubled per id
            out.retry_after = SECONDARY_WAIT * 2.0 ** min(item.throttles - 1, 16)
        spent = out.quota is not None and out.quota.remaining < 1 and out.quota.reset > 0
        hosts = host.throttled(now, item.sent, out.retry_after, fresh=not item.refused, said=out.said,
                               declared=out.quota)
        item.heard = (host.takes, host.refusals)
        item.refused = not hosts  # its own trouble: its next refusal is no fresh sign of the host's
        test = now if out.retry_after is not None else max(now, host.next_slot)  # its own next test, or its word's
        if hosts and host.refusing_since is not None and test - host.refusing_since > cap:  # nothing taken so long
            self._beyond_reach(host, item, now, host.refusing_since, out.status)
        return hosts and (spent or (out.retry_after or 0.0) <= cap)

    def _kept(self, item: Item, out: Outcome) -> bool:
        """Does a refusal leave an id its last try? Yes while the host refuses everyone: since the id's first refusal
        in a row it refused other ids more than its background explains (Host.bar), at a share (the id's own pooled
        in) that makes the id's refusals in a row no rarer than the bar's tail, and it took one within --max-backoff;
        and for --tries more refusals at most, so ids refused for their own reasons, retried, cost twice their tries
        at worst. Else the refusals are the id's own and spend its tries (a few ids in trouble of their own may be all
        a run has left to ask); but a host that never took one has refused everything for longer than --max-backoff,
        and the run ends with its ids pending (exit 1), as after a search."""
        host, now, cap = self.timeline.hosts[item.host], self.fx.clock(), self.cfg.max_backoff
        took, refused = host.takes - item.streak[0], host.refusals - item.streak[1] - item.throttles
        # were everyone refused alike, the share of all (its own pooled in) would make its refusals in a row this likely
        pooled = (refused + item.throttles) / (took + refused + item.throttles)
        likely = refused and pooled ** item.throttles > SHARE_TAIL
        if not likely or refused <= host.bar(took + refused) or item.throttles >= 2 * self.cfg.tries or \
                (out.retry_after or 0.0) > cap or host.takes and now - host.last_ok > cap:
            return False
        if not host.takes and now - host.first_sent > cap:
            self._beyond_reach(host, item, now, host.first_sent, out.status)
        return True

    def _alone(self, item: Item, out: Outcome) -> bool:
        """Was the id refused again with no other id answered since its previous refusal? Then nothing told whose
        its refusals are: it keeps its last try once and goes behind the ids ready, so that others' answers tell."""
        if not item.alone or item.asked_alone or (out.retry_after or 0.0) > self.cfg.max_backoff:  # its word: it fails
            return False
        item.asked_alone = True
        return True

    def _beyond_reach(self, host: Host, item: Item, now: float, since: float, status: Optional[int]) -> None:
        """The host has taken nothing since `since`, longer than --max-backoff: it is paused past the run's reach
        (even at a look that an id's own wait, at most --max-backoff, puts later), so the run ends, ids pending.
        `status`: the refusal's, for the way out when the ids left are refused for themselves (see stop_lines)."""
        cap = self.cfg.max_backoff
        host.paused_until = max(host.paused_until, now + max(2 * cap, self.cfg.cooldown) + cap + 1.0)
        self.tally.throttled = self.tally.throttled or {"host": shown_host(build_url(self.cfg.request.url, item.id)),
                                                        "since": iso(self.fx.wallclock() - (now - since)),
                                                        "status": status}

    def _unreachable(self, host: Host, out: Outcome, now: float) -> bool:
        """When every id goes to one host, that host being unreachable means the
        API is down, not the ids: wait for it, and stop if it does not come back."""
        was_down = host.down_since is not None
        down = host.unreachable(now, self._probe_wait)
        if down and not was_down:
            name = f"the proxy {out.via}" if out.via else self.api  # the part at fault, not the API behind it
            self.tally.down = {"host": name, "reason": out.error, "since": iso(self.fx.wallclock()), "probes": 0}
            self.say(f"redrive: {name} is unreachable ({out.error}); waiting for it, "
                     f"{self.cfg.tries * self.cfg.passes} probes at most")
        if down:
            self.tally.down["probes"] = host.probes
        if host.probes >= self.cfg.tries * self.cfg.passes:
            self.tally.stopping(Stop.UNREACHABLE, self.fx.clock(), self.cfg)
        return down

    def _probe_wait(self, probe: int) -> float:
        return backoff_delay(probe, self.cfg.backoff, self.cfg.max_backoff, self.fx.rand)

    def settle(self, item: Item, out: Outcome) -> str:
        """Apply what one attempt means for its id (see next_step); say what, in a word or three."""
        item.tries += 1
        step = next_step(out, item.tries, item.pass_no, self.cfg, bool(self.tally.stop), self.fx.rand)
        if item.doubted and item.listed and step.move in (Move.FAIL, Move.GIVE_UP, Move.UNAVAILABLE):
            return "kept: no answer again, its stored result stays in doubt"  # named in report.json's in_doubt
        if step.move in (Move.DONE, Move.UNAVAILABLE, Move.GIVE_UP):
            self.tally.in_doubt.discard(item.id)  # answered again (see ask_again): its new verdict stands
        if item.id in self.suspect and step.move in (Move.UNAVAILABLE, Move.GIVE_UP):
            self.suspect.discard(item.id)  # its answer may have been another's (see in_step): no verdict, no try
            self.tally.doubted += 1
            item.tries -= 1
            self.schedule(item, self.fx.clock())
            return "asked again: an answer too many came on its connection"
        if step.move is Move.DONE:
            self.books.done(item, out)
        elif step.move is Move.HALT:
            if not self.tally.fatal:
                self.tally.fatal, self.tally.fatal_id = out, item.id
            self.tally.stopping(Stop.FATAL, self.fx.clock(), self.cfg)
        elif step.move is Move.RETRY:
            item.turned_away = out.cause is Cause.TIMEOUT  # behind the others, which tell if the host went silent
            self.schedule(item, self.fx.clock() + step.wait)
        elif step.move in (Move.FAIL, Move.GIVE_UP) and out.throttle and (self._kept(item, out) or self._alone(item, out)):
            item.tries, item.turned_away = item.tries - 1, True  # behind the ids ready, as a host's refusal
            wait = max(out.retry_after or 0.0, backoff_delay(item.tries, self.cfg.backoff, self.cfg.max_backoff,
                                                             self.fx.rand))
            self.schedule(item, self.fx.clock() + wait)
            return f"kept its last try: the host refuses the others too; again in {duration(wait)}"
        elif step.move in (Move.FAIL, Move.GIVE_UP):
            self.books.failed(item, step)
            if step.move is Move.FAIL:
                self.schedule(Item(item.id, item.pass_no + 1, timed_out=item.timed_out, prior=item.prior,
                                   listed=item.listed, own=item.own, line=item.line, throttles=item.throttles,
                                   streak=item.streak), self.fx.clock() + step.wait)  # its refusals in a row go on
        elif step.move is Move.UNAVAILABLE:
            self.books.unavailable(item, step.outcome)
        return f"retry in {duration(step.wait)}" if step.move is Move.RETRY else step.move.value


class Timekeeper:
    """The main thread's decisions, with no threads: the state made durable
    and the status line drawn on time, --max-time, a run whose next id is
    due beyond its reach, the grace for requests in flight after a stop,
    and how long to wait before looking again."""

    def __init__(self, cfg: Config, fx: Effects, timeline: Schedule, settler: Settler, ledger: Ledger, progress,
                 started: Optional[float] = None):
        self.cfg, self.fx, self.timeline, self.settler = cfg, fx, timeline, settler
        self.ledger, self.progress, self.tally = ledger, progress, settler.tally
        started = fx.clock() if started is None else started  # the run's start: reading the state counts too
        self.end_at = None if cfg.max_time is None else started + cfg.max_time
        self.said_stopping = False

    def tend(self) -> bool:
        """One look at the run: sync, progress, deadline, a stop's grace. False: it is over."""
        timeline, now = self.timeline, self.fx.clock()
        if timeline.empty():
            return self.settler.release_held()  # a retry it schedules keeps the run going
        self.progress.tick(self.settler.snapshot)
        if self.end_at is not None and not self.tally.stop and now >= self.end_at:
            self.tally.stopping(Stop.TIME, now, self.cfg)
        wake = None if self.tally.stop or timeline.inflight else timeline.next_wake(now)
        end_at = None if timeline.active else self.end_at  # a gate's wait past --max-time is --max-time's stop
        if wake is not None and beyond_reach(wake, now, end_at, self.cfg):  # an id's time, or a gate's
            self.tally.due = self.fx.wallclock() + wake - now
            self.tally.stopping(Stop.LATER, now, self.cfg)
        if not self.tally.stop:
            return True
        if timeline.inflight and now < self.tally.stop_at:
            if self.tally.stop in SIGNAL_STOPS and not self.said_stopping:
                self.said_stopping = True
                self.progress.say(stopping_line(self.tally.stop, timeline.inflight, self.tally.stop_at - now))
            return True
        self.settler.release_held()  # the run is over whatever it leaves: nothing is scheduled after a stop
        return False

    def timeout(self) -> Optional[float]:
        """How long the main thread may wait before it must look again."""
        now = self.fx.clock()
        limits = [self.tally.stop_at] if self.tally.stop else []
        wake = None if self.tally.stop else self.timeline.next_wake(now)
        if wake is not None:
            limits.append(wake)
        if self.end_at is not None and not self.tally.stop:
            limits.append(self.end_at)
        timeout = max(0.0, min(limits) - now) if limits else None
        inflight = self.timeline.inflight
        real = inflight or self.fx.sleep is None  # injected sleeps stay exact in tests
        for due in (self.ledger.seconds_to_sync(), self.progress.due_in()) if real else ():
            if due is not None:
                timeout = due if timeout is None else min(timeout, due)
        return timeout if inflight else (timeout or 0.0)


class Batch:
    """Runs the passes: schedules ids by the time they become ready, behind
    their host's gate. Workers fetch, settle their outcome and take their
    next id under one lock; the main thread keeps time and stops the run."""

    def __init__(self, cfg: Config, ledger: Ledger, state: State, fx: Effects, redact: Redactor, progress,
                 started: Optional[float] = None):
        self.cfg, self.ledger, self.fx, self.redact = cfg, ledger, fx, redact
        self.timeline = Schedule(cfg, fx.rand)
        self.host_settings = HostSettings()
        self.jobs = queue.SimpleQueue()  #: ids for idle workers, None to end
        self.flushes = queue.SimpleQueue()  #: state files for the fsync thread, None to end
        self.wake = Wake()  #: for the main thread; set() is safe in a signal handler
        self.watchdog = Watchdog()
        self.lock = threading.Lock()  #: guards the schedule, the tallies and the ledger
        self.closed, self.failure = False, None
        self.tally = Tally()
        books = Books(cfg, ledger, state, redact, fx.wallclock, self.tally)
        self.settler = Settler(cfg, self.timeline, books, fx, progress.say)
        self.keeper = Timekeeper(cfg, fx, self.timeline, self.settler, ledger, progress, started)
        self.sleep = fx.sleep or self.wake.wait
        self.wakes_at = 0.0  #: when the main thread looks again, unless woken
        self.timed = False  #: some requests are paced: threads switch every SWITCH_INTERVAL
        self.aside = []  #: Aside: sockets idle workers set aside, to be looked at (see in_step)

    def request_stop(self, why: Stop) -> None:
        """Stop starting requests; wait a little for those in flight.
        Safe in a signal handler: it takes no lock."""
        self.tally.stopping(why, self.fx.clock(), self.cfg)
        self.wake.set()

    def crashed(self, exc: BaseException, item: Optional[Item] = None) -> None:
        """A bug in redrive: stop, keep the id pending, keep the traceback for crash.log."""
        if self.tally.crash is None:
            self.tally.crash = crash_record(exc, item.id if item else None, self.fx.wallclock())
        self.tally.stop = None  # a crash outranks any other stop
        self.request_stop(Stop.CRASH)

    def run(self) -> Tally:
        """The main thread keeps time: it starts work when workers are idle,
        sleeps until the next id is due, and stops the run. Workers settle
        their own outcomes and take their next id themselves, under the lock."""
        workers = [threading.Thread(target=self._work, daemon=True) for _ in range(self.cfg.concurrency)]
        flusher = threading.Thread(target=self._flush, name="redrive-fsync", daemon=True)
        switch = sys.getswitchinterval()
        if self.cfg.rate:
            self._keep_time()
        for thread in (*workers, flusher):
            thread.start()
        try:
            while True:
                with self.lock:
                    look = self.look()
                if look is None:
                    break
                timeout, idle, dirty = look
                if dirty:
                    self.flushes.put(dirty)
                (self.sleep if idle else self.wake.wait)(timeout)
        except RedriveError:
            raise
        except Exception as exc:
            with self.lock:
                self.crashed(exc)
        finally:
            with self.lock:
                self.closed = True  # a worker that finishes now records nothing
                self.tally.abandoned = self.timeline.inflight
                self.tally.quota = self.settler.quota_view()
            for _ in workers:
                self.jobs.put(None)
            self.flushes.put(None)
            flusher.join()  # the files it took are on disk before the ledger closes
            self.watchdog.close()
            sys.setswitchinterval(switch)
        if self.failure:
            raise self.failure  # the last fsync failed
        return self.tally

    def look(self) -> Optional[tuple]:
        """One look of the main thread, the lock held: tend the run, hand out
        what may start. None: the run is over; else (how long it may wait,
        whether nothing is in flight, the state files due for an fsync)."""
        if self.failure:
            raise self.failure
        if self.aside:  # sockets idle workers set aside: looked at in time, or all before the run can end
            doubted = look_aside(self.aside, self.host_settings, time.monotonic(), wait=self.timeline.empty())
            self.settler.ask_again(doubted, 1)
        if not self.keeper.tend():
            return None
        if not self.tally.stop:
            self._hand_out()
        timeout = self.keeper.timeout()
        self.wakes_at = self.fx.clock() + bounded_wait(timeout)
        idle = not self.timeline.inflight
        return timeout, idle, self.ledger.due_files(idle)

    def _keep_time(self) -> None:
        """Requests are paced from now on: threads switch every SWITCH_INTERVAL
        (a cost in CPU per request that an unpaced run need not pay)."""
        self.timed = True
        sys.setswitchinterval(SWITCH_INTERVAL)

    def _flush(self) -> None:
        """The fsyncs, on their own thread: the disk's time would hold every
        answer if the lock were held for it, and every paced start if the
        main thread waited for it."""
        names = self.flushes.get()
        while names is not None:
            try:
                self.ledger.flush_files(names)
            except RedriveError as exc:
                self.failure = exc
                self.wake.set()
            names = self.flushes.get()

    def _hand_out(self) -> None:
        """Give idle workers every id that may start now."""
        while self.timeline.inflight < self.cfg.concurrency and (item := self._take_ready()) is not None:
            self.jobs.put(item)

    def _take_ready(self) -> Optional[Item]:
        """The next id that may start now, unless the run is stopping."""
        return None if self.tally.stop or self.closed else self.settler.take(self.fx.clock())

    def _work(self) -> None:
        """A worker: fetch, settle, and go straight on to the next ready id.
        A state file that cannot be written is raised by the main thread; any
        other exception is a bug: the run stops, the id stays pending."""
        session = make_session(self.cfg, self.host_settings, self.watchdog)
        item = self.jobs.get()
        while item is not None:
            fetched = False
            try:
                outcome = fetch(session, item.id, self.cfg, self.redact, self.fx.wallclock, item.prior)
                with self.lock:  # the ledger's lines go out in the order they are settled
                    fetched = True
                    item = self._finish(item, outcome)
                    if item is None and (session.unwatched or session.aside):  # before the run can end
                        self.aside.extend(leave_idle(session))
            except RedriveError as exc:
                self.failure, item = exc, None
            except Exception as exc:
                with self.lock:
                    self.timeline.inflight -= not fetched  # _finish counts it out itself
                    self.crashed(exc, item)
                item = None
            if item is None:
                self.wake.set()
                item = self.jobs.get()

    def _finish(self, item: Item, outcome: Outcome) -> Optional[Item]:
        """Settle one outcome (the lock held); return this worker's next id, if any."""
        if self.closed:
            return None
        self.timeline.inflight -= 1
        if self.tally.crash:
            return None  # the run is stopping for a bug: settle nothing more
        self.settler.finish(item, outcome)
        if not self.timed and self.timeline.paced(item.host):
            self._keep_time()
        mine = self._take_ready()
        if mine is not None:
            self._hand_out()  # a success may have widened the gate: fill it now, not at the next tick
        opens = self.timeline.gate_opens(item.host, self.fx.clock())
        if opens is not None and opens < self.wakes_at:
            self.wake.set()  # the gate opens before the main thread looks again (a spent quota came back)
        return mine


def plan(listing: Listing, state: State, cfg: Config, batch: Batch, ledger: Ledger, fx: Effects,
         refresh: Optional[Refresh] = None) -> None:
    """Put every unsettled id on the schedule at the pass it reached, and
    each done id a refresh asks again: those with a record now, the rest as
    the schedule reads them from the file (Feed). Each is FED in the
    listing's flags."""
    now, wall, flags = fx.clock(), fx.wallclock(), listing.flags
    settler = batch.settler
    settler.counts["done"] = listing.total - listing.pending()
    state.lines = flags
    if refresh is not None:
        refresh.mark()
        settler.refresh_due = refresh.count
    ahead = False
    for n, item_id in listing.marked:
        if flags[n] == DUE:
            plan_refresh(n, item_id, refresh, state, cfg, batch, fx)
        if flags[n] != PENDING:
            continue
        flags[n] = FED
        if item_id in state.unavailable and not wants_again(state.unavailable[item_id], cfg.retry_unavailable):
            settler.counts["unavailable"] += 1
            continue
        last = latest_failure(state, item_id)
        if last and not ahead and parse_iso(last["at"]) > wall:
            ahead = True
            settler.say("redrive: warning: failed.jsonl holds times in the future (a clock ahead?); they count as now")
        step = resume_step(last, cfg, wall) if last else None
        listed = item_id in state.gone
        if step is None and not listed:
            batch.timeline.add_untried(n, item_id)
        elif step is None:
            settler.schedule(Item(item_id, listed=listed, line=n), now)
        elif step.move is Move.GIVE_UP:
            settle_exhausted(item_id, last, ledger, state, cfg, wall)
            settler.counts["unavailable"] += 1
        else:
            settler.schedule(Item(item_id, last["pass"] + 1, timed_out=record_cause(last) is Cause.TIMEOUT,
                                  listed=listed, line=n), now + step.wait)
    batch.timeline.feed = Feed(listing, refresh)
    batch.timeline.read_on()


def plan_refresh(n: int, item_id: str, refresh: Refresh, state: State, cfg: Config, batch: Batch,
                 fx: Effects) -> None:
    """A done id due for a refresh whose refresh failed since the cut-off (a
    run cut short): on the schedule at the pass it reached. Any other is
    read as the schedule wants it (Feed)."""
    last = state.failed.get(item_id)
    if not last or last["at"] < refresh.before:
        return
    step = resume_step(last, cfg, fx.wallclock())
    if step is None:
        return
    refresh.flags[n] = DONE  # in hand, as the Feed leaves a line it reads
    prior, settler = refresh.prior(n), batch.settler
    batch.tally.asked_again.add(item_id)
    if step.move is Move.GIVE_UP:  # its last pass failed just before a kill
        settler.books.note_refresh(Item(item_id, prior=prior), {
            "id": item_id, "at": iso(fx.wallclock()), "result": "kept", "status": last["status"],
            "reason": last["error"]})
    else:
        settler.schedule(Item(item_id, last["pass"] + 1, timed_out=record_cause(last) is Cause.TIMEOUT,
                              prior=prior, listed=True, line=n), fx.clock() + step.wait)


def settle_exhausted(item_id, last, ledger, state, cfg, wall) -> None:
    """An id that failed its last pass but was never moved on (a kill, or fewer --passes)."""
    give_up(unavailable_record(item_id, last["error"], last["status"], Bucket(last["bucket"]), record_cause(last),
                               last["tries"], wall, cfg.passes), ledger, state)


# ------------------------------------------------------ report and progress


def fit(parts: list, width: int) -> list:
    """The (priority, text) parts of a status line, the lowest dropped first until they fit `width`."""
    parts = list(parts)
    while len(parts) > 1 and len(", ".join(text for _, text in parts)) > width:
        parts.remove(min(parts, key=lambda part: part[0]))
    return parts if len(parts[0][1]) <= width else [(0, parts[0][1][:width])]


class Progress:
    """The status line on stderr: rewritten in place a few times a second on
    a terminal, one plain line every 30 s anywhere else, nothing with -q."""

    def __init__(self, stream, total: int, clock: Callable[[], float], quiet: bool,
                 width: Optional[Callable[[], int]] = None):
        self.stream, self.total, self.clock = stream, total, clock
        self.quiet = quiet
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval = TTY_INTERVAL if self.tty else LOG_INTERVAL
        self.span = max(RATE_WINDOW, 2 * self.interval)  #: rates over at least the time since the last line
        self.width = width or self.columns  #: asked anew for each line: the terminal may have been resized
        self.next_at = clock() + self.interval
        self.window = [(clock(), 0, 0)]  #: (time, requests, settled) samples for the rates
        self.shown = False

    def begin(self, settled: int) -> None:
        """The run starts with `settled` ids done or unavailable already: its rates count only its own."""
        self.window = [(self.clock(), 0, settled)]

    def due_in(self) -> Optional[float]:
        return None if self.quiet else max(0.0, self.next_at - self.clock())

    def columns(self) -> int:
        """The width of the terminal the line goes to (stderr's, not stdout's)."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        return columns or shutil.get_terminal_size((100, 24)).columns  # 0: a terminal that does not say

    def tick(self, snapshot: Callable[[], Snapshot]) -> None:
        now = self.clock()
        if self.quiet or now < self.next_at:
            return
        self.next_at = now + self.interval
        parts = self.render(snapshot(), now)
        if self.tty:  # one row, or every rewrite after a resize leaves a stale wrapped line behind
            parts = fit(parts, max(10, self.width() - 1))
        line = ", ".join(text for _, text in parts)
        self.stream.write(f"\r{line}\x1b[K" if self.tty else f"redrive: {line}\n")
        self.stream.flush()
        self.shown = self.tty

    def render(self, snap: Snapshot, now: float) -> str:
        done, unavailable = snap.done, snap.unavailable
        self.window.append((now, snap.requests, done + unavailable + (snap.refresh[0] if snap.refresh else 0)))
        recent = [w for w in self.window if now - w[0] <= self.span]
        self.window = recent if len(recent) > 1 else self.window[-2:]  # at least since the last line
        span = max(now - self.window[0][0], 1e-9)
        rate = (self.window[-1][1] - self.window[0][1]) / span
        settling = (self.window[-1][2] - self.window[0][2]) / span
        # (what is dropped last when the line must be cut to the terminal: lowest first, text) in their order
        parts = [(9, f"pass {snap.pass_no}"), (9, f"{done}/{self.total} done")]
        if snap.refresh:
            parts.append((9, f"{snap.refresh[0]}/{snap.refresh[1]} refreshed"))
        parts += [(6, f"{unavailable} unavailable"), (5, f"{snap.awaiting} failed"),
                  (3, f"{rate:.1f} req/s" if rate >= 1 or not rate else f"{rate:.2f} req/s")]
        if snap.quota:
            of = f"/{snap.quota['limit']}" if snap.quota["limit"] is not None else ""
            parts.append((2, f"quota {snap.quota['remaining']}{of}, resets {snap.quota['resets_at'][11:16]}"))
        if snap.down:
            parts.append((7, "unreachable, probing"))
        elif snap.paused_until - now >= 0.5:
            parts.append((4, f"throttled, pausing {duration(snap.paused_until - now)}"))
        elif snap.waiting_until is not None and snap.waiting_until - now >= 0.5:
            parts.append((4, f"waiting {duration(snap.waiting_until - now)}"))
        left = self.total - done - unavailable + (snap.refresh[1] - snap.refresh[0] if snap.refresh else 0)
        if left:
            parts.append((8, f"ETA {self.eta(left, settling, snap, now)}"))
        return parts

    @staticmethod
    def eta(left: int, settling: float, snap: Snapshot, now: float) -> str:
        """Time to the end: the ids left at the pace they settle, but no sooner
        than the last id waiting out a backoff or a cool-down is due, plus the
        turn of those waiting for a later pass; a known wait before anything settles."""
        wait = max(0.0, snap.last_due - now, (snap.waiting_until or now) - now)
        if settling <= 0:
            return f"{duration(wait)} at least" if wait >= 0.5 else "not known yet"
        awaiting = snap.awaiting
        later = wait + (awaiting / settling if awaiting else 0.0)
        return duration(max(left / settling, later))

    def say(self, line: str) -> None:
        """An event line, printed above the status line."""
        if not self.quiet:
            self.clear()
            print(shown_text(line), file=self.stream, flush=True)

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.shown = False


def residue(ids: Iterable[str], state: State, tally: Tally, uncounted: Callable[[], int] = lambda: 0) -> tuple:
    """(rows, pending): a row for every id not done (of `ids`, in order) that
    is unavailable or failed, with its state, reason and recommended action,
    and for the first PENDING_LISTED pending ids; and how many ids are
    pending in all, with uncounted() more that `ids` left out (read after
    them). A run stopped early over a million ids lists no million rows."""
    rows, pending = [], 0
    reason, action = (tally.stop.pending, tally.stop.action) if tally.stop else NOT_REQUESTED
    for item_id in ids:
        if item_id in state.done:
            continue
        if item_id in state.unavailable:
            r = state.unavailable[item_id]
            rows.append({"id": shown_id(item_id), "state": "unavailable", "reason": r["reason"], "status": r["status"],
                         "bucket": r["bucket"], "cause": record_cause(r).value, "action": r["action"],
                         "new": item_id in state.fresh and item_id not in state.repeated})
        elif latest_failure(state, item_id):
            f = state.failed[item_id]
            rows.append({"id": shown_id(item_id), "state": "failed", "reason": f["error"], "status": f["status"],
                         "bucket": f["bucket"], "action": f"waits for pass {f['pass'] + 1}: rerun to continue"
                         if tally.stop is not Stop.LATER else f"waits for pass {f['pass'] + 1}, due {f.get('due')}: "
                         "rerun the same command after then"})
        else:
            pending += 1
            if pending <= PENDING_LISTED:
                rows.append({"id": shown_id(item_id), "state": "pending", "reason": reason, "status": None,
                             "bucket": None, "action": action})
    return rows, pending + uncounted()


def group_residue(rows: list, pending: int, cfg: Config) -> list:
    """One line per (state, reason): how many ids, and the one thing to do about them."""
    groups = Counter((r["state"], r["reason"], r["status"], r["bucket"]) for r in rows)
    actions = {(r["state"], r["reason"]): r["action"] for r in rows if r["state"] != "unavailable"}
    causes = {(r["state"], r["reason"]): record_cause(r) for r in rows if r["state"] == "unavailable"}
    lines = []
    for (state, reason, status, bucket), count in groups.most_common():
        if state == "unavailable":
            action = recommend(Bucket(bucket), status, causes[(state, reason)], reason, cfg.passes, many=count > 1)
        else:
            action = actions[(state, reason)]
        lines.append({"state": state, "reason": reason, "count": pending if state == "pending" else count,
                      "action": action})
    return sorted(lines, key=lambda line: -line["count"])


def build_report(total: int, rest: Iterable[str], duplicates: int, state: State, tally: Tally, cfg: Config,
                 elapsed: float, redact: Redactor, now: float, refresh: Optional[dict] = None,
                 uncounted: Callable[[], int] = lambda: 0) -> dict:
    """report.json: what this run did and exactly what is missing, and why.
    rest: the ids not done, in input order (a stream); uncounted(): pending ids it left out."""
    rows, pending = residue(rest, state, tally, uncounted)
    counts = Counter(r["state"] for r in rows)
    return {
        "redrive": __version__, "ids_file": shown_path(cfg.ids_file), "state_dir": shown_path(cfg.state_dir),
        "url": redact(kept_url(cfg.request.url_spec, cfg.request.public)), "finished_at": iso(now),
        "exit_code": None, "stop": tally.stop and tally.stop.value, "elapsed_s": round(elapsed, 3),
        "requests": tally.requests, "passes": cfg.passes, "unreachable": tally.down,
        "counts": {"input": total, "duplicates": duplicates,
                   "done": total - counts["unavailable"] - counts["failed"] - pending,
                   "unavailable": counts["unavailable"], "failed": counts["failed"], "pending": pending},
        "per_pass": {str(p): dict(c) for p, c in sorted(tally.per_pass.items())},
        "reasons": group_residue(rows, pending, cfg),
        "new_unavailable": len(state.fresh - state.repeated),
        "unresolved": [{**row, "id": redact(row["id"])} for row in rows],
        "pending_listed": min(pending, PENDING_LISTED),
        "quota": tally.quota,
        "out_of_step": tally.doubted,
        "in_doubt": [redact(i) for i in sorted(tally.in_doubt)[:PENDING_LISTED]],
        "refresh": refresh,
        "shard": list(cfg.shard) if cfg.shard else None,
    }


def summarize(report: dict, news: bool = False, listing: str = "") -> list:
    """The end-of-run summary for stderr, drawn from the report: the ids a
    person can act on before the definitive answers, each reason once with a
    few of its ids. `news` (-q, a cron mail): only what this run changed is
    named, NAMED_NEWS ids a reason, then the command that lists them all
    (listing); the unavailable ids of earlier runs are one count line, and
    the shard and the state dir are named (three shards mail alike)."""
    c = report["counts"]
    dup = f" ({c['duplicates']} duplicate line{'s' if c['duplicates'] != 1 else ''} ignored)" if c["duplicates"] else ""
    lines = [f"redrive: {c['input']} ids{dup}, {report['requests']} requests in {report['elapsed_s']:.1f} s"]
    lines += [f"  {label:<13}{c[label]:>7}" for label in ("done", "unavailable", "failed", "pending")]
    for pass_no, counts in report["per_pass"].items():
        lines.append(f"  pass {pass_no}: " + ", ".join(f"{counts[k]} {k}" for k in ("done", "failed", "unavailable")
                                                     if counts.get(k)))
    if report.get("out_of_step") and not news:
        lines.append(f"  {report['out_of_step']} ids asked again: the server sent an answer too many on a "
                     "kept-alive connection, and theirs may have been another id's (the last result line wins)")
    if report.get("in_doubt"):
        lines.append(f"  {len(report['in_doubt'])} ids in doubt, not answered again: their stored results may be "
                     "another id's (report.json in_doubt); --refresh asks every done id again")
    rows = [r for r in report["unresolved"] if not news or r["state"] != "unavailable" or r["new"]]
    older = sum(1 for r in report["unresolved"] if r["state"] == "unavailable") - \
        sum(1 for r in rows if r["state"] == "unavailable")
    groups = residue_groups(rows, report, NAMED_NEWS if news else NAMED_PER_REASON)
    shard = f"shard {report['shard'][0]}/{report['shard'][1]}, " if report.get("shard") else ""
    if groups:
        lines.append(f"what went unavailable or is left in this run ({shard}state in {report['state_dir']}), and "
                     "what to do:" if news else "what is missing, and what to do:")
    for (state, reason), ids, count, action in groups:
        what = reason if state == "unavailable" else f"{state}, {reason}"
        lines.append(f"  {count} x {what}: {action}")
        more = f" and {count - len(ids)} more" if count > len(ids) else ""
        lines.append(f"      {', '.join(ids)}{more}")
        if more and news and state == "unavailable" and listing:
            lines.append(f"      all of them: {listing}")
    if older:
        lines.append(f"  and {older} id{'s' if older != 1 else ''} unavailable from earlier runs: see unavailable.jsonl")
    return lines + refresh_lines(report["refresh"])


def refresh_lines(refresh: Optional[dict]) -> list:
    """The summary's lines on a refresh: its counts, then each reason a result was kept, with a few ids."""
    if not refresh:
        return []
    asked = refresh["due"] - refresh["left"]
    counts = ", ".join(f"{refresh[result]} {result}" for result in REFRESH_RESULTS)
    left = f"; {refresh['left']} left: rerun to continue" if refresh["left"] else ""
    lines = [f"  refresh: {asked} of {refresh['due']} ids fetched before {refresh['before'][:16]}Z asked: "
             f"{counts}{left}"]
    groups = {}
    for row in refresh["kept_ids"]:
        groups.setdefault(row["reason"], []).append(row["id"])
    for reason, ids in sorted(groups.items(), key=lambda group: -len(group[1])):
        more = f" and {len(ids) - NAMED_PER_REASON} more" if len(ids) > NAMED_PER_REASON else ""
        lines += [f"  {len(ids)} x not refreshed, {reason}: the last result is kept; a later refresh asks again",
                  f"      {', '.join(ids[:NAMED_PER_REASON])}{more}"]
    return lines


#: Ids a summary names for each reason; the rest are counted (every one is in the state files and report.json).
NAMED_PER_REASON = 3
NAMED_NEWS = 20  #: in a cron mail (-q): what changed, named


def residue_groups(rows: list, report: dict, named: int = 3) -> list:
    """((state, reason), a few ids, how many, the action) for each reason, the
    ids a person can act on first (failures that may pass, then what is left
    pending), the definitive answers (404, 410 and other skips) last."""
    actions = {(g["state"], g["reason"]): g["action"] for g in report["reasons"]}
    grouped = {}
    for row in rows:
        grouped.setdefault((row["state"], row["reason"]), []).append(row)
    def rank(item):
        (state, _), members = item
        settled = state == "unavailable" and members[0]["bucket"] == Bucket.SKIP.value
        return ({"unavailable": 0, "failed": 1, "pending": 2}[state] + 3 * settled, -len(members))
    return [(key, [r["id"] for r in members[:named]],
             report["counts"]["pending"] if key[0] == "pending" else len(members), actions.get(key, ""))
            for key, members in sorted(grouped.items(), key=rank)]


def exit_code(report: dict) -> ExitCode:
    stop = Stop(report["stop"]) if report["stop"] else None
    if stop and stop.code is not None:
        return stop.code
    unsettled = report["counts"]["failed"] + report["counts"]["pending"] + (report.get("refresh") or {}).get("left", 0)
    return ExitCode.INCOMPLETE if unsettled else ExitCode.OK


def stop_lines(tally: Tally, cfg: Config, redact: Redactor) -> list:
    """What to say about a run that stopped early, and what to do next."""
    if tally.stop is Stop.FATAL:
        out = tally.fatal
        return [f"redrive: halted: {out.error} for {redact(shown_id(tally.fatal_id))!r} "
                f"({redact(shown_url(cfg.request, tally.fatal_id))})",
                f"  body: {out.excerpt!r}",
                "  nothing was marked failed; fix the key or the account, then rerun the same command to resume"
                if out.status != 407 else "  nothing was marked failed; the proxy asks for credentials: fix the "
                "user and password of the *_proxy URL (or unset it), then rerun the same command to resume"] + \
            ([f"  in a list of URLs on many hosts, one host's {out.status} need not stop the rest: rerun with "
              f"--skip {out.status} to list such ids as unavailable and go on"]
             if cfg.request.url == "{id}" and out.status not in (None, 407) else [])
    if tally.stop in SIGNAL_STOPS:
        return [f"redrive: {tally.stop.value}; {tally.abandoned} request(s) still in flight were left pending; "
                "rerun the same command to resume"]
    down = tally.down and f"{tally.down['host']} unreachable ({tally.down['reason']}) since {tally.down['since']}"
    if tally.stop is Stop.TIME:
        return [f"redrive: --max-time {cfg.max_time:g} s reached; rerun the same command to resume"] + \
            ([f"  {down}, {tally.down['probes']} probes failed so far"] if down else [])
    if tally.stop is Stop.UNREACHABLE:
        return [f"redrive: stopped: {down}, {tally.down['probes']} probes failed",
                "  nothing was marked failed; rerun the same command once it is back"]
    quota = tally.quota
    if tally.stop is Stop.LATER and tally.throttled:
        status = tally.throttled["status"]  # ids refused for ever, all that is left, read as a host refusing all
        status = status if status is not None and status >= 400 else None  # --skip 200 would skip every success
        return [f"redrive: {tally.throttled['host']} has refused every request since {tally.throttled['since']}, "
                f"longer than --max-backoff; no try was spent: rerun the same command after {iso(tally.due)}"] + \
            ([f"  if it answers other ids and refuses only these (a part of the API down), rerun with --skip {status} "
              f"to list them as unavailable"] if status is not None else [])
    if tally.stop is Stop.LATER and quota and quota["remaining"] < 1 and tally.due >= parse_iso(quota["resets_at"]):
        of = f"/{quota['limit']}" if quota["limit"] is not None else ""
        due = iso(tally.due)  # the reset the gate waits for: the stop's cause, not a window renewed since
        return [f"redrive: the API's quota is spent ({quota['remaining']}{of} left); it resets at "
                f"{due[11:16]} UTC ({due}), past --max-backoff: rerun then"]
    if tally.stop is Stop.LATER:
        return [f"redrive: nothing is due before {iso(tally.due)}, beyond this run's reach "
                f"(--max-backoff, --cooldown{', --max-time' if cfg.max_time else ''}); "
                "rerun the same command after then"]
    if tally.stop is Stop.MISCONFIGURED:
        m = tally.misconfigured
        url = redact(shown_url(cfg.request, m["id"]))
        head = f"redrive: halted: the first {m['answers']} answers were all {m['sign']}, e.g. {cfg.request.method} {url} "
        if m.get("fine"):  # a row after answers that were fine: something changed mid-run
            return [f"redrive: halted: {m['answers']} ids in a row answered {m['sign']} after {m['fine']} answers "
                    f"that did not, e.g. {cfg.request.method} {url}; is the key still valid, the API or the network "
                    "the same?", "  nothing was recorded for them; fix it and rerun, or give --no-guard if such "
                    "answers are expected"]
        if m.get("refresh") or not m.get("fresh", True):  # ids that answered before: the key or the set-up changed, not every item
            return [head + f"-> {m['sign']}, on a state dir with ids done; is the key still valid, and --url right?",
                    "  no result was dropped; fix it and rerun, or give --no-guard if such answers are expected"]
        return [head + f"-> {m['sign']}; is --url (or the ids file) right?",
                "  nothing was marked failed or unavailable; fix it and rerun (no id is done yet, so a changed "
                "--url is taken), or give --no-guard if such answers are expected"]
    if tally.stop is Stop.CRASH:
        crash = tally.crash
        where = f" on id {redact(shown_id(crash['id']))!r}" if crash["id"] is not None else ""
        return [f"redrive: internal error{where}: {redact(crash['error'])[:300]}; the traceback is in "
                f"{cfg.state_dir / 'crash.log'}; nothing was lost: rerun to resume, and please report it"]
    return []


# -------------------------------------------------------------------- check


def check(ids_file: Path, state_dir: Path, quiet: bool, out, shard: Optional[tuple] = None) -> ExitCode:
    """--check: reconcile IDS_FILE (the shard's ids, for a shard) with the state
    dir. No network, no writes: absence is only visible against the full
    expected set, so here it is, read through an index it does not keep
    and matched against the ledgers part by part on disk."""
    check_ids_file(ids_file)
    torn = [name for name in STATE_FILES if has_torn_tail(state_dir / name)]
    state = load_state(state_dir, repair=False)
    read_paces(state_dir)  # a damaged one stops the next run: say so now, as for a ledger
    index = current_index(ids_file, state_dir, shard, keep=False)
    listing = listing_of(ids_file, index, state, False)
    take_back_gone(state, listing, state_dir)  # done, then found removed upstream by a refresh: unavailable
    keyed, recorded = 0, set(state.failed) | set(state.unavailable)
    for _, item_id in listing.lines((PENDING, DONE)):  # one pass: keys in URL ids, and the records' ids listed
        keyed += key_in_query(item_id)
        recorded.discard(item_id)
    strangers, no_result, no_done = reconcile(ids_file, index, state_dir, recorded)
    problems = {"done ids without a result line": no_result, "result lines without a done line": no_done,
                "torn last lines": (len(torn), torn)}
    counts = state_counts(listing, state)
    of = f", shard {shard[0]}/{shard[1]}" if shard else ""
    lines = [f"redrive check: {ids_file} ({listing.total} ids{of}) against {state_dir}"]
    if keyed_ids_warning(keyed):
        lines.append(f"  warning: {keyed_ids_warning(keyed)}")
    lines += [f"  {label:<13}{counts[label]:>7}" for label in ("done", "unavailable", "failed", "pending")]
    lines.append(f"  {'not in input':<13}{strangers:>7}  (ids in the state that {ids_file.name} does not list)")
    lines += [f"  {label}: {count} ({', '.join(shown_id(str(i)) for i in first)}{', ...' if count > len(first) else ''})"
              for label, (count, first) in problems.items() if count]
    before = unfinished_refresh(state_dir)
    if before:
        lines.append(f"  a refresh of the ids fetched before {before[:16]}Z is unfinished: rerun to go on with it")
    settled = counts["failed"] == counts["pending"] == 0 and not before
    consistent = not any(count for count, _ in problems.values())
    lines.append(("every id is settled" if settled else "some ids are not settled: rerun to continue") +
                 ("; the state is consistent" if consistent else "; the state needs repair: the next run does it"))
    code = ExitCode.OK if settled and consistent else ExitCode.INCOMPLETE
    if code or not quiet:
        print("\n".join(map(shown_text, lines)), file=out)
    return code


def unfinished_refresh(state_dir: Path) -> Optional[str]:
    """The cut-off of a refresh run.json keeps (one not over yet), or None."""
    refresh = (run_json(state_dir) or {}).get("refresh")
    return refresh.get("before") if isinstance(refresh, dict) and _when(refresh.get("before")) else None


#: The ids --check names of each kind of inconsistency, the smallest first.
NAMED = 5


def reconcile(ids_file: Path, index: Index, state_dir: Path, recorded: set) -> tuple:
    """(how many ids of the state the input does not list; (how many, and
    the NAMED smallest) done ids without a result line; the same of result
    lines without a done line). recorded: the failed and unavailable ids the
    input does not list. The input's ids, done.txt's and results.jsonl's
    are matched part by part, as built_index matches them."""
    done_path, results = state_dir / "done.txt", state_dir / "results.jsonl"
    size = sum(p.stat().st_size for p in (ids_file, done_path, results) if p.is_file())
    strangers, no_result, no_done = 0, [0, []], [0, []]
    with Parts(state_dir, max(1, size // INDEX_PART), ("lines", "done", "results", "recorded")) as split:
        flags = index.flags
        for line, ids, _, _ in id_blocks(ids_file):
            split.add("lines", [i for n, i in enumerate(ids, line) if flags[n] in (PENDING, DONE)])
        for lines in done_between(done_path, 0, done_end(done_path)):
            split.add("done", lines)
        for ids, _ in ledger_blocks(results, RESULT_SHAPE):
            split.add("results", ids)
        split.add("recorded", list(recorded))
        for part in split:
            listed, done, fetched = (set(part[kind][1]) for kind in ("lines", "done", "results"))
            strangers += len((done | fetched | set(part["recorded"][1])) - listed)
            for found, ids in ((no_result, done - fetched), (no_done, fetched - done)):
                found[0] += len(ids)
                found[1] = heapq.nsmallest(NAMED, itertools.chain(found[1], ids))
    return strangers, tuple(no_result), tuple(no_done)


def cover(ids_file: Path, state_dirs: list, out) -> ExitCode:
    """--cover: do the state dirs of all N shards together settle the list?
    Each dir's run.json names its shard; no shard may be missing or twice,
    and no id done in a dir other than its shard's. No network, no writes;
    exit 0 when covered. Each dir is read through an index it does not keep."""
    check_ids_file(ids_file)
    shards, problems = {}, []
    for state_dir in state_dirs:
        if not state_dir.is_dir():
            raise RedriveError(f"{state_dir}: no such folder; give the state dirs of the shards (a shard's run "
                               "makes IDS.shard-K-of-N.redrive beside the ids file, or the --state-dir it was given)")
        shard = shard_of(state_dir)
        if not shard:
            raise RedriveError(f"{state_dir}: no shard's state dir (its run.json names no --shard); give the state "
                               "dirs of the shards")
        if shard in shards:
            problems.append(f"shard {shard[0]}/{shard[1]} twice: {shards[shard]} and {state_dir}")
        shards[shard] = state_dir
        for lines in read_done(state_dir, lambda p: done_between(p, 0, done_end(p))) or ():
            elsewhere = (i for i in lines if not in_shard(i, shard))
            problems += [f"{shown_id(i)!r} done in {state_dir}, which is not the dir of its shard"
                         for i in itertools.islice(elsewhere, max(0, 20 - len(problems)))]
    n = max(s[1] for s in shards)
    missing_shards = [f"{k}/{n}" for k in range(1, n + 1) if (k, n) not in shards]
    if any(s[1] != n for s in shards):
        problems.append("the dirs are of shards of different N: " + ", ".join(f"{k}/{m}" for k, m in shards))
    unsettled, named, everyone = 0, [], 0
    for shard, state_dir in shards.items():
        state = load_state(state_dir, repair=False)
        index = current_index(ids_file, state_dir, shard, keep=False)
        listing = listing_of(ids_file, index, state, False)
        take_back_gone(state, listing, state_dir)
        counts = state_counts(listing, state)
        unsettled += counts["failed"] + counts["pending"]
        everyone = listing.total + index.flags.count(OTHER_SHARD)
        more = (i for _, i in listing.lines((PENDING,)) if i not in state.unavailable)
        named += itertools.islice(more, 10 - len(named))
    lines = [f"redrive cover: {ids_file} ({everyone} ids) against {len(shards)} of {n} shards"]
    lines += [f"  shards missing: {', '.join(missing_shards)}"] if missing_shards else []
    lines += [f"  {problem}" for problem in problems[:20]]
    if unsettled:
        shown = ", ".join(shown_id(i) for i in named)
        lines.append(f"  {unsettled} ids not settled yet: {shown}{', ...' if unsettled > len(named) else ''}")
    covered = not (missing_shards or problems or unsettled)
    lines.append("every id is settled in its shard, and in no other" if covered else "the shards do not cover the list")
    print("\n".join(map(shown_text, lines)), file=out)
    return ExitCode.OK if covered else ExitCode.INCOMPLETE


def state_counts(listing: Listing, state: State) -> Counter:
    """done, unavailable, failed and pending, each id counted once (in that
    order of precedence), from the index's flags and the ids with a record."""
    marked = [i for n, i in listing.marked if listing.flags[n] == PENDING]
    counts = Counter(done=listing.total - listing.pending())
    counts["unavailable"] = sum(1 for i in marked if i in state.unavailable)
    counts["failed"] = sum(1 for i in marked if i in state.failed and i not in state.unavailable)
    counts["pending"] = listing.pending() - counts["unavailable"] - counts["failed"]
    return counts


#: A results line as redrive writes it, read without a JSON parse: the id
#: (no escapes in it), a url, a status, a time, and the line's end.
RESULT_SHAPE = re.compile(rb'^\{"id":"([^"\\\n]*)","url":"[^\n]*?","status":\d{3},"fetched_at":"[^"\n]*",[^\n]*\}$',
                          re.M)


# ------------------------------------------------------------------ export


#: What a results.jsonl line may hold, as --fields names it.
RESULT_FIELDS = ("id", "url", "status", "fetched_at", "confirmed_at", "final_url", "etag", "last_modified",
                 "body_encoding", "body")


def export(args, state_dir: Path, out, err) -> ExitCode:
    """--export: the latest result of every done id, in input order (the
    last line of an id wins), read from the state dir: no request, no lock.
    The ids file is read through the state's index, and each id's last
    result line found by a join on disk: the list is never held whole."""
    if args.export == "files" and args.out is None:
        raise RedriveError("--export files needs --out DIR, the folder to write one file per id into")
    check_ids_file(args.ids_file)
    known = state_dir.is_dir()  # else nothing was fetched: nothing to export
    index = current_index(args.ids_file, state_dir, args.shard, keep=False) if known else Index(0, "", 0, 0, 0, "",
                                                                                                 None, bytearray())
    listing = Listing(args.ids_file, index.flags, *index.counts(), [])
    unavailable = latest_records(state_dir / "unavailable.jsonl")
    path = state_dir / "results.jsonl"
    heads = result_heads(path, set(unavailable)) if unavailable else {}
    gone = gone_upstream((i for i in unavailable if i in heads), unavailable, heads)
    if args.export == "gone":  # what is unavailable now, with its reason, time and action
        for n, item_id in listing.lines((PENDING, DONE)) if known else ():
            if item_id in unavailable and (index.flags[n] == PENDING or item_id in gone):
                out.write(json.dumps(unavailable[item_id], ensure_ascii=False) + "\n")
        return ExitCode.OK
    fields = [f for f in (args.fields or "id,status,fetched_at").split(",") if f]
    unknown = [f for f in fields if f.split(".")[0] not in RESULT_FIELDS or "." in f and f.split(".")[0] != "body"]
    if unknown:
        raise RedriveError(f"--fields: no result has {unknown[0]!r}; the fields are {', '.join(RESULT_FIELDS)}, "
                           "and body.PATH for a value inside the body (body.items.0.name)")
    result_at = last_lines(args.ids_file, len(index.flags), path, state_dir, RESULT_SHAPE)
    refreshed = state_dir / "refreshed.jsonl"
    refreshed_at = last_lines(args.ids_file, len(index.flags), refreshed, state_dir)
    writer = csv.writer(out, lineterminator="\n") if args.export == "csv" else None
    if writer:
        writer.writerow(fields)
    empty = set(f for f in fields if f.startswith("body."))  # paths no row has had a value at, so far
    taken, written, renamed = set(), set(), []  #: names given, in lower case and as written; (id, file) renamed
    with open(path if path.is_file() else os.devnull, "rb") as fh, \
            open(refreshed if refreshed.is_file() else os.devnull, "rb") as rh:
        for n, item_id in listing.lines((DONE,)) if known else ():
            where, again = result_at.get(n), refreshed_at.get(n)
            if where is None or item_id in gone:
                continue
            fh.seek(where)
            line = fh.readline()
            at = fetched_at(line)
            if again is not None:
                rh.seek(again)
                last = json.loads(rh.readline())
                if last["result"] in ("unchanged", "changed"):  # a 304 or a 200 said the result is current
                    at = max(at, last["at"])
            line = line[:line.rindex(b"}")] + b',"confirmed_at":' + json.dumps(at).encode() + b"}\n"
            if args.export == "jsonl":
                out.write(line.decode("utf-8"))
            elif writer:
                row = [cell(json.loads(line), name) for name in fields]
                empty -= {name for name, value in zip(fields, row) if value != ""}
                writer.writerow(row)
            else:
                name = file_name(item_id, taken, args.out)
                written.add(name)
                write_file(args.out, name, body_bytes(json.loads(line)))
                if name != quote(item_id, safe=""):
                    renamed.append(json.dumps({"id": item_id, "file": name}, ensure_ascii=False) + "\n")
    if args.export == "files":
        prune_export(args.out, written, renamed, err)
    for name in sorted(empty) if writer else ():
        print(shown_text(f"redrive: warning: no exported result has a value at {name}; is the path right?"), file=err)
    return ExitCode.OK


def fetched_at(line: bytes) -> str:
    """The fetched_at of a results.jsonl line, read from its head (the body is not parsed)."""
    cut = line.find(b',"body":')
    head = json.loads(line[:cut] + b"}") if cut > 0 else json.loads(line)
    return head["fetched_at"]


def iter_lines(fh) -> Iterable[tuple]:
    """(offset, line) of each whole line of a file opened in binary."""
    offset = 0
    for line in fh:
        if line.endswith(b"\n"):
            yield offset, line
        offset += len(line)


def cell(record: dict, path: str) -> str:
    """A CSV cell: the value at a dotted path of a result ('body.items.0.name'); JSON when not a scalar."""
    value = record
    for step in path.split("."):
        if isinstance(value, dict):
            value = value.get(step)
        elif isinstance(value, list) and decimal(step, 0, len(value) - 1) is not None:
            value = value[int(step)]
        else:
            value = None
    if value is None or isinstance(value, str):
        return neutral(value or "")
    return neutral(json.dumps(value, ensure_ascii=False)) if isinstance(value, (dict, list)) else str(value)


#: A cell a spreadsheet would run as a formula starts with one of these (OWASP's CSV injection list).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def neutral(text: str) -> str:
    """A text cell a spreadsheet shows as text: one that starts like a formula
    gets a leading "'" (numbers are written as they are; --export jsonl has every value raw)."""
    return "'" + text if text.startswith(FORMULA_START) else text


#: --export files: the ids whose file has another name than their own, one JSON line each.
NAMES_FILE = ".redrive-names.jsonl"
#: --export files: the names of the files the last export wrote (see prune_export).
FILES_LIST = ".redrive-files"
#: Names no common file system takes for a file: Windows' devices, and what is too long anywhere.
RESERVED_NAMES = frozenset({"con", "prn", "aux", "nul", *(f"{d}{n}" for d in ("com", "lpt") for n in range(1, 10))})
MAX_NAME_BYTES = 200


def file_name(item_id: str, taken: set, folder: Path) -> str:
    """--export files: the id percent-encoded, unless no common file system
    could hold it (too long, a device name, or a twin by case of a name given
    already on macOS or Windows) or a folder holds the name: then a stable
    name from its SHA-256, listed in NAMES_FILE. `taken` gathers the names
    given, in lower case."""
    name = quote(item_id, safe="")
    name = name.replace(".", "%2E") if not name.strip(".") else name  # '.' and '..' name no file
    stem, path = name.split(".")[0].lower(), folder / name
    if len(name.encode()) > MAX_NAME_BYTES or stem in RESERVED_NAMES or name.lower() in taken or \
            name in (NAMES_FILE, FILES_LIST) or path.is_dir() and not path.is_symlink():
        name = "id-" + hashlib.sha256(item_id.encode("utf-8")).hexdigest()[:40]
    taken.add(name.lower())
    return name


def prune_export(folder: Path, names: set, renamed: list, err) -> None:
    """--export files: the folder mirrors what is done now (`names`, the
    files this export wrote). The files an earlier export wrote (listed in
    FILES_LIST) for ids not done any more are removed; files it never wrote
    are left, and said."""
    folder.mkdir(parents=True, exist_ok=True)
    listed = folder / FILES_LIST
    try:
        before = set(listed.read_text(encoding="utf-8").splitlines())
    except (FileNotFoundError, UnicodeDecodeError):
        before = set()
    for name in sorted(before - names - {NAMES_FILE, FILES_LIST}):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(folder / name)  # an id gone upstream, or out of the list: no stale file looks live
    strangers = sorted(set(os.listdir(folder)) - names - before - {NAMES_FILE, FILES_LIST})
    if strangers:
        print(shown_text(f"redrive: warning: {folder} holds {len(strangers)} file(s) no export wrote, e.g. "
                         f"{strangers[0]!r}: they are left as they are"), file=err)
    if renamed:
        write_file(folder, NAMES_FILE, "".join(renamed).encode("utf-8"))
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / NAMES_FILE)
    write_file(folder, FILES_LIST, "".join(n + "\n" for n in sorted(names)).encode("utf-8"))


def body_bytes(record: dict) -> bytes:
    """The body of one result as its bytes: base64 undone, JSON written out."""
    body = record.get("body")
    if record.get("body_encoding") == "base64":
        return base64.b64decode(body)
    if isinstance(body, str):
        return body.encode("utf-8")
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def write_file(folder: Path, name: str, data: bytes) -> None:
    """One file inside `folder`, written through a new temporary file and
    renamed over the name: a symlink there is replaced, never followed."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name[:MAX_NAME_BYTES]}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -------------------------------------------------------------------- demo


class DemoHandler(http.server.BaseHTTPRequestHandler):
    """A small API that misbehaves the way real ones do, chosen by the id's hash."""
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave at once, no delayed-ACK stall

    def do_GET(self):
        item_id = self.path.rsplit("/", 1)[-1]
        with self.server.lock:
            self.server.hits[item_id] += 1
            hit = self.server.hits[item_id]
        time.sleep(0.03 + int(hashlib.sha256(item_id.encode()).hexdigest(), 16) % 5 * 0.02)
        self.reply(*demo_reply(item_id, hit))

    def reply(self, status: int, body: bytes, headers: dict) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def demo_reply(item_id: str, hit: int) -> tuple:
    """(status, body, headers) for the hit-th request of an id."""
    kind = int(hashlib.sha256(item_id.encode()).hexdigest(), 16) % 25
    if kind in (0, 1):
        return 404, b'{"error": "not found"}', {"Content-Type": "application/json"}
    if kind in (2, 3) and hit == 1:
        return 429, b'{"error": "slow down"}', {"Retry-After": "1", "Content-Type": "application/json"}
    if kind in (4, 5) and hit <= 2:
        return 503, b"<html>busy</html>", {"Content-Type": "text/html"}
    if kind in (8, 9) and hit <= 4:  # outlasts pass one's tries, recovers in pass two
        return 503, b"<html>maintenance</html>", {"Content-Type": "text/html"}
    if kind == 6 and hit == 1:
        return 200, b"", {"Content-Type": "application/json"}
    if kind == 7:
        return 500, b"<html>internal error</html>", {"Content-Type": "text/html"}
    body = json.dumps({"id": item_id, "title": f"Item {item_id}", "price": 10 + kind}).encode()
    return 200, body, {"Content-Type": "application/json"}


class DemoServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client hanging up is part of the show, not news


def start_demo_server(asked: Counter) -> DemoServer:
    """The demo API, each id already asked as often as `asked` says."""
    server = DemoServer(("127.0.0.1", 0), DemoHandler)
    server.hits, server.lock = Counter(asked), threading.Lock()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


# -------------------------------------------------------------------- CLI


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as a RedriveError, not sys.exit,
    and suggests the option a typo was meant to be."""

    def error(self, message):
        unknown = re.findall(r"(?<!\S)(--?[\w-]+)", message.partition("unrecognized arguments:")[2])
        options = [o for o in self._option_string_actions if o.startswith("--")]
        guesses = [min(options, key=lambda o: edit_distance(word.split("=")[0], o)) for word in unknown]
        hint = "".join(f"; did you mean {guess}?" for word, guess in zip(unknown, guesses)
                       if edit_distance(word.split("=")[0], guess) <= TYPO_DISTANCE)
        raise RedriveError(f"{message}{hint}; see --help")


#: A typo is this many letters off an option at most: further off, it is no typo ('--dry-run' is not '--retry-unsafe').
TYPO_DISTANCE = 2


def edit_distance(a: str, b: str) -> int:
    """Levenshtein's distance: the letters to insert, delete or change to turn a into b."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row, last = [i], row
        for j, y in enumerate(b, 1):
            row.append(min(last[j] + 1, row[j - 1] + 1, last[j - 1] + (x != y)))
    return row[-1]


def bounded(kind: str, low: float, high: float, whole: bool = False, above: bool = False) -> Callable:
    """An argparse type: a number from low (or above it) to high. Every
    number has an upper bound, or a typo such as 1e10 overflows a timer or
    asks for 30,000 threads."""
    def parse(text: str):
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = None
        if value is None or not (value > low if above else value >= low) or not value <= high:
            floor = f"above {low:g}" if above else f"from {low:g}"
            top = f"{high:,.0f}" if high >= 10000 else f"{high:g}"
            raise argparse.ArgumentTypeError(f"give {kind} {floor} to {top}, not {text!r}")
        return value

    return parse


DAY = 86400.0
positive_int = bounded("a whole number", 1, 1000, whole=True)
thread_count = bounded("a whole number", 1, 512, whole=True)
seconds = bounded("a number of seconds", 0, DAY)
positive_seconds = bounded("a number of seconds", 0, DAY, above=True)
positive_rate = bounded("a number of requests per second", 0.001, 1e6)
byte_count = bounded("a number of bytes", 1, 2 ** 33, whole=True)


MAX_SHARDS = 1_000_000


def shard_spec(text: str) -> tuple:
    k, slash, n = text.partition("/")
    if k == "auto" and (not slash or decimal(n, 1, MAX_SHARDS)):
        return "auto", int(n) if slash else None
    if slash and decimal(n, 1, MAX_SHARDS) and decimal(k, 1, int(n)):
        return int(k), int(n)
    raise argparse.ArgumentTypeError(f"give K/N with 1 <= K <= N, such as 2/3, or auto/N; not {text!r}")


#: The job engines whose worker index --shard auto reads: (its variable, the variable of its first index,
#: or None when it counts from 0).
SHARD_ENGINES = (("JOB_COMPLETION_INDEX", None), ("AWS_BATCH_JOB_ARRAY_INDEX", None),
                 ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN"))


def resolve_shard(spec: Optional[tuple], environ) -> Optional[tuple]:
    """--shard auto/N as (K, N), K from the job engine's index (Kubernetes and
    AWS Batch count from 0, Slurm from SLURM_ARRAY_TASK_MIN); N may come
    from SLURM_ARRAY_TASK_COUNT."""
    if not spec or spec[0] != "auto":
        return spec
    names = " ".join(name for name, _ in SHARD_ENGINES)
    for name, first in SHARD_ENGINES:
        if not environ.get(name):
            continue
        index, low = read_number(environ, name, 0), read_number(environ, first, 0) if first else 0
        total = read_number(environ, "SLURM_ARRAY_TASK_COUNT", 1) if first else None
        k, n = index - (low or 0) + 1, spec[1] or total or 0
        if not 1 <= k <= n:
            raise RedriveError(f"--shard auto: {name}={index} gives shard {k}, outside 1 to {n or 'N'}; give "
                               "--shard auto/N with N the number of workers")
        return k, n
    raise RedriveError(f"--shard auto: none of {names} is set (the job engine's worker index); give --shard K/N")


def read_number(environ, name: str, low: int) -> Optional[int]:
    """The whole number in environment variable `name` (None: not set); a value that is not one is an error naming it."""
    if name not in environ:
        return None
    number = decimal(environ[name], low, MAX_SHARDS)
    if number is None:
        raise RedriveError(f"--shard auto: {name}={shown_text(environ[name][:40])!r} is not a whole number from "
                           f"{low} to {MAX_SHARDS} (decimal digits only): fix the job's environment, or give --shard K/N")
    return number


#: The classes --retry-unavailable names besides statuses: a failure's cause, as failed.jsonl writes it.
RETRY_CLASSES = {cause.value.replace(" ", "-"): cause for cause in Cause}


def retry_classes(text: str) -> frozenset:
    """'500,503,5xx,timeout' -> the selectors wants_again matches: statuses, ('xx', N) and causes; or 'all'."""
    chosen = set()
    for word in (w.strip().lower() for w in text.split(",")):
        if word == "all":
            chosen.add("all")
        elif decimal(word, 100, 599):
            chosen.add(int(word))
        elif len(word) == 3 and word[0] in "12345" and word[1:] == "xx":
            chosen.add(("xx", int(word[0])))
        elif word in RETRY_CLASSES:
            chosen.add(RETRY_CLASSES[word])
        else:
            raise argparse.ArgumentTypeError(f"{word!r} is no class: give statuses (500,503), 5xx, all, or causes "
                                             f"({' '.join(RETRY_CLASSES)}); IDS_FILE goes before the option")
    return frozenset(chosen)


def wants_again(record: dict, chosen: Optional[frozenset]) -> bool:
    """Is an unavailable id's record one that --retry-unavailable brings back?"""
    if not chosen:
        return False
    status = record.get("status")
    return "all" in chosen or status in chosen or (status is not None and ("xx", status // 100) in chosen) or \
        record_cause(record) in chosen


DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY}


def duration_spec(text: str) -> float:
    """'30s', '12h', '7d' -> seconds: a number with its unit, above 0, up to ten years."""
    found = DURATION.fullmatch(text.strip().lower())
    seconds = float(found.group(1)) * UNIT_SECONDS[found.group(2)] if found else 0.0
    if not 0 < seconds <= 3650 * DAY:
        raise argparse.ArgumentTypeError(f"give a DURATION as a number and s, m, h or d (30s, 12h, 7d), "
                                         f"not {text!r}")
    return seconds


def status_codes(text: str) -> frozenset:
    try:
        return parse_codes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give HTTP statuses such as 429,500-599, not {text!r}") from None


EXAMPLES = """examples:
  python3 redrive.py sample_ids.txt --demo
  python3 redrive.py ids.txt --url 'https://api.example.com/items/{id}' \\
      -H 'X-API-Key: ${API_KEY}' -q

exit codes:
""" + "".join(f"  {int(code):<4}{meaning}\n" for code, meaning in EXIT_MEANINGS.items())


METHOD = re.compile(r"^[A-Z]+$")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One line per option, '-H, --header VALUE' rather than the metavar twice."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=min(100, shutil.get_terminal_size().columns))

    def _format_action_invocation(self, action):
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return f"{', '.join(action.option_strings)} {self._format_args(action, action.dest.upper())}"


def usage_parts(doc: str) -> tuple:
    """(usage line, description) for --help, from the module docstring: its
    usage line, and its first line and first paragraph. One text says it."""
    paragraphs = doc.split("\n\n")
    usage = paragraphs[1].removeprefix("usage: python3 ")
    return usage, f"{paragraphs[0]}\n\n{paragraphs[2]}"


USAGE, DESCRIPTION = usage_parts(__doc__)


def build_parser() -> Parser:
    """The command line: IDS_FILE, the request options, the run options."""
    p = Parser(prog="redrive.py", usage=USAGE, epilog=EXAMPLES, formatter_class=HelpFormatter,
               description=DESCRIPTION, allow_abbrev=False)  # '--max-tim 5' is a typo, not --max-time
    p.add_argument("ids_file", metavar="IDS_FILE", type=Path, help="one id (or full http(s) URL) per line")
    add_request_options(p.add_argument_group("request (kept in run.json: a rerun without these reuses them)"))
    add_run_options(p.add_argument_group("run"))
    return p


def add_request_options(req) -> None:
    req.add_argument("--url", metavar="TEMPLATE", help="URL with {id} (default: each id is a URL)")
    req.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
                     help="repeatable; ${VAR} is read from the env")
    req.add_argument("--method", type=str.upper, metavar="M", help="HTTP method (GET)")
    req.add_argument("--data", metavar="TEMPLATE", help="request body with {id}")
    req.add_argument("--expect-json", action="store_true", help="retry a body that is not JSON")
    req.add_argument("--require", action="append", default=[], metavar="TEXT",
                     help="retry a body without TEXT ({id} is the id: '\"id\":\"{id}\"' checks the answer is its own)")
    req.add_argument("--require-field", action="append", default=[], metavar="NAME",
                     help="retry JSON whose field NAME is null/missing")
    req.add_argument("--public", action="append", default=[], metavar="NAME",
                     help="a --url query parameter (or form field of --data) whose value is no secret: kept and shown")
    req.add_argument("--demo", action="store_true", help="use a built-in misbehaving API on 127.0.0.1")


def add_run_options(run) -> None:
    run.add_argument("--state-dir", type=Path, metavar="DIR", help="default: IDS_FILE's name + .redrive")
    run.add_argument("--concurrency", type=thread_count, default=4, metavar="N", help="worker threads (4)")
    run.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S",
                     help="limit on each attempt as a whole (30)")
    run.add_argument("--tries", type=positive_int, default=5, metavar="N", help="attempts per pass (5)")
    run.add_argument("--passes", type=positive_int, default=2, metavar="N",
                     help="passes; later ones re-drive failures (2)")
    run.add_argument("--backoff", type=seconds, default=1.0, metavar="S", help="first backoff, doubling (1)")
    run.add_argument("--max-backoff", type=seconds, default=60.0, metavar="S", help="backoff cap (60)")
    run.add_argument("--cooldown", type=bounded("a number of seconds", 0, 7 * DAY), default=30.0, metavar="S",
                     help="wait before a failure's next pass (30)")
    run.add_argument("--fatal", type=status_codes, metavar="CODES", help="statuses that halt the job (401,402)")
    run.add_argument("--retry", type=status_codes, metavar="CODES", help="statuses retried (408,429,5xx but 501,505)")
    run.add_argument("--skip", type=status_codes, metavar="CODES", help="statuses settled at once (400,404,410)")
    run.add_argument("--rate", type=positive_rate, metavar="R", help="at most R requests per second, evenly")
    run.add_argument("--per-host", type=thread_count, metavar="N", help="at most N requests in flight per host")
    run.add_argument("--shard", type=shard_spec, metavar="K/N",
                     help="only the ids of shard K of N (1/3, 2/3, 3/3); auto/N: K from the job engine's index")
    run.add_argument("--max-bytes", type=byte_count, default=50 * 1024 * 1024, metavar="N",
                     help="skip a body larger than N bytes (50 MiB)")
    run.add_argument("--retry-unavailable", nargs="?", const="all", type=retry_classes, metavar="CLASSES",
                     help="bring unavailable ids back, for one run: all, or those of CLASSES "
                          "(500,503 5xx 404 timeout throttled unreached transport bad-body too-large)")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--refresh", action="store_true",
                       help="ask every done id again, with If-None-Match / If-Modified-Since: a 304 keeps its result")
    again.add_argument("--refresh-older-than", type=duration_spec, metavar="DURATION",
                       help="as --refresh, only the ids fetched DURATION ago or more (30s, 12h, 7d)")
    run.add_argument("--max-time", type=bounded("a number of seconds", 0, 31 * DAY, above=True), metavar="S",
                     help="start no request after S s, exit 1")
    run.add_argument("--report", type=Path, metavar="FILE", help="write report.json to FILE too")
    run.add_argument("--metrics-file", type=Path, metavar="FILE",
                     help="write the run's metrics there at every exit, in the Prometheus text format "
                          "(node_exporter's textfile collector)")
    run.add_argument("--fsync", action="store_true", help="fsync each record before the next step")
    run.add_argument("--allow-config-change", action="store_true", help="accept a request unlike run.json's")
    run.add_argument("--retry-unsafe", action="store_true", help="retry POST/PATCH that may have been processed")
    run.add_argument("--no-guard", action="store_true", help="don't halt when 20 answers in a row fail alike")
    run.add_argument("--dry-run", action="store_true",
                     help="send nothing, write nothing: say how many ids are done, unavailable and new, and show "
                          "the first five requests, secrets redacted")
    run.add_argument("--export", choices=("jsonl", "csv", "files", "gone"),
                     help="no network, no lock: the latest result of each done id, in input order, to stdout "
                          "(jsonl, csv) or to --out DIR (files); or the unavailable ids' records (gone)")
    run.add_argument("--fields", metavar="LIST", help="--export csv: the columns, dotted paths (id,body.name)")
    run.add_argument("--out", type=Path, metavar="DIR", help="--export files: one file per id, in DIR")
    run.add_argument("--cover", nargs="+", type=Path, metavar="STATE_DIR",
                     help="no network, no writes: do these shards' state dirs together settle IDS_FILE, each id in "
                          "one shard? exit 0 when they do")
    run.add_argument("--check", action="store_true", help="no network: reconcile IDS_FILE and the state")
    run.add_argument("-q", "--quiet", action="store_true",
                     help="print only what a person must act on: an exit code but 0, or ids newly unavailable")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="a line for each request: time, id, answer, ms, bytes, what was decided")
    run.add_argument("--version", action="version", version=f"redrive {__version__}")


def default_state_dir(args) -> Path:
    """--state-dir, else beside IDS_FILE; /dev/stdin and the like have no beside."""
    if args.state_dir:
        return args.state_dir
    if str(args.ids_file.absolute()).startswith(("/dev/", "/proc/")):
        raise RedriveError(f"{args.ids_file}: no state dir can go beside it; give --state-dir DIR")
    plain = args.ids_file.with_name(args.ids_file.stem + ".redrive")
    if not args.shard:
        return plain
    own = args.ids_file.with_name(f"{args.ids_file.stem}.shard-{args.shard[0]}-of-{args.shard[1]}.redrive")
    # two shards on one machine never share a state dir; one an older redrive kept beside the ids is kept
    kept = shard_of(plain) if plain.is_dir() and not own.is_dir() else False
    return plain if kept is None or kept == args.shard else own


def shard_of(state_dir: Path):
    """The shard run.json keeps (None: none recorded; False: no run.json that says)."""
    record = run_json(state_dir)
    if record is None:
        return False
    return tuple(record["shard"]) if isinstance(record.get("shard"), list) else None


def run_json(state_dir: Path) -> Optional[dict]:
    """STATE_DIR/run.json read leniently, for a look that must not fail (--check, the shard's dir): None
    when there is none, or it is no JSON object (a run says why: see read_run_record)."""
    try:
        record = json.loads((state_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def config_from_args(args, environ, record: Optional[dict]) -> Config:
    """Turn parsed options into the one frozen Config, checking what argparse cannot.
    A rerun takes every request option it does not name from run.json."""
    if record is not None:
        given = frozenset(name for name in REQUEST_OPTIONS if getattr(args, name))
        args = argparse.Namespace(**{**vars(args), **recorded_request(record, given),
                                     "shard": recorded_shard(args.shard, record, default_state_dir(args))})
    if args.demo and args.url:
        raise RedriveError("--demo brings its own server; leave out --url")
    method = args.method or "GET"
    if not METHOD.match(method):
        raise RedriveError(f"--method {method[:20]!r} is not an HTTP method; give GET, POST, ...")
    if args.dry_run:  # it sends nothing: a ${VAR} not set is shown by its name, not asked for
        specs = " ".join([args.url or "", args.data or "", *args.header])
        environ = {**{name: f"${{{name}}}" for name in ENV_REF.findall(specs)}, **environ}
    headers = [parse_header(h, environ) for h in args.header]
    fatal, retry, skip = resolve_buckets(args.fatal, args.retry, args.skip)
    refresh = 0.0 if args.refresh else args.refresh_older_than
    if refresh is not None and method not in ("GET", "HEAD"):
        raise RedriveError(f"--refresh asks with If-None-Match, which only GET and HEAD take as 'answer if "
                           f"changed' (a {method} would be refused with 412 or done again); leave it out")
    url_spec = args.url or "{id}"
    request = Request(
        method=method, url=expand_env(url_spec, environ, "--url"), url_spec=url_spec,
        data=None if args.data is None else expand_env(args.data, environ, "--data"), data_spec=args.data,
        headers=tuple((n, v) for n, v, _ in headers), header_specs=tuple((n, spec) for n, _, spec in headers),
        expect_json=args.expect_json, require=tuple(args.require), require_field=tuple(args.require_field), public=tuple(args.public),
        demo=args.demo)
    return Config(
        ids_file=args.ids_file, state_dir=default_state_dir(args), request=request,
        concurrency=args.concurrency, timeout=args.timeout, tries=args.tries, passes=args.passes,
        backoff=args.backoff, max_backoff=args.max_backoff, cooldown=args.cooldown,
        rate=args.rate, per_host=args.per_host, shard=args.shard,
        fatal=fatal, retry=retry, skip=skip, max_bytes=args.max_bytes,
        retry_unavailable=args.retry_unavailable, refresh=refresh, max_time=args.max_time, quiet=args.quiet, verbose=args.verbose,
        fsync=args.fsync, report=args.report, metrics_file=args.metrics_file, allow_config_change=args.allow_config_change,
        retry_unsafe=args.retry_unsafe, guard=not args.no_guard,
        secrets=tuple(v for _, v, _ in headers) + tuple(env_values(f"{url_spec} {args.data}", environ)) +
        netrc_secrets())


def recorded_shard(given: Optional[tuple], record: dict, state_dir: Path) -> Optional[tuple]:
    """The shard of a run over this state dir: the one run.json keeps, unless
    none is given. Another one, once ids are done, would mix two shards."""
    kept = tuple(record["shard"]) if record.get("shard") else None
    if given and kept and given != kept and (state_dir / "done.txt").is_file() and \
            (state_dir / "done.txt").stat().st_size:
        raise RedriveError(f"{state_dir} holds shard {kept[0]}/{kept[1]}, and ids are done in it; --shard "
                           f"{given[0]}/{given[1]} would mix two shards: give its own --state-dir")
    return given or kept


def demo_config(cfg: Config) -> tuple:
    """The demo: a local server and short delays, the normal code path. An
    id misbehaves by how often it was asked, as failed.jsonl records it, so
    a demo stopped and resumed ends as one that ran through."""
    asked, failed = Counter(), cfg.state_dir / "failed.jsonl"
    for record in read_records(failed) if failed.is_file() else ():
        asked[record["id"]] += record["tries"]
    server = start_demo_server(asked)
    url = f"http://127.0.0.1:{server.server_address[1]}/items/{{id}}"
    request = dataclasses.replace(cfg.request, url=url)
    return server, dataclasses.replace(cfg, request=request, tries=3, backoff=0.2, max_backoff=2.0, cooldown=2.0,
                                       timeout=5.0)


def dry_run(cfg: Config, err, out) -> ExitCode:
    """--dry-run: what a run would ask, with nothing sent and nothing written.
    It reads the list as a run does, through an index it does not keep."""
    check_ids_file(cfg.ids_file)
    redact = Redactor(cfg.secrets + tuple(secret_query_values(cfg.request.url, cfg.request.public)))
    check_urls(cfg, (), redact)
    known = cfg.state_dir.is_dir()
    state = load_state(cfg.state_dir, repair=False) if known else State()
    record = read_run_record(cfg.state_dir) if known else None
    done_file = cfg.state_dir / "done.txt"
    anything_done = done_file.exists() and done_file.stat().st_size > 0
    note = settle_run_record(cfg, copy.deepcopy(record), anything_done, time.time(), write=False)[0]  # as a run would
    if note and not cfg.quiet:
        print(shown_text(f"redrive: {redact(note)}"), file=err)
    before = refresh_cutoff(cfg, record, time.time())[0]
    index = current_index(cfg.ids_file, cfg.state_dir, cfg.shard, keep=False)
    if index.flags.count(NO_ID) == len(index.flags):
        raise RedriveError(f"{cfg.ids_file}: no ids in it; put one id per line ('#' lines are comments)")
    listing = listing_of(cfg.ids_file, index, state, before is not None)
    check_listed(cfg, (i for _, i in listing.lines((PENDING,))) if cfg.request.url == "{id}" else (), redact, err)
    if known:
        take_back_gone(state, listing, cfg.state_dir)
    refresh = Refresh(listing, cfg.state_dir, before) if before and known else None
    if refresh:
        refresh.mark()
    settled = lambda item_id: item_id in state.unavailable and not wants_again(state.unavailable[item_id],
                                                                               cfg.retry_unavailable)
    marked = [i for n, i in listing.marked if listing.flags[n] == PENDING]
    unavailable = sum(map(settled, marked))
    failed = sum(1 for i in marked if i in state.failed and i not in state.unavailable)
    left = listing.pending()
    everyone = listing.total + index.flags.count(OTHER_SHARD)
    shard = f" (shard {cfg.shard[0]}/{cfg.shard[1]} of {everyone})" if cfg.shard else ""
    print(f"redrive: dry run, nothing sent: {listing.total} ids{shard}: {listing.total - left} done, {unavailable} "
          f"unavailable, {failed} failed earlier, {left - unavailable - failed} new" +
          (f", {refresh.count if refresh else 0} done to refresh (fetched before {before[:16]}Z)" if before else ""),
          file=out)
    asked = ((i, None) for _, i in listing.lines((PENDING,)) if not settled(i))
    due = ((i, refresh.prior(n)) for n, i in listing.lines((DUE,))) if refresh else ()
    for item_id, prior in itertools.islice(itertools.chain(asked, due), 5):
        shown = "(the demo's server)" if cfg.request.demo else redact(shown_url(cfg.request, item_id))
        conditional = "".join(f", {name}: {value}" for name, value in prior.headers()) if prior else ""
        print(shown_text(f"  {cfg.request.method} {shown}{conditional}"), file=out)
    if refresh:
        refresh.close()
    return ExitCode.OK


def check_report_path(cfg: Config) -> None:
    """--report and --metrics-file name neither the ids file nor a state file
    (it would be replaced), and can be written: found out before the run is
    paid for."""
    for option, given in (("--report", cfg.report), ("--metrics-file", cfg.metrics_file)):
        if given is not None:
            check_output_file(cfg, option, given)


def check_output_file(cfg: Config, option: str, given: Path) -> None:
    target = Path(os.path.abspath(given))
    kept = [(cfg.ids_file, "the ids file")] + [(cfg.state_dir / name, f"the state file {name}")
                                               for name in OWN_FILES if name != "report.json"]
    for path, what in kept:
        if Path(os.path.abspath(path)) == target or target.exists() and path.exists() and os.path.samefile(path, target):
            raise RedriveError(f"{option} {given}: that is {what}, which it would replace; "
                               "name a file outside the state dir")
    if os.path.lexists(target) and not stat.S_ISREG(os.lstat(target).st_mode):
        raise RedriveError(f"{option} {given}: exists and is not a regular file (a link, a pipe, a device), "
                           "which it would replace; name a new file or a regular one")
    if target.is_dir() or not os.access(target.parent, os.W_OK | os.X_OK) or \
            target.exists() and not os.access(target, os.W_OK):
        raise RedriveError(f"{option} {given}: cannot be written there; pick a writable path")


def prepare_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RedriveError(f"{path}: cannot create the state dir ({exc.strerror}); pick another --state-dir") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise RedriveError(f"{path}: state dir is not writable; fix its permissions or pick another --state-dir")
    refuse_foreign_files(path)


def refuse_foreign_files(state_dir: Path) -> None:
    """A state file that is a symlink or not a regular file is refused before
    anything is read from, written to or cut from it: redrive would truncate
    or append to whatever it points at."""
    for name in OWN_FILES:
        try:
            mode = os.lstat(state_dir / name).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise RedriveError(f"{state_dir / name}: {exc.strerror.lower()}; check the state dir") from None
        if not stat.S_ISREG(mode):
            what = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
            raise RedriveError(f"{state_dir / name}: {what}; redrive writes only files of its own there: "
                               "move it away, or use a new --state-dir")


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP stop a run or a reader. Before a run's
    first request (the state read, the index built, a refresh joined), and
    in a reader, the first one raises RedriveError with the signal's exit
    code wherever it lands, saying `said`; this process's scratch dirs are
    removed on the way out (it may land while one is made or removed).
    Once a run's batch is attached, the first asks it to stop; a second stops it
    at once, leaving what is in flight pending (report.json is still written,
    and the status line ended). A third exits on the spot. Every line is
    already written with os.write, so nothing flushed is lost."""

    STOPS = {signal.SIGINT: Stop.INTERRUPTED, signal.SIGTERM: Stop.TERMINATED,
             **({signal.SIGHUP: Stop.HUNG_UP} if hasattr(signal, "SIGHUP") else {})}

    def __init__(self, said: str):
        self.said, self.batch, self.saved, self.seen = said, None, {}, 0

    def handle(self, signum, frame):
        stop = self.STOPS[signum]
        self.seen += 1
        if self.seen > 2:
            os._exit(int(stop.code))
        if self.batch is None:
            if self.seen == 1:  # a second finds the first on its way out
                raise RedriveError(f"{stop.value} {self.said}", stop.code)
            return
        if self.seen == 2:
            self.batch.tally.stop_at = self.batch.fx.clock()  # no grace: the run loop ends at its next look
        self.batch.request_stop(stop)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.STOPS:
                self.saved[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, failed, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        if failed is not None:  # the stop may have landed while a scratch dir was made or removed
            for where in Parts.places:
                remove_scratch(where, scratch_prefix())


def run(cfg: Config, fx: Effects, err) -> ExitCode:
    """Load the state, run the passes, report. Raises RedriveError for setup problems."""
    started = fx.clock()
    check_ids_file(cfg.ids_file)
    redact = Redactor(cfg.secrets + tuple(secret_query_values(cfg.request.url, cfg.request.public)))
    check_urls(cfg, (), redact)
    check_report_path(cfg)
    prepare_state_dir(cfg.state_dir)
    with RunLock(cfg.state_dir, fx.wallclock):
        ledger, due = Ledger(cfg.state_dir, cfg.fsync, fx.clock, fx.fsync), None
        try:
            with StopSignals("before the first request; nothing was sent: rerun to resume") as stops:
                record = read_run_record(cfg.state_dir)
                paces = read_paces(cfg.state_dir)
                state = load_state(cfg.state_dir)
                complete_lost_done(state, ledger)  # before the index is brought up to date: it reads its done line
                before, resumed = refresh_cutoff(cfg, record, fx.wallclock())
                listing = read_input(cfg, state, before is not None, redact, err)
                done_file = cfg.state_dir / "done.txt"
                fresh = not (done_file.exists() and done_file.stat().st_size > 0)
                note, since = settle_run_record(cfg, record, not fresh, fx.wallclock(), before)
                forget_old_verdicts(state, since)
                for line in filter(None, (note, resumed)) if not cfg.quiet else ():
                    print(shown_text(f"redrive: {redact(line)}"), file=err)
                take_back_gone(state, listing, cfg.state_dir)
                due = Refresh(listing, cfg.state_dir, before) if before else None
                ledger.open()
                tally = run_passes(cfg, fx, err, listing, state, ledger, fresh, redact, due, started, stops, paces)
        finally:
            ledger.close()
            if due is not None:
                due.close()
        came_back = frozenset(i for i in state.done if i in state.unavailable and i not in state.fresh)
        if state.fresh or came_back:  # only a run that settled ids can have written a second line for one
            compact(cfg.state_dir / "unavailable.jsonl", came_back)  # failed.jsonl keeps its line per (id, pass)
        if tally.refresh:
            compact(cfg.state_dir / "refreshed.jsonl")
        refresh = refresh_view(before, due.count if due else 0, tally, redact)
        if refresh and not refresh["left"]:
            end_refresh(cfg.state_dir)
            # a refresh that is over needs no line per pass of the ids it asked: each keeps its last, as elsewhere
            compact(cfg.state_dir / "failed.jsonl", only=frozenset(tally.asked_again))
        rest = itertools.chain(listing.not_done(PENDING_LISTED),  # not done, in file order
                               (i for _, i in sorted(tally.gone)))  # gone upstream in this refresh
        report = build_report(listing.total, rest, listing.duplicates, state, tally, cfg, fx.clock() - started,
                              redact, fx.wallclock(), refresh, lambda: listing.untried_past)
        return finish(report, tally, cfg, redact, err)


def refresh_view(before: Optional[str], due: int, tally: Tally, redact: Redactor) -> Optional[dict]:
    """The refresh as report.json shows it: its cut-off, how many ids it
    asked, by result, how many are left, and each id whose result was kept."""
    if not before:
        return None
    settled = sum(tally.refresh.values())
    return {"before": before, "due": due, **{result: tally.refresh[result] for result in REFRESH_RESULTS},
            "left": due - settled,
            "kept_ids": [{"id": redact(shown_id(r["id"])), "status": r["status"], "reason": r["reason"]}
                         for r in tally.kept]}


def check_listed(cfg: Config, ids: Iterable[str], redact: Redactor, err) -> None:
    """Before anything is sent: a bad URL among the ids, or a local setting
    that cannot work for them, raises; a key in the ids is warned of. The
    ids are read once: they may be a stream."""
    first = []  # the first ones, whose origins' proxies are checked

    def kept(stream):
        for item_id in stream:
            if len(first) < 10 * CHECKED_ORIGINS:
                first.append(item_id)
            yield item_id
    keyed = keyed_ids_warning(check_urls(cfg, kept(ids), redact))
    if keyed and not cfg.quiet:
        print(f"redrive: warning: {keyed}", file=err)
    check_local_settings(cfg, first, redact)


def read_input(cfg: Config, state: State, refresh: bool, redact: Redactor, err) -> Listing:
    """The run's Listing, from the state's index brought up to date: its
    shard's ids not done, and those done that a refresh asks again or that
    may be gone upstream. A bad id URL raises, a key in the ids is warned
    of: for a list of URLs, that is one pass over the ids left."""
    index = current_index(cfg.ids_file, cfg.state_dir, cfg.shard)
    if index.flags.count(NO_ID) == len(index.flags):
        raise RedriveError(f"{cfg.ids_file}: no ids in it; put one id per line ('#' lines are comments)")
    listing = listing_of(cfg.ids_file, index, state, refresh)
    ids = (i for _, i in listing.lines((PENDING,))) if cfg.request.url == "{id}" else ()
    check_listed(cfg, ids, redact, err)
    return listing


def run_passes(cfg: Config, fx: Effects, err, listing: Listing, state: State, ledger: Ledger, fresh: bool,
               redact: Redactor, refresh: Optional[Refresh], started: float, stops: StopSignals,
               paces: dict) -> Tally:
    """Every pass, the stop signals sent to the batch. refresh: the done ids
    a refresh asks again, if any; started: when the run began (--max-time's start);
    paces: the limits earlier runs found (read_paces), kept for the next run when it ends."""
    total = listing.total
    for note in state.repairs:
        print(shown_text(f"redrive: warning: {redact(note)}"), file=err)
    progress = Progress(err, total, fx.clock, cfg.quiet)
    batch = Batch(cfg, ledger, state, fx, redact, progress, started)
    plan(listing, state, cfg, batch, ledger, fx, refresh)
    counts = batch.settler.counts
    again = refresh.count - counts["refreshed"] if refresh else 0  # those noted kept at once are not asked
    new, before = batch.timeline.pending() - again, refresh and refresh.before
    progress.begin(counts["done"] + counts["unavailable"] + counts["refreshed"])
    # nothing done yet, or a refresh of ids that answered before: the first answers all failing alike mean the
    # set-up (the --url, the key) is wrong, not the ids, and are held, not settled (a revoked key's 404s are no verdict)
    if cfg.guard and batch.timeline.pending() >= GUARD_MIN:
        batch.settler.guard = Guard(min(GUARD_SAMPLE, batch.timeline.pending()), fresh)
    again = f", {batch.timeline.pending() - new} to refresh (fetched before {before[:16]}Z)" if before else ""
    host = batch.timeline.fixed_host
    learnt = paces.get(pace_key(host)) if host else None  # why the run is paced from its first request
    paced = f"; the limit found before, {learnt['pace']:.3g} r/s, paces it (paces.json)" if learnt else ""
    progress.say(f"redrive: {total} ids, {new} to fetch{again}, state in {cfg.state_dir}{paced}")
    stops.batch = batch
    batch.timeline.recalled = paces
    try:
        tally = batch.run()
    finally:
        progress.clear()
        batch.wake.close()
    remember_paces(cfg.state_dir, batch.timeline.hosts, paces, fx.clock(), fx.wallclock())
    return tally


def finish(report: dict, tally: Tally, cfg: Config, redact: Redactor, err) -> ExitCode:
    """Write report.json (and --report), print the summary, return the exit code."""
    code = exit_code(report)
    report["exit_code"] = int(code)
    if tally.crash:
        crashed = tally.crash["id"]
        report["crash"] = {"id": None if crashed is None else redact(shown_id(crashed)),
                           "error": redact(tally.crash["error"]), "log": "crash.log"}
        write_crash_log(cfg.state_dir / "crash.log", tally.crash["id"], tally.crash["traceback"], redact,
                        tally.crash["at"])
    text = json.dumps(report, indent=1, ensure_ascii=False) + "\n"
    for path in filter(None, (cfg.state_dir / "report.json", cfg.report)):
        write_atomically(path, text)
    if cfg.metrics_file:
        write_metrics(cfg.metrics_file, cfg.state_dir, int(code), report, tally)
    kept = (report["refresh"] or {}).get("kept")
    if code != ExitCode.OK or not cfg.quiet or report["new_unavailable"] or kept or report["in_doubt"]:  # -q: news only
        lines = stop_lines(tally, cfg, redact) + summarize(report, news=cfg.quiet, listing=redact(gone_listing(cfg)))
        print("\n".join(map(shown_text, lines)), file=err, flush=True)
    return code


#: The metrics file's series: (name, type, help). Every sample is labelled with the state dir.
METRICS = (
    ("redrive_last_success_timestamp_seconds", "gauge", "Unix time the last run that ended with exit 0 ended."),
    ("redrive_exit_code", "gauge", "Exit code of the last run."),
    ("redrive_run_duration_seconds", "gauge", "How long the last run took."),
    ("redrive_ids", "gauge", "Ids of the list by state at the end of the last run."),
    ("redrive_requests", "gauge", "Answers the last run got, by status class (none: no answer)."),
    ("redrive_refusals", "gauge", "Refusals the last run got: 429, 503 and answers that said they were a rate limit."),
    ("redrive_in_doubt", "gauge", "Done ids whose stored result may be another id's, not answered again (in_doubt)."),
    ("redrive_quota_remaining", "gauge", "Requests the API declared left, at the end of the last run."),
    ("redrive_quota_reset_timestamp_seconds", "gauge", "Unix time the API declared its quota resets."),
)


def label(value: str) -> str:
    """A label value in the Prometheus text format: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_metrics(path: Path, state_dir: Path, code: int, report: Optional[dict], tally: Optional["Tally"]) -> None:
    """--metrics-file: the run in the Prometheus text format that
    node_exporter's textfile collector reads, written whole (a scrape never
    sees half a file). The last success is carried over from the file a run
    that did not end 0 replaces. A run that stopped before it began (exit 2,
    75) has no report: only its exit code."""
    where = f'state_dir="{label(str(shown_path(state_dir)))}"'
    last = parse_iso(report["finished_at"]) if code == ExitCode.OK and report else previous_success(path)
    samples = {"redrive_exit_code": [("", code)]}
    if report and tally:
        samples.update({
            "redrive_run_duration_seconds": [("", report["elapsed_s"])],
            "redrive_ids": [(f',state="{k}"', report["counts"][k]) for k in ("done", "unavailable", "failed",
                                                                             "pending")],
            "redrive_requests": [(f',class="{k}"', n) for k, n in sorted(tally.answers.items())],
            "redrive_refusals": [("", tally.refusals)],
            "redrive_in_doubt": [("", len(tally.in_doubt))]})
    if last is not None:
        samples["redrive_last_success_timestamp_seconds"] = [("", last)]
    quota = (report or {}).get("quota")
    if quota:
        samples["redrive_quota_remaining"] = [("", quota["remaining"])]
        samples["redrive_quota_reset_timestamp_seconds"] = [("", parse_iso(quota["resets_at"]))]
    lines = []
    for name, kind, text in METRICS:
        if name in samples:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{where}{extra}}} {float(value)!r}" for extra, value in samples[name]]
    write_atomically(path, "\n".join(lines) + "\n")


def previous_success(path: Path) -> Optional[float]:
    """The last success an earlier metrics file at path recorded, if any."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found = re.search(r"^redrive_last_success_timestamp_seconds\{[^\n]*\} (\S+)$", text, re.M)
    return header_number(found.group(1)) if found else None


def gone_listing(cfg: Config) -> str:
    """The command that lists every unavailable id of this state dir."""
    try:
        own = default_state_dir(argparse.Namespace(ids_file=cfg.ids_file, state_dir=None, shard=cfg.shard))
    except RedriveError:
        own = None
    where = ["--state-dir", str(cfg.state_dir)] if cfg.state_dir != own else []
    shard = ["--shard", "/".join(map(str, cfg.shard))] if cfg.shard else []
    return shlex.join(["redrive.py", str(cfg.ids_file), *where, *shard, "--export", "gone"])


def write_crash_log(path: Path, item_id: Optional[str], trace: str, redact: Redactor, now: float) -> None:
    """The traceback of a bug, for a bug report: never a secret in it."""
    text = f"redrive {__version__}, Python {sys.version.split()[0]}, {iso(now)}\nid: {item_id!r}\n{trace}"
    try:
        path.write_text(redact(text), encoding="utf-8")
    except OSError:
        pass  # the one-line message still says what happened


def crash_exit(exc: BaseException, state_dir: Optional[Path], err, redact: Redactor, now: float) -> ExitCode:
    """A bug outside the batch (starting or reporting): one line, the traceback in a file, exit 70."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    folder = state_dir if state_dir is not None and state_dir.is_dir() else Path(tempfile.gettempdir())
    path = folder / ("crash.log" if folder == state_dir else f"redrive-crash-{os.getpid()}.log")
    write_crash_log(path, None, trace, redact, now)
    print(shown_text(f"redrive: internal error: {type(exc).__name__}: {redact(str(exc))[:200]}; the traceback "
                     f"is in {path}; please report it"), file=err)
    return ExitCode.SOFTWARE


class SafeStream:
    """An output stream whose failure never stops the work: with a closed
    stderr, or a reader gone away (`redrive ... 2>&1 | head -1`), redrive
    goes quiet and the crawl goes on to its normal end and exit code."""

    def __init__(self, stream):
        self.stream, self.dead = stream, stream is None

    def write(self, text: str) -> int:
        self._do(lambda: self.stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._do(lambda: self.stream.flush())

    def isatty(self) -> bool:
        try:
            return not self.dead and self.stream.isatty()
        except (OSError, ValueError, AttributeError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def _do(self, action) -> None:
        if self.dead:
            return
        try:
            action()
        except (OSError, ValueError):
            self.dead = True
            self._silence()

    def _silence(self) -> None:
        """Point the dead descriptor at /dev/null: Python's own flush at exit then fails no more."""
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass  # not a file (a test's StringIO): nothing to silence


def reserve_standard_fds() -> None:
    """Put /dev/null on a closed stdin, stdout or stderr (`2>&-`), so that no
    state file is ever opened as descriptor 2 and written to by a message."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def netrc_secrets() -> tuple:
    """The passwords of the .netrc requests sends (read as requests reads it:
    $NETRC, else ~/.netrc or ~/_netrc), with their Basic form: a server that
    echoes them back shows '***'."""
    import netrc
    names = [os.environ["NETRC"]] if os.environ.get("NETRC") else \
        [os.path.join(os.path.expanduser("~"), name) for name in (".netrc", "_netrc")]
    for name in names:
        try:
            entries = netrc.netrc(name).hosts.values()
        except (OSError, netrc.NetrcParseError):
            continue
        return tuple(secret for login, _, password in entries if password for secret in
                     (password, base64.b64encode(f"{login or ''}:{password}".encode()).decode()))
    return ()


def secret_query_values(url: str, public: Iterable[str] = ()) -> list:
    """The template's query values kept_url hides, to scrub from output
    wherever a server echoes them (a redirect's URL, an error page): any
    key-like one, and any other of MIN_HIDDEN characters or more."""
    try:
        query = urlsplit(url).query
    except ValueError:
        query = url.partition("?")[2]  # not a URL that parses: the check of --url says so, without a secret
    pairs = (p.partition("=") for p in QUERY_SEPARATOR.split(query)[::2])  # the pairs, not their separators
    public = frozenset(public)
    values = [form for name, eq, value in pairs if "{id}" not in value and unquote_plus(name) not in public
              and (key_like(name) or len(value or name) >= MIN_HIDDEN)
              for form in ((value, unquote_plus(value)) if eq else (name, unquote_plus(name)))]
    userinfo = USERINFO.search(url)
    if userinfo:  # a token as userinfo, or the password of user:password, as written and decoded
        user, colon, password = userinfo.group(1).partition(":")
        values += [password if colon else user, unquote(password if colon else user)]
        basic = f"{unquote(user)}:{unquote(password)}".encode("latin-1", "replace")  # requests sends it as Basic
        values.append(base64.b64encode(basic).decode())
    return [v for v in values if v]


def main(argv=None, *, fx: Effects = Effects(), err=None, out=None, environ=None) -> int:
    """The command line: parse, run, map every user error to its exit code."""
    if err is None:
        reserve_standard_fds()
    err = SafeStream(err or sys.stderr)
    environ = os.environ if environ is None else environ
    server, state_dir, secrets = None, None, ()
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help and --version
            return int(exc.code or 0)
        args.shard = resolve_shard(args.shard, environ)
        state_dir = default_state_dir(args)
        if state_dir.is_dir():
            refuse_foreign_files(state_dir)
        reading = StopSignals("while reading the state; rerun the same command")
        if args.check:
            shard = args.shard or (shard_of(state_dir) if state_dir.is_dir() else None) or None
            with reading:
                return int(check(args.ids_file, state_dir, args.quiet, SafeStream(out or sys.stdout), shard))
        if args.export:
            with reading:
                return int(export(args, state_dir, SafeStream(out or sys.stdout), err))
        if args.cover:
            with reading:
                return int(cover(args.ids_file, args.cover, SafeStream(out or sys.stdout)))
        cfg = config_from_args(args, environ, read_run_record(default_state_dir(args)))
        secrets = cfg.secrets
        if cfg.request.demo:
            server, cfg = demo_config(cfg)
        if args.dry_run:
            with reading:
                return int(dry_run(cfg, err, SafeStream(out or sys.stdout)))
        return int(run(cfg, fx, err))
    except RedriveError as exc:
        print(shown_text(f"redrive: error: {exc}"), file=err)
        metrics = getattr(locals().get("args"), "metrics_file", None)
        if metrics is not None and state_dir is not None and "--metrics-file" not in str(exc):
            with contextlib.suppress(OSError, RedriveError):  # the monitor sees this exit too, not the last run's
                write_metrics(metrics, state_dir, int(exc.code), None, None)
        return int(exc.code)
    except KeyboardInterrupt:
        print("redrive: interrupted while starting; rerun the same command", file=err)
        return int(ExitCode.INTERRUPTED)
    except OSError as exc:
        if not exc.filename:
            return int(crash_exit(exc, state_dir, err, Redactor(secrets), fx.wallclock()))
        print(f"redrive: error: {shown_text(str(exc.filename))}: {(exc.strerror or str(exc)).lower()}; "
              "check the file, its permissions and the free space", file=err)
        return int(ExitCode.USAGE)
    except Exception as exc:  # a bug: never a traceback on the terminal
        return int(crash_exit(exc, state_dir, err, Redactor(secrets), fx.wallclock()))
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    sys.exit(main())
