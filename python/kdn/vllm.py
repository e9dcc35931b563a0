"""kdn.vllm: kdn's KDN as a vLLM KV connector (KVConnectorBase_V1), loaded
out of tree (docs/clients.md):

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KdnConnector", "kv_connector_module_path": "kdn.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "kdn_uri": "kdn-store://127.0.0.1:5560", "kdn_model": "/path/model.gguf",
            "kdn_curve_keys": "/run/curve.key"}})

Extra config: kdn_uri (required; a Redis URL without its password, which
vLLM prints), kdn_redis_password_file (default: $KDN_REDIS_PASSWORD_FILE,
else $KDN_REDIS_PASSWORD), kdn_model (the files the fingerprint is computed
from; default: vLLM's model), kdn_kv_dtype (default: vLLM's KV dtype: f32
for float32, bf16, f16), kdn_curve_keys, kdn_ns, kdn_chunk_tokens (default
256), kdn_store_queue_mib (KV waiting to be stored at most, default 1024).
A request's extra_args {"kv_transfer_params": {"kdn_store": false}} keeps
its KV out of the KDN.

No KDN failure is vLLM's: a lookup the KDN fails is a miss, a load it fails
after a lookup promised KV reports those blocks as load errors (vLLM's
kv_load_failure_policy recomputes them), and stores run on a thread of the
connector, off vLLM's step, each failure dropped; all logged once per cause
and counted (kdn.Client.failures, kdn.BackgroundStore.dropped).

Scheduler side: the KDN's reach for a prompt (at most its length less one),
rounded down to vLLM's block size, past what vLLM's own prefix cache has.
Worker side: before the forward, the fetched KV goes into the request's
blocks through the attention backend's own cache-update operation (its
layout is the backend's, never assumed here); after the forward that ends a
prompt's prefill, the prompt's KV is read out of its blocks and stored. The
read goes through a map from each (token, element) to its place in a
block's page that a probe through the same operation draws at start-up, so
any backend whose pages are a permutation of their tokens' K and V works.
"""

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

import kdn

logger = logging.getLogger("kdn.vllm")

_KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass
class _Req:
    req_id: str
    token_ids: list
    block_ids: list
    load_from: int = 0  # tokens [load_from, load_to) come from the KDN
    load_to: int = 0
    store: bool = False  # this step ends the prompt's prefill: store its KV


@dataclass
class KdnConnectorMetadata(KVConnectorMetadata):
    reqs: list = field(default_factory=list)


class KdnConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("kdn_uri"):
            raise ValueError("kdn.vllm: kv_connector_extra_config needs kdn_uri "
                             "(kdn-store://host:port or redis://host:port)")
        self.block_size = vllm_config.cache_config.block_size
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None):
            raise ValueError("kdn.vllm: a KV cache dtype of %s is not supported (auto only)"
                             % cache_dtype)
        kv_dtype = extra.get("kdn_kv_dtype") or _KV_DTYPES.get(vllm_config.model_config.dtype)
        if kv_dtype is None:
            raise ValueError("kdn.vllm: vLLM's dtype %s has no kdn KV dtype"
                             % vllm_config.model_config.dtype)
        model_path = extra.get("kdn_model") or vllm_config.model_config.model
        self.model = kdn.Model(model_path, kv_dtype=kv_dtype)
        self.client = kdn.Client(extra["kdn_uri"], self.model,
                                 curve_keys=extra.get("kdn_curve_keys"), ns=extra.get("kdn_ns"),
                                 chunk_tokens=int(extra.get("kdn_chunk_tokens", 0)),
                                 redis_password_file=extra.get("kdn_redis_password_file"))
        self._store_queue_bytes = int(float(extra.get("kdn_store_queue_mib", 1024)) * (1 << 20))
        self._stores = None  # the worker side's BackgroundStore, made at its first store
        self.role_can_save = self._kv_transfer_config.kv_role in ("kv_producer", "kv_both")
        self.role_can_load = self._kv_transfer_config.kv_role in ("kv_consumer", "kv_both")
        # Scheduler side.
        self._external = {}  # req_id -> tokens the KDN brings
        self._reqs = {}  # req_id -> [token ids, block ids, stored?, store wanted?]
        # Worker side.
        self._kv = {}
        self._layers = {}
        self._page_map = None
        self._load_errors = set()
        logger.info("kdn.vllm: %s role, KDN %s, %r", role.name, self.client.uri, self.model)

    # ---- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.role_can_load:
            return 0, False
        ids = list(request.prompt_token_ids or [])
        hit = self.client.lookup(ids, limit=len(ids) - 1, failure="miss") if len(ids) > 1 else 0
        hit = hit // self.block_size * self.block_size
        return max(hit - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            self._external[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output):
        meta = KdnConnectorMetadata()
        for r in scheduler_output.scheduled_new_reqs:
            params = getattr(r.sampling_params, "extra_args", None) or {}
            wanted = (params.get("kv_transfer_params") or {}).get("kdn_store", True)
            st = self._reqs[r.req_id] = [list(r.prompt_token_ids or []), list(r.block_ids[0]),
                                         False, bool(wanted) and self.role_can_save]
            ext = self._external.pop(r.req_id, 0)
            req = _Req(r.req_id, st[0], list(st[1]))
            if ext > 0:
                req.load_from, req.load_to = r.num_computed_tokens - ext, r.num_computed_tokens
            self._mark_store(req, st, r.num_computed_tokens
                             + scheduler_output.num_scheduled_tokens[r.req_id])
            if req.load_to > 0 or req.store:
                meta.reqs.append(req)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                st[1] = list(new[0]) if rid in resumed else st[1] + list(new[0])
            req = _Req(rid, st[0], list(st[1]))
            self._mark_store(req, st, cached.num_computed_tokens[i]
                             + scheduler_output.num_scheduled_tokens[rid])
            if req.store:
                meta.reqs.append(req)
        return meta

    def _mark_store(self, req, st, computed_after_step):
        if st[3] and not st[2] and computed_after_step >= len(st[0]) > 0:
            req.store = st[2] = True

    def request_finished(self, request, block_ids):
        self._reqs.pop(request.request_id, None)
        self._external.pop(request.request_id, None)
        return False, None

    # ---- worker side

    def register_kv_caches(self, kv_caches):
        self._kv = dict(kv_caches)
        ctx = self._vllm_config.compilation_config.static_forward_context
        self._layers = {name: ctx[name] for name in self._kv if name in ctx}
        if len(self._kv) != self.model.layers:
            raise ValueError("kdn.vllm: vLLM has %d KV cache layers; the kdn model (%s) %d"
                             % (len(self._kv), self.model.path, self.model.layers))

    def _slots(self, req, first, last):
        t = np.arange(first, last)
        blocks = np.asarray(req.block_ids, dtype=np.int64)[t // self.block_size]
        return torch.from_numpy(blocks * self.block_size + t % self.block_size)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        for req in meta.reqs:
            if req.load_to <= req.load_from:
                continue
            n, k, v = self.client.fetch(req.token_ids, limit=req.load_to, major="token",
                                        failure="miss")
            if n < req.load_to:
                # The KDN lost chunks since the lookup: those blocks are
                # recomputed (kv_load_failure_policy) or the request fails.
                first_bad = max(n, req.load_from) // self.block_size
                last = math.ceil(req.load_to / self.block_size)
                self._load_errors.update(req.block_ids[first_bad:last])
                logger.warning("kdn.vllm: %s: the KDN gave %d of %d tokens", req.req_id, n,
                               req.load_to)
            if n <= req.load_from:
                continue
            slots = self._slots(req, req.load_from, n)
            for i, name in enumerate(self._kv):
                layer = self._layers[name]
                key = torch.from_numpy(k[i, req.load_from:n]).to(self._kv[name].dtype)
                value = torch.from_numpy(v[i, req.load_from:n]).to(self._kv[name].dtype)
                layer.impl.do_kv_cache_update(layer, key, value, self._kv[name], slots)

    def wait_for_layer_load(self, layer_name):
        pass  # loads are done in start_load_kv, before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass  # the prompt's KV is read after the forward, in wait_for_save

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for req in meta.reqs:
            if req.store:
                self._store(req)

    def shutdown(self):
        """Stores what waits (at most 30 s), then stops the store thread."""
        if self._stores is not None:
            self._stores.close(timeout=30.0)
            if self._stores.dropped:
                logger.warning("kdn.vllm: %d stores were dropped", self._stores.dropped)

    def get_block_ids_with_load_errors(self):
        bad, self._load_errors = self._load_errors, set()
        return bad

    # The page map: where each token's K and V elements sit in a block's
    # page (the (block, head) slice of a layer's cache, flattened), drawn
    # by writing coded values through the backend's own update into a
    # scratch block.
    def _draw_page_map(self):
        name = next(iter(self._kv))
        layer, cache = self._layers[name], self._kv[name]
        n, d, heads = self.block_size, self.model.head_dim, self.model.kv_heads
        page = cache[0].numel() // heads
        if page != 2 * n * d:
            raise ValueError("kdn.vllm: a page of %d elements is not the K and V of %d tokens "
                             "of head_dim %d" % (page, n, d))
        codes = torch.arange(1, 2 * n * d + 1, dtype=torch.int64)  # K then V, [t][d]
        found = torch.zeros(page, dtype=torch.int64)
        base = 256  # digits small enough for any 16-bit float to hold exactly
        for digit in range(2):
            scratch = torch.zeros_like(cache[:1])
            values = (codes // base ** digit % base).to(cache.dtype)
            key = values[:n * d].view(n, 1, d).expand(n, heads, d).contiguous()
            value = values[n * d:].view(n, 1, d).expand(n, heads, d).contiguous()
            layer.impl.do_kv_cache_update(layer, key, value, scratch,
                                          torch.arange(n, dtype=torch.int64))
            pages = scratch.reshape(heads, page).to(torch.int64)
            if not torch.equal(pages, pages[:1].expand_as(pages)):
                raise ValueError("kdn.vllm: this attention backend's heads do not share one "
                                 "page layout")
            found += pages[0] * base ** digit
        if sorted(found.tolist()) != list(range(1, page + 1)):
            raise ValueError("kdn.vllm: this attention backend's pages are not a permutation of "
                             "their tokens' K and V; kdn.vllm cannot read them")
        where = torch.full((2 * n * d + 1,), -1, dtype=torch.int64)
        where[found] = torch.arange(page)
        self._page_map = (where[1:n * d + 1].view(n, d), where[n * d + 1:].view(n, d))

    def _store(self, req):
        # The prompt's KV is copied out of its blocks here, on vLLM's step
        # (the blocks are vLLM's to reuse once the step ends); the store
        # itself, which asks the KDN what it holds and puts what it lacks,
        # runs on the store thread.
        if self._page_map is None:
            self._draw_page_map()
        kpos, vpos = self._page_map
        tokens = len(req.token_ids)
        nblocks = math.ceil(tokens / self.block_size)
        blocks = torch.tensor(req.block_ids[:nblocks], dtype=torch.int64)
        ks, vs = [], []
        for name in self._kv:
            cache = self._kv[name]
            pages = cache[blocks].reshape(nblocks, self.model.kv_heads, -1)
            # [blocks, heads, n, d] -> [tokens, heads, d]
            k = pages[:, :, kpos].permute(0, 2, 1, 3).reshape(-1, self.model.kv_heads,
                                                               self.model.head_dim)
            v = pages[:, :, vpos].permute(0, 2, 1, 3).reshape(-1, self.model.kv_heads,
                                                               self.model.head_dim)
            # Copies (the indexing above gathers): the cache may change
            # before the store thread reads them.
            ks.append(k[:tokens].contiguous())
            vs.append(v[:tokens].contiguous())
        if self._stores is None:
            self._stores = kdn.BackgroundStore(self.client, max_bytes=self._store_queue_bytes,
                                               name="kdn.vllm-store")
        self._stores.put(list(req.token_ids), ks, vs, "thd", label=req.req_id)
