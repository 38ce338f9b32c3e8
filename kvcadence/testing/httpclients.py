"""Plain concurrent HTTP clients of an SGLang worker that are not kvcadence's driver.

Open-loop arrivals (each client starts at a uniform random time in ``[0, span_s)``,
whatever the worker is doing), shared system prompts (by default three, of 96, 160 and 224
random tokens: ``systems``, ``--systems N,N,...``; client ``i`` uses the ``i % len``-th),
multi-turn chats whose next prompt is the previous prompt + the previous output + 3
"chat-template" tokens + a 16-token user turn (``turn_in``, ``--turn-in N``; a chat's first
prompt is its system prompt + ``turn_in`` + 8 tokens), and single shots (a system prompt +
20 tokens, ``single_in``, ``--single-in N``; 8 output tokens). Chat turns ask for 4-20
tokens (``chat_out``, ``--chat-out MIN-MAX``); a chat's 2nd and 4th turns may stop at EOS
(``ignore_eos`` off), every other request runs to its length (greedy decoding; with
``eos_everywhere``, ``--no-ignore-eos``, every request may stop at EOS: 0.5.23 then reserves
only part of its answer, so a tight pool retracts). Some requests stream (``"stream": true``: a
chat's last turn, every other single shot). With ``cancel_share`` (``--cancel-share F``) a
share of the requests (drawn from a generator of their own: the plans above stay those of the
seed) stream and their client hangs up after 1-4 output tokens (``cancel_after``,
``--cancel-after MIN-MAX``), as a user stopping a generation: SGLang aborts the request; a
chat goes on with the partial answer in its next prompt. With ``parallel_share``
(``--parallel-share F``) a share of the single shots (a generator of their own too) ask
for ``parallel_n`` (``--parallel-n N``, default 3) parallel samples of one prompt
(``"n": N``, sampled at temperature ``PARALLEL_TEMPERATURE`` so the samples differ; not
streamed), as best-of-n and RL rollout clients do. With ``routing_keys`` (``--routing-keys
N``) client ``i`` sends every request with ``"routing_key": "key-<i % N>"`` (what a router
sets for ``--schedule-policy routing-key``). With ``cache_salts`` (``--cache-salts N``)
client ``i`` sends ``"cache_salt": "tenant-<i % N>"``, and with ``extra_keys``
(``--extra-keys N``) ``"extra_key": "app-<i % N>"``, each but where ``i % N`` is 0 (those
send none): SGLang 0.5.23 keeps each ``(extra_key, cache_salt)`` in a cache namespace of its
own, as a multi-tenant front end asks it to. With ``priorities`` (``--priorities P,P,...``)
client ``i`` sends ``"priority": P[i % len]`` (``none``: no priority), for a worker run with
``--enable-priority-scheduling``. With ``logprob_share`` (``--logprob-share F``) a share of
the single shots (a generator of their own) ask for their prompt's logprobs from
``logprob_start`` on (``--logprob-start K``, default 0: ``"return_logprob": true,
"logprob_start_len": K``), as an evaluation harness scoring prompts does (``/v1/completions``
with ``echo`` and ``logprobs`` sends 0): SGLang then reuses at most ``K`` cached tokens of
it. With ``unbounded_share`` (``--unbounded-share F``) a share of the single shots (a
generator of their own) are sent with ``"max_new_tokens": null`` (no ``ignore_eos``,
sampled at ``PARALLEL_TEMPERATURE``), what SGLang's OpenAI layer forwards for a client that
sets no ``max_tokens`` (the native API's own default, a key left out, is 128): the worker
runs them to EOS or its context limit and reserves admission room for that limit. No
rid is sent: SGLang picks one. Plain
``httpx``, one connection per client thread, ``POST /generate`` with ``input_ids``.

With ``flush_at`` (``--flush-at S``, repeatable) an operator thread calls ``POST
/flush_cache`` at ``S`` seconds into the run, whatever the clients are doing, as an operator
would (after a weight update, say): SGLang flushes only when nothing is running or waiting
and refuses otherwise, so the call is repeated every ``FLUSH_RETRY_S`` until it succeeds
(or ``FLUSH_GIVE_UP_S`` passed). Each outcome is kept in ``Clients.flushes``.

Seeded: the number of requests, their start times, system prompts, turn counts, output
lengths and every prompt token are fixed by ``seed`` (each client draws from its own
generator); only the outputs (greedy) and the worker's timing are not.

Why ~600 lines: one seeded traffic model whose every option is a kind of production traffic
the corpus records (hang-ups, parallel samples, scoring requests, requests without an output
limit, flushes, routing keys, namespaces, priorities) and its command line.

Used by ``tests/capture/test_production_worker.py`` (60 requests) and to record the
corpus captures ``http-clients-p16``, ``dp2-p32-http-clients`` and ``p8-chunk128-nooverlap-http-clients``
(``python -m kvcadence.testing.httpclients``: attaches
``kvcadence capture --server --sglang-metrics`` while the clients run; see
``tests/replay/data/corpus/README.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.argtypes import nonneg_float, positive_int
from kvcadence.errors import KvcadenceError
from kvcadence.outguard import term_as_interrupt
from kvcadence.testing.capturerun import start_capture, stop_capture

SYSTEM_LENGTHS = (96, 160, 224)
#: a parallel-sampling request's temperature (``--parallel-share``): samples that differ
PARALLEL_TEMPERATURE = 1.0
#: an operator's ``/flush_cache`` refused (the worker was busy) is tried again this often ...
FLUSH_RETRY_S = 0.25
#: ... for this long
FLUSH_GIVE_UP_S = 120.0


@dataclass(frozen=True)
class Plan:
    """One client: a chat (``turns`` > 0: output lengths per turn) or a single shot."""

    index: int
    start_s: float
    system: int  # index into ``Clients.systems``
    outputs: tuple[int, ...]  # max_new_tokens per request
    streams: tuple[bool, ...]  # stream flag per request
    chat: bool
    #: per request: hang up after this many output tokens (None: read the whole answer)
    cancels: tuple[int | None, ...] = ()
    #: per request: parallel samples asked for (``"n"``; empty: one each)
    samples: tuple[int, ...] = ()
    #: its prompt's logprobs asked for from this position on (None: none asked for)
    logprob_start: int | None = None
    #: sent without ``max_new_tokens`` (to EOS or the worker's context limit)
    unbounded: bool = False


class Clients:
    """Open-loop chats and single shots over shared system prompts (plain httpx)."""

    def __init__(
        self,
        url: str,
        seed: int,
        sessions: int = 8,
        singles: int = 24,
        span_s: float = 12.0,
        timeout_s: float = 600.0,
        chat_out: tuple[int, int] = (4, 20),
        systems: tuple[int, ...] = SYSTEM_LENGTHS,
        single_in: int = 20,
        turn_in: int = 16,
        cancel_share: float = 0.0,
        cancel_after: tuple[int, int] = (1, 4),
        flush_at: tuple[float, ...] = (),
        parallel_share: float = 0.0,
        parallel_n: int = 3,
        logprob_share: float = 0.0,
        logprob_start: int = 0,
        unbounded_share: float = 0.0,
        routing_keys: int = 0,
        cache_salts: int = 0,
        extra_keys: int = 0,
        priorities: tuple[int | None, ...] = (),
        eos_everywhere: bool = False,
    ) -> None:
        self.url = url
        self.eos_everywhere = eos_everywhere
        self.priorities = priorities
        self.routing_keys = routing_keys
        self.cache_salts = cache_salts
        self.extra_keys = extra_keys
        self.flush_at = tuple(sorted(flush_at))
        #: per ``flush_at`` point: {"at_s", "ok", "tries", "done_s", "status"}
        self.flushes: list[dict[str, Any]] = []
        self.seed = seed
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.chat_out = chat_out
        self.single_in = single_in
        self.turn_in = turn_in
        self.systems = [self._toks(self.rng, n) for n in systems]
        self.plans = self._plan(sessions, singles, span_s)
        if cancel_share > 0:
            self.plans = self._cancel(cancel_share, cancel_after)
        if parallel_share > 0:
            self.plans = self._parallel(parallel_share, parallel_n)
        if logprob_share > 0:
            self.plans = self._logprobs(logprob_share, logprob_start)
        if unbounded_share > 0:
            self.plans = self._unbounded(unbounded_share)
        self.sent: list[dict[str, Any]] = []  # {"input_ids", "output_ids", "stream", ...}
        self.errors: list[str] = []
        self.lock = threading.Lock()

    @staticmethod
    def _toks(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, 1024) for _ in range(n)]

    def _plan(self, sessions: int, singles: int, span_s: float) -> list[Plan]:
        starts = sorted(self.rng.uniform(0, span_s) for _ in range(sessions + singles))
        kinds = ["chat"] * sessions + ["single"] * singles
        self.rng.shuffle(kinds)
        plans = []
        for i, (s, kind) in enumerate(zip(starts, kinds, strict=True)):
            if kind == "chat":
                turns = self.rng.randint(3, 5)
                outs = tuple(self.rng.randint(*self.chat_out) for _ in range(turns))
                streams = tuple(k == turns - 1 for k in range(turns))
                plans.append(Plan(i, s, i % len(self.systems), outs, streams, True))
            else:
                plans.append(Plan(i, s, i % len(self.systems), (8,), (i % 2 == 0,), False))
        return plans

    def _cancel(self, share: float, after: tuple[int, int]) -> list[Plan]:
        """The plans with ``share`` of their requests cancelled after ``after`` (MIN, MAX)
        output tokens (streamed), drawn from a generator of their own."""
        rng = random.Random(f"{self.seed}-cancel")
        plans = []
        for p in self.plans:
            cancels = tuple(
                rng.randint(*after) if rng.random() < share else None for _ in p.outputs
            )
            streams = tuple(s or c is not None for s, c in zip(p.streams, cancels, strict=True))
            plans.append(dataclasses.replace(p, streams=streams, cancels=cancels))
        return plans

    def _parallel(self, share: float, n: int) -> list[Plan]:
        """The plans with ``share`` of the single shots asking for ``n`` parallel samples
        (not streamed, never cancelled), drawn from a generator of their own."""
        rng = random.Random(f"{self.seed}-parallel")
        plans = []
        for p in self.plans:
            if not p.chat and rng.random() < share:
                p = dataclasses.replace(
                    p, samples=(n,), streams=(False,), cancels=(None,) if p.cancels else ()
                )
            plans.append(p)
        return plans

    def _logprobs(self, share: float, start: int) -> list[Plan]:
        """The plans with ``share`` of the single shots (not asking for parallel samples)
        asking for their prompt's logprobs from ``start`` on, drawn from a generator of
        their own."""
        rng = random.Random(f"{self.seed}-logprobs")
        return [
            dataclasses.replace(p, logprob_start=start)
            if not p.chat and not p.samples and rng.random() < share
            else p
            for p in self.plans
        ]

    def _unbounded(self, share: float) -> list[Plan]:
        """The plans with ``share`` of the plain single shots (no parallel samples, no
        logprobs) sent without ``max_new_tokens``, drawn from a generator of their own."""
        rng = random.Random(f"{self.seed}-unbounded")
        return [
            dataclasses.replace(p, unbounded=True)
            if not p.chat and not p.samples and p.logprob_start is None and rng.random() < share
            else p
            for p in self.plans
        ]

    @property
    def n_requests(self) -> int:
        """Requests sent (a parallel-sampling one counts once)."""
        return sum(len(p.outputs) for p in self.plans)

    def send(
        self,
        client: Any,
        ids: list[int],
        n_out: int,
        stream: bool,
        ignore_eos: bool,
        cancel: int | None = None,
        samples: int = 1,
        routing_key: str | None = None,
        namespace: dict[str, Any] | None = None,
        unbounded: bool = False,
    ) -> list:
        """One request; ``cancel``: hang up once that many output tokens came (streamed);
        ``samples`` > 1: that many parallel samples (not streamed; the first one's
        output is returned, every sample is kept in ``sent``)."""
        params: dict[str, Any] = {
            "max_new_tokens": n_out,
            "temperature": 0 if samples == 1 else PARALLEL_TEMPERATURE,
            "ignore_eos": ignore_eos,
        }
        if unbounded:  # no limit, as the OpenAI layer forwards an unset max_tokens
            params = {"max_new_tokens": None, "temperature": PARALLEL_TEMPERATURE}
        if samples > 1:
            params["n"] = samples
        body = {
            "input_ids": ids,
            "sampling_params": params,
            "stream": stream,
        }
        if routing_key is not None:
            body["routing_key"] = routing_key
        body.update(namespace or {})
        out: list[int] = []
        if stream:
            with client.stream("POST", self.url + "/generate", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        d = json.loads(line[5:])
                        ids_now = d.get("output_ids") or []
                        # cumulative or incremental chunks: keep the longest consistent view
                        if ids_now[: len(out)] == out:
                            out = list(ids_now)
                        else:
                            out += ids_now
                        if cancel is not None and len(out) >= cancel:
                            break  # leaving the block closes the connection: SGLang aborts
        else:
            r = client.post(self.url + "/generate", json=body)
            r.raise_for_status()
            got = r.json()
            if samples > 1:  # one result per sample
                with self.lock:
                    for k, one in enumerate(got):
                        self.sent.append(
                            {
                                "input_ids": ids,
                                "output_ids": one["output_ids"],
                                "stream": False,
                                "cancel": None,
                                "sample": k,
                                "samples": samples,
                            }  # fmt: skip
                        )
                return list(got[0]["output_ids"])
            out = got["output_ids"]
        with self.lock:
            self.sent.append(
                {"input_ids": ids, "output_ids": out, "stream": stream, "cancel": cancel}
            )
        return out

    def prompts(self, plan: Plan) -> tuple[list[int], list[list[int]]]:
        """``plan``'s first prompt and, per later turn, the tokens appended after the
        previous output (3 template tokens + a ``turn_in``-token user turn): turn k+1's prompt is
        turn k's prompt + its output + ``appended[k]``. From the client's own generator, so
        a capture's prompts can be told apart by seed alone."""
        rng = random.Random(f"{self.seed}-{plan.index}")
        own = self.turn_in + 8 if plan.chat else self.single_in
        first = self.systems[plan.system] + self._toks(rng, own)
        appended = [self._toks(rng, 3) + self._toks(rng, self.turn_in) for _ in plan.outputs[1:]]
        return first, appended

    def namespace(self, i: int) -> dict[str, str]:
        """Client ``i``'s cache namespace fields (``cache_salts``, ``extra_keys``)."""
        out = {}
        if self.cache_salts and i % self.cache_salts:
            out["cache_salt"] = f"tenant-{i % self.cache_salts}"
        if self.extra_keys and i % self.extra_keys:
            out["extra_key"] = f"app-{i % self.extra_keys}"
        return out

    def fields(self, i: int) -> dict[str, Any]:
        """Client ``i``'s request fields besides the prompt: its namespace and its
        ``priority`` (``priorities``; none where its entry is None)."""
        out: dict[str, Any] = dict(self.namespace(i))
        if self.priorities and self.priorities[i % len(self.priorities)] is not None:
            out["priority"] = self.priorities[i % len(self.priorities)]
        return out

    def _client(self, plan: Plan, t0: float) -> None:
        import httpx

        ids, appended = self.prompts(plan)
        key = f"key-{plan.index % self.routing_keys}" if self.routing_keys else None
        ns = self.fields(plan.index)
        if plan.logprob_start is not None:  # a scoring request: its prompt's logprobs
            ns = {**ns, "return_logprob": True, "logprob_start_len": plan.logprob_start}
        time.sleep(max(0.0, t0 + plan.start_s - time.monotonic()))
        try:
            with httpx.Client(timeout=self.timeout_s) as c:
                cancels = plan.cancels or (None,) * len(plan.outputs)
                samples = plan.samples or (1,) * len(plan.outputs)
                for k, (n_out, stream, cancel, n) in enumerate(
                    zip(plan.outputs, plan.streams, cancels, samples, strict=True)
                ):
                    # a chat's 2nd and 4th turns may stop at EOS, nothing else
                    ignore = not self.eos_everywhere and (not plan.chat or k % 2 == 0)
                    out = self.send(
                        c,
                        ids,
                        n_out,
                        stream,
                        ignore,
                        cancel,
                        samples=n,
                        routing_key=key,
                        namespace=ns,
                        unbounded=plan.unbounded,
                    )
                    if k < len(appended):
                        time.sleep(0.02)
                        ids = ids + out + appended[k]
        except Exception as exc:  # noqa: BLE001 - reported through ``errors``
            with self.lock:
                self.errors.append(repr(exc))

    def _operator(self, t0: float) -> None:
        """``POST /flush_cache`` at each ``flush_at`` point, again every ``FLUSH_RETRY_S``
        while the worker refuses (busy), for at most ``FLUSH_GIVE_UP_S``."""
        import httpx

        with httpx.Client(timeout=30.0) as c:
            for at in self.flush_at:
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                tries, status, deadline = 0, None, time.monotonic() + FLUSH_GIVE_UP_S
                while True:
                    tries += 1
                    try:
                        status = c.post(self.url + "/flush_cache").status_code
                    except httpx.HTTPError:
                        status = None
                    if status == 200 or time.monotonic() > deadline:
                        break
                    time.sleep(FLUSH_RETRY_S)
                done = round(time.monotonic() - t0, 3)
                with self.lock:
                    self.flushes.append(
                        {
                            "at_s": at,
                            "ok": status == 200,
                            "tries": tries,
                            "done_s": done,
                            "status": status,
                        }
                    )

    def run(self) -> None:
        """Each client (and the flush operator) in a daemon thread: an interrupt ends the run."""
        t0, thread = time.monotonic(), functools.partial(threading.Thread, daemon=True)
        threads = [thread(target=self._client, args=(p, t0)) for p in self.plans]
        if self.flush_at:
            threads.append(thread(target=self._operator, args=(t0,)))
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvcadence.testing.httpclients",
        description="Run the plain HTTP clients against a worker; with --out, capture the "
        "run (KV events + the worker's --export-metrics-to-file records) meanwhile.",
    )
    ap.add_argument("--server", required=True, help="worker URL")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--sessions", type=int, default=8, help="multi-turn chats (3-5 turns)")
    ap.add_argument("--singles", type=int, default=24, help="single-shot requests")
    ap.add_argument("--span-s", type=float, default=12.0, help="client starts spread over")
    ap.add_argument(
        "--chat-out",
        type=_out_range,
        default=(4, 20),
        metavar="MIN-MAX",
        help="a chat turn's max_new_tokens, uniform in [MIN, MAX] (default 4-20)",
    )
    ap.add_argument(
        "--systems",
        type=_lengths,
        default=SYSTEM_LENGTHS,
        metavar="N,N,...",
        help="the shared system prompts' lengths in tokens; client i uses the "
        "(i %% count)-th (default 96,160,224)",
    )
    ap.add_argument(
        "--single-in",
        type=positive_int,
        default=20,
        metavar="N",
        help="a single shot's own tokens after its system prompt (default 20)",
    )
    ap.add_argument(
        "--turn-in",
        type=positive_int,
        default=16,
        metavar="N",
        help="a chat's user turn in tokens: each later prompt appends 3 template tokens + N, "
        "the first is the system prompt + N + 8 (default 16)",
    )
    ap.add_argument(
        "--cancel-share",
        type=_share,
        default=0.0,
        metavar="F",
        help="share of the requests (0-1) that stream and hang up early, as a user stopping "
        "a generation: SGLang aborts them; a chat goes on with the partial answer (default 0)",
    )
    ap.add_argument(
        "--cancel-after",
        type=_out_range,
        default=(1, 4),
        metavar="MIN-MAX",
        help="a cancelled request's client hangs up after MIN-MAX output tokens (default 1-4)",
    )
    ap.add_argument(
        "--flush-at",
        type=nonneg_float,
        action="append",
        default=[],
        metavar="S",
        help="an operator's POST /flush_cache S seconds into the run, repeated every "
        f"{FLUSH_RETRY_S} s while the busy worker refuses it (repeatable)",
    )
    ap.add_argument(
        "--parallel-share",
        type=_share,
        default=0.0,
        metavar="F",
        help="share of the single shots (0-1) that ask for --parallel-n parallel samples of "
        f'one prompt ("n"; temperature {PARALLEL_TEMPERATURE}, not streamed) (default 0)',
    )
    ap.add_argument(
        "--parallel-n",
        type=positive_int,
        default=3,
        metavar="N",
        help="parallel samples a --parallel-share request asks for (default 3)",
    )
    ap.add_argument("--logprob-share", type=_share, default=0.0, metavar="F",
                    help="share of the single shots (0-1) that ask for their prompt's logprobs "
                    "from --logprob-start on (a scoring request) (default 0)")  # fmt: skip
    ap.add_argument("--logprob-start", type=int, default=0, metavar="K",
                    help='the "logprob_start_len" a --logprob-share request sends (default 0)')  # fmt: skip
    ap.add_argument("--unbounded-share", type=_share, default=0.0, metavar="F",
                    help='share of the single shots (0-1) sent with "max_new_tokens": null (to '
                    "EOS, sampled, or the worker's context limit) (default 0)")  # fmt: skip
    ap.add_argument("--routing-keys", type=positive_int, metavar="N",
                    help='client i sends "routing_key": "key-<i %% N>" (default: none)')  # fmt: skip
    ap.add_argument("--cache-salts", type=positive_int, metavar="N",
                    help='client i sends "cache_salt": "tenant-<i %% N>", none where i %% N '
                    "is 0 (default: none)")  # fmt: skip
    ap.add_argument("--extra-keys", type=positive_int, metavar="N",
                    help='client i sends "extra_key": "app-<i %% N>", none where i %% N is 0 '
                    "(default: none)")  # fmt: skip
    ap.add_argument("--priorities", type=_priorities, metavar="P,P,...",
                    help='client i sends "priority": P[i %% len] (an int; "none": no '
                    "priority), for a worker with --enable-priority-scheduling (default: none)")  # fmt: skip
    ap.add_argument("--no-ignore-eos", action="store_true", dest="eos_everywhere",
                    help="send every request without ignore_eos (default: only a chat's 2nd and "
                    "4th turns)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="capture bundle directory to create")
    ap.add_argument("--sglang-metrics", help="the worker's metrics dir (with --out)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds before stopping")
    ap.add_argument("--sent", type=Path, help="write what the clients sent/got (JSON lines)")
    a = ap.parse_args(argv)
    if a.out is not None and not a.sglang_metrics:
        ap.error("--out needs --sglang-metrics (the worker's --export-metrics-to-file-dir)")
    try:  # SIGTERM (``kill``, ``pkill``) as Ctrl-C: ``_run``'s ``finally`` stops the capture
        return term_as_interrupt(_run)(a)
    except KvcadenceError as exc:  # one line, as every kvcadence command
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        kept = f"; the capture was stopped and {a.out} kept" if a.out else ""
        print(f"{ap.prog}: interrupted{kept}", file=sys.stderr)
        return 130


def _out_range(text: str) -> tuple[int, int]:
    """``MIN-MAX`` (``--chat-out``): two output lengths, 1 <= MIN <= MAX."""
    lo, sep, hi = text.partition("-")
    if not (sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(lo), int(hi)


def _lengths(text: str) -> tuple[int, ...]:
    """``N,N,...`` (``--systems``): one or more system prompt lengths, each >= 1."""
    parts = text.split(",")
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected lengths N,N,... each >= 1, got {text!r}")
    return tuple(int(p) for p in parts)


def _priorities(text: str) -> tuple[int | None, ...]:
    """``P,P,...`` (``--priorities``): request priorities, each an int or ``none``."""
    out: list[int | None] = []
    for part in text.split(","):
        p = part.strip()
        if p == "none":
            out.append(None)
            continue
        try:
            out.append(int(p))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected priorities P,P,... (ints or none), got {text!r}"
            ) from None
    return tuple(out)


def _share(text: str) -> float:
    """``F`` (``--cancel-share``): a share in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return value


def _run(a: argparse.Namespace) -> int:
    clients = Clients(
        a.server,
        a.seed,
        a.sessions,
        a.singles,
        a.span_s,
        chat_out=a.chat_out,
        systems=a.systems,
        single_in=a.single_in,
        turn_in=a.turn_in,
        cancel_share=a.cancel_share,
        cancel_after=a.cancel_after,
        flush_at=tuple(a.flush_at),
        parallel_share=a.parallel_share,
        parallel_n=a.parallel_n,
        logprob_share=a.logprob_share,
        logprob_start=a.logprob_start,
        unbounded_share=a.unbounded_share,
        routing_keys=a.routing_keys or 0,
        cache_salts=a.cache_salts or 0,
        extra_keys=a.extra_keys or 0,
        priorities=a.priorities or (),
        eos_everywhere=a.eos_everywhere,
    )
    print(f"{clients.n_requests} requests from {len(clients.plans)} clients", file=sys.stderr)
    proc = start_capture(a.server, a.sglang_metrics, a.out) if a.out else None
    t0 = time.monotonic()
    try:
        clients.run()
    finally:
        summary = stop_capture(proc, a.out, a.settle) if proc and a.out else ""
    print(f"clients done in {time.monotonic() - t0:.1f} s, {len(clients.errors)} errors")
    for f in clients.flushes:
        print(
            f"flush at {f['at_s']} s: {'done' if f['ok'] else 'refused'} at {f['done_s']} s "
            f"after {f['tries']} tries (HTTP {f['status']})"
        )
    print(summary)
    if a.sent:
        with open(a.sent, "w") as fh:
            for s in clients.sent:
                fh.write(json.dumps(s) + "\n")
    for e in clients.errors:
        print(e, file=sys.stderr)
    return 1 if clients.errors or not all(f["ok"] for f in clients.flushes) else 0


if __name__ == "__main__":
    sys.exit(main())
