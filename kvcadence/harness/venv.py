"""The real SGLang worker's environment: SGLang 0.5.23's venv and the tiny model, cached.

What this file owns:

* ``ensure_venv()`` -- a venv cached outside the repository (``~/.cache/kvcadence/
  sglang-0.5.23-venv``, or ``$KVCADENCE_SGLANG_VENV``), built with ``torch==2.14.1
  torchvision==0.29.1``, then ``--no-deps sglang==0.5.23``, then the pinned requirements
  shipped as package data. Rebuilt when missing or when the requirements' hash changed
  (``venv_ready``: a stamp file holds the hash); an ``flock`` lock file keeps two processes
  from building it at once.
* ``ensure_model()`` -- the tiny random-weight Llama (``sglang_cpu/mkmodel.py``) in the cache.

Only the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvcadence.errors import HarnessError

SGLANG_VERSION = "0.5.23"
TORCH_PINS: tuple[str, ...] = ("torch==2.14.1", "torchvision==0.29.1")
ASSET_DIR = Path(__file__).resolve().parent / "sglang_cpu"
REQUIREMENTS = ASSET_DIR / "sglang-cpu-requirements.txt"
MKMODEL = ASSET_DIR / "mkmodel.py"
STAMP_NAME = ".kvcadence-stamp"


def cache_dir() -> Path:
    """``~/.cache/kvcadence`` (computed at call time from ``Path.home()``)."""
    return Path.home() / ".cache" / "kvcadence"


def venv_dir() -> Path:
    """The SGLang venv: ``$KVCADENCE_SGLANG_VENV`` or ``<cache>/sglang-0.5.23-venv``."""
    env = os.environ.get("KVCADENCE_SGLANG_VENV")
    return Path(env).expanduser() if env else cache_dir() / f"sglang-{SGLANG_VERSION}-venv"


def model_dir() -> Path:
    """Where the tiny Llama is generated."""
    return cache_dir() / "tinyllama-1024v-128h-2l"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def requirements_hash() -> str:
    """Hash of everything that defines the venv (pins + requirements file bytes)."""
    h = hashlib.sha256()
    h.update(("\n".join(TORCH_PINS) + f"\nsglang=={SGLANG_VERSION}\n").encode())
    h.update(REQUIREMENTS.read_bytes())
    return h.hexdigest()


def venv_ready(venv: Path | None = None) -> bool:
    """True when the venv exists and was built from the current requirements."""
    venv = venv or venv_dir()
    stamp = venv / STAMP_NAME
    if not stamp.is_file() or not venv_python(venv).exists():
        return False
    try:
        return json.loads(stamp.read_text()).get("hash") == requirements_hash()
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip(venv: Path, args: Sequence[str], log) -> None:
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+ " + " ".join(cmd), file=log, flush=True)
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise HarnessError(
            f"pip install {' '.join(args)} failed (exit {proc.returncode}); see {log.name}"
        )


def ensure_venv(*, force: bool = False, quiet: bool = False) -> Path:
    """Build the SGLang venv unless an up-to-date one exists; return its directory."""
    venv = venv_dir()
    if not force and venv_ready(venv):
        return venv
    with _file_lock(venv.with_name(venv.name + ".lock")):
        if not force and venv_ready(venv):  # someone else built it while we waited
            return venv
        if venv.exists():
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        log_path = venv.with_name(venv.name + ".build.log")
        t0 = time.monotonic()
        if not quiet:
            print(f"harness: building {venv} (log: {log_path}) ...", file=sys.stderr, flush=True)
        with open(log_path, "w") as log:
            base = getattr(sys, "_base_executable", None) or sys.executable
            proc = subprocess.run(
                [base, "-m", "venv", str(venv)], stdout=log, stderr=subprocess.STDOUT
            )
            if proc.returncode != 0:
                raise HarnessError(f"could not create venv {venv}; see {log_path}")
            _pip(venv, list(TORCH_PINS), log)
            _pip(venv, ["--no-deps", f"sglang=={SGLANG_VERSION}"], log)
            _pip(venv, ["-r", str(REQUIREMENTS)], log)
        stamp = {"hash": requirements_hash(), "built_s": round(time.monotonic() - t0, 1)}
        (venv / STAMP_NAME).write_text(json.dumps(stamp))
        if not quiet:
            print(f"harness: venv ready in {stamp['built_s']} s", file=sys.stderr, flush=True)
    return venv


def ensure_model(*, quiet: bool = False) -> Path:
    """Generate the tiny deterministic Llama into the cache (once)."""
    out = model_dir()
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    venv = ensure_venv(quiet=quiet)
    with _file_lock(out.with_name(out.name + ".lock")):
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        proc = subprocess.run(
            [str(venv_python(venv)), str(MKMODEL), str(tmp)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise HarnessError(f"mkmodel.py failed: {proc.stderr.strip().splitlines()[-1:]}")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out
