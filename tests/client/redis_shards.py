"""A Redis Cluster's shards as the client tests see them (test_hf.py,
vllm_e2e.py): which primary holds a prompt's first chunk, and whether any
process shows a secret."""

from pathlib import Path

from llama_cpp_tokenize import llama_cpp_ids
from prompts import text


def redis_key(model, span):
    return "kdn:%s:%s" % (model.fingerprint, span.key)


def slot_owners(cluster):
    """[(first slot, last slot, node)] of the cluster's primaries."""
    owners = []
    for node in cluster.nodes:
        rc, out = cluster.node_cli(node, "cluster", "nodes")
        assert rc == 0, out
        mine = next(line.split() for line in out.splitlines() if "myself" in line.split()[2])
        for r in mine[8:]:
            if not r.startswith("["):
                lo, _, hi = r.partition("-")
                owners.append((int(lo), int(hi or lo), node))
    return owners


def node_of(cluster, owners, key):
    rc, out = cluster.node_cli(cluster.nodes[0], "cluster", "keyslot", key)
    assert rc == 0, out
    slot = int(out)
    return next(node for lo, hi, node in owners if lo <= slot <= hi)


def prompts_on(smollm2, model, client, cluster, node, count, seeds):
    """`count` prompts whose first chunk the primary `node` holds."""
    owners = slot_owners(cluster)
    found = []
    for ids in llama_cpp_ids(smollm2, [text(s, 9) for s in seeds]):
        if node_of(cluster, owners, redis_key(model, client.spans(ids)[0])) is node:
            found.append(ids)
    assert len(found) >= count, "too few prompts on %s" % node.name
    return found[:count]


def no_process_shows(secret):
    """True when no command line on this machine holds `secret`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if secret.encode() in cmdline.read_bytes():
                return False
        except OSError:
            pass
    return True
