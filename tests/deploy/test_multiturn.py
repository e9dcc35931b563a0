"""A chat's later turns cost only their new tokens (docs/kvbus.md, "Tail keys").

A deployment of the tiny model with a shared kdn-store: the decode worker
stores each finished conversation (its full chunks and the tail pieces past
them) and the prefill worker of the next turn loads it down to the last token
with KV. Every request here takes the prefill worker's path ("disaggregation":
"always"); test_local_prefill.py has the decode worker prefill next turns. The prompts are token ids, so that a conversation is exactly the
tokens the model saw and produced (text could not round-trip the random
model's bytes).
"""

import random
import time

from deploy_util import CHUNK_TOKENS, generate_ids, metric, parse_metrics, settled_metrics

ANSWER_TOKENS = 8
FIRST_TOKENS = 300       # a full chunk and a tail of 44
TURN_TOKENS = 40         # each later user message


def engine(model, ids, *flags):
    return generate_ids(model, ids, ANSWER_TOKENS, *flags)


def test_later_turns_compute_only_their_new_tokens(store_deployment):
    d = store_deployment
    rng = random.Random(20261122)
    ids = [rng.randrange(3, 256) for _ in range(FIRST_TOKENS)]
    stored = 0  # tokens of the conversation the KDN holds (all but the last answer token)
    for turn in range(1, 4):
        before = parse_metrics(d.metrics())
        r = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation="always")
        after = parse_metrics(d.metrics())
        grew = {source: metric(after, "kdn_prompt_tokens_total", source=source)
                - metric(before, "kdn_prompt_tokens_total", source=source)
                for source in ("cached", "computed")}
        tail = (metric(after, "kdn_prompt_tail_tokens_total")
                - metric(before, "kdn_prompt_tail_tokens_total"))
        usage = r["usage"]
        assert usage["prompt_tokens"] == len(ids), usage
        assert usage["completion_tokens"] == ANSWER_TOKENS, usage
        # Greedy output equals the engine alone on the whole conversation.
        want = engine(d.model, ids).decode("utf-8", errors="replace")
        assert r["choices"][0]["text"] == want, "turn %d: served text differs from kdn-generate's" % turn
        # Only the tokens past what the KDN held were computed: for a later
        # turn, the last answer token (never run through the model) and the
        # new message.
        assert usage["prompt_tokens_details"]["cached_tokens"] == stored, (turn, usage)
        assert grew == {"cached": stored, "computed": len(ids) - stored}, (turn, grew)
        assert tail == stored - (stored // CHUNK_TOKENS) * CHUNK_TOKENS, (turn, tail)
        if turn > 1:
            assert grew["computed"] == TURN_TOKENS + 1, (turn, grew)

        answer = [int(t) for t in engine(d.model, ids, "--print-ids").split(b",")]
        assert len(answer) == ANSWER_TOKENS
        stored = len(ids) + ANSWER_TOKENS - 1
        ids = ids + answer + [rng.randrange(3, 256) for _ in range(TURN_TOKENS)]
        # The decode worker stores the conversation on its store I/O thread
        # once the last token is out; give that round trip time to land.
        time.sleep(1.0)


def worker_counter(samples, name, worker, role):
    return metric(samples, name, worker=worker, role=role)


def test_resident_kv_serves_repeats_and_next_turns_with_no_kv_copied(store_deployment):
    """docs/engine.md, "Resident KV": the workers' pools keep prompts and
    conversations. A repeated prompt attaches its prefix from the prefill
    worker's pool (no KV bytes copied in from the host tier or kdn-store),
    and a chat's next turn attaches the conversation at the decode worker;
    the answers stay kdn-generate's."""
    d = store_deployment
    rng = random.Random(20261125)
    ids = [rng.randrange(3, 256) for _ in range(FIRST_TOKENS)]
    first = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation="always")
    want = engine(d.model, ids).decode("utf-8", errors="replace")
    assert first["choices"][0]["text"] == want
    time.sleep(1.0)  # the prefill worker publishes after its reply

    before = settled_metrics(d)
    again = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation="always")
    after = settled_metrics(d)
    assert again["choices"][0]["text"] == want
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == FIRST_TOKENS - 1, again["usage"]
    hit = (worker_counter(after, "kdn_worker_resident_hit_tokens_total", "prefill-0", "prefill")
           - worker_counter(before, "kdn_worker_resident_hit_tokens_total", "prefill-0", "prefill"))
    loaded = (worker_counter(after, "kdn_worker_kv_loaded_bytes_total", "prefill-0", "prefill")
              - worker_counter(before, "kdn_worker_kv_loaded_bytes_total", "prefill-0", "prefill"))
    assert hit == cached and loaded == 0, (hit, loaded)
    assert worker_counter(after, "kdn_worker_resident_kv_blocks", "prefill-0", "prefill") > 0

    # The next turn: the decode worker attaches the conversation it kept.
    answer = [int(t) for t in engine(d.model, ids, "--print-ids").split(b",")]
    turn2 = ids + answer + [rng.randrange(3, 256) for _ in range(TURN_TOKENS)]
    before = settled_metrics(d)
    r = d.completion(turn2, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation="always")
    after = settled_metrics(d)
    assert r["choices"][0]["text"] == engine(d.model, turn2).decode("utf-8", errors="replace")
    decode_hit = (worker_counter(after, "kdn_worker_resident_hit_tokens_total", "decode-0", "decode")
                  - worker_counter(before, "kdn_worker_resident_hit_tokens_total", "decode-0",
                                   "decode"))
    decode_loaded = (worker_counter(after, "kdn_worker_kv_loaded_bytes_total", "decode-0", "decode")
                     - worker_counter(before, "kdn_worker_kv_loaded_bytes_total", "decode-0",
                                      "decode"))
    assert decode_hit == FIRST_TOKENS + ANSWER_TOKENS - 1 and decode_loaded == 0, (decode_hit,
                                                                                  decode_loaded)
    # Every block is free or cached and held by no request: the resident
    # blocks are all evictable.
    s = settled_metrics(d)
    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        cached = metric(s, "kdn_worker_resident_kv_blocks", worker=worker, role=role)
        assert cached > 0, worker
        assert metric(s, "kdn_worker_resident_evictable_kv_blocks", worker=worker,
                      role=role) == cached, worker
