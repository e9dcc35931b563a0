"""transformers adapter: a prompt's KV between the KDN and a DynamicCache.

    import kdn, kdn.hf
    client = kdn.Client(uri, kdn.Model("model.gguf"))
    cache, cached = kdn.hf.fetch_cache(model, input_ids, client)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    kdn.hf.store_cache(model, input_ids, out_cache, client)
    kdn.hf.store_erratum(model, doc_ids, note_ids, client)   # a document's edit

No KDN failure fails them: a fetch the KDN fails is a miss and a store it
fails stores nothing, logged once per cause and counted in the client's
`failures` (kdn.Client, failure="miss"). One sequence at a time (a batch of one). The KV is head-major in
transformers ([batch, kv_heads, tokens, head_dim]) and token-major in kdn's
chunks; libkdn_client converts in one pass, straight into the tensors.
Works with DynamicCache as transformers 4.4x and 5.x build it.
"""

import torch

from kdn import Client

__all__ = ["attach", "fetch_cache", "store_cache", "fetch_document", "store_document",
           "store_erratum"]


def attach(model, client):
    """Makes `client` the KDN that fetch_cache and store_cache use for
    `model` when they are given none."""
    model._kdn_client = client
    return model


def _client(model, client):
    c = client if client is not None else getattr(model, "_kdn_client", None)
    if not isinstance(c, Client):
        raise ValueError("no kdn.Client given, and none attached to the model (kdn.hf.attach)")
    _check_model(model, c)
    return c


def _shape(model):
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def _check_model(model, client):
    layers, kv_heads, head_dim = _shape(model)
    m = client.model
    if (layers, kv_heads, head_dim) != (m.layers, m.kv_heads, m.head_dim):
        raise ValueError("this transformers model's KV is %d layers x %d KV heads x %d; the "
                         "KDN client's model (%s) has %d x %d x %d" % (
                             layers, kv_heads, head_dim, m.path, m.layers, m.kv_heads,
                             m.head_dim))


def _ids(input_ids):
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ValueError("one sequence at a time (a batch of %d given)" % len(ids))
        ids = ids[0]
    return [int(t) for t in ids]


def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.4x: no config argument
        return DynamicCache()


def fetch_cache(model, input_ids, client=None):
    """(cache, cached): a DynamicCache holding the KV of the longest prefix
    of `input_ids` the KDN holds, and its length in tokens. At least one
    prompt token is always left to compute (the model needs its logits), so
    `cached` is at most len(input_ids) - 1; 0 with an empty cache on a miss."""
    c = _client(model, client)
    ids = _ids(input_ids)
    limit = max(len(ids) - 1, 0)
    layers, kv_heads, head_dim = _shape(model)
    cache = _new_cache(model)
    if limit == 0:
        return cache, 0
    dtype = next(model.parameters()).dtype
    k = torch.empty((layers, 1, kv_heads, limit, head_dim), dtype=dtype)
    v = torch.empty_like(k)
    got = c.fetch_into(ids, [k[i, 0] for i in range(layers)], [v[i, 0] for i in range(layers)],
                       "htd", limit=limit, failure="miss")
    if got == 0:
        return cache, 0
    device = next(model.parameters()).device
    for i in range(layers):
        cache.update(k[i, :, :, :got].to(device), v[i, :, :, :got].to(device), i)
    return cache, got


def fetch_document(model, doc_ids, client=None, steer=None):
    """A DynamicCache holding the KV of the document `doc_ids` as the KDN
    holds it (computed on its own, from position 0: kdn's blend reads it so),
    or None when the KDN lacks it whole. `steer`: (vector name, strength),
    its steered version (docs/serving.md, "Steering a document")."""
    c = _client(model, client)
    ids = _ids(doc_ids)
    layers, kv_heads, head_dim = _shape(model)
    dtype = next(model.parameters()).dtype
    k = torch.empty((layers, 1, kv_heads, len(ids), head_dim), dtype=dtype)
    v = torch.empty_like(k)
    if not c.fetch_document_into(ids, [k[i, 0] for i in range(layers)],
                                 [v[i, 0] for i in range(layers)], "htd", failure="miss",
                                 steer=steer):
        return None
    cache = _new_cache(model)
    device = next(model.parameters()).device
    for i in range(layers):
        cache.update(k[i].to(device), v[i].to(device), i)
    return cache


def store_document(model, doc_ids, cache, client=None):
    """Stores the KV of the document `doc_ids` (the first len(doc_ids) tokens
    of `cache`, computed from position 0 with nothing before them) under its
    key, where a kdn request naming the document blends it. Returns whether
    the KDN held it already (False too when the KDN failed the store)."""
    c = _client(model, client)
    ids = _ids(doc_ids)
    ks, vs = _one_sequence(cache, len(ids), c.model.layers)
    return c.store_document(ids, ks, vs, "htd", failure="miss")


def store_erratum(model, doc_ids, note_ids, client=None):
    """The erratum edit (docs/serving.md, "Editing a document") with
    transformers: the document's KV from the KDN, the note's computed on top
    of it, the whole stored as the edited document (`doc_ids + note_ids`),
    which a kdn request names as {"text": ..., "erratum": ...}. Returns
    whether the KDN held the edited version already; ValueError when it
    lacks the original."""
    doc, note = _ids(doc_ids), _ids(note_ids)
    if not note:
        raise ValueError("an erratum has at least one token")
    cache = fetch_document(model, doc, client)
    if cache is None:
        raise ValueError("the KDN does not hold the document (%d tokens) whole" % len(doc))
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([note], device=device), past_key_values=cache, use_cache=True)
    return store_document(model, doc + note, out.past_key_values, client)


def _one_sequence(cache, tokens, layers):
    """Per-layer K and V ([kv_heads, tokens, head_dim], on the CPU) of a
    batch-of-one cache holding at least `tokens` tokens."""
    kv = _layer_kv(cache)
    if len(kv) != layers:
        raise ValueError("the cache has %d layers; the model %d" % (len(kv), layers))
    ks, vs = [], []
    for key, value in kv:
        if key.shape[0] != 1:
            raise ValueError("one sequence at a time (a cache of batch %d)" % key.shape[0])
        if key.shape[2] < tokens:
            raise ValueError("the cache holds %d tokens; %d given" % (key.shape[2], tokens))
        ks.append(key[0].detach().cpu())
        vs.append(value[0].detach().cpu())
    return ks, vs


def _layer_kv(cache):
    """[(K, V)] per layer, each [batch, kv_heads, tokens, head_dim]."""
    if isinstance(cache, (tuple, list)):  # the legacy tuple of (K, V)
        return [(kv[0], kv[1]) for kv in cache]
    if hasattr(cache, "layers") and cache.layers and hasattr(cache.layers[0], "keys"):
        return [(layer.keys, layer.values) for layer in cache.layers]  # transformers 5
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4.4x


def store_cache(model, input_ids, cache, client=None):
    """Stores the KV of `input_ids` (the first len(input_ids) tokens of
    `cache`: a DynamicCache or the legacy tuple, as a forward pass or
    generate returned it) in the KDN. Returns a kdn.StoreResult (a store the
    KDN failed: what it stored before, and not_stored from there)."""
    c = _client(model, client)
    ids = _ids(input_ids)
    ks, vs = _one_sequence(cache, len(ids), c.model.layers)
    return c.store(ids, ks, vs, "htd", failure="miss")
