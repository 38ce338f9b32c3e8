"""``python -m kvcadence.testing.httpclients`` (the plain HTTP clients' recording entry
point) on bad input: one line, an exit code from the exception tree, no bundle."""

from __future__ import annotations

import socket
import time

import pytest

from kvcadence.testing.httpclients import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


def test_out_without_metrics_dir_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--server", "http://127.0.0.1:1", "--out", str(tmp_path / "b")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--out needs --sglang-metrics" in err[-1]
    assert not (tmp_path / "b").exists()


def test_unreachable_worker_is_one_line_not_a_traceback(tmp_path, capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    out = tmp_path / "b"
    rc = main(["--server", url, "--out", str(out), "--sglang-metrics", str(tmp_path / "m")])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m kvcadence.testing.httpclients: error: capture did not")
    assert "Traceback" not in "\n".join(err) and "cannot reach" in err[-1]


def test_chat_out_sets_the_chat_turns_output_lengths_only():
    """``--chat-out MIN-MAX`` draws each chat turn's ``max_new_tokens`` from ``[MIN, MAX]``;
    single shots keep their 8 tokens, and the default (4-20) keeps the plans a seed gave
    before the option existed (``http-clients-p16``'s truth is rebuilt from its seed)."""
    from kvcadence.testing.httpclients import Clients

    long = Clients("", 613, sessions=28, singles=86, span_s=90.0, chat_out=(32, 160))
    chats = [o for p in long.plans if p.chat for o in p.outputs]
    assert len(chats) > 50 and min(chats) >= 32 and max(chats) <= 160
    assert max(chats) - min(chats) > 64  # drawn over the range, not pinned to an end
    assert {p.outputs for p in long.plans if not p.chat} == {(8,)}
    short = [o for p in Clients("", 612, 32, 76, 60.0).plans if p.chat for o in p.outputs]
    assert min(short) >= 4 and max(short) <= 20
    assert (
        Clients("", 612, 32, 76, 60.0).plans
        == Clients("", 612, 32, 76, 60.0, chat_out=(4, 20)).plans
    )


def test_systems_sets_the_shared_system_prompts():
    """``--systems N,N,...`` sets the shared system prompts' lengths (longer prompts span
    several prefill chunks); every client's first prompt starts with its system prompt, the
    clients cycle over them, and the default keeps the plans and prompts a seed gave before
    the option existed."""
    from kvcadence.testing.httpclients import Clients

    c = Clients("", 618, 26, 90, 120.0, chat_out=(32, 128), systems=(160, 288, 416))
    assert [len(s) for s in c.systems] == [160, 288, 416]
    assert {p.system for p in c.plans} == {0, 1, 2}
    for plan in c.plans[:12]:
        first, _ = c.prompts(plan)
        assert first[: len(c.systems[plan.system])] == c.systems[plan.system]
        assert len(first) == len(c.systems[plan.system]) + (24 if plan.chat else 20)
    two = Clients("", 618, 4, 4, 10.0, systems=(40, 8))
    assert [len(s) for s in two.systems] == [40, 8] and {p.system for p in two.plans} == {0, 1}
    old, new = (
        Clients("", 612, 32, 76, 60.0),
        Clients("", 612, 32, 76, 60.0, systems=(96, 160, 224)),
    )
    assert old.plans == new.plans and old.systems == new.systems
    assert [len(s) for s in old.systems] == [96, 160, 224]


def test_single_in_and_turn_in_set_the_requests_own_tokens():
    """``--single-in N`` is a single shot's own tokens after its system prompt, ``--turn-in
    N`` a chat's user turn (a first prompt: system + N + 8; each later prompt: previous prompt
    + output + 3 template tokens + N), so prompts can outgrow a prefill chunk even when the
    system prompt is cached; the defaults (20, 16) keep the prompts a seed gave before."""
    from kvcadence.testing.httpclients import Clients

    c = Clients("", 618, 26, 90, 120.0, chat_out=(32, 128), single_in=240, turn_in=200)
    chats = singles = 0
    for plan in c.plans:
        first, appended = c.prompts(plan)
        own = len(first) - len(c.systems[plan.system])
        if plan.chat:
            chats += 1
            assert own == 208 and [len(a) for a in appended] == [203] * (len(plan.outputs) - 1)
        else:
            singles += 1
            assert own == 240 and appended == []
    assert (chats, singles) == (26, 90)
    old, new = (
        Clients("", 612, 32, 76, 60.0),
        Clients("", 612, 32, 76, 60.0, single_in=20, turn_in=16),
    )
    assert all(old.prompts(p) == new.prompts(p) for p in old.plans)
    first, appended = old.prompts(next(p for p in old.plans if p.chat))
    assert len(appended[0]) == 19


BAD_SHAPES = [
    *(("--chat-out", bad) for bad in ("160-32", "0-8", "32", "a-b")),
    *(("--systems", bad) for bad in ("", "160,,288", "0", "a,8", "-8")),
    *((flag, bad) for flag in ("--single-in", "--turn-in") for bad in ("0", "-3", "x")),
    *(("--priorities", bad) for bad in ("", "1,,2", "high", "1.5", "None")),
]


@pytest.mark.parametrize(("flag", "bad"), BAD_SHAPES)
def test_a_shape_option_with_a_bad_value_is_a_usage_error(flag, bad, capsys):
    """``--chat-out`` not a MIN-MAX range, ``--systems`` not positive lengths,
    ``--single-in`` / ``--turn-in`` not a positive count: exit 2, the option named."""
    with pytest.raises(SystemExit) as exc:
        main(["--server", "http://127.0.0.1:1", flag, bad])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cancel_share_marks_streamed_requests_that_hang_up_early():
    """``--cancel-share F`` makes a share of the requests stream and hang up after
    ``--cancel-after MIN-MAX`` tokens, drawn from a generator of their own: the seed's plans
    (starts, outputs, prompts) stay what they were, only ``streams`` and ``cancels`` move."""
    from kvcadence.testing.httpclients import Clients

    plain = Clients("", 700, 46, 120, 75.0)
    cut = Clients("", 700, 46, 120, 75.0, cancel_share=0.3, cancel_after=(2, 5))
    assert [p.cancels for p in plain.plans] == [()] * len(plain.plans)
    cancels = [c for p in cut.plans for c in p.cancels]
    assert len(cancels) == plain.n_requests
    chosen = [c for c in cancels if c is not None]
    assert 0.2 * len(cancels) < len(chosen) < 0.4 * len(cancels)
    assert min(chosen) >= 2 and max(chosen) <= 5
    for a, b in zip(plain.plans, cut.plans, strict=True):
        assert (a.start_s, a.outputs, a.system, a.chat) == (b.start_s, b.outputs, b.system, b.chat)
        assert plain.prompts(a) == cut.prompts(b)
        for s0, s1, c in zip(a.streams, b.streams, b.cancels, strict=True):
            assert s1 == (s0 or c is not None)  # a cancelled request streams


def test_parallel_share_asks_single_shots_for_several_samples():
    """``--parallel-share F`` makes a share of the single shots ask for ``--parallel-n``
    parallel samples (not streamed, not cancelled), drawn from a generator of their own:
    chats, starts, outputs and prompts stay the seed's."""
    from kvcadence.testing.httpclients import Clients

    plain = Clients("", 700, 46, 120, 75.0, cancel_share=0.3)
    par = Clients("", 700, 46, 120, 75.0, cancel_share=0.3, parallel_share=0.5, parallel_n=4)
    chosen = [p for p in par.plans if p.samples]
    singles = [p for p in par.plans if not p.chat]
    assert all(not p.chat and p.samples == (4,) for p in chosen)
    assert 0.35 * len(singles) < len(chosen) < 0.65 * len(singles)
    for a, b in zip(plain.plans, par.plans, strict=True):
        assert (a.start_s, a.outputs, a.system, a.chat) == (b.start_s, b.outputs, b.system, b.chat)
        assert plain.prompts(a) == par.prompts(b)
        if b.samples:
            assert b.streams == (False,) and b.cancels == (None,)
        else:
            assert (a.streams, a.cancels) == (b.streams, b.cancels)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--cancel-share", "1.5"),
        ("--cancel-share", "x"),
        ("--cancel-after", "0-3"),
        ("--parallel-share", "2"),
        ("--parallel-n", "0"),
        ("--routing-keys", "0"),
        ("--routing-keys", "x"),
        ("--cache-salts", "0"),
        ("--extra-keys", "-1"),
        ("--logprob-share", "1.5"),
        ("--logprob-start", "x"),
        ("--unbounded-share", "-0.1"),
    ],
)
def test_bad_cancel_options_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--server", "http://127.0.0.1:1", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["-1", "x", "nan"])
def test_bad_flush_at_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--server", "http://127.0.0.1:1", "--flush-at", value])
    assert exc.value.code == 2
    assert "--flush-at" in capsys.readouterr().err.strip().splitlines()[-1]


def test_flush_at_retries_a_busy_worker_until_it_flushes(monkeypatch):
    """``--flush-at S``: the operator's ``POST /flush_cache`` at ``S`` s is refused while the
    worker is busy (SGLang answers 400) and tried again until it is done; the outcome, with
    its tries, is kept. A real HTTP server on loopback plays the worker."""
    import http.server
    import threading

    import kvcadence.testing.httpclients as hc

    calls: list[float] = []

    class Worker(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            calls.append(time.monotonic())
            busy = self.path == "/flush_cache" and len(calls) < 3
            self.send_response(400 if busy else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(hc, "FLUSH_RETRY_S", 0.01)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        c = hc.Clients(url, 1, sessions=0, singles=0, flush_at=(0.2, 0.0))
        t0 = time.monotonic()
        c.run()
    finally:
        srv.shutdown()
        srv.server_close()
    assert [(f["at_s"], f["ok"], f["tries"], f["status"]) for f in c.flushes] == [
        (0.0, True, 3, 200),  # refused twice (busy), then flushed
        (0.2, True, 1, 200),
    ]
    assert len(calls) == 4 and calls[3] - t0 >= 0.2  # the second at its time, not before


def test_sigterm_stops_the_capture_child_and_exits_130(monkeypatch, tmp_path, capsys):
    """``pkill`` (SIGTERM) of the recorder mid-run is taken as Ctrl-C: its capture child is
    stopped the orderly way (SIGINT after the settle time) instead of being left running, the
    client threads are abandoned, and it exits 130 with one line naming the kept bundle."""
    import os
    import signal
    import subprocess
    import sys

    import kvcadence.testing.httpclients as hc

    # the capture child: exits 0 on SIGINT, as ``kvcadence capture`` does. It waits in short
    # sleeps, as the capture's poll loop does: a SIGINT that lands after Python's last
    # signal check and before a long sleep begins is handled only when that sleep ends
    # (a 60 s sleep here failed CI once: the child was still running, not yet asleep)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
            "print('ready', flush=True)\n"
            "for _ in range(600):\n"
            "    time.sleep(0.1)",
        ],
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    monkeypatch.setattr(hc, "start_capture", lambda url, metrics, out: child)

    def killed(self: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setattr(hc.Clients, "run", killed)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "b"
    t0 = time.monotonic()
    try:
        argv = ["--server", "http://127.0.0.1:1", "--singles", "1", "--sessions", "0"]
        rc = main([*argv, "--out", str(out), "--sglang-metrics", str(tmp_path), "--settle", "0"])
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
    assert rc == 130 and time.monotonic() - t0 < 4
    assert child.wait(5) == 0  # stopped by its SIGINT, not killed above
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err.strip().splitlines()
    prog = "python -m kvcadence.testing.httpclients"
    assert err[-1] == f"{prog}: interrupted; the capture was stopped and {out} kept"


def test_routing_keys_and_namespaces_tag_each_clients_requests():
    """(And ``--logprob-share F --logprob-start K``: scoring requests, and
    ``--unbounded-share F``: requests without an output limit, below.)
    ``--routing-keys N``: client ``i`` sends every request with ``"routing_key":
    "key-<i % N>"`` (what a router sets for ``--schedule-policy routing-key``); without it
    no request has one. ``--cache-salts N`` / ``--extra-keys M``: ``"cache_salt":
    "tenant-<i % N>"`` / ``"extra_key": "app-<i % M>"``, none where the remainder is 0. A
    real HTTP server on loopback plays the worker (streamed and plain answers)."""
    import http.server
    import json
    import threading

    import kvcadence.testing.httpclients as hc

    bodies: list[dict] = []

    class Worker(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            ans = {"output_ids": [5] * (body["sampling_params"].get("max_new_tokens") or 3)}
            data = (
                f"data: {json.dumps(ans)}\n\ndata: [DONE]\n\n"
                if body["stream"]
                else json.dumps(ans)
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        keyed = hc.Clients(url, 3, sessions=2, singles=3, span_s=0.1, routing_keys=2)
        keyed.run()
        n_keyed = len(bodies)
        hc.Clients(url, 3, sessions=1, singles=1, span_s=0.1).run()
        n_plain = len(bodies)
        spaced = hc.Clients(url, 4, sessions=2, singles=10, span_s=0.1, cache_salts=2, extra_keys=3)
        spaced.run()
        n_spaced = len(bodies)
        ranked = hc.Clients(url, 5, sessions=2, singles=6, span_s=0.1, priorities=(None, 0, 30))
        ranked.run()
        n_ranked = len(bodies)
        eos = hc.Clients(url, 6, sessions=2, singles=4, span_s=0.1, eos_everywhere=True)
        eos.run()
        n_eos = len(bodies)
        scoring = hc.Clients(
            url, 7, sessions=2, singles=12, span_s=0.1, logprob_share=0.5, logprob_start=3
        )
        scoring.run()
        n_scoring = len(bodies)
        open_ended = hc.Clients(url, 8, sessions=2, singles=12, span_s=0.1, unbounded_share=0.5)
        open_ended.run()
    finally:
        srv.shutdown()
        srv.server_close()
    assert not keyed.errors and n_keyed == keyed.n_requests
    want = {
        tuple(keyed.prompts(p)[0]): f"key-{p.index % 2}" for p in keyed.plans
    }  # each client's first prompt
    got = {tuple(b["input_ids"]): b["routing_key"] for b in bodies[:n_keyed]}
    assert all(got[k] == v for k, v in want.items())
    assert {b["routing_key"] for b in bodies[:n_keyed]} == {"key-0", "key-1"}
    assert all("routing_key" not in b for b in bodies[n_keyed:])
    assert all("cache_salt" not in b and "extra_key" not in b for b in bodies[:n_plain])
    assert not spaced.errors and n_spaced - n_plain == spaced.n_requests
    assert all("priority" not in b for b in bodies[:n_spaced])
    firsts = {tuple(spaced.prompts(p)[0]): p.index for p in spaced.plans}
    for b in bodies[n_plain:n_spaced]:
        i = firsts.get(tuple(b["input_ids"]))
        if i is not None:  # a client's first request
            assert b.get("cache_salt") == (f"tenant-{i % 2}" if i % 2 else None)
            assert b.get("extra_key") == (f"app-{i % 3}" if i % 3 else None)
    spaces = {(b.get("extra_key"), b.get("cache_salt")) for b in bodies[n_plain:n_spaced]}
    assert len(spaces) == 6 and (None, None) in spaces
    # --priorities: client i sends priorities[i % 3], none where that is None
    assert not ranked.errors and n_ranked - n_spaced == ranked.n_requests
    firsts = {tuple(ranked.prompts(p)[0]): p.index for p in ranked.plans}
    seen = set()
    for b in bodies[n_spaced:n_ranked]:
        i = firsts.get(tuple(b["input_ids"]))
        if i is not None:
            assert b.get("priority") == (None, 0, 30)[i % 3]
            seen.add(b.get("priority"))
    assert seen == {None, 0, 30}
    # single shots and a chat's odd turns are sent with ignore_eos, unless --no-ignore-eos
    assert any(b["sampling_params"]["ignore_eos"] for b in bodies[n_spaced:n_ranked])
    assert not eos.errors and n_eos - n_ranked == eos.n_requests
    assert not any(b["sampling_params"]["ignore_eos"] for b in bodies[n_ranked:n_eos])
    assert all("return_logprob" not in b for b in bodies[:n_eos])
    # --logprob-share: those single shots ask for their prompt's logprobs from K on
    assert not scoring.errors and n_scoring - n_eos == scoring.n_requests
    scored = {tuple(scoring.prompts(p)[0]) for p in scoring.plans if p.logprob_start is not None}
    assert scored and all(not p.chat for p in scoring.plans if p.logprob_start is not None)
    for b in bodies[n_eos:n_scoring]:
        asked = tuple(b["input_ids"]) in scored
        assert (b.get("return_logprob"), b.get("logprob_start_len")) == (
            (True, 3) if asked else (None, None)
        )
    # --unbounded-share: those single shots are sent with no output limit (sampled)
    assert not open_ended.errors and len(bodies) - n_scoring == open_ended.n_requests
    free = {tuple(open_ended.prompts(p)[0]) for p in open_ended.plans if p.unbounded}
    assert free and all(not p.chat for p in open_ended.plans if p.unbounded)
    for b in bodies[n_scoring:]:
        unbounded = tuple(b["input_ids"]) in free
        assert (b["sampling_params"]["max_new_tokens"] is None) == unbounded
        if unbounded:
            assert b["sampling_params"] == {"max_new_tokens": None, "temperature": 1.0}
