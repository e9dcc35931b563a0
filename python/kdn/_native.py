"""ctypes declarations of libkdn_client's C API (client/include/kdn/client.h).

The library is found, in order, at $KDN_CLIENT_LIB (a path to the .so), in
this package's _lib folder (an installed kdn), under $KDN_LIB_DIR, in the
repository's build/lib (a source checkout), then by the system's loader
(LD_LIBRARY_PATH, ldconfig).
"""

import ctypes
import os
from pathlib import Path

API_VERSION = 4


class KdnError(RuntimeError):
    """A failed libkdn_client call: `code` is the status name
    ("INVALID_ARGUMENT", "UNAVAILABLE", ...), the message says the rest.
    `miss` is true when the failure is the KDN's, not the caller's
    (kdn_status_is_miss): a lookup or fetch that failed so is a miss, a
    store that failed so stored nothing, and an engine goes on."""

    def __init__(self, code, message, miss=False):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message
        self.miss = miss


class ModelInfo(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("kv_dtype", ctypes.c_int),
                ("fingerprint", ctypes.c_char * 33)]


class ClientOptions(ctypes.Structure):
    _fields_ = [("curve_keys_path", ctypes.c_char_p), ("ns", ctypes.c_char_p),
                ("chunk_tokens", ctypes.c_int32), ("redis_ttl_ms", ctypes.c_int64),
                ("redis_password_file", ctypes.c_char_p)]


class Span(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint8 * 16), ("first", ctypes.c_int64),
                ("count", ctypes.c_int64)]


class KvLayout(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("layers", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("k", ctypes.POINTER(ctypes.c_void_p)), ("v", ctypes.POINTER(ctypes.c_void_p)),
                ("buffer_bytes", ctypes.c_uint64), ("stride_token", ctypes.c_int64),
                ("stride_head", ctypes.c_int64), ("block_tokens", ctypes.c_int32),
                ("stride_block", ctypes.c_int64), ("block_table", ctypes.POINTER(ctypes.c_int32)),
                ("block_table_len", ctypes.c_int64)]


class StoreResult(ctypes.Structure):
    _fields_ = [("stored", ctypes.c_int64), ("already_held", ctypes.c_int64),
                ("not_stored", ctypes.c_int64)]


def _candidates():
    env = os.environ.get("KDN_CLIENT_LIB")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here / "_lib" / "libkdn_client.so.2"
    if os.environ.get("KDN_LIB_DIR"):
        yield Path(os.environ["KDN_LIB_DIR"]) / "libkdn_client.so.2"
    yield here.parents[1] / "build" / "lib" / "libkdn_client.so.2"
    yield Path("libkdn_client.so.2")  # the system's loader


def _load():
    tried = []
    for path in _candidates():
        if path.is_absolute() and not path.exists():
            tried.append(str(path))
            continue
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError("libkdn_client is not found; build it (scripts/build.sh) or set "
                      "KDN_CLIENT_LIB. Tried: " + "; ".join(tried))


lib = _load()
_i32p, _i64p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
_decls = {
    "kdn_api_version": (ctypes.c_int, []),
    "kdn_last_error": (ctypes.c_char_p, []),
    "kdn_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kdn_status_is_miss": (ctypes.c_int, [ctypes.c_int]),
    "kdn_model_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]),
    "kdn_model_close": (None, [ctypes.c_void_p]),
    "kdn_model_get_info": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ModelInfo)]),
    "kdn_client_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_void_p,
                                       ctypes.POINTER(ClientOptions),
                                       ctypes.POINTER(ctypes.c_void_p)]),
    "kdn_client_close": (None, [ctypes.c_void_p]),
    "kdn_spans": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64, ctypes.POINTER(Span),
                                 ctypes.c_int64, _i64p]),
    "kdn_lookup": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64, ctypes.c_int64, _i64p]),
    "kdn_fetch": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.POINTER(KvLayout), _i64p]),
    "kdn_store": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64, ctypes.POINTER(KvLayout),
                                 ctypes.POINTER(StoreResult)]),
    "kdn_document_held": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64,
                                         ctypes.POINTER(ctypes.c_int)]),
    "kdn_document_fetch": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64,
                                          ctypes.POINTER(KvLayout)]),
    "kdn_document_store": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64,
                                          ctypes.POINTER(KvLayout), ctypes.POINTER(ctypes.c_int)]),
    "kdn_steering_vector_fetch": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64,
                                                 _i32p, ctypes.POINTER(ctypes.c_float), _i64p]),
    "kdn_steered_document_fetch": (ctypes.c_int, [ctypes.c_void_p, _i32p, ctypes.c_int64,
                                                  ctypes.c_char_p, ctypes.c_float,
                                                  ctypes.POINTER(KvLayout)]),
}
for _name, (_res, _args) in _decls.items():
    _f = getattr(lib, _name)
    _f.restype, _f.argtypes = _res, _args

if lib.kdn_api_version() != API_VERSION:
    raise ImportError("libkdn_client speaks API version %d; this package speaks %d"
                      % (lib.kdn_api_version(), API_VERSION))


def check(status):
    """Raises KdnError for a status other than KDN_OK (0)."""
    if status != 0:
        raise KdnError(lib.kdn_status_name(status).decode(), lib.kdn_last_error().decode(),
                       bool(lib.kdn_status_is_miss(status)))
