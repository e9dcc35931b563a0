"""kdn's KDN for any engine: store the KV of a token sequence, fetch the KV of
its longest stored prefix, under the content addresses kdn's workers use
(docs/clients.md). A thin layer over libkdn_client's C API; numpy is its only
dependency, and torch tensors are taken as they are.

    import kdn
    model = kdn.Model("SmolLM2-135M-Instruct.Q4_1.gguf", kv_dtype="f32")
    client = kdn.Client("kdn-store://127.0.0.1:5560", model, curve_keys="run/keys/members")
    hit = client.lookup(token_ids)
    n, k, v = client.fetch(token_ids)   # numpy, [layers, kv_heads, n, head_dim]

The adapters: kdn.hf (transformers' DynamicCache), kdn.vllm (a vLLM KV
connector). No KDN failure fails them: with failure="miss" (what they pass)
a lookup or fetch the KDN fails is a miss and a store it fails stores
nothing, each logged once per cause and counted in Client.failures; only
the caller's own errors (a buffer that does not fit) raise.
"""

import atexit
import ctypes
import logging
import threading
import weakref

import numpy as np

from kdn._native import KdnError, check, lib
from kdn import _native

__all__ = ["BackgroundStore", "Client", "KdnError", "Model", "Span", "StoreResult", "layout_of",
           "redact_uri"]

logger = logging.getLogger("kdn")

DTYPES = {"f32": 0, "f16": 1, "bf16": 2}
_ITEMSIZE = {0: 4, 1: 2, 2: 2}


class Model:
    """A model's identity for the KDN: its fingerprint over its files (a GGUF
    file or a Hugging Face folder), as kdn's workers compute it, for KV kept as
    `kv_dtype` ("f32", "f16", "bf16": what the engine's KV cache holds)."""

    def __init__(self, path, kv_dtype="f32"):
        self._handle = None
        if kv_dtype not in DTYPES:
            raise ValueError("kv_dtype must be one of %s, not %r" % (sorted(DTYPES), kv_dtype))
        handle = ctypes.c_void_p()
        check(lib.kdn_model_open(str(path).encode(), DTYPES[kv_dtype], ctypes.byref(handle)))
        self._handle = handle
        info = _native.ModelInfo()
        check(lib.kdn_model_get_info(handle, ctypes.byref(info)))
        self.path = str(path)
        self.kv_dtype = kv_dtype
        self.layers, self.kv_heads, self.head_dim = info.layers, info.kv_heads, info.head_dim
        self.fingerprint = info.fingerprint.decode()

    def close(self):
        if getattr(self, "_handle", None):
            lib.kdn_model_close(self._handle)
            self._handle = None

    def __del__(self):
        self.close()

    def __repr__(self):
        return "kdn.Model(%r, kv_dtype=%r: %d layers x %d KV heads x %d, fingerprint %s)" % (
            self.path, self.kv_dtype, self.layers, self.kv_heads, self.head_dim, self.fingerprint)


def redact_uri(uri):
    """`uri` without its password ("redis://user:***@host:port"): what kdn
    prints of a KDN's address."""
    scheme = "redis://"
    if not uri.startswith(scheme):
        return uri
    rest = uri[len(scheme):]
    at = rest.rfind("@")
    if at < 0 or ":" not in rest[:at]:
        return uri
    return scheme + rest[:at].split(":", 1)[0] + ":***@" + rest[at + 1:]


class Span:
    __slots__ = ("key", "first", "count")

    def __init__(self, key, first, count):
        self.key, self.first, self.count = key, first, count

    def __repr__(self):
        return "Span(%s, first=%d, count=%d)" % (self.key, self.first, self.count)


class StoreResult:
    __slots__ = ("stored", "already_held", "not_stored")

    def __init__(self, r=None, stored=0, already_held=0, not_stored=0):
        if r is not None:
            stored, already_held, not_stored = r.stored, r.already_held, r.not_stored
        self.stored, self.already_held, self.not_stored = stored, already_held, not_stored

    def __repr__(self):
        return "StoreResult(stored=%d, already_held=%d, not_stored=%d)" % (
            self.stored, self.already_held, self.not_stored)


def _tokens(tokens):
    a = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1), dtype=np.int32)
    return a, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(a)


def _array(x):
    """(address, shape, strides in elements, kdn dtype, itemsize) of a numpy
    array or a CPU torch tensor, without a copy."""
    if hasattr(x, "data_ptr"):  # torch
        if x.device.type != "cpu":
            raise ValueError("KV buffers must be in host memory, not on %s" % x.device)
        name = str(x.dtype).replace("torch.", "")
        dt = {"float32": 0, "float16": 1, "bfloat16": 2}.get(name)
        if dt is None:
            raise ValueError("KV buffers must be float32, float16 or bfloat16, not %s" % name)
        return x.data_ptr(), tuple(x.shape), tuple(x.stride()), dt
    a = np.asarray(x)
    dt = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}.get(a.dtype)
    if dt is None:
        raise ValueError("numpy KV buffers must be float32 or float16, not %s" % a.dtype)
    if any(s % a.itemsize for s in a.strides) or not a.flags.writeable:
        raise ValueError("numpy KV buffers must be writeable and element-aligned")
    return a.ctypes.data, a.shape, tuple(s // a.itemsize for s in a.strides), dt


def layout_of(k, v, dims, block_table=None):
    """The C layout of per-layer K and V buffers (`k` and `v`: one array or
    tensor per layer, all of one shape, strides and dtype), whose axes `dims`
    names: "t" tokens, "h" KV heads, "d" head_dim (its stride must be 1), and
    for paged buffers "b" blocks, with "t" then the token within a block and
    `block_table` each logical block's physical block. transformers' cache
    of one sequence, [kv_heads, tokens, head_dim], is "htd"; vLLM's flash
    layout per layer, [blocks, block_size, kv_heads, head_dim], "bthd".
    Returns (layout, keepalive): keep the second while the layout is used."""
    if len(k) != len(v) or not k:
        raise ValueError("one K and one V buffer per layer")
    dims = dims.lower()
    if sorted(dims) not in (sorted("thd"), sorted("bthd")):
        raise ValueError("dims must name t, h, d (and b when paged), not %r" % dims)
    ptr, shape, strides, dt = _array(k[0])
    if len(shape) != len(dims):
        raise ValueError("buffers of shape %s do not have the %d axes %r names"
                         % (shape, len(dims), dims))
    bases_k, bases_v = [], []
    for x in list(k) + list(v):
        p, s, st, d = _array(x)
        if s != shape or st != strides or d != dt:
            raise ValueError("every layer's K and V buffer must share shape, strides and dtype: "
                             "%s %s %s against %s %s %s" % (s, st, d, shape, strides, dt))
        (bases_k if len(bases_k) < len(k) else bases_v).append(p)
    ax = {c: i for i, c in enumerate(dims)}
    if shape[ax["d"]] > 1 and strides[ax["d"]] != 1:
        raise ValueError("head_dim must be the contiguous axis (stride 1), not stride %d"
                         % strides[ax["d"]])
    if any(s < 0 for s in strides):
        raise ValueError("negative strides are not supported")
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if all(shape) else 0
    L = _native.KvLayout()
    L.dtype, L.layers = dt, len(k)
    L.kv_heads, L.head_dim = shape[ax["h"]], shape[ax["d"]]
    karr = (ctypes.c_void_p * len(k))(*bases_k)
    varr = (ctypes.c_void_p * len(v))(*bases_v)
    L.k, L.v = karr, varr
    L.buffer_bytes = extent * _ITEMSIZE[dt]
    L.stride_token, L.stride_head = strides[ax["t"]], strides[ax["h"]]
    keep = [karr, varr, k, v]
    if "b" in ax:
        if block_table is None:
            raise ValueError("a paged layout (dims with 'b') needs block_table")
        table = np.ascontiguousarray(np.asarray(block_table, dtype=np.int64), dtype=np.int32)
        L.block_tokens, L.stride_block = shape[ax["t"]], strides[ax["b"]]
        L.block_table = table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        L.block_table_len = len(table)
        keep.append(table)
    return L, keep


class Client:
    """A connection to a KDN for one model's KV: "kdn-store://host:port"
    (`curve_keys`: the deployment's members' key file, or $KDN_CURVE_KEYS) or
    "redis://[user@]host:port[,...]" (the password from
    `redis_password_file`, else the file $KDN_REDIS_PASSWORD_FILE names, else
    $KDN_REDIS_PASSWORD; one in the URL works too, but shows wherever the
    URL does). `ns` is the tenant's cache salt and `chunk_tokens` the
    deployment's --chunk-tokens; both must match the deployment's for keys
    to meet. `uri` keeps the address without its password. Thread-safe.

    lookup, fetch, fetch_into and store raise KdnError when they fail; with
    failure="miss", a failure that is the KDN's (KdnError.miss: unreachable,
    slow, full, unreadable) is a miss instead (0 tokens; a StoreResult with
    nothing stored), logged once per (call, status) and counted in
    `failures`, {(call, status name): count}. The document calls
    (has_document, fetch_document, fetch_document_into, store_document) do
    the same for a document's KV, stored whole under its segment key as
    kdn's blend reads it (docs/clients.md, "Documents")."""

    def __init__(self, uri, model, curve_keys=None, ns=None, chunk_tokens=0, redis_ttl_ms=0,
                 redis_password_file=None):
        self._handle = None
        self.model = model
        self.uri = redact_uri(uri)
        self.failures = {}
        self._lock = threading.Lock()
        o = _native.ClientOptions(curve_keys.encode() if curve_keys else None,
                                  ns.encode() if ns else None, chunk_tokens, redis_ttl_ms,
                                  str(redis_password_file).encode() if redis_password_file
                                  else None)
        handle = ctypes.c_void_p()
        check(lib.kdn_client_open(uri.encode(), model._handle, ctypes.byref(o),
                                  ctypes.byref(handle)))
        self._handle = handle

    def _failed(self, call, error, failure):
        """`error` raised, or counted and logged when failure="miss" and
        it is the KDN's."""
        if failure not in ("raise", "miss"):
            raise ValueError("failure must be 'raise' or 'miss', not %r" % failure)
        if failure == "raise" or not error.miss:
            raise error
        with self._lock:
            n = self.failures[(call, error.code)] = self.failures.get((call, error.code), 0) + 1
        if n == 1:
            logger.warning("kdn: a %s at %s failed (%s), taken as %s; later %s failures of "
                           "this kind are counted in Client.failures, not logged",
                           call, self.uri, error,
                           "nothing stored" if call.startswith("store") else "a miss", call)

    def close(self):
        if getattr(self, "_handle", None):
            lib.kdn_client_close(self._handle)
            self._handle = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def spans(self, tokens):
        """The spans of `tokens` as they are stored: full chunks, then tail pieces."""
        _, p, n = _tokens(tokens)
        count = ctypes.c_int64()
        check(lib.kdn_spans(self._handle, p, n, None, 0, ctypes.byref(count)))
        arr = (_native.Span * count.value)()
        check(lib.kdn_spans(self._handle, p, n, arr, count.value, ctypes.byref(count)))
        return [Span(bytes(s.key).hex(), s.first, s.count) for s in arr]

    def lookup(self, tokens, limit=None, failure="raise"):
        """How many leading tokens of `tokens` the KDN holds (at most `limit`)."""
        _, p, n = _tokens(tokens)
        hit = ctypes.c_int64()
        try:
            check(lib.kdn_lookup(self._handle, p, n, -1 if limit is None else limit,
                                 ctypes.byref(hit)))
        except KdnError as e:
            self._failed("lookup", e, failure)
            return 0
        return hit.value

    def fetch_into(self, tokens, k, v, dims, limit=None, block_table=None, failure="raise"):
        """Writes the KV of the longest stored prefix of `tokens` (at most
        `limit` tokens) into the per-layer buffers `k` and `v` (layout_of
        describes `dims`); returns how many tokens it wrote, from token 0."""
        layout, keep = layout_of(k, v, dims, block_table)
        _, p, n = _tokens(tokens)
        fetched = ctypes.c_int64()
        try:
            check(lib.kdn_fetch(self._handle, p, n, -1 if limit is None else limit,
                                ctypes.byref(layout), ctypes.byref(fetched)))
        except KdnError as e:
            self._failed("fetch", e, failure)
            return 0
        finally:
            del keep
        return fetched.value

    def fetch(self, tokens, limit=None, dtype=np.float32, major="head", failure="raise"):
        """(n, k, v): the KV of the longest stored prefix of `tokens` as numpy
        arrays of shape [layers, kv_heads, n, head_dim] (major="head") or
        [layers, n, kv_heads, head_dim] (major="token"): views of one
        allocation, no copy (torch.from_numpy shares them too)."""
        m = self.model
        cap = len(np.asarray(tokens).reshape(-1)) if limit is None else int(limit)
        cap = max(cap, 0)
        if major == "head":
            shape, dims = (m.layers, m.kv_heads, cap, m.head_dim), "htd"
        elif major == "token":
            shape, dims = (m.layers, cap, m.kv_heads, m.head_dim), "thd"
        else:
            raise ValueError("major must be 'head' or 'token', not %r" % major)
        k, v = np.zeros(shape, dtype), np.zeros(shape, dtype)
        if cap == 0:
            return 0, k, v
        got = self.fetch_into(tokens, list(k), list(v), dims, limit=cap, failure=failure)
        cut = (slice(None), slice(None), slice(0, got)) if major == "head" else (
            slice(None), slice(0, got))
        return got, k[cut], v[cut]

    def store(self, tokens, k, v, dims, block_table=None, failure="raise"):
        """Stores the KV of all of `tokens` (tokens [0, len) of the per-layer
        buffers `k` and `v`, described as for layout_of), each chunk and tail
        piece the KDN lacks. Returns a StoreResult; raises KdnError (with the
        result's counts in its message) if a put fails, or, with
        failure="miss", returns the counts (not_stored: the span that failed
        and those after it)."""
        layout, keep = layout_of(k, v, dims, block_table)
        _, p, n = _tokens(tokens)
        r = _native.StoreResult()
        try:
            check(lib.kdn_store(self._handle, p, n, ctypes.byref(layout), ctypes.byref(r)))
        except KdnError as e:
            self._failed("store", e, failure)
        finally:
            del keep
        return StoreResult(r)


    def has_document(self, tokens, failure="raise"):
        """Whether the KDN holds KV under the document `tokens`' key (whole,
        or pruned by kdn, which fetch_document cannot give)."""
        _, p, n = _tokens(tokens)
        held = ctypes.c_int()
        try:
            check(lib.kdn_document_held(self._handle, p, n, ctypes.byref(held)))
        except KdnError as e:
            self._failed("has_document", e, failure)
            return False
        return bool(held.value)

    def fetch_document_into(self, tokens, k, v, dims, block_table=None, failure="raise",
                            steer=None):
        """Writes the document's KV (computed on its own, from position 0)
        into tokens [0, len(tokens)) of the per-layer buffers `k` and `v`
        (layout_of describes `dims`). True when it did; a document the KDN
        lacks is KdnError NOT_FOUND (a miss: False with failure="miss").
        `steer`: (vector name, strength), its steered version's KV
        (docs/serving.md, "Steering a document")."""
        layout, keep = layout_of(k, v, dims, block_table)
        _, p, n = _tokens(tokens)
        try:
            if steer is None:
                check(lib.kdn_document_fetch(self._handle, p, n, ctypes.byref(layout)))
            else:
                name, strength = steer
                check(lib.kdn_steered_document_fetch(self._handle, p, n, name.encode("utf-8"),
                                                     float(strength), ctypes.byref(layout)))
        except KdnError as e:
            self._failed("fetch_document", e, failure)
            return False
        finally:
            del keep
        return True

    def steering_vector(self, name, failure="raise"):
        """(layers, values): the steering vector `name` kdn made
        (POST /v1/kdn/steering), its layers and a float32 array
        [len(layers), kv_heads, head_dim] of its values; None for a miss
        with failure="miss"."""
        count = ctypes.c_int64()
        raw = name.encode("utf-8")
        try:
            check(lib.kdn_steering_vector_fetch(self._handle, raw, 0, None, None,
                                                ctypes.byref(count)))
            m = self.model
            layers = np.zeros(count.value, np.int32)
            values = np.zeros((count.value, m.kv_heads, m.head_dim), np.float32)
            check(lib.kdn_steering_vector_fetch(
                self._handle, raw, count.value, layers.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.byref(count)))
            if count.value != len(layers):  # gone, or made again, between the two reads
                raise KdnError("UNAVAILABLE", "steering vector %r changed while read" % name,
                               miss=True)
        except KdnError as e:
            self._failed("steering_vector", e, failure)
            return None
        return [int(l) for l in layers], values

    def fetch_document(self, tokens, dtype=np.float32, major="head", failure="raise",
                       steer=None):
        """(k, v): the document's KV as numpy arrays, shaped as fetch's, or
        None for a miss with failure="miss". `steer`: as fetch_document_into's."""
        m = self.model
        n = len(np.asarray(tokens).reshape(-1))
        if major not in ("head", "token"):
            raise ValueError("major must be 'head' or 'token', not %r" % major)
        shape = (m.layers, m.kv_heads, n, m.head_dim) if major == "head" else (
            m.layers, n, m.kv_heads, m.head_dim)
        k, v = np.zeros(shape, dtype), np.zeros(shape, dtype)
        dims = "htd" if major == "head" else "thd"
        if not self.fetch_document_into(tokens, list(k), list(v), dims, failure=failure,
                                        steer=steer):
            return None
        return k, v

    def store_document(self, tokens, k, v, dims, block_table=None, failure="raise"):
        """Stores the KV of the document `tokens` (tokens [0, len) of the
        per-layer buffers, computed from position 0 with nothing before it)
        under its key, unless the KDN holds it. Returns whether it was held
        already; with failure="miss", a store the KDN failed returns False,
        nothing stored."""
        layout, keep = layout_of(k, v, dims, block_table)
        _, p, n = _tokens(tokens)
        held = ctypes.c_int()
        try:
            check(lib.kdn_document_store(self._handle, p, n, ctypes.byref(layout),
                                         ctypes.byref(held)))
        except KdnError as e:
            self._failed("store_document", e, failure)
            return False
        finally:
            del keep
        return bool(held.value)


def _nbytes(x):
    if hasattr(x, "element_size"):  # torch
        return x.element_size() * x.numel()
    return np.asarray(x).nbytes


class BackgroundStore:
    """Stores off the caller's thread: put() hands a store to one thread of
    its own and returns at once, so a KDN that is slow or down never holds
    the caller (an engine's step). While more than `max_bytes` of KV waits,
    a put is dropped and counted. The thread stores with failure="miss"
    (Client.failures counts what the KDN failed). close() stores what waits,
    for at most `timeout` seconds, then stops the thread; a process that
    exits without it closes it then. Thread-safe.

    The buffers given to put() must be the caller's copies: the thread reads
    them later."""

    def __init__(self, client, max_bytes=1 << 30, name="kdn-store"):
        self.client = client
        self.max_bytes = max_bytes
        self.stored = 0  # stores done (whatever the KDN held or took)
        self.dropped = 0  # puts dropped while max_bytes waited
        self._waiting = []
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A process that ends without close() still stores what waits.
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def put(self, tokens, k, v, dims, label=""):
        """Queues a store of `tokens`' KV (as Client.store takes it); False,
        counted in `dropped`, when max_bytes already waits or it is closed."""
        size = sum(_nbytes(x) for x in list(k) + list(v))
        with self._cv:
            if self._closed or (self._bytes > 0 and self._bytes + size > self.max_bytes):
                self.dropped += 1
                first = self.dropped == 1
                waiting = self._bytes
            else:
                self._waiting.append((tokens, k, v, dims, label, size))
                self._bytes += size
                self._cv.notify_all()
                return True
        if first:
            logger.warning("kdn: a store of %s was dropped: %d bytes of KV already wait for "
                           "the KDN (at most %d); later drops are counted in "
                           "BackgroundStore.dropped, not logged", label or "KV", waiting,
                           self.max_bytes)
        return False

    def pending(self):
        """Bytes of KV waiting or being stored."""
        with self._cv:
            return self._bytes

    def flush(self, timeout=None):
        """Waits until nothing waits or is being stored (at most `timeout`
        seconds); True when so."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._waiting and not self._busy, timeout)

    def close(self, timeout=30.0):
        """Stores what waits (at most `timeout` seconds), then stops; what is
        left then is dropped and counted."""
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            if not done:
                self.dropped += len(self._waiting)
                self._waiting.clear()
            self._cv.notify_all()
        self._thread.join(timeout=1.0 if not done else None)

    def _run(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting or self._closed)
                if not self._waiting:
                    return
                tokens, k, v, dims, label, size = self._waiting.pop(0)
                self._busy = True
            try:
                r = self.client.store(tokens, k, v, dims, failure="miss")
                logger.info("kdn: %s: stored %d tokens' KV (%s)", label or "KV", len(tokens), r)
            except Exception:  # a caller's error in what it queued: logged, not fatal
                logger.exception("kdn: a store of %s failed", label or "KV")
            finally:
                with self._cv:
                    self.stored += 1
                    self._bytes -= size
                    self._busy = False
                    self._cv.notify_all()
