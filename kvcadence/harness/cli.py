"""Command ``harness``: ``kvcadence harness setup|start|stop|status`` manages the real-SGLang
CPU worker (``start --dp-size N`` for data-parallel ranks, ``--env KEY=VALUE`` for its
environment, ``--ready-timeout SECONDS`` for how long to wait for it to come up).

Only the standard library (and the stdlib-only ``kvcadence.argtypes`` / ``errors``) is
imported here; ``kvcadence.harness.worker`` is imported by the run function.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from kvcadence.argtypes import positive_float
from kvcadence.errors import UsageError

#: ``kvcadence.harness.worker.DEFAULT_READY_TIMEOUT_S`` (repeated so ``--help`` imports nothing
#: of the worker module; a test keeps them equal)
DEFAULT_READY_TIMEOUT_S = 600.0


def register(sub: Any) -> None:
    _register_harness(sub)


def _register_harness(sub: Any) -> None:
    p = sub.add_parser(
        "harness",
        help="set up / start / stop a real SGLang 0.5.23 CPU worker (tests, demos)",
        description=(
            "The real-SGLang CPU harness: a cached venv (~/.cache/kvcadence, or "
            "$KVCADENCE_SGLANG_VENV), a tiny random Llama, one loopback worker with KV "
            "events + replay, stopped by PID."
        ),
        epilog="examples:\n"
        "  kvcadence harness setup\n"
        "  kvcadence harness start --page-size 1 --max-total-tokens 2000\n"
        "  kvcadence harness status\n"
        "  kvcadence harness stop\n",
    )
    acts = p.add_subparsers(title="actions", metavar="ACTION", dest="harness_action")
    s = acts.add_parser(
        "setup",
        help="build the venv and the model (idempotent)",
        description="Build the cached venv with SGLang 0.5.23 (needs network, once) and the tiny "
        "random-weight Llama; prints their paths as JSON.",
        epilog="examples:\n  kvcadence harness setup\n  kvcadence harness setup --force\n",
    )
    s.add_argument("--force", action="store_true", help="rebuild the venv")
    s.set_defaults(_run=run_harness)
    st = acts.add_parser(
        "start",
        help="start a detached worker; prints its JSON description",
        description="Start one detached SGLang worker on loopback with KV events on; prints its "
        "URL, PID and event/replay endpoints as JSON (also kept for 'harness stop').",
        epilog="examples:\n"
        "  kvcadence harness start --page-size 1 --max-total-tokens 2000\n"
        "  kvcadence harness start --dp-size 2 --chunked-prefill-size 512\n"
        "  kvcadence harness start --dp-size 2 --ready-timeout 1200   # a loaded box\n",
    )
    st.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="SGLang --page-size, tokens per KV page (default 1)",
    )
    st.add_argument(
        "--max-total-tokens",
        type=int,
        default=20000,
        help="SGLang --max-total-tokens, the KV pool size in tokens (default 20000)",
    )
    st.add_argument(
        "--chunked-prefill-size",
        type=int,
        help="SGLang --chunked-prefill-size (default: SGLang's own)",
    )
    st.add_argument("--workdir", default=None, help="log + metrics dir (default: a cache dir)")
    st.add_argument(
        "--no-replay",
        action="store_true",
        help="no replay_endpoint in --kv-events-config (missed messages cannot be recovered)",
    )
    st.add_argument(
        "--buffer-steps",
        type=int,
        default=None,
        metavar="N",
        help="the publisher's replay ring (--kv-events-config buffer_steps; SGLang's default "
        "10000 messages): a small ring makes a capture attached mid-run miss the history",
    )
    st.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel ranks (--dp-size N): rank r publishes on events_port + r and "
        "replays on replay_port + r; SGLANG_CPU_OMP_THREADS_BIND is set to split this "
        "box's CPUs between the ranks unless given (default 1)",
    )
    st.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for the worker (repeatable)",
    )
    st.add_argument(
        "--extra-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="more SGLang server arguments, split like a shell line (repeatable; write it "
        "with '=' since it starts with '--'), e.g. --extra-arg=--disable-overlap-schedule "
        "--extra-arg='--schedule-policy lpm'; arguments the harness sets itself (ports, "
        "model, page size, pool, chunking, DP size, KV events, metrics dir) are refused",
    )
    st.add_argument(
        "--ready-timeout",
        type=positive_float,
        default=DEFAULT_READY_TIMEOUT_S,
        metavar="SECONDS",
        help="how long to wait for the worker's /health before giving up (default "
        f"{DEFAULT_READY_TIMEOUT_S:g}; importing SGLang on a loaded CPU box can take minutes); "
        "on a timeout, an early exit or Ctrl-C/SIGTERM the worker's whole process tree is "
        "stopped",
    )
    st.add_argument(
        "--trace-evictions",
        default=None,
        metavar="FILE",
        help="the worker appends a JSON line to FILE (a new file) for every radix-tree "
        "eviction: cause (prefill, decode, check_decode, retract), tokens asked for, available "
        "before and after, tokens freed, the batch's rids (docs/simulator.md, \"Eviction "
        "traces\"; `kvcadence replay --trace-evictions` writes the simulator's)",
    )
    st.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a tokenizer directory for the worker (--tokenizer-path DIR instead of "
        "--skip-tokenizer-init): it then takes text prompts and serves /v1/chat/completions "
        "with the tokenizer's chat template, as a production worker does (the tiny model has "
        "no tokenizer of its own: docs/production.md shows a word-level one of its 1024 ids)",
    )
    st.add_argument(
        "--no-enable-metrics",
        action="store_true",
        help="do not pass --enable-metrics (no request_received_ts etc. in meta_info; how "
        "the bundles in examples/ were recorded)",
    )
    st.set_defaults(_run=run_harness)
    sp = acts.add_parser(
        "stop",
        help="stop the worker started by 'harness start' (by PID)",
        description="Stop the worker 'harness start' recorded, by its PID, with its whole "
        "process tree (SIGTERM, then SIGKILL after a grace period); prints what was done.",
        epilog="examples:\n  kvcadence harness stop\n",
    )
    sp.set_defaults(_run=run_harness)
    ss = acts.add_parser(
        "status",
        help="venv / model / worker state as JSON",
        description="Print whether the venv and the model exist and whether a worker is alive.",
        epilog="examples:\n  kvcadence harness status\n",
    )
    ss.set_defaults(_run=run_harness)
    p.set_defaults(_run=lambda a: (p.print_help(), 2)[1])


def run_harness(args: argparse.Namespace) -> int:
    from kvcadence.harness import worker as harness

    act = args.harness_action
    if act == "setup":
        venv = harness.ensure_venv(force=args.force)
        model = harness.ensure_model()
        print(json.dumps({"venv": str(venv), "model": str(model)}))
        return 0
    if act == "status":
        print(json.dumps(harness.status(), indent=2))
        return 0
    if act == "start":
        st = harness.status().get("server")
        if isinstance(st, dict) and st.get("alive"):
            raise UsageError(f"a harness worker is already running (pid {st['pid']}); stop it")
        workdir = Path(args.workdir) if args.workdir else harness.cache_dir() / "harness-run"
        if args.dp_size < 1:
            raise UsageError("--dp-size must be >= 1")
        if args.buffer_steps is not None and args.buffer_steps < 1:
            raise UsageError("--buffer-steps must be >= 1")
        if args.trace_evictions and Path(args.trace_evictions).exists():
            raise UsageError(f"--trace-evictions {args.trace_evictions}: exists (not appended to)")
        cfg = harness.ServerConfig(
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            replay=not args.no_replay,
            buffer_steps=args.buffer_steps,
            dp_size=args.dp_size,
            enable_metrics=not args.no_enable_metrics,
            env=_env_pairs(args.env),
            extra_args=_extra_args(args.extra_arg),
            trace_evictions=args.trace_evictions,
            tokenizer=_tokenizer_dir(args.tokenizer),
        )
        h = harness.start_server(
            cfg, workdir, ready_timeout=args.ready_timeout, detach=True, quiet=False
        )
        d = h.to_json()
        d["url"] = h.url
        d["events_endpoints"] = h.events_endpoints
        d["replay_endpoints"] = h.replay_endpoints
        d["tokenizer"] = cfg.tokenizer  # a capture scrubs it from its header
        harness.state_path().write_text(json.dumps(d))
        print(json.dumps(d))
        return 0
    if act == "stop":
        sp = harness.state_path()
        if not sp.is_file():
            print("harness: no worker recorded", file=sys.stderr)
            return 0
        st = json.loads(sp.read_text())
        rc = harness.stop_pid(int(st["pid"]))
        sp.unlink()
        print(json.dumps({"pid": st["pid"], "stopped": rc is not None, "rc": rc}))
        return 0
    raise UsageError("harness needs an action: setup | start | stop | status")


# set by the harness itself (build_command) or by a dedicated ``harness start`` flag
_HARNESS_OWNED = (
    "--model-path",
    "--host",
    "--port",
    "--page-size",
    "--max-total-tokens",
    "--chunked-prefill-size",
    "--dp-size",
    "--kv-events-config",
    "--export-metrics-to-file-dir",
    "--tokenizer-path",
    "--skip-tokenizer-init",
)


def _extra_args(items: list[str]) -> list[str]:
    """``--extra-arg ARGS`` options -> the SGLang argument list (each split like a shell
    line); UsageError for an argument the harness owns or an unbalanced quote."""
    out: list[str] = []
    for item in items:
        try:
            parts = shlex.split(item)
        except ValueError as exc:
            raise UsageError(f"--extra-arg {item!r}: {exc}") from exc
        for part in parts:
            name = part.split("=", 1)[0]
            if name in _HARNESS_OWNED:
                raise UsageError(
                    f"--extra-arg {item!r}: {name} is set by the harness "
                    "(use the harness start flag)"
                )
        out += parts
    return out


def _tokenizer_dir(path: str | None) -> str | None:
    """``--tokenizer DIR`` -> its absolute path (the worker runs in its own directory);
    UsageError where DIR holds no ``tokenizer_config.json``."""
    if path is None:
        return None
    d = Path(path).resolve()
    if not (d / "tokenizer_config.json").is_file():
        raise UsageError(f"--tokenizer {path}: no tokenizer_config.json there")
    return str(d)


def _env_pairs(items: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` options -> a dict (UsageError for a malformed one)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE (KEY a variable name)")
        out[key] = value
    return out
