"""``kvcadence collectives``: validate the flags, then launch the kernels worker via torchrun.

Runs ``sys.executable -m torch.distributed.run --standalone --nproc-per-node N -m
kvcadence.kernels ...`` (the same flags, paths made absolute). Top level imports only the
standard library; the flag definitions and the ``prefixes.json`` check are imported when
the command runs, so bad input fails here (one line, exit 2) before any worker starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

HELP = "time dense all-reduce vs packed all-gather merges of a shared KV prefix (torchrun)"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``collectives`` subcommand."""
    from kvcadence.kernels.options import add_arguments

    p = sub.add_parser(
        "collectives",
        help=HELP,
        description=HELP + ". Launches torchrun; see docs/kernels.md.",
        epilog="examples:\n"
        "  kvcadence collectives --backend gloo --tokens 4096 65536 --repeat 5\n"
        "  kvcadence prefixes run.kvcb --out prefixes.json\n"
        "  kvcadence collectives --nproc-per-node 2 --backend gloo --prefixes prefixes.json "
        "--out collectives.jsonl\n",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=2,
        metavar="N",
        help="ranks to launch (default 2; NCCL needs one GPU per rank)",
    )
    add_arguments(p)
    p.set_defaults(_run=run)


def launch_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for ``args``."""
    from kvcadence.kernels.options import worker_argv

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc_per_node),
        "-m",
        "kvcadence.kernels",
        *worker_argv(args),
    ]


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: ``base`` (this process's) plus this checkout on PYTHONPATH
    (the workers must import this kvcadence even from an uninstalled tree) and
    ``OMP_NUM_THREADS=1`` unless set: torchrun sets the same for several ranks, but prints a
    five-line banner about it on stderr when it has to."""
    env = dict(os.environ if base is None else base)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(args: argparse.Namespace) -> int:
    """Validate, launch, and pass the workers' failure on as exit 1 (their lines say why)."""
    from kvcadence.errors import UsageError
    from kvcadence.kernels.memory import host_available, memory_problem
    from kvcadence.kernels.options import config_from_args, nccl_problem

    if not 1 <= args.nproc_per_node <= 64:
        raise UsageError(f"--nproc-per-node must be in 1..64, got {args.nproc_per_node}")
    cfg = config_from_args(args)  # raises UsageError / InputError on bad flags or prefixes.json
    if importlib.util.find_spec("torch") is None:
        raise UsageError("torch is not installed (pip install 'kvcadence[kernels]')")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == "nccl":  # said here, once: not by every rank plus torchrun's traceback
        problem = nccl_problem(gpus, args.nproc_per_node)
        if problem:
            raise UsageError(problem)
    on_gpu = args.backend == "nccl" or (
        args.backend == "auto" and nccl_problem(gpus, args.nproc_per_node) is None
    )
    # (its total, not its free memory: asking for that would hold a CUDA context here,
    # memory the workers then lack, for the whole run)
    device = torch.cuda.get_device_properties(0).total_memory if on_gpu else None
    problem = memory_problem(cfg, args.nproc_per_node, on_gpu, host_available(), device)
    if problem:  # before launching: the workers would allocate until killed
        raise UsageError(problem)
    proc = subprocess.run(launch_command(args), env=launch_env(), check=False)
    if proc.returncode == 0:
        return 0
    print(
        f"kvcadence: error: collectives workers failed (torchrun exit {proc.returncode})",
        file=sys.stderr,
    )
    return 1
