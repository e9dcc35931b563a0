#!/usr/bin/env python3
"""The NIXL peer of `kdn-bench pd-transfer`: how fast NIXL moves one request's
KV between two processes on this machine, host memory to host memory.

  python3 -m venv /tmp/nixl-venv
  /tmp/nixl-venv/bin/pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 numpy
  /tmp/nixl-venv/bin/python bench/nixl_peer.py --bytes 134217728 --chunk-bytes 8388608 --reps 5

(A plain `pip install nixl` works too but pulls torch and CUDA, some 6 GB;
the host-memory path needs neither.)

Process A (the initiator, this one) holds N bytes of random content; process B
(the target, spawned with multiprocessing) holds an N-byte destination. Both
buffers are page-aligned anonymous mappings, written once before registration
so no page faults are timed. The agents exchange NIXL metadata and B's buffer
address over a multiprocessing pipe (no network). A writes its buffer into B's
with NIXL WRITE as one prepared transfer of ceil(N/M) descriptors of M bytes
each; a rep is timed from posting the transfer to the completion A observes
(polling check_xfer_state). One untimed warm-up, then R timed reps; GB/s is
bytes/seconds/1e9, best of R. Afterwards B hashes its buffer and A checks the
hash equals its own; a mismatch is a failure.

stderr: human progress (and whatever NIXL and UCX log: the script points fd 1
at stderr, since both log to stdout). stdout: exactly one line of JSON.

UCX picks its transports itself; with UCX_TLS unset (leave it unset, not empty:
UCX_TLS= fails) the wheel's UCX puts with cma (process_vm_writev, one copy) and
wires up over tcp on loopback. UCX_PROTO_INFO=y prints what it chose. NIXL's
UCX backend asks for peer error handling, which shared-memory transports lack,
so UCX_TLS=sm,self needs --backend-param ucx_error_handling_mode=none. The
agents run without NIXL's progress thread unless --progress-thread: on a
2-core machine it takes a core from the thread doing the copy. Other plugins
in the wheel do not move host memory between processes (POSIX is DRAM<->file
in one agent; LIBFABRIC does not load). NIXL is a bench-only dependency.
"""

import argparse
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import sys
import time

TARGET = "kdn-nixl-target"
INITIATOR = "kdn-nixl-initiator"
TIMEOUT_S = 120.0


def log(msg: str) -> None:
    print(f"[nixl_peer {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def import_nixl():
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl  # noqa: F401
        import numpy  # noqa: F401
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        sys.exit(f"nixl_peer: cannot import nixl ({e}); `pip install nixl numpy` "
                 "into a venv (NIXL is a bench-only dependency)")
    return nixl_agent, nixl_agent_config


def make_agent(name: str, backend: str, params: dict, progress_thread: bool):
    nixl_agent, nixl_agent_config = import_nixl()
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
    agent = nixl_agent(name, config)
    if backend not in agent.get_plugin_list():
        raise RuntimeError(f"backend {backend} not in this nixl build "
                           f"(plugins: {agent.get_plugin_list()})")
    try:
        agent.create_backend(backend, params)
    except Exception as e:
        raise RuntimeError(f"cannot create backend {backend}: {type(e).__name__}: {e}")
    return agent


def host_buffer(nbytes: int, fill: bytes):
    """A page-aligned anonymous mapping, every page written (pre-faulted)."""
    import numpy as np
    buf = mmap.mmap(-1, nbytes)
    arr = np.frombuffer(buf, dtype=np.uint8)
    if fill:
        arr[:] = np.frombuffer(fill, dtype=np.uint8)
    else:
        arr.fill(0xA5)
    return buf, arr


def chunks(addr: int, nbytes: int, chunk: int):
    """Nx3 descriptor array (address, length, device 0) covering nbytes."""
    import numpy as np
    starts = np.arange(0, nbytes, chunk, dtype=np.uint64)
    lens = np.minimum(np.uint64(chunk), np.uint64(nbytes) - starts)
    return np.stack([starts + np.uint64(addr), lens, np.zeros_like(starts)], axis=1)


def nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "unknown"


def digest(arr) -> str:
    return hashlib.blake2b(memoryview(arr), digest_size=16).hexdigest()


def recv(conn, what: str, agent=None, peer=None):
    """Next pipe message; progresses `agent` (its UCX worker) while waiting."""
    deadline = time.monotonic() + TIMEOUT_S
    while not conn.poll(0.001):
        if agent is not None:
            agent.get_new_notifs()
        if peer is not None and not peer.is_alive():
            raise RuntimeError(f"the target exited (code {peer.exitcode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {TIMEOUT_S:.0f} s waiting for {what}")
    return conn.recv()


def target_main(conn, nbytes: int, backend: str, params: dict,
                progress_thread: bool) -> None:
    """Process B: registers an N-byte destination, publishes it, waits, hashes."""
    try:
        agent = make_agent(TARGET, backend, params, progress_thread)
        _, dst = host_buffer(nbytes, b"")
        agent.register_memory(chunks(dst.ctypes.data, nbytes, nbytes), "DRAM",
                              backends=[backend])
        try:
            meta = agent.get_agent_metadata()
        except Exception as e:
            raise RuntimeError(f"no metadata for remote agents ({e}): backend {backend} "
                               "does not do transfers between processes")
        conn.send(("ready", meta, dst.ctypes.data))
        msg = recv(conn, "the initiator's verify request", agent)
        assert msg == "verify", msg
        conn.send(("digest", digest(dst)))
        recv(conn, "the initiator's goodbye", agent)  # keep dst registered till then
    except BaseException as e:  # report to A, which owns the exit status
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:  # A is gone
            pass
        raise


def wait_done(agent, handle) -> str:
    state = agent.transfer(handle)
    deadline = time.perf_counter() + TIMEOUT_S
    while state == "PROC" and time.perf_counter() < deadline:
        state = agent.check_xfer_state(handle)
    return state


def run(args) -> dict:
    import numpy as np
    params = dict(kv.split("=", 1) for kv in args.backend_param)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=target_main, daemon=True,
                         args=(child_conn, args.bytes, args.backend, params,
                               args.progress_thread))
    target.start()
    try:
        agent = make_agent(INITIATOR, args.backend, params, args.progress_thread)
        log(f"filling {args.bytes} source bytes")
        rng = np.random.default_rng(20261126)
        _, src = host_buffer(args.bytes, rng.bytes(args.bytes))
        agent.register_memory(chunks(src.ctypes.data, args.bytes, args.bytes), "DRAM",
                              backends=[args.backend])
        msg = recv(conn, "the target's metadata", peer=target)
        if msg[0] != "ready":
            raise RuntimeError(f"target: {msg[1]}")
        _, meta, dst_addr = msg
        remote = agent.add_remote_agent(meta)
        local_descs = chunks(src.ctypes.data, args.bytes, args.chunk_bytes)
        remote_descs = chunks(dst_addr, args.bytes, args.chunk_bytes)
        n = len(local_descs)
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM",
                                        backends=[args.backend])
        remote_h = agent.prep_xfer_dlist(remote, remote_descs, "DRAM",
                                         backends=[args.backend])
        idx = np.arange(n, dtype=np.int32)
        xfer = agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx,
                                       backends=[args.backend])
        log(f"{n} descriptors of up to {args.chunk_bytes} bytes, backend {args.backend}, "
            f"UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}")
        rates = []
        for rep in range(args.reps + 1):
            t0 = time.perf_counter()
            state = wait_done(agent, xfer)
            dt = time.perf_counter() - t0
            if state != "DONE":
                raise RuntimeError(f"transfer {rep} ended in state {state}")
            if rep == 0:
                log(f"warm-up {dt * 1e3:.1f} ms")
                continue
            rates.append(args.bytes / dt / 1e9)
            log(f"rep {rep}: {dt * 1e3:.2f} ms, {rates[-1]:.2f} GB/s")
        conn.send("verify")
        msg = recv(conn, "the target's digest", peer=target)
        if msg[0] != "digest":
            raise RuntimeError(f"target: {msg[1]}")
        mine = digest(src)
        if msg[1] != mine:
            raise RuntimeError(f"verify failed: target holds {msg[1]}, source is {mine}")
        log(f"verified: both sides hash to {mine}")
        agent.release_xfer_handle(xfer)
        agent.remove_remote_agent(remote)
    finally:
        try:
            conn.send("bye")
        except OSError:
            pass
        target.join(timeout=10)
        if target.is_alive():
            target.kill()
    return {"peer": "nixl", "nixl_version": nixl_version(), "backend": args.backend,
            "bytes": args.bytes, "chunk_bytes": args.chunk_bytes, "reps": args.reps,
            "gbytes_per_s": round(max(rates), 3),
            "all_gbytes_per_s": [round(r, 3) for r in rates], "descriptors": n,
            "progress_thread": args.progress_thread, "backend_params": params,
            "ucx_tls": os.environ.get("UCX_TLS", ""),
            "method": f"NIXL WRITE host->host between 2 processes, one prepared xfer of "
                      f"{n} descriptors, timed post to DONE polled by the initiator, "
                      f"best of {args.reps} after 1 warm-up"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=128 << 20)
    ap.add_argument("--chunk-bytes", type=int, default=8 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="UCX")
    ap.add_argument("--progress-thread", action="store_true",
                    help="give each agent NIXL's progress thread (off: on 2 cores it "
                         "competes with the polling thread; up to 3x slower here)")
    ap.add_argument("--backend-param", action="append", default=[], metavar="KEY=VALUE",
                    help="backend init parameter, e.g. ucx_error_handling_mode=none "
                         "(lets UCX_TLS=sm,self work: shm has no peer failure handler)")
    args = ap.parse_args()
    if any("=" not in kv for kv in args.backend_param):
        sys.exit("nixl_peer: --backend-param takes KEY=VALUE")
    if args.bytes <= 0 or args.chunk_bytes <= 0 or args.reps <= 0:
        sys.exit("nixl_peer: --bytes, --chunk-bytes and --reps must be positive")
    # NIXL's Python logger and UCX both write to stdout; keep stdout for the JSON.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import_nixl()
    try:
        result = run(args)
    except Exception as e:
        sys.exit(f"nixl_peer: transfer failed: {type(e).__name__}: {e}")
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main()
