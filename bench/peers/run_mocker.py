#!/usr/bin/env python3
"""Referee Dynamo's mocker against a real SGLang capture: one reproducible peer run.

    python bench/peers/run_mocker.py [--input FIXTURE_DIR_OR_BUNDLE] [--out DIR]
                                     [--update-doc docs/peers.md] [--save-recording DIR]

Steps (each step's output and log land in ``--out``, default ``out/peers-mocker/``):

1. the mocker's own venv (default ``~/.cache/kvcadence/dynamo-1.6.1-venv``, Python 3.11):
   ``pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1`` plus their runtime
   dependencies (``aisimulate``, a placeholder on the package index, is not needed for the
   default timing model). Built once; ``.kvcadence-complete`` marks a finished build.
2. the real bundle: ``--input`` is a bundle, or a directory in the fixture layout
   (``events.jsonl``, ``requests.jsonl``, ``server_info.json``) imported with
   ``kvcadence import`` (default: the repository's ``sglang-0.5.23-agent-ps1`` fixture);
3. kvcadence's replay of it (``kvcadence replay``);
4. the mocker on loopback (``DYN_*_HOST=127.0.0.1``, ``--discovery-backend file``,
   ``--engine-type sglang``, the capture's page size and pool, outputs replayed from a
   response-replay trace written from the bundle's ``output_ids``), its KV events recorded
   live with ``kvcadence capture --endpoint ... --replay-endpoint ...``, the bundle's schedule
   driven into it by ``mocker_client.py`` (same prompts, one closed loop per lane with the
   recorded start offsets and pauses), the requests appended with ``kvcadence import
   --append``;
5. ``kvcadence report real sim mocker`` (three-way), and the peers table
   (``peers-table.md``) built from its ``report.json``; ``--update-doc`` rewrites the table
   between the ``peers-table`` markers of a document.

``--save-recording DIR`` also writes the mocker's stream as ``frames.jsonl`` +
``requests.jsonl`` (the fixture's import form, request token ids left out: they are the real
bundle's) for the committed test recording. Every process started here is stopped by its
PID; only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_INPUT = REPO / "tests" / "data" / "fixtures" / "sglang-0.5.23-agent-ps1"
DYNAMO_VERSION = "1.6.1"
DEFAULT_VENV = Path.home() / ".cache" / "kvcadence" / f"dynamo-{DYNAMO_VERSION}-venv"
RUNTIME_DEPS = [
    "pydantic<=2.13.5",
    "uvloop",
    "aiohttp",
    "msgspec",
    "pyzmq",
    "prometheus-client",
    "tqdm",
    "typing-extensions",
    "zstandard",
    "redis",
    "certifi",
    "pyyaml",
    "packaging",
    "msgpack",
]
LOOPBACK_ENV = (
    "DYN_TCP_RPC_HOST",
    "DYN_EVENT_PLANE_HOST",
    "DYN_TCP_RESPONSE_STREAM_HOST",
    "DYN_SYSTEM_HOST",
)
TABLE_START = "<!-- peers-table:start -->"
TABLE_END = "<!-- peers-table:end -->"


def say(msg: str) -> None:
    print(f"run_mocker: {msg}", file=sys.stderr, flush=True)


def kvcadence(*args: str, log: Path, ok: tuple[int, ...] = (0,)) -> int:
    """Run ``python -m kvcadence ARGS`` with this interpreter, output to ``log``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "w") as fh:
        rc = subprocess.call(
            [sys.executable, "-m", "kvcadence", *args], stdout=fh, stderr=subprocess.STDOUT, env=env
        )
    if rc not in ok:
        raise SystemExit(f"kvcadence {args[0]} failed (exit {rc}); see {log}")
    return rc


# ------------------------------------------------------------------ 1. the mocker's venv


def ensure_venv(venv: Path, python: str | None) -> Path:
    py = venv / "bin" / "python"
    if (venv / ".kvcadence-complete").exists():
        return py
    exe = python or shutil.which("python3.11")
    if exe is None:
        raise SystemExit(
            "no python3.11 found (Dynamo's wheels need 3.10-3.13); give --python or "
            "install python3.11"
        )
    say(f"building the mocker venv {venv} with {exe} (a 75 MB wheel; once)")
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.check_call([exe, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.check_call(
        [*pip, "--no-deps", f"ai-dynamo=={DYNAMO_VERSION}", f"ai-dynamo-runtime=={DYNAMO_VERSION}"]
    )
    subprocess.check_call([*pip, *RUNTIME_DEPS])
    subprocess.check_call([str(py), "-c", "import dynamo.mocker.args, dynamo.runtime"])
    (venv / ".kvcadence-complete").write_text(DYNAMO_VERSION + "\n")
    return py


# ------------------------------------------------------------------ 2. the schedule


def real_bundle(inp: Path, out: Path) -> Path:
    if (inp / "events.jsonl").exists():
        dst = out / "real.kvcb"
        shutil.rmtree(dst, ignore_errors=True)
        args = ["import", "--frames", str(inp / "events.jsonl")]
        args += ["--requests", str(inp / "requests.jsonl")]
        if (inp / "server_info.json").exists():
            args += ["--server-info", str(inp / "server_info.json")]
        kvcadence(*args, "--out", str(dst), log=out / "import-real.log")
        return dst
    return inp


def read_requests(bundle: Path) -> list[Any]:
    sys.path.insert(0, str(REPO))
    from kvcadence.format.bundle import BundleReader

    return [r for r in BundleReader(bundle).requests() if r.error is None]


def read_server_info(bundle: Path) -> dict[str, Any]:
    from kvcadence.format.bundle import BundleReader

    h = BundleReader(bundle).header
    return dict(getattr(h, "server_info", None) or {})


def build_schedule(reqs: list[Any]) -> dict[str, Any]:
    """One closed loop per lane: first request at its recorded offset from the first send,
    each later one after the recorded pause (its send - the previous finish)."""
    t0 = min(r.send_ns for r in reqs)
    lanes: dict[int, list[Any]] = {}
    for r in reqs:
        lanes.setdefault(r.lane if r.lane is not None else 0, []).append(r)
    out = []
    for lane, rs in sorted(lanes.items()):
        rs.sort(key=lambda r: r.send_ns)
        items = []
        for i, r in enumerate(rs):
            gap = 0.0 if i == 0 else max(0.0, (r.send_ns - rs[i - 1].finish_ns) / 1e9)
            items.append(
                {
                    "rid": r.rid,
                    "session": r.session,
                    "turn": r.turn,
                    "input_ids": list(r.input_ids),
                    "max_tokens": len(r.output_ids) or int(r.max_new_tokens or 1),
                    "gap_s": gap,
                }
            )
        out.append({"lane": lane, "start_s": (rs[0].send_ns - t0) / 1e9, "requests": items})
    return {"lanes": out}


def write_replay_trace(reqs: list[Any], path: Path) -> None:
    with open(path, "w") as fh:
        for r in reqs:
            row = {
                "request_id": r.rid,
                "output_length": len(r.output_ids),
                "output_token_ids": list(r.output_ids),
            }
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")


# ------------------------------------------------------------------ 4. the live run


def stop(proc: subprocess.Popen[Any] | None, sig: int, wait: float) -> None:
    """Signal ``proc``'s own process group (it was started in a new session) and wait."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_mocker(py: Path, real: Path, out: Path, args: argparse.Namespace, reqs: list[Any]) -> Path:
    info = read_server_info(real)
    page = args.block_size or int(info.get("page_size") or 1)
    blocks = args.blocks or int(info.get("max_total_num_tokens") or 5000) // page
    sched = out / "schedule.json"
    sched.write_text(json.dumps(build_schedule(reqs)))
    trace = out / "response_replay.jsonl"
    write_replay_trace(reqs, trace)
    kv_dir = out / "dyn-file-kv"
    shutil.rmtree(kv_dir, ignore_errors=True)
    kv_dir.mkdir()
    env = {**os.environ, "DYN_FILE_KV": str(kv_dir), **dict.fromkeys(LOOPBACK_ENV, "127.0.0.1")}
    env.pop("PYTHONPATH", None)
    cmd = [
        str(py), "-m", "dynamo.mocker", "--engine-type", "sglang",
        "--block-size", str(page), "--num-gpu-blocks-override", str(blocks),
        "--kv-bytes-per-token", "1024", "--discovery-backend", "file",
        "--zmq-kv-events-ports", str(args.port), "--zmq-replay-ports", str(args.replay_port),
        "--sglang-schedule-policy", str(info.get("schedule_policy") or "fifo").replace("fcfs", "fifo"),
        "--sglang-chunked-prefill-size", str(info.get("chunked_prefill_size") or 4096),
        "--sglang-max-prefill-tokens", str(info.get("max_prefill_tokens") or 16384),
        "--sglang-schedule-conservativeness", str(info.get("schedule_conservativeness") or 1.0),
        "--speedup-ratio", str(args.speedup), "--response-replay-trace-path", str(trace),
    ]  # fmt: skip
    (out / "mocker-command.txt").write_text(" ".join(cmd) + "\n")
    mocker_bundle = out / "mocker.kvcb"
    shutil.rmtree(mocker_bundle, ignore_errors=True)
    mocker = capture = None
    mlog = open(out / "mocker.log", "w")
    clog = open(out / "capture.log", "w")
    try:
        say(f"starting the mocker (block size {page}, {blocks} blocks, speed-up {args.speedup})")
        mocker = subprocess.Popen(
            cmd, env=env, stdout=mlog, stderr=subprocess.STDOUT, start_new_session=True, cwd=out
        )
        deadline = time.monotonic() + args.start_timeout
        while not any(p.is_file() for p in kv_dir.rglob("*")):
            if mocker.poll() is not None:
                raise SystemExit(f"the mocker exited ({mocker.returncode}); see {out}/mocker.log")
            if time.monotonic() > deadline:
                raise SystemExit(f"the mocker did not register in {args.start_timeout} s")
            time.sleep(0.5)
        say("mocker registered; starting kvcadence capture")
        kenv = {**os.environ, "PYTHONPATH": str(REPO)}
        capture = subprocess.Popen(
            [
                sys.executable, "-m", "kvcadence", "capture",
                "--endpoint", f"tcp://127.0.0.1:{args.port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{args.replay_port}",
                "--out", str(mocker_bundle), "--quiet",
            ],
            env=kenv, stdout=clog, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        time.sleep(args.join_wait)  # the SUB socket joins before any traffic
        if capture.poll() is not None:
            raise SystemExit(f"kvcadence capture exited early; see {out}/capture.log")
        say(f"driving {len(reqs)} requests")
        client_out = out / "mocker-requests.jsonl"
        cenv = {**env}
        with open(out / "client.log", "w") as fh:
            rc = subprocess.call(
                [str(py), str(HERE / "mocker_client.py"), str(sched), str(client_out)],
                env=cenv, stdout=fh, stderr=subprocess.STDOUT, timeout=args.run_timeout,
            )  # fmt: skip
        if rc != 0:
            raise SystemExit(f"the mocker client failed ({rc}); see {out}/client.log")
        time.sleep(args.settle)
    finally:
        stop(capture, signal.SIGINT, 30)
        stop(mocker, signal.SIGTERM, 20)
        mlog.close()
        clog.close()
    kvcadence(
        "import", "--requests", str(client_out), "--out", str(mocker_bundle), "--append",
        log=out / "import-mocker.log",
    )  # fmt: skip
    return mocker_bundle


# ------------------------------------------------------------------ 5. report and table

ROWS: list[tuple[str, str, str]] = [
    ("Stored events / request", "stored_events_per_request", "{:.3f}"),
    ("blocks / Stored, median", "blocks_per_stored_event.median", "{:g}"),
    ("blocks / Stored, mean", "blocks_per_stored_event.mean", "{:.1f}"),
    ("Removed events / request", "removed_events_per_request", "{:.3f}"),
    ("blocks / Removed, median", "blocks_per_removed_event.median", "{:g}"),
    ("blocks / Removed, mean", "blocks_per_removed_event.mean", "{:.1f}"),
    ("stored blocks total", "total_stored_blocks", "{:,}"),
    ("removed blocks total", "total_removed_blocks", "{:,}"),
    ("messages", "messages", "{:,}"),
    ("events / message, mean", "events_per_message.mean", "{:.2f}"),
    ("share of single-block Stored events", "share_single_block_stores", "{:.3f}"),
]


def _fmt(spec: str, v: Any) -> str:
    if v is None:
        return "–"
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def peers_table(doc: dict[str, Any], names: list[str]) -> str:
    bundles = doc["bundles"]
    head = "| metric | " + " | ".join(names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    for title, key, spec in ROWS:
        vals = [_fmt(spec, b["metrics"].get(key, {}).get("value")) for b in bundles]
        lines.append(f"| {title} | " + " | ".join(vals) + " |")
    fam = doc.get("hash_families") or {}
    shared = ["–"]
    recomputed = ["–"]
    for b in bundles[1:]:
        f = fam.get("bundles", {}).get(b["label"], {})
        s = f.get("shared_with_real_blocks")
        total = f.get("distinct_stored_hashes")
        shared.append("–" if s is None else ("all" if s == total else f"{s:,} of {total:,}"))
        r = f.get("recomputed_shared_with_real_blocks")
        recomputed.append("–" if r is None else f"{r:,} of {total:,}")
    lines.append("| block hashes shared with real | " + " | ".join(shared) + " |")
    lines.append(
        "| … after recomputing SGLang hashes from token_ids | " + " | ".join(recomputed) + " |"
    )
    fams = ["SGLang" if fam.get("bundles", {}).get(b["label"], {}).get("family") == "sglang"
            else fam.get("bundles", {}).get(b["label"], {}).get("family", "–") for b in bundles]  # fmt: skip
    lines.append("| hash family (recomputed from token_ids) | " + " | ".join(fams) + " |")
    return "\n".join(lines) + "\n"


def update_doc(path: Path, table: str, note: str) -> None:
    text = path.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"{path} has no {TABLE_START} ... {TABLE_END} markers")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(f"{head}{TABLE_START}\n{note}\n\n{table}{TABLE_END}{tail}")


def save_recording(mocker: Path, dst: Path) -> None:
    """The mocker's frames (fixture import form) and its request timings (no token ids)."""
    from kvcadence.format.bundle import BundleReader

    dst.mkdir(parents=True, exist_ok=True)
    rd = BundleReader(mocker)
    with open(dst / "frames.jsonl", "w") as fh:
        for fr in rd.events():
            payload = bytes(fr.payload)
            if fr.payload_is_bin:
                import msgspec

                payload = msgspec.msgpack.decode(payload)
            row = {
                "recv_ns": fr.recv_ns,
                "topic": fr.topic,
                "seq": fr.seq,
                "payload_b64": base64.b64encode(payload).decode(),
                "via": "replay" if fr.via == 1 else "live",
            }
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    keep = ("rid", "lane", "session", "turn", "max_new_tokens", "send_ns", "first_token_ns")
    with open(dst / "requests.jsonl", "w") as fh:
        for r in rd.requests():
            row = {k: getattr(r, k) for k in keep}
            row["finish_ns"] = r.finish_ns
            row["n_output"] = len(r.output_ids)
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="bundle or fixture dir")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "peers-mocker")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--python", help="Python 3.10-3.13 for the mocker venv (default python3.11)")
    ap.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio")
    ap.add_argument("--block-size", type=int, help="default: the capture's page size")
    ap.add_argument("--blocks", type=int, help="KV blocks (default: the capture's pool / page)")
    ap.add_argument("--port", type=int, default=25557, help="mocker KV-event PUB port")
    ap.add_argument("--replay-port", type=int, default=25558, help="mocker replay port")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--run-timeout", type=float, default=1800.0)
    ap.add_argument("--join-wait", type=float, default=3.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--update-doc", type=Path, help="rewrite the table between its markers")
    ap.add_argument("--save-recording", type=Path, help="write frames/requests JSONL here")
    ap.add_argument("--reuse", action="store_true", help="reuse OUT/mocker.kvcb if present")
    args = ap.parse_args(argv)

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    py = ensure_venv(args.venv, args.python)
    real = real_bundle(args.input.resolve(), out)
    sim = out / "sim.kvcb"
    shutil.rmtree(sim, ignore_errors=True)
    say("kvcadence replay of the real bundle")
    kvcadence("replay", str(real), "--out", str(sim), log=out / "replay.log")
    reqs = read_requests(real)
    mocker = out / "mocker.kvcb"
    if not (args.reuse and mocker.exists()):
        mocker = run_mocker(py, real, out, args, reqs)
    report = out / "report"
    shutil.rmtree(report, ignore_errors=True)
    say("three-way report")
    kvcadence(
        "report", str(real), str(sim), str(mocker), "--out", str(report), "--no-plots",
        log=out / "report.log", ok=(0, 3),
    )  # fmt: skip
    doc = json.loads((report / "report.json").read_text())
    version = doc["inputs"][0].get("sglang_version")
    real_name = f"real SGLang {version}" if version else "real"
    names = [real_name, "kvcadence replay", f"Dynamo mocker {DYNAMO_VERSION}"]
    table = peers_table(doc, names)
    (out / "peers-table.md").write_text(table)
    print(table)
    if args.update_doc:
        note = (
            f"Generated by `python bench/peers/run_mocker.py --update-doc {args.update_doc}` "
            f"({len(reqs)} requests, mocker speed-up {args.speedup:g})."
        )
        update_doc(args.update_doc, table, note)
    if args.save_recording:
        save_recording(mocker, args.save_recording)
    say(f"done: {report}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
