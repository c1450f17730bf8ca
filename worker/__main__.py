"""``python -m worker``: serve one GGUF model to the router over ZeroMQ.

Usage::

    python -m worker --model NAME --gguf PATH --endpoint ENDPOINT [--n-ctx N]
                     [--chat-template NAME_OR_TEXT] [--max-queue N] [--parent-pid PID]
                     [--threads N] [--kv-events-endpoint EP] [--kv-events-to-router] [--auth-fd FD]
    python -m worker --spare --endpoint ENDPOINT [--parent-pid PID] [--auth-fd FD]

``--spare`` starts a warm spare (``worker.spare``): no model yet; it imports and loads its
kernels, says Hello with model "", and waits for the router's Assign, whose fields replace the
model options above; from there it is the same worker. Exit status as below (0 also when it
is stopped before it got a model).

ENDPOINT is the router's bound ROUTER socket (``ipc://PATH`` or
``tcp://HOST:PORT``); the worker connects a DEALER socket to it, sends Hello,
loads the model, sends Ready (or Error "load_failed" and exits 1), and serves
until Shutdown, SIGTERM or its parent process (``--parent-pid``, default the
process that started it) is gone. Exit status: 0 after Shutdown / SIGTERM /
parent gone, 1 after a load failure, 2 for bad arguments or an internal crash.

``--threads N`` sets the BLAS/OpenMP thread count of this process
(``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, before NumPy is
imported); without it the environment decides. Several workers on few cores each
running one thread per core slow each other down badly (busy-waiting BLAS threads).

``--auth-fd FD`` is an inherited pipe holding this worker's credentials
(``protocol.credentials``: the per-spawn secret it proves in Hello and, over tcp,
its CURVE keys); it is read to its end and closed before anything else. The
router always passes one; without it the worker sends an empty secret, which a
router never accepts (tests drive such workers with their own stub).

Log level: environment variable ``MODELYARD_WORKER_LOG`` (default INFO), to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from protocol.credentials import WorkerCredentials
from protocol.limits import DEFAULT_WEIGHTS, WEIGHT_MODES
from protocol.lifecycle import model_options, option_defaults

#: Environment variables that set the BLAS / OpenMP thread pools (read when NumPy loads).
THREAD_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def _positive(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _non_negative(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker", description="Serve one GGUF model to the modelyard router.")
    d = option_defaults()  # each model option's default: protocol.ModelOptions'
    p.add_argument("--model", default=None, help="configured model name (echoed in Hello/Ready)")
    p.add_argument("--gguf", default=None, help="path of the GGUF file")
    p.add_argument("--spare", action="store_true",
                   help="a warm spare: no model yet; wait for the router's Assign (worker.spare)")
    p.add_argument("--endpoint", required=True, help="router ROUTER endpoint: ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--n-ctx", type=_positive, default=None, help="KV cache size in tokens (default: engine's)")
    p.add_argument("--chat-template", default=None, help="chat template text or known name (chatml, gemma)")
    p.add_argument("--max-queue", type=_non_negative, default=d["max_queue"],
                   help=f"Generate requests that may wait behind the running ones (default {d['max_queue']})")
    p.add_argument("--parallel", type=_positive, default=d["parallel"],
                   help=f"KV slots: sequences decoded at once (default {d['parallel']})")
    p.add_argument("--kv-budget-mib", type=float, default=None,
                   help="KV memory of all sequences and cached prefixes, MiB (default: the engine's, 2048)")
    p.add_argument("--weights", choices=WEIGHT_MODES, default=None,
                   help=f"how weight matrices are held: the GGUF's quantized blocks or float32 (default {DEFAULT_WEIGHTS})")
    p.add_argument("--n-ubatch", type=_positive, default=None,
                   help="tokens of a prompt's micro-batch, llama.cpp's n_ubatch (default: the engine's, 512)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is gone (default: the parent at start)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="BLAS/OpenMP threads for this worker (default: as the environment says)")
    p.add_argument("--slot-save-path", default=None,
                   help="directory of slot save/restore files (POST /slots/{id}?action=...); default: off")
    p.add_argument("--kv-cache-dir", default=None,
                   help="directory where idle KV caches are saved on stop and restored lazily after a load")
    p.add_argument("--kv-cache-mib", type=float, default=d["kv_cache_mib"],
                   help=f"disk budget of --kv-cache-dir, MiB (default {d['kv_cache_mib']:g})")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV events (vLLM's format) on a ZeroMQ PUB socket bound here: tcp://HOST:PORT or "
                        "ipc://PATH (default: off); plaintext, unauthenticated: bind it to localhost or ipc")
    p.add_argument("--kv-events-block-size", type=_positive, default=d["kv_events_block_size"],
                   help=f"tokens per block of the KV events (default {d['kv_events_block_size']})")
    p.add_argument("--kv-events-to-router", action="store_true",
                   help="also send the KV events to the router (KvEvents frames)")
    p.add_argument("--auth-fd", type=_non_negative, default=None,
                   help="inherited pipe with this worker's credentials (secret, CURVE keys)")
    args = p.parse_args(argv)
    if args.spare and (args.model is not None or args.gguf is not None):
        p.error("--spare takes no --model / --gguf: the router's Assign names them")
    if not args.spare and (args.model is None or args.gguf is None):
        p.error("--model and --gguf are required (or --spare)")
    for flag, ep in (("--endpoint", args.endpoint), ("--kv-events-endpoint", args.kv_events_endpoint or "ipc://")):
        if not ep.startswith(("ipc://", "tcp://")):
            p.error(f"{flag} must be ipc://PATH or tcp://HOST:PORT, got {ep!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    credentials = None
    if args.auth_fd is not None:  # first: the pipe is this worker's alone from here on
        from protocol.credentials import read_credentials

        try:
            credentials = read_credentials(args.auth_fd)
        except ValueError as e:
            print(f"python -m worker: --auth-fd: {e}", file=sys.stderr)
            return 2
    if args.threads is not None:  # before NumPy is imported (worker.server imports the engine)
        for var in THREAD_ENV_VARS:
            os.environ[var] = str(args.threads)
    if args.spare:
        return serve_spare(args, credentials)
    if (args.weights or DEFAULT_WEIGHTS) == "quantized":  # numba and the file-independent kernels load while the rest starts
        from worker.engine import preload_kernels

        preload_kernels()
    from worker.config import WorkerConfig
    from worker.server import WorkerServer

    logging.basicConfig(level=os.environ.get("MODELYARD_WORKER_LOG", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s worker[{os.getpid()}] %(message)s")
    if args.threads is not None:
        logging.info("BLAS/OpenMP threads: %d (%s)", args.threads, ", ".join(f"{v}={os.environ[v]}"
                                                                            for v in THREAD_ENV_VARS))
    parent = args.parent_pid if args.parent_pid is not None else os.getppid()
    server = WorkerServer(WorkerConfig(**model_options(args), endpoint=args.endpoint, parent_pid=parent,
                                       credentials=credentials))
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    return server.serve()


def serve_spare(args: argparse.Namespace, credentials: WorkerCredentials | None) -> int:
    """``--spare``: warm up, wait for Assign, then serve the assigned model on the same socket."""
    logging.basicConfig(level=os.environ.get("MODELYARD_WORKER_LOG", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s worker[{os.getpid()}] %(message)s")
    from worker.config import ParentWatch, WorkerConfig
    from worker.server import WorkerServer
    from worker.spare import SpareWait, warm_up

    took = warm_up()
    logging.info("spare: imports and kernels in %.2f s", took)
    parent = args.parent_pid if args.parent_pid is not None else os.getppid()
    waiter = SpareWait(args.endpoint, credentials, ParentWatch(parent))
    signal.signal(signal.SIGTERM, lambda *_: waiter.stop.set())
    signal.signal(signal.SIGINT, lambda *_: waiter.stop.set())
    got = waiter.wait_for_model()
    if isinstance(got, int):
        return got
    ctx, sock, a = got
    try:
        cfg = WorkerConfig(**model_options(a), endpoint=args.endpoint, parent_pid=parent,
                           credentials=waiter.credentials)
    except ValueError as e:  # the codec checked the values; a defect here is a bug, said as a load failure
        from protocol import Error, encode
        from protocol.errors import ErrorCode

        sock.send(encode(Error(id=f"worker-{os.getpid()}", code=ErrorCode.LOAD_FAILED, message=str(e)[:4000])))
        sock.close(linger=1000)
        ctx.term()
        return 1
    server = WorkerServer(cfg)
    if a.threads:
        server.runner.request_threads(a.threads)
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    return server.serve(connected=(ctx, sock))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine thread may be inside a forward pass it cannot be interrupted from; the socket is
    # closed and every answer sent, so leave without waiting for it.
    os._exit(code)
