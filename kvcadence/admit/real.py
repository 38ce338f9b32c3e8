"""Run ``sglang_adder_driver.py`` (the REAL SGLang PrefillAdder) and compare it with ``admit``.

Owns the bridge to the SGLang 0.5.23 venv built by ``kvcadence.harness.venv`` (found via
``venv_python()``; ``$KVCADENCE_SGLANG_VENV`` overrides it): one subprocess per call,
all queues in one JSON job (the ~10 s sglang import is paid once), and the projection of a tick
(kvcadence's or the driver's raw one) onto the fields both must agree on.
Only the standard library is imported at module level.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcadence.admit.ticks import (
    AdmitConfig,
    AdmitResult,
    QueuedRequest,
    classify_stop,
    specs_to_jobs,
)
from kvcadence.errors import HarnessError
from kvcadence.harness.venv import venv_python, venv_ready

DRIVER = Path(__file__).resolve().parent.parent / "harness" / "sglang_adder_driver.py"


def sglang_python() -> Path:
    """The SGLang venv's python (it may not exist; see ``sglang_available``)."""
    return Path(venv_python())


def sglang_available() -> tuple[bool, str]:
    """(available, reason) -- whether the real sglang PrefillAdder can be imported."""
    py = sglang_python()
    if py.exists() and not venv_ready(py.parent.parent):
        return False, f"the SGLang venv at {py.parent.parent} is incomplete (being built?)"
    if not py.exists():
        return False, (
            f"no SGLang 0.5.23 venv at {py.parent.parent} (build it with the capture harness, "
            "kvcadence.harness.venv.ensure_venv(), or set KVCADENCE_SGLANG_VENV)"
        )
    if not (py.parent.parent / "lib").exists():
        return False, f"{py.parent.parent} is not a virtualenv"
    return True, ""


def driver_config(cfg: AdmitConfig) -> dict[str, Any]:
    if cfg.semantics != "0.5.23":
        raise HarnessError("the real-SGLang driver runs 0.5.23 semantics only (installed sglang)")
    if cfg.cp_enabled:
        raise HarnessError("CP limits are kvcadence-only; the real PrefillAdder has none")
    return {
        "available_tokens": cfg.available_tokens,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "page_size": cfg.page_size,
        "max_running_requests": cfg.max_running_requests,
        "new_token_ratio": cfg.new_token_ratio,
        "drain": cfg.drain,
        "load_back_threshold": cfg.load_back_threshold,
        "max_ticks": cfg.max_ticks,
    }


def run_real_many(
    cases: Sequence[tuple[AdmitConfig, Sequence[Sequence[QueuedRequest]]]],
    *,
    timing_repeats: int = 0,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Several (config, queues) jobs in ONE driver subprocess (one ~10 s sglang import)."""
    ok, reason = sglang_available()
    if not ok:
        raise HarnessError(reason)
    job = {
        "jobs": [
            {
                "config": driver_config(cfg),
                "queues": [specs_to_jobs(q) for q in queues],
                "timing_repeats": timing_repeats,
            }
            for cfg, queues in cases
        ]
    }
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run(
        [str(sglang_python()), str(DRIVER)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=str(DRIVER.parent),
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-5:]
        raise HarnessError(f"sglang adder driver failed (rc {proc.returncode}): {' | '.join(tail)}")
    try:
        return json.loads(proc.stdout)["jobs"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise HarnessError(f"sglang adder driver printed no JSON jobs ({exc})") from None


def project_real_tick(raw: dict[str, Any], cfg: AdmitConfig) -> dict[str, Any]:
    """A driver tick in the comparable form (stop classified as kvcadence classifies)."""
    stop = raw["stop"]
    if stop is not None and stop["kind"] == "max_running":
        stop = dict(stop, kind="OTHER:max_running")
    return {
        "accepted": [
            (a["rid"], a["prefix_len"], a["extend_len"], a["loaded"], a["continuation"])
            for a in raw["accepted"]
        ],
        "stopped_on_rid": stop["rid"] if stop else None,
        "stopped_result": classify_stop(
            stop,
            rem_input_tokens=raw["rem_input_tokens"],
            rem_chunk_tokens=raw["rem_chunk_tokens"],
            chunking=cfg.chunked_prefill_size is not None,
            semantics=cfg.semantics,
        ),
        "stopped_admitted": bool(stop and stop["admitted"]),
        "log_hit_tokens": raw["log_hit_tokens"],
        "log_input_tokens": raw["log_input_tokens"],
        "rem_input_tokens": raw["rem_input_tokens"],
        "rem_chunk_tokens": raw["rem_chunk_tokens"],
        "rem_total_tokens": round(raw["rem_total_tokens"], 6),
        "allocator_available_after_tick": raw["allocator_available_after_tick"],
        "load_back_events": raw["load_back_events"],
        "evictions": [{"rid": r, "tokens": n} for r, n in raw["evictions"]],
    }


def project_tick(tick: dict[str, Any]) -> dict[str, Any]:
    """A kvcadence ``admit`` tick in the comparable form."""
    return {
        "accepted": [
            (a["rid"], a["prefix_len"], a["extend_len"], a["loaded"], a["continuation"])
            for a in tick["accepted"]
        ],
        "stopped_on_rid": tick["stopped_on_rid"],
        "stopped_result": tick["stopped_result"],
        "stopped_admitted": tick["stopped_admitted"],
        "log_hit_tokens": tick["log_hit_tokens"],
        "log_input_tokens": tick["log_input_tokens"],
        "rem_input_tokens": tick["rem_input_tokens"],
        "rem_chunk_tokens": tick["rem_chunk_tokens"],
        "rem_total_tokens": round(tick["rem_total_tokens"], 6),
        "allocator_available_after_tick": tick["allocator_available_after_tick"],
        "load_back_events": tick["load_back_events"],
        "evictions": tick["evictions"],
    }


def compare(result: AdmitResult, real: dict[str, Any], cfg: AdmitConfig) -> list[str]:
    """Differences between one kvcadence run and the driver's run of the same queue."""
    ours = [project_tick(t) for t in result.ticks]
    theirs = [project_real_tick(t, cfg) for t in real["ticks"]]
    diffs: list[str] = []
    if len(ours) != len(theirs):
        diffs.append(f"tick count {len(ours)} != real {len(theirs)}")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        for key in a:
            if a[key] != b[key]:
                diffs.append(f"tick {i} {key}: kvcadence {a[key]!r} != real {b[key]!r}")
        if diffs:
            break
    return diffs
